"""Running the scripts of examples/ as a user would, for the tests that check what they show."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_ON_ENGINE = Path(__file__).resolve().parent / "engine_examples.py"
ENGINE_EXAMPLES = {"vllm_connector.py": ("vllm", "skipped: needs vLLM 0.33"),
                   "sglang_hicache.py": ("sglang", "skipped: needs SGLang 0.5.23")}


def dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def run_example(name: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """Run one example; generous timeout: the SGLang example imports SGLang's modules (tens of seconds on a
    loaded machine, and a download of the wheel into the tests' cache the first time)."""
    full_env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": dead_endpoint(), **env}
    full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    command = [sys.executable, str(EXAMPLES / name)]
    if name in ENGINE_EXAMPLES:
        command.insert(1, str(RUN_ON_ENGINE))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
