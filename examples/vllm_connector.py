"""Put kvobs on vLLM (0.33): wrap the KV connector you already use in KVObsConnector.

    python examples/vllm_connector.py                      # prints the configurations
    python examples/vllm_connector.py facebook/opt-125m    # runs vLLM with them (needs vLLM 0.33 and a GPU)

kvobs then sees every CPU-offloading load as a `prefetch` transfer and every store as a `write_back`, checks
the blocks for NaN/Inf when the data is there (loads when the copy has landed, stores before they are
submitted), and reports a corrupt load to vLLM as a load failure, so vLLM recomputes it. On a
prefill/decode pair, the prefill node's `send` and the decode node's `receive` share one trace.
Nothing else changes: the wrapped connector runs exactly as it would alone.
"""

from __future__ import annotations

import json
import sys
from typing import Any

OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}


def kvobs_transfer_config(connector: dict[str, Any], kv_role: str, engine: str = "vllm") -> dict[str, Any]:
    """vLLM's kv_transfer_config with `connector` wrapped by kvobs."""
    return {
        "kv_connector": "KVObsConnector",  # KVObsConnectorNoHMA for a connector without HMA support
        "kv_connector_module_path": "kvobs.integrations.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"connector": connector, "engine": engine, "integrity": "report"},
    }


def print_configurations() -> None:
    from kvobs.integrations.vllm.options import read_options

    setups = {
        "CPU offloading": kvobs_transfer_config(OFFLOADING, "kv_both"),
        "prefill node": kvobs_transfer_config({"kv_connector": "NixlConnector"}, "kv_producer", "vllm-prefill"),
        "decode node": kvobs_transfer_config({"kv_connector": "NixlConnector"}, "kv_consumer", "vllm-decode"),
    }
    for name, config in setups.items():
        options = read_options(config["kv_connector_extra_config"])  # what the connector checks at start-up
        print(f"# {name}: wraps {options.connector['kv_connector']}, integrity={options.integrity}")
        print(f"vllm serve <model> --kv-transfer-config '{json.dumps(config)}'")
    try:
        read_options({"connector": OFFLOADING, "integrity": "skip"})
    except ValueError as exc:
        print(f"refused at start-up: {exc}")


def run(model: str) -> None:
    """Two identical prompts: the second one's KV comes back from CPU memory through kvobs."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its metrics here
    from prometheus_client import generate_latest
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, gpu_memory_utilization=0.5,
              kv_transfer_config=KVTransferConfig(**kvobs_transfer_config(OFFLOADING, "kv_both")))
    prompt = "kvobs watches the KV cache as it moves between GPU and CPU memory. " * 40
    for _ in range(2):
        llm.generate([prompt], SamplingParams(max_tokens=8))
    print(b"\n".join(line for line in generate_latest().splitlines() if line.startswith(b"kvobs_transfers")).decode())


if __name__ == "__main__":
    print_configurations()
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vLLM is not installed here: to run these, pip install vllm==0.33.0 (a GPU machine) and pass a model")
