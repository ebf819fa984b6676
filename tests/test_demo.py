"""The simulated engine behind `kvobs demo`: both incidents unguarded on every seed, none guarded.

Runs are short (2 s at most) but the race windows are wide on purpose, so one or two seconds are plenty.
"""

from __future__ import annotations

import io
import math
import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvobs import semconv as sc
from kvobs.sim import GUARDED, UNGUARDED, SimConfig, SimEngine
from kvobs.sim.demo import DemoOptions, run_demo, serve
from kvobs.sim.engine import SimulationFailed
from kvobs.sim.report import INCIDENT_FIELDS, RUN_FIELDS, format_table, histogram_quantile, incidents


def demo(seed: int, duration: float = 2.0, **options) -> dict:
    return run_demo(DemoOptions(duration_s=duration, seed=seed, metrics_port=0, quiet=True, **options))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_unguarded_shows_both_incidents_and_guarded_none(seed):
    summary = demo(seed)
    unguarded, guarded = summary["runs"]["unguarded"], summary["runs"]["guarded"]
    for field in INCIDENT_FIELDS:
        assert unguarded[field] >= 1, (field, unguarded)
        assert guarded[field] == 0, (field, guarded)
    assert summary["incidents"] == {
        "unguarded_nan_incident": True, "unguarded_hang_incident": True, "guarded_clean": True,
    }
    # The guards did real work: early signals recovered, the forward pass kept off blocks a prefetch was writing.
    assert guarded["signals_recovered"] >= 1
    assert guarded["lock_wait_p99_s"] > 0 and guarded["forward_lock_wait_p99_s"] > 0
    assert guarded["transfers_done"] > 0 and guarded["throughput_per_s"] > 0
    # Blocks freed before their write-back ran are stored stale unguarded; the guarded engine frees them after.
    assert unguarded["stale_blocks_written_to_storage"] >= 1
    assert guarded["stale_blocks_written_to_storage"] == 0
    # A run that takes no lock measured no lock wait: null, never interpolated noise.
    for field in ("lock_wait_p50_s", "lock_wait_p99_s", "forward_lock_wait_p50_s", "forward_lock_wait_p99_s"):
        assert unguarded[field] is None, field


def test_faults_are_seen_and_the_guarded_engine_keeps_running():
    summary = demo(11, duration=2.5, faults=frozenset({"nan", "stale-signal"}))
    assert summary["faults"] == ["nan", "stale-signal"]
    guarded = summary["runs"]["guarded"]
    assert guarded["poisoned_storage_entries"] >= 1
    assert guarded["prefetch_corrupt"] >= 1  # found by the prefetch check, evicted, recomputed
    assert guarded["nan_checks_nan"] >= guarded["prefetch_corrupt"]
    assert guarded["stale_signals_injected"] == 1
    assert guarded["pending_signals"] >= 1  # the stale signal is still waiting (TTL longer than the run)
    for field in INCIDENT_FIELDS:
        assert guarded[field] == 0, (field, guarded)
    assert guarded["requests_completed"] > 0
    assert summary["runs"]["unguarded"]["nan_blocks_served_to_prefix_hits"] >= 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashed_engine_thread_fails_the_run_loudly_never_a_silent_hang():
    broken = SimConfig(family_blocks=0)  # the workload cannot draw a prefix: the forward thread raises
    with pytest.raises(SimulationFailed, match="the unguarded simulation failed: ValueError"):
        demo(0, duration=30.0, config=broken)
    err = io.StringIO()
    assert serve(DemoOptions(duration_s=30.0, metrics_port=0, quiet=True, config=broken), stderr=err) == 1
    assert "error: the guarded simulation failed: ValueError" in err.getvalue()


def test_each_run_has_its_own_registry_and_engine_label():
    engines = [SimEngine(SimConfig(run=run, seed=0)) for run in (UNGUARDED, GUARDED)]
    assert engines[0].registry is not engines[1].registry
    assert [e.config.engine for e in engines] == ["demo-unguarded", "demo-guarded"]
    for engine in engines:
        value = engine.registry.get_sample_value(
            sc.TRANSFERS_TOTAL, {"engine": engines[0].config.engine, "path": "prefetch", "outcome": "ok"}
        )
        assert value == (0.0 if engine is engines[0] else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_served_during_the_run_one_run_at_a_time():
    port = free_port()
    seen: list[set[str]] = []
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_demo(DemoOptions(
        duration_s=1.5, seed=4, metrics_port=port, quiet=True))))
    runner.start()
    while runner.is_alive():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            time.sleep(0.1)
            continue
        engines = {
            s.labels["engine"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if "engine" in s.labels
        }
        seen.append(engines)
        time.sleep(0.2)
    runner.join()
    assert result["runs"]["guarded"]["transfers_done"] > 0
    assert {"demo-unguarded"} in seen and {"demo-guarded"} in seen
    assert all(len(engines) <= 1 for engines in seen)  # the two runs never mix


def test_histogram_quantile_matches_promql():
    buckets = [(0.001, 0), (0.01, 50), (0.1, 100), (math.inf, 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.001 + 0.009 * 0.5)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 0.98)
    assert histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]) is None  # nothing measured
    assert histogram_quantile(0.99, [(0.1, 1), (math.inf, 10)]) == 0.1  # +Inf bucket: highest finite bound
    assert histogram_quantile(0.5, []) is None


def synthetic_run(guarded: bool, **values) -> dict:
    run = {key: 0 for key, _, _ in RUN_FIELDS}
    run.update(guarded=guarded, write_back_rejected=1, send_rejected=0, prefetch_corrupt=0, signals_recovered=2,
               forward_lock_wait_p99_s=0.002, **values)
    return run


def test_table_has_a_row_per_field_and_a_column_per_run_in_order():
    runs = {"unguarded": synthetic_run(False, lock_wait_p99_s=None, lock_wait_p50_s=None),
            "guarded": synthetic_run(True, lock_wait_p99_s=0.0243, lock_wait_p50_s=0.0026),
            "third_run": synthetic_run(True, lock_wait_p99_s=0.0001, lock_wait_p50_s=0.00002)}
    summary = {"seed": 3, "duration_s": 2.0, "faults": [], "runs": runs, "incidents": incidents(runs)}
    lines = format_table(summary).splitlines()
    for _, label, _ in RUN_FIELDS:
        assert any(line.startswith(label) for line in lines), label
    header = next(line for line in lines if line.split() == list(runs))
    assert header.index("unguarded") < header.index("guarded") < header.index("third_run")
    assert "seed=3" in lines[0]
    assert lines[1].split(":")[0].strip() == "unguarded" and "kvobs observes only" in lines[1]
    p99 = re.split(r"\s{2,}", next(line for line in lines if line.startswith("lock wait p99")))
    assert p99[1:] == ["-", "24.3 ms", "100 us"]  # nothing measured: "-", never "0" or "5 us"
    assert "third_run: no incident" in lines and "unguarded reproduced: nothing" in lines


def test_incidents_per_run_keyed_by_its_name():
    runs = {"unguarded": synthetic_run(False, nan_blocks_written_to_storage=3, nan_blocks_served_to_prefix_hits=1,
                                       lost_layer0_signals=2, hung_sends=0),
            "guarded": synthetic_run(True),
            "third_run": synthetic_run(True, hung_sends=1)}
    assert incidents(runs) == {"unguarded_nan_incident": True, "unguarded_hang_incident": False,
                               "guarded_clean": True, "third_run_clean": False}
    assert set(INCIDENT_FIELDS) <= set(runs["guarded"])
