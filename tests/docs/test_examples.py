"""Every script in examples/ runs; the OTLP example delivers its spans, and ends quickly when nothing listens.

The engine examples run on the engine's real modules: an installed engine, else the wheel the tests cache,
loaded by `engine_examples.py` around the example (the examples themselves never reach into tests/). Without
the engine they say what they need and exit 0.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import pytest

from examples_support import ENGINE_EXAMPLES, EXAMPLES, run_example
from support import otlp_receiver


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_runs(script):
    proc = run_example(script)
    unavailable = "cannot be had" in proc.stderr  # an engine example offline, without the engine's wheel
    if proc.returncode and unavailable and os.environ.get("CI", "").lower() != "true":
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", sorted(ENGINE_EXAMPLES))
def test_engine_examples_say_what_they_need_and_exit_0_without_the_engine(script):
    package, message = ENGINE_EXAMPLES[script]
    hide = (f"import runpy, sys; sys.modules[{package!r}] = None; "
            f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120,
                          cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(message), proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_import_nothing_from_the_test_tree(script):
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse((EXAMPLES / script).read_text()))
        for alias in (node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else ())
    } | {
        node.module.split(".")[0] for node in ast.walk(ast.parse((EXAMPLES / script).read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"upstream", "pytest", "support", "tests", "conftest"}
    assert '"tests"' not in (EXAMPLES / script).read_text()


def test_prefix_cache_manager_guards_both_paths():
    proc = run_example("prefix_cache_manager.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "write-back stored 4 blocks, prefetch loaded 4 blocks" in out
    assert "write-back of a NaN block returned None; 'k5' stored: False" in out
    assert "prefetch refused: corrupt KV cache" in out
    assert "rejected: kvobs rejected write_back transfer: asynchronous" in out
    assert 'kvobs_nan_checks_total{engine="prefix-cache-example",path="write_back",result="nan"} 1.0' in out
    assert 'kvobs_transfers_total{engine="prefix-cache-example",outcome="rejected",path="write_back"} 2.0' in out


def test_otlp_example_delivers_spans_to_a_real_receiver():
    with otlp_receiver() as (receiver, port):
        proc = run_example(
            "otlp_export.py", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_SERVICE_NAME="ex-svc",
        )
    assert proc.returncode == 0, proc.stderr
    names = sorted(span.name for _, span in receiver.spans)
    assert names == ["kvobs.prefetch", "kvobs.send", "kvobs.write_back"]
    assert {svc["service.name"] for svc, _ in receiver.spans} == {"ex-svc"}
    request_ids = {
        kv.value.string_value for _, span in receiver.spans for kv in span.attributes
        if kv.key == "kvobs.request_id"
    }
    assert request_ids == {"req-1", "req-2"}


def test_otlp_example_ends_quickly_when_nothing_listens():
    """The exporter's 2 s timeout bounds the shutdown: the run with nothing listening takes at most a few seconds
    more than the same run delivering to a receiver, timed just before it (start-up, imports and the kernel
    load vary with the machine's load; the SDK's default timeout and retries would add tens of seconds)."""
    with otlp_receiver() as (_, port):
        start = time.monotonic()
        delivered = run_example("otlp_export.py", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")
        delivering = time.monotonic() - start
    assert delivered.returncode == 0, delivered.stderr
    start = time.monotonic()
    proc = run_example("otlp_export.py", timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "handed to the OTLP exporter" in proc.stdout
    assert elapsed < delivering + 8, (elapsed, delivering)
