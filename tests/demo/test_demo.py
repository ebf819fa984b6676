"""The simulated engine behind `kvobs demo`: both incidents unguarded on every seed, none in either guarded run
(global lock, block lock), and the block lock's targets reported.

Runs are short (2 s at most) but the race windows are wide on purpose, so one or two seconds are plenty.
"""

from __future__ import annotations

import ast
import io
import math
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvobs
from kvobs import semconv as sc
from kvobs.demo import BLOCK_LOCK, GLOBAL_LOCK, UNGUARDED, SimConfig, SimEngine
from kvobs.demo.app import DemoOptions, run_demo, serve
from kvobs.demo.engine import SimulationFailed
from kvobs.demo.report import (
    GUARDED_INVARIANTS,
    INCIDENT_FIELDS,
    RUN_FIELDS,
    format_table,
    histogram_quantile,
    incidents,
)
from kvobs.demo.targets import judge, targets

GUARDED_RUNS = ("global_lock", "block_lock")


def demo(seed: int, duration: float = 2.0, **options) -> dict:
    return run_demo(DemoOptions(duration_s=duration, seed=seed, metrics_port=0, quiet=True, **options))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unguarded_shows_both_incidents_and_the_guarded_runs_none(seed):
    summary = demo(seed)
    assert list(summary["runs"]) == ["unguarded", "global_lock", "block_lock"]
    unguarded = summary["runs"]["unguarded"]
    for field in INCIDENT_FIELDS:
        assert unguarded[field] >= 1, (field, unguarded)
    # Blocks freed before their write-back ran are stored stale unguarded; the guarded engines free them after.
    assert unguarded["stale_blocks_written_to_storage"] >= 1
    for name in GUARDED_RUNS:
        guarded = summary["runs"][name]
        for field in GUARDED_INVARIANTS:
            assert guarded[field] == 0, (name, field, guarded)
        # No step read a block a prefetch was still writing: no NaN reached a write-back or send to refuse.
        assert guarded["write_back_rejected"] == guarded["send_rejected"] == 0, name
        # The guards did real work: early signals recovered, transfers and forward steps took the lock.
        assert guarded["signals_recovered"] >= 1, name
        assert guarded["lock_wait_p99_s"] > 0 and guarded["forward_lock_wait_total_s"] > 0, name
        assert guarded["transfers_done"] > 0 and guarded["throughput_per_s"] > 0, name
    assert summary["incidents"] == {
        "unguarded_nan_incident": True, "unguarded_hang_incident": True, "global_lock_clean": True,
        "block_lock_clean": True,
    }
    # A run that takes no lock measured no lock wait: null, never interpolated noise.
    for field in ("lock_wait_p50_s", "lock_wait_p99_s", "forward_lock_wait_p50_s", "forward_lock_wait_p99_s",
                  "forward_lock_wait_total_s"):
        assert unguarded[field] is None, field
    # The targets are judged on these very runs (whether they are met is measured, not asserted: timing).
    assert set(summary["targets"]) == {"forward_lock_wait_p99", "forward_lock_wait_total", "throughput"}
    p99 = summary["targets"]["forward_lock_wait_p99"]
    runs = summary["runs"]
    assert p99["run_value"] == runs["block_lock"]["forward_lock_wait_p99_s"]
    assert p99["baseline_value"] == runs["global_lock"]["forward_lock_wait_p99_s"]


def test_faults_are_seen_and_the_guarded_engines_keep_running():
    # 3 s: a poisoned entry (one every 0.5 s) is found only when a later request hits it; at 2 s a loaded
    # machine (other processes on the two cores) once ended a block-lock run before any did
    summary = demo(11, duration=3.0, faults=frozenset({"nan", "stale-signal"}))
    assert summary["faults"] == ["nan", "stale-signal"]
    for name in GUARDED_RUNS:
        guarded = summary["runs"][name]
        assert guarded["poisoned_storage_entries"] >= 1, name
        assert guarded["prefetch_corrupt"] >= 1, name  # found by the prefetch check, evicted, recomputed
        assert guarded["nan_checks_nan"] >= guarded["prefetch_corrupt"], name
        assert guarded["stale_signals_injected"] == 1, name
        assert guarded["pending_signals"] >= 1, name  # the stale signal is still waiting (TTL longer than the run)
        for field in GUARDED_INVARIANTS:
            assert guarded[field] == 0, (name, field, guarded)
        assert guarded["requests_completed"] > 0, name
    assert summary["runs"]["unguarded"]["nan_blocks_served_to_prefix_hits"] >= 1


