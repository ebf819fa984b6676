"""Run a real vLLM engine from the test suite: its Python is .venv-vllm's (scripts/setup_vllm.sh), the test
suite's own .venv has no vLLM. Tests talk to `driver.py` in a subprocess, or to vLLM's OpenAI API server.

The engine needs a model and none can be downloaded: `tiny_model()` builds a tiny random-weight Llama once,
cached under ~/.cache/kvobs/tiny-llama/<hash of the build script> (KVOBS_MODEL_CACHE overrides the root).
Without .venv-vllm the engine tests are skipped with the reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from running_vllm import tiny_llama

REPO = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ANSWER_PREFIX = "KVOBS-ANSWER "
START_TIMEOUT_S = 240
CALL_TIMEOUT_S = 120

# Words of the tiny model's vocabulary: prompts made of them tokenize one token per word.
PROMPT_WORDS = (
    "the cache moves blocks from storage to the device and back while the model reads its keys and values "
    "a prefix that was seen before is loaded instead of computed again so the first token comes sooner "
    "when a block is corrupt the engine must compute it again and never serve what it read"
).split()


def prompt(seed: int, words: int = 80) -> str:
    """A prompt of `words` vocabulary words; distinct seeds give distinct prefixes from the first block on."""
    return " ".join(PROMPT_WORDS[(seed * 7 + i * (seed + 1)) % len(PROMPT_WORDS)] for i in range(words))


def vllm_python() -> pathlib.Path:
    """.venv-vllm's Python; skip (fail in CI) when scripts/setup_vllm.sh has not built it."""
    if (REPO / ".venv-vllm" / ".kvobs-setup-vllm").is_file() and VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    reason = f"no running vLLM: {REPO / '.venv-vllm'} is not set up (run scripts/setup_vllm.sh; scripts/test.sh does)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine process on these CPU-only machines."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "PROMETHEUS_", "KVOBS_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="INFO", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.update(extra)
    return env


def tiny_model(hybrid: bool = False) -> pathlib.Path:
    """The tiny Llama's directory, built on first use (into a private folder, then moved into place);
    `hybrid`: its sliding-window variant, whose two layers vLLM keeps in two KV cache groups."""
    python = vllm_python()
    script = HERE / "tiny_llama.py"
    target = tiny_llama.cached_dir(hybrid)
    root = target.parent
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    building = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        subprocess.run([str(python), str(script), str(building), *(["--hybrid"] if hybrid else [])], check=True, env=engine_env(),
                       capture_output=True, timeout=300)
        with contextlib.suppress(OSError):  # another process won the race: its copy is the same
            building.rename(target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def offloading(*, wrapped: bool = True, **kvobs_options: Any) -> dict[str, Any]:
    """kv_transfer_config: vLLM's OffloadingConnector on the CPU-copying spec, wrapped by kvobs or not."""
    child = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
                                           "spec_module_path": "running_vllm.cpu_offloading",
                                           "cpu_bytes_to_use": 64_000_000}}
    return wrap(child, **kvobs_options) if wrapped else child


def shared_storage(path: pathlib.Path, *, wrapped: bool = True, **kvobs_options: Any) -> dict[str, Any]:
    """kv_transfer_config: vLLM's example (shared-storage) connector, files under `path`."""
    child = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    return wrap(child, "KVObsConnectorNoHMA", **kvobs_options) if wrapped else child


def wrap(child: dict[str, Any], name: str = "KVObsConnector", **kvobs_options: Any) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": "kvobs.integrations.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connector": child, **kvobs_options}}


class Engine:
    """One driver process: `call(op, **args)` sends a command and returns its answer; `log` is its output."""

    def __init__(self, connector: dict[str, Any] | None, env: dict[str, str], model: pathlib.Path | None = None) -> None:
        config = {"model": str(model or tiny_model()), "connector": connector}
        self.log: list[str] = []
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.process = subprocess.Popen(
            [str(vllm_python()), str(HERE / "driver.py"), json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._expect(START_TIMEOUT_S)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(ANSWER_PREFIX):
                self._answers.put(json.loads(line[len(ANSWER_PREFIX):]))
            else:
                self.log.append(line.rstrip("\n"))
        self._answers.put(None)

    def _expect(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the engine did not answer within {timeout} s; its log ends:\n" + self.tail()) from None
        if answer is None:
            raise AssertionError("the engine process ended; its log ends:\n" + self.tail())
        if "error" in answer:
            raise AssertionError(f"the engine failed: {answer['traceback']}\nits log ends:\n" + self.tail())
        return answer

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log[-lines:])

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        return self._expect(timeout)

    def generate(self, prompts: list[str], max_tokens: int = 8, timeout: float = CALL_TIMEOUT_S) -> list[dict[str, Any]]:
        return self.call("generate", timeout=timeout, prompts=prompts, max_tokens=max_tokens)["outputs"]

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)


@contextlib.contextmanager
def engine(connector: dict[str, Any] | None, model: pathlib.Path | None = None, **env: str) -> Iterator[Engine]:
    """A running engine for the `with` block (on the tiny Llama, or `model`)."""
    running = Engine(connector, engine_env(**env), model)
    try:
        yield running
    finally:
        running.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ApiServer:
    """vLLM's OpenAI API server (`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of
    the vllm-cpu build looks for a distribution named `vllm` and fails)."""

    def __init__(self, connector: dict[str, Any] | None, env: dict[str, str], log_path: pathlib.Path) -> None:
        self.model = str(tiny_model())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--model", self.model, "--tokenizer", self.model,
                   "--max-model-len", "256", "--block-size", "32", "--enforce-eager", "--dtype", "float32",
                   "--seed", "0", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                   "--enable-prompt-tokens-details"]
        if connector is not None:
            command += ["--kv-transfer-config", json.dumps(connector)]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the API server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"the API server was not healthy within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
            payload = response.read()
        return json.loads(payload) if payload.strip() else {}

    def complete(self, text: str, max_tokens: int = 8) -> dict[str, Any]:
        return self.post("/v1/completions", {"model": self.model, "prompt": text, "max_tokens": max_tokens,
                                              "temperature": 0.0, "ignore_eos": True, "seed": 0})

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return response.read().decode()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@contextlib.contextmanager
def api_server(connector: dict[str, Any] | None, log_path: pathlib.Path, **env: str) -> Iterator[ApiServer]:
    """vLLM's API server for the `with` block; its engine core (scheduler and worker) in a process of its own."""
    running = ApiServer(connector, engine_env(**{"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **env}), log_path)
    try:
        yield running
    finally:
        running.close()


def samples(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`, from exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


_DYING_ENGINE = """
import os, signal
import kvobs
from kvobs.telemetry._metrics.refresher import Refresher

obs = kvobs.KVObserver("vllm", lock=None)
obs.begin("prefetch", key=1, block_ids=[1, 2])
Refresher.shared().refresh()
os.kill(os.getpid(), signal.SIGKILL)
"""


def leave_a_dead_engines_gauges(directory: pathlib.Path) -> None:
    """Leave in a multiprocess directory what a killed engine process leaves: a load in flight under engine
    label "vllm" in its live gauges (as a previous run's engine core, killed, leaves them for the next)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    dying = subprocess.run([sys.executable, "-c", _DYING_ENGINE], env=env, capture_output=True, text=True, check=False)
    assert dying.returncode == -signal.SIGKILL, dying.stderr
