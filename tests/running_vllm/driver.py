"""Drive a running vLLM engine for the tests, from .venv-vllm's Python (the test suite's own .venv has no vLLM).

    .venv-vllm/bin/python tests/running_vllm/driver.py CONFIG_JSON

CONFIG_JSON: {"model": DIR, "connector": {...} or null (the kv_transfer_config), "kvobs_observer": bool}.
Commands arrive as JSON lines on stdin, one answer per command leaves as a JSON line on stdout prefixed by
`ANSWER_PREFIX` (vLLM logs to stdout too). Commands: generate (prompts, max_tokens), reset_prefix_cache,
poison (NaN over the CPU store, in-process engines only), poison_files (NaN over a shared-storage
connector's files), scrape (this process's Prometheus registry),
quit. An error answers {"error": ...} and the driver goes on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

ANSWER_PREFIX = "KVOBS-ANSWER "


def build_engine(config: dict[str, Any]) -> Any:
    from vllm import LLM

    options: dict[str, Any] = dict(model=config["model"], tokenizer=config["model"], max_model_len=256,
                                   block_size=32, enforce_eager=True, seed=0, max_num_seqs=4,
                                   max_num_batched_tokens=256, dtype="float32")
    if config.get("connector") is not None:
        options["kv_transfer_config"] = config["connector"]
    return LLM(**options)


def generate(llm: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "outputs": [
        {"token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
         "num_cached_tokens": out.num_cached_tokens, "prompt_tokens": len(out.prompt_token_ids)}
        for out in outputs]}


def poison() -> dict[str, Any]:
    from running_vllm.cpu_offloading import poison_all

    return {"poisoned": poison_all()}


def poison_files(path: str) -> dict[str, Any]:
    """NaN over every KV file a shared-storage connector wrote under `path`."""
    import pathlib

    import safetensors.torch

    files = sorted(pathlib.Path(path).rglob("*.safetensors"))
    for file in files:
        kv_cache = safetensors.torch.load_file(file)["kv_cache"]
        safetensors.torch.save_file({"kv_cache": torch_full_nan(kv_cache)}, file)
    return {"poisoned": len(files)}


def torch_full_nan(tensor: Any) -> Any:
    import torch

    return torch.full_like(tensor, float("nan"))


def scrape() -> dict[str, Any]:
    from prometheus_client import REGISTRY, generate_latest

    return {"text": generate_latest(REGISTRY).decode()}


def answer(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "generate":
        return generate(llm, command["prompts"], command.get("max_tokens", 8))
    if op == "reset_prefix_cache":
        return {"reset": bool(llm.reset_prefix_cache())}
    if op == "poison":
        return poison()
    if op == "poison_files":
        return poison_files(command["path"])
    if op == "scrape":
        return scrape()
    raise ValueError(f"unknown op {op!r}")


def main(config_json: str) -> None:
    config = json.loads(config_json)
    llm = build_engine(config)
    print(ANSWER_PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            result = answer(llm, command)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            result = {"error": repr(exc), "traceback": traceback.format_exc()}
        print(ANSWER_PREFIX + json.dumps(result), flush=True)
    print(ANSWER_PREFIX + json.dumps({"bye": True}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