def test_the_block_lock_itself_keeps_prefetched_blocks_safe_without_the_scheduler_probe():
    """With the scheduler's look at the lock switched off, a forward step that includes a prefill whose prefetch
    is still copying waits for that prefetch (a conflict with holder_path=prefetch) instead of reading its
    blocks: no NaN anywhere, not even for the NaN checks to refuse (without the lock they refuse many)."""
    engine = SimEngine(SimConfig(run=BLOCK_LOCK, seed=0))
    engine.forward.prefix_probe = None
    engine.start()
    time.sleep(2.0)
    engine.stop()
    engine.raise_if_failed()
    counters = engine.stats.counters()
    assert counters["prefix_hits"] >= 1
    for field in GUARDED_INVARIANTS:
        assert counters[field] == 0, (field, counters)
    assert counters["prefix_probes"] == 0
    assert counters["write_back_rejected"] == counters["send_rejected"] == 0  # no NaN computed from a prefix
    waited_for_prefetch = engine.registry.get_sample_value(sc.LOCK_CONFLICTS_TOTAL, {
        "engine": "demo-block-lock", "lock": "kv_cache", "path": "forward", "holder_path": "prefetch"})
    assert waited_for_prefetch and waited_for_prefetch >= 1


def test_a_block_lock_run_keeps_its_lock_file_in_a_directory_of_its_own_removed_at_stop():
    engines = [SimEngine(SimConfig(run=BLOCK_LOCK, seed=0)) for _ in range(2)]
    directories = [engine.lock_files.directory for engine in engines]
    assert directories[0] != directories[1]
    assert all(os.listdir(d) == ["kvobs-kv_cache.blocks"] for d in directories)
    assert isinstance(engines[0].observer.lock, kvobs.BlockLock)
    for engine, directory in zip(engines, directories):
        engine.start()
        time.sleep(0.3)
        engine.stop()
        assert not os.path.exists(directory)
    unlocked = SimEngine(SimConfig(run=UNGUARDED, seed=0))
    assert unlocked.lock_files.directory is None  # only a block lock needs a file


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashed_engine_thread_fails_the_run_loudly_never_a_silent_hang():
    broken = SimConfig(family_blocks=0)  # the workload cannot draw a prefix: the forward thread raises
    with pytest.raises(SimulationFailed, match="the unguarded simulation failed: ValueError"):
        demo(0, duration=30.0, config=broken)
    err = io.StringIO()
    assert serve(DemoOptions(duration_s=30.0, metrics_port=0, quiet=True, config=broken), stderr=err) == 1
    assert re.search(r"error: the (global|block)_lock simulation failed: ValueError", err.getvalue())


def test_each_run_has_its_own_registry_and_engine_label():
    engines = [SimEngine(SimConfig(run=run, seed=0)) for run in (UNGUARDED, GLOBAL_LOCK, BLOCK_LOCK)]
    assert len({id(e.registry) for e in engines}) == 3
    assert [e.config.engine for e in engines] == ["demo-unguarded", "demo-global-lock", "demo-block-lock"]
    for engine in engines:
        value = engine.registry.get_sample_value(
            sc.TRANSFERS_TOTAL, {"engine": engines[0].config.engine, "path": "prefetch", "outcome": "ok"}
        )
        assert value == (0.0 if engine is engines[0] else None)
        engine.lock_files.remove()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_samples(port: int) -> list | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_metrics_are_served_during_the_run_one_run_at_a_time_with_the_lock_panels_data():
    port = free_port()
    scrapes: list[list] = []
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_demo(DemoOptions(
        duration_s=1.5, seed=4, metrics_port=port, quiet=True))))
    runner.start()
    while runner.is_alive():
        samples = scrape_samples(port)
        if samples is not None:
            scrapes.append(samples)
        time.sleep(0.1 if samples is None else 0.2)
    runner.join()
    assert result["runs"]["block_lock"]["transfers_done"] > 0
    seen = [{s.labels["engine"] for s in samples if "engine" in s.labels} for samples in scrapes]
    assert {"demo-unguarded"} in seen and {"demo-global-lock"} in seen and {"demo-block-lock"} in seen
    assert all(len(engines) <= 1 for engines in seen)  # the runs never mix
    # The dashboards' lock panels: conflicts by path and holder path (the global lock's forward pass waits for
    # transfers), and blocks claimed now by mode (the block lock's gauges, one series per mode).
    samples = [s for scrape in scrapes for s in scrape]
    holders = {s.labels["holder_path"] for s in samples if s.name == sc.LOCK_CONFLICTS_TOTAL
               and s.labels["engine"] == "demo-global-lock" and s.labels["path"] == "forward" and s.value > 0}
    assert holders & {"prefetch", "write_back", "send"}, holders
    modes = {s.labels["mode"] for s in samples if s.name == sc.LOCK_BLOCKS_CLAIMED
             and s.labels["engine"] == "demo-block-lock"}
    assert modes == set(sc.CLAIM_MODES)


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
               prefix_probes=0, forward_requests_deferred=0, prefix_probe_total_s=0.0)
    run.update(values)
    return run


