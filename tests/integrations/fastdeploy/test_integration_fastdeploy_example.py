"""examples/fastdeploy_storage_cache.py shows what it says (tests/docs/test_examples.py only checks that it runs)."""

from __future__ import annotations

from examples_support import run_example


def test_the_storage_cache_example_shows_each_case():
    proc = run_example("fastdeploy_storage_cache.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "loaded [8, 9, 10], no false alarm" in out
    assert "poisoned storage entry: loaded [] (nothing loaded: the engine recomputes)" in out
    assert "write-back of an Inf block returned (no hang); stored: False" in out
    assert 'kvobs_nan_checks_total{engine="fd-rank0",path="prefetch",result="nan"} 1.0' in out
    assert 'kvobs_transfers_total{engine="fd-rank0",outcome="rejected",path="write_back"} 1.0' in out
