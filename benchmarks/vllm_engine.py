"""kvobs on a running vLLM: its own CPU time per transfer inside the engine, and tokens/s wrapped vs plain.

    .venv-vllm/bin/python benchmarks/vllm_engine.py [--rounds 6] [--prompts 4] [--max-tokens 32]

Run with .venv-vllm's Python (scripts/setup_vllm.sh); the tiny random-weight Llama of the engine tests is built
on first use. Two engines run side by side, each in a process of its own (in-process engines: the engine runs
in that process): vLLM's OffloadingConnector on the CPU-copying spec of the tests, plain and wrapped by
KVObsConnector. Each round serves the same workload on both, in alternating order (each prompt, then again
after vLLM's prefix cache is emptied, so its prefix loads through the connector); a round's ratio is wrapped
tokens/s over plain tokens/s, and the rounds' median and spread (min..max) are printed.

Inside the wrapped engine, kvobs's own time is measured around the integration's per-transfer calls
(`Transfers.begin`, `complete`: validation, the lifecycle, telemetry and the NaN/Inf check) and its
per-step calls (the wrapper's worker-side observation around bind, load, save and finish), in CPU time of
the engine's thread (thread_time_ns); inside the per-transfer calls, the general lifecycle's share
(`KVObserver.begin`, `Transfer.complete`) and the check's (measured around the cache check, for its GB/s).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from running_vllm import driver, tiny_llama  # noqa: E402  (the tests' engine driver and model)

WORDS = tiny_llama.WORDS


def prompt(seed: int, words: int = 170) -> str:
    """A prompt of five and a bit 32-token blocks; distinct seeds differ from the first token."""
    return " ".join(WORDS[(seed * 7 + i * (seed + 1)) % len(WORDS)] for i in range(words))


def connector(wrapped: bool) -> dict[str, Any]:
    child = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
                                           "spec_module_path": "running_vllm.cpu_offloading",
                                           "cpu_bytes_to_use": 64_000_000}}
    if not wrapped:
        return child
    return {"kv_connector": "KVObsConnector", "kv_connector_module_path": "kvobs.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"connector": child}}


# -- inside an engine process ----------------------------------------------------------------------------------


class Timers:
    """CPU ns of each call to the wrapped functions, on the calling thread (thread_time_ns: time the thread
    spent preempted by the engine's own OpenMP threads is not kvobs's cost)."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = defaultdict(list)
        self.bytes_checked = 0

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            time.thread_time_ns()  # the first read after the engine's own work pays the clock's cold path
            started = time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.ns[label].append(time.thread_time_ns() - started)

        setattr(owner, name, timed)

    def report(self) -> dict[str, Any]:
        return {"ns": dict(self.ns), "bytes_checked": self.bytes_checked}


def install_timers() -> Timers:
    """Time kvobs's per-transfer and per-step code in this (wrapped) engine process."""
    from kvobs import observer
    from kvobs._lifecycle import transfer
    from kvobs.integrations.vllm import _transfers as transfers
    from kvobs.integrations.vllm import _worker as worker

    timers = Timers()
    for name in ("begin", "complete"):
        timers.wrap(transfers.Transfers, name, name)
    timers.wrap(observer.KVObserver, "begin", "lifecycle")
    timers.wrap(transfer.Transfer, "complete", "lifecycle")
    for name in STEP_CALLS:
        timers.wrap(worker.WorkerSide, name, f"step:{name}")
    install_check_timer(timers)
    return timers


STEP_CALLS = ("bound", "cleared", "loading", "saving", "saved", "results", "finished", "load_errors")