def test_table_has_a_row_per_field_a_column_per_run_in_order_and_a_line_per_target():
    runs = {"unguarded": synthetic_run(False, lock_wait_p99_s=None, lock_wait_p50_s=None, throughput_per_s=20.0),
            "global_lock": synthetic_run(True, lock_wait_p99_s=0.0243, lock_wait_p50_s=0.0026,
                                         forward_lock_wait_p99_s=0.03, forward_lock_wait_total_s=2.0),
            "block_lock": synthetic_run(True, lock_wait_p99_s=0.0001, lock_wait_p50_s=0.00002, prefix_probes=9,
                                        forward_requests_deferred=4, forward_lock_wait_p99_s=0.001,
                                        forward_lock_wait_total_s=0.5, throughput_per_s=40.0)}
    summary = {"seed": 3, "duration_s": 2.0, "faults": [], "runs": runs, "incidents": incidents(runs),
               "targets": targets(runs)}
    lines = format_table(summary).splitlines()
    for _, label, _ in RUN_FIELDS:
        assert any(line.startswith(label) for line in lines), label
    header = next(line for line in lines if line.split() == list(runs))
    assert header.index("unguarded") < header.index("global_lock") < header.index("block_lock")
    assert "seed=3" in lines[0]
    assert lines[1].split(":")[0].strip() == "unguarded" and "kvobs observes only" in lines[1]
    p99 = re.split(r"\s{2,}", next(line for line in lines if line.startswith("lock wait p99")))
    assert p99[1:] == ["-", "24.3 ms", "100 us"]  # nothing measured: "-", never "0" or "5 us"
    assert "block_lock: no incident" in lines and "unguarded reproduced: nothing" in lines
    assert any(line.startswith("block_lock: 4 times a prefill was left for a later step") for line in lines)
    assert lines[-3:] == [
        "target forward_lock_wait_p99: block_lock vs global_lock 1.0 ms vs 30.0 ms: reduction 97% "
        "(reduction >= 90%): met",
        "target forward_lock_wait_total: block_lock vs global_lock 500.0 ms vs 2.00 s: reduction 75% "
        "(reduction >= 90%): MISSED",
        "target throughput: block_lock vs unguarded 40.0 vs 20.0: ratio 200% (ratio >= 90%): met",
    ]


def test_targets_are_judged_only_on_runs_present_and_measured():
    assert targets({"unguarded": synthetic_run(False)}) == {}
    assert set(targets({"block_lock": synthetic_run(True), "global_lock": synthetic_run(True)})) == {
        "forward_lock_wait_p99", "forward_lock_wait_total"}
    assert judge("throughput_per_s", 9.0, "unguarded", 10.0, "ratio")["met"] is True  # 90% is within 10%
    assert judge("throughput_per_s", 8.9, "unguarded", 10.0, "ratio")["met"] is False
    nothing = judge("forward_lock_wait_p99_s", 0.001, "global_lock", None, "reduction")
    assert (nothing["reduction"], nothing["met"]) == (None, None)


def test_incidents_per_run_keyed_by_its_name_and_guarded_runs_need_no_stale_block():
    runs = {"unguarded": synthetic_run(False, nan_blocks_written_to_storage=3, nan_blocks_served_to_prefix_hits=1,
                                       lost_layer0_signals=2, hung_sends=0, stale_blocks_written_to_storage=5),
            "global_lock": synthetic_run(True),
            "block_lock": synthetic_run(True, hung_sends=1),
            "fourth": synthetic_run(True, stale_blocks_written_to_storage=1)}
    assert incidents(runs) == {"unguarded_nan_incident": True, "unguarded_hang_incident": False,
                               "global_lock_clean": True, "block_lock_clean": False, "fourth_clean": False}
    assert set(GUARDED_INVARIANTS) <= set(runs["global_lock"])


# -- the demo is a user of kvobs: public names only ------------------------------------------------------------

PUBLIC_MODULES = {"kvobs", "kvobs.errors", "kvobs.semconv", "kvobs.config", "kvobs.policy", "kvobs.integrity",
                  "kvobs.signals", "kvobs.testing"}


def kvobs_names_used(source: str) -> list[str]:
    """Every kvobs module or name a source imports or reaches as an attribute (`kvobs.x.y`), the simulator's
    own modules left out."""
    used = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            used += [alias.name for alias in node.names if alias.name.split(".")[0] == "kvobs"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvobs":
            used += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kvobs":
            used.append(f"kvobs.{node.attr}")
    return [name for name in used if not name.startswith("kvobs.demo")]


def is_public(name: str) -> bool:
    """A public module, or a name kvobs (or a public module) exports."""
    if name in PUBLIC_MODULES:
        return True
    module, _, attr = name.rpartition(".")
    if module == "kvobs":
        return attr in kvobs.__all__ or attr == "__version__" or name in PUBLIC_MODULES
    return module in PUBLIC_MODULES


def test_the_demo_uses_kvobs_public_names_only():
    sim = Path(kvobs.__file__).parent / "sim"
    internal = {f"{path.name}: {name}" for path in sorted(sim.glob("*.py"))
                for name in kvobs_names_used(path.read_text()) if not is_public(name)}
    assert internal == set()
