"""A plain `pip install kvobs` (no extra) has no torch, yet kvobs imports, checks a NumPy cache for NaN/Inf and
runs a decorated transfer; what needs an extra says which one.

One fresh virtual environment is built per test run, in a temporary directory, from a copy of the package
(pip builds in the source tree, which must stay clean). pip's cache makes it take seconds after the first time.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Building the environment takes minutes on a loaded machine the first time (pip's cache is cold).
pytestmark = pytest.mark.timeout(900)

PLAIN_USE = textwrap.dedent(
    """
    import importlib.util

    import numpy as np
    from prometheus_client import CollectorRegistry

    import kvobs

    assert importlib.util.find_spec("torch") is None, "torch is installed"
    assert "site-packages" in kvobs.__file__, kvobs.__file__
    cache = np.zeros((16, 4, 8), dtype=np.float16)      # [blocks, tokens, dim]
    cache[5, 1, 2] = np.nan
    cache[9, 0, 0] = np.inf
    result = kvobs.check_blocks(cache, [4, 5, 9])
    print("check", result.result, result.nan_block_ids, result.inf_block_ids, result.checked_blocks)
    layers = [(cache, cache.copy()) for _ in range(2)]  # (key, value) per layer
    print("layers", kvobs.check_blocks(layers, np.array([5, 6])).nan_block_ids)

    registry = CollectorRegistry()
    obs = kvobs.KVObserver("plain", registry=registry)

    @obs.prefetch(block_ids="ids", cache="cache")
    def load(ids, cache):
        return len(ids)

    print("loaded", load([1, 2], cache))
    try:
        load([5], cache)
    except kvobs.CorruptKVError as exc:
        print("refused", exc.bad_block_ids)
    for outcome in ("ok", "error"):
        print(outcome, registry.get_sample_value(
            "kvobs_transfers_total", {"engine": "plain", "path": "prefetch", "outcome": outcome}))
    try:
        kvobs.check_blocks(cache, [1], method="torch")
    except ValueError as exc:
        print("torch method:", exc)
    """
)


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without what would put the repository's kvobs on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PROMETHEUS_MULTIPROC_DIR")}
    return {**env, **extra}


def run(*command: str | Path, cwd: Path | None = None, timeout: float = 600, **env: str) -> str:
    proc = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=clean_environment(**env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding `pip install .` and nothing else; its python."""
    root = tmp_path_factory.mktemp("plain-install")
    source = root / "kvobs-src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "kvobs", source / "kvobs", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run(sys.executable, "-m", "venv", root / "venv")
    python = root / "venv" / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--no-compile", str(source))
    return python


def test_plain_install_has_no_torch(plain_venv):
    installed = run(plain_venv, "-m", "pip", "list", "--format=freeze").lower().splitlines()
    names = {line.split("==")[0] for line in installed}
    assert "kvobs" in names
    assert not {name for name in names if name in ("torch", "triton", "numba") or name.startswith("nvidia-")}
    proc = subprocess.run([plain_venv, "-c", "import torch"], capture_output=True, text=True, timeout=60,
                          env=clean_environment())
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


def test_plain_install_checks_a_numpy_cache_and_guards_a_transfer(plain_venv, tmp_path):
    out = run(plain_venv, "-c", PLAIN_USE, cwd=tmp_path, timeout=120)  # not the repository: the installed kvobs
    assert "check nan (5,) (9,) 3\n" in out
    assert "layers (5,)\n" in out
    assert "loaded 2\n" in out
    assert "refused (5,)\n" in out
    assert "ok 1.0\nerror 1.0\n" in out
    assert "torch method: method='torch' needs torch, which is not installed: pip install 'kvobs[torch]'" in out


def test_plain_install_demo_says_which_extra_it_needs(plain_venv, tmp_path):
    proc = subprocess.run([plain_venv.parent / "kvobs", "demo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=clean_environment())
    assert proc.returncode == 2
    assert "kvobs demo needs torch, which is not installed: pip install 'kvobs[torch]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_examples_run_on_the_plain_install_without_the_test_tree(plain_venv, tmp_path):
    """What the README tells a user to install is enough for every example: the engine examples say what they
    need and exit 0."""
    examples = shutil.copytree(REPO / "examples", tmp_path / "examples")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody_listens = f"http://127.0.0.1:{s.getsockname()[1]}"
    for script in sorted(examples.glob("*.py")):
        proc = subprocess.run([plain_venv, script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env=clean_environment(OTEL_EXPORTER_OTLP_ENDPOINT=nobody_listens))
        assert proc.returncode == 0, (script.name, proc.stdout + proc.stderr)
        assert "Traceback" not in proc.stderr, (script.name, proc.stderr)
        if script.name in ("vllm_connector.py", "sglang_hicache.py"):
            assert proc.stdout.startswith("skipped: needs "), (script.name, proc.stdout)
        else:
            assert "skipped" not in proc.stdout, (script.name, proc.stdout)