def install_check_timer(timers: Timers) -> None:
    """Time the NaN/Inf check itself (and count the bytes it read)."""
    from kvobs._lifecycle import checks as transfer_checks

    original = transfer_checks.replacement

    def replacement(t: Any, blocks: Any, *, can_replace: bool) -> Any:
        time.thread_time_ns()  # as in Timers.wrap
        started = time.thread_time_ns()
        try:
            return original(t, blocks, can_replace=can_replace)
        finally:
            if t.cache is not None and blocks is not None and blocks.distinct:
                timers.ns["check"].append(time.thread_time_ns() - started)
            if t.cache is not None and blocks is not None:
                timers.bytes_checked += len(blocks.distinct) * sum(view[0].nbytes for view in t.cache)

    transfer_checks.replacement = replacement  # kvobs._lifecycle.transfer calls it through the module


class FloorObserver:
    """The least any Python observer does per transfer at the points where kvobs observes one: note the job and
    its block ids when it is submitted, take the note back and keep one record when the worker reports it done.

    It runs in the plain engine, at the same calls of the offloading worker, timed as kvobs is: what the
    engine's cold CPU caches cost any Python code there (the baseline of kvobs's per-transfer time)."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[list[int], float]] = {}
        self.records: list[tuple[int, int, float]] = []

    def begin(self, job_id: int, spec: Any) -> None:
        self.open[job_id] = (spec.block_ids.tolist(), time.perf_counter())

    def complete(self, job_id: int) -> None:
        ids, started = self.open.pop(job_id)
        self.records.append((job_id, len(ids), time.perf_counter() - started))


def install_floor(timers: Timers) -> None:
    """Run a FloorObserver around the plain engine's offloading worker (the tests' CPU-copying one)."""
    from running_vllm import cpu_offloading

    floor = FloorObserver()
    timers.wrap(floor, "begin", "floor:begin")
    timers.wrap(floor, "complete", "floor:complete")
    worker = cpu_offloading.CPUCopyOffloadingWorker
    submit_store = worker.submit_store
    submit_load = worker.submit_load
    get_finished = worker.get_finished

    def observed_store(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        floor.begin(job_id, src_spec)  # the GPU blocks read
        return submit_store(self, job_id, src_spec, dst_spec)

    def observed_load(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        floor.begin(job_id, dst_spec)  # the GPU blocks written
        return submit_load(self, job_id, src_spec, dst_spec)

    def observed_finished(self: Any) -> list[Any]:
        results = get_finished(self)
        for result in results:
            floor.complete(result.job_id)
        return results

    worker.submit_store = observed_store
    worker.submit_load = observed_load
    worker.get_finished = observed_finished


def serve(wrapped: bool, model: str) -> None:
    """The engine process: JSON commands on stdin, answers on stdout behind driver.ANSWER_PREFIX."""
    if wrapped:
        timers = install_timers()
    else:
        timers = Timers()
        install_floor(timers)
    import kvobs

    llm = driver.build_engine({"model": model, "connector": connector(wrapped)})
    print(driver.ANSWER_PREFIX + json.dumps({"ready": True, "kvobs": kvobs.__file__}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "round":
            tokens = 0
            started = time.perf_counter()
            for text in command["prompts"]:
                for _ in range(2):  # the second time, its prefix loads through the connector
                    llm.reset_prefix_cache()
                    (out,) = driver.generate(llm, [text], command["max_tokens"])["outputs"]
                    tokens += len(out["token_ids"])
            answer = {"tokens": tokens, "seconds": time.perf_counter() - started}
        elif command["op"] == "timers":
            answer = timers.report()
        elif command["op"] == "reset":  # after the warm-up round: its one-off set-up is not a transfer's cost
            timers.ns.clear()
            timers.bytes_checked = 0
            answer = {}
        else:
            break
        print(driver.ANSWER_PREFIX + json.dumps(answer), flush=True)


# -- the benchmark's own process ---------------------------------------------------------------------------------


class EngineProcess:
    def __init__(self, wrapped: bool, model: str) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", "wrapped" if wrapped else "plain", "--model", model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.kvobs_file = self.read()["kvobs"]

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(driver.ANSWER_PREFIX):
                return json.loads(line[len(driver.ANSWER_PREFIX):])
        raise RuntimeError("the engine process ended")

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def model_dir() -> str:
    path = tiny_llama.cached_dir()
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tests" / "running_vllm" / "tiny_llama.py"), str(path)],
                       check=True, capture_output=True)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve", choices=("plain", "wrapped"))
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve == "wrapped", args.model)
        return
    model = model_dir()
    plain = EngineProcess(False, model)
    wrapped = EngineProcess(True, model)
    try:
        ratios = []
        for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
            prompts = [prompt(1000 * r + i) for i in range(args.prompts)]  # new prefixes: loads and stores
            order = (plain, wrapped) if r % 2 else (wrapped, plain)
            speed = {}
            for engine in order:
                result = engine.ask(op="round", prompts=prompts, max_tokens=args.max_tokens)
                speed[engine] = result["tokens"] / result["seconds"]
            if r:
                ratios.append(speed[wrapped] / speed[plain])
            else:
                wrapped.ask(op="reset")
                plain.ask(op="reset")
        timers = wrapped.ask(op="timers")
        floor = plain.ask(op="timers")["ns"]
    finally:
        plain.close()
        wrapped.close()
    print(f"kvobs imported from {wrapped.kvobs_file}")
    print_report(ratios, timers, floor, args)


def print_report(ratios: list[float], timers: dict[str, Any], floor: dict[str, list[int]], args: Any) -> None:
    ns = timers["ns"]
    print(f"rounds={args.rounds} prompts/round={args.prompts} max_tokens={args.max_tokens}")
    for label, what in (("begin", "Transfers.begin (validation, lifecycle, telemetry; a store's source check)"),
                        ("complete", "Transfers.complete (a load's destination check, the end's telemetry)"),
                        ("lifecycle", "  KVObserver.begin and Transfer.complete inside them"),
                        ("check", "  the NaN/Inf check inside those"),
                        *((f"step:{name}", f"per-step {name}") for name in STEP_CALLS)):
        values = sorted(ns.get(label, [])) or [0]
        print(f"kvobs {what}: {len(values)} calls, median {statistics.median(values) / 1000:.1f} us, "
              f"p90 {values[int(0.9 * (len(values) - 1))] / 1000:.1f} us")
    begun = len(ns.get("begin", [])) or 1
    ours = sum(ns.get("begin", [])) + sum(ns.get("complete", []))
    lifecycle = sum(ns.get("lifecycle", []))
    check = sum(ns.get("check", []))
    print(f"kvobs per transfer without the check (mean of begin + complete - check): {(ours - check) / begun / 1000:.1f} us"
          f" = lifecycle (Transfer, telemetry) {(lifecycle - check) / begun / 1000:.1f} us"
          f" + the vLLM integration {(ours - lifecycle) / begun / 1000:.1f} us")
    floored = len(floor.get("floor:begin", [])) or 1
    floor_us = (sum(floor.get("floor:begin", [])) + sum(floor.get("floor:complete", []))) / floored / 1000
    print(f"baseline: the least a Python observer does at the same calls of the plain engine (FloorObserver): "
          f"{floor_us:.1f} us per transfer over {len(floor.get('floor:begin', []))} transfers; kvobs without the "
          f"check / baseline: {(ours - check) / begun / 1000 / floor_us:.1f}x")
    steps = len(ns.get("step:bound", [])) or 1
    per_step = sum(sum(ns.get(f"step:{name}", [])) for name in STEP_CALLS)
    print(f"kvobs per engine step (the wrapper's worker-side observation, all calls, transfers included): "
          f"{per_step / steps / 1000:.1f} us over {steps} steps")
    checks = ns.get("check", [])
    if checks:
        print(f"  check speed: {timers['bytes_checked'] / sum(checks):.2f} GB/s over "
              f"{timers['bytes_checked'] / len(checks):.0f} bytes per check")
    print(f"tokens/s wrapped / plain: median {statistics.median(ratios):.4f}, "
          f"min {min(ratios):.4f}, max {max(ratios):.4f} over {len(ratios)} paired rounds")


if __name__ == "__main__":
    main()
