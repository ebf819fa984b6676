"""FastDeploy's storage cache under kvobs: the engine's PrefixCacheManager (issue -> done signal) and each rank's
CacheTransferManager (the copy, checked on its Paddle GPU tensors), on the FastDeploy-shaped classes with real
threads, pools, barriers and queues (see tests/fastdeploy_shaped)."""

from __future__ import annotations

import os
import time
import types
from contextlib import ExitStack

import numpy as np
import pytest
from fastdeploy_shaped.cluster import BLOCKS, make_cluster, read_task, write_task
from fastdeploy_shaped.tensors import BACKEND
from support import lock_is_free_from_other_thread

import kvobs
from kvobs import ThreadLock
from kvobs import semconv as sc
from kvobs.integrations import fastdeploy as kvfd
from kvobs.testing import capture

KEYS = [f"h{i}" for i in range(7)]


class Setup:
    """A running cluster, the engine's observer and one observer per rank, with every record they saw."""

    def __init__(self, stack: ExitStack, n_ranks: int = 1, deadline: float = 60.0, instrument: bool = True) -> None:
        self.cluster = make_cluster(n_ranks, barrier_timeout=10)
        stack.callback(self.cluster.stop)
        self.records: list = []
        self.engine_cap = stack.enter_context(capture(
            "fd-engine", lock=ThreadLock("engine"), deadline=deadline, hooks=[self.records.append]))
        self.engine_obs = self.engine_cap.observer
        self.rank_caps = [stack.enter_context(capture(
            f"fd-rank{r}", lock=ThreadLock(f"rank{r}"), deadline=deadline, integrity="raise",
            capacity=BLOCKS, hooks=[self.records.append])) for r in range(n_ranks)]
        if instrument:
            stack.callback(kvfd.instrument_prefix_cache_manager(self.cluster.engine, self.engine_obs))
            for rank, cap in zip(self.cluster.ranks, self.rank_caps):
                stack.callback(kvfd.instrument_cache_transfer_manager(rank, cap.observer))
        self.cluster.start()

    def ended(self, engine: str, path: str) -> list:
        return [r for r in self.records if r.engine == engine and r.path == path]

    def wait_for(self, engine: str, path: str, count: int = 1) -> list:
        deadline = time.monotonic() + 60
        while len(self.ended(engine, path)) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.ended(engine, path)


@pytest.fixture
def setup():
    with ExitStack() as stack:
        yield lambda **kw: Setup(stack, **kw)


def test_runs_on_real_paddle_tensors():
    """FastDeploy's caches are Paddle tensors; the shaped engine uses them when paddlepaddle is installed."""
    if BACKEND != "paddle":
        reason = "paddlepaddle is not installed: the FastDeploy integration tests ran on NumPy arrays"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def test_the_copy_is_covered_not_the_submission(setup):
    s = setup()
    s.cluster.fill(KEYS[:4])
    s.cluster.store.hang.set()  # the storage read blocks: the copy is in progress
    assert s.cluster.engine.issue_prefetch_storage_task(read_task("r1", KEYS[:4], [3, 4, 5, 6]), is_sync=False) == []
    rank_obs = s.rank_caps[0].observer
    deadline = time.monotonic() + 60  # the first check of a cache compiles its kernel: seconds on a busy machine
    while lock_is_free_from_other_thread(rank_obs.lock):  # until the rank's copy holds its lock
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # submitted and copying: both locks held, nothing checked yet, the engine's transfer still open
    assert not lock_is_free_from_other_thread(s.engine_obs.lock)
    assert s.engine_obs.open_transfer(sc.PATH_PREFETCH, "r1") is not None
    assert not s.rank_caps[0].value("kvobs_nan_checks_total", path="prefetch", result="clean")
    s.cluster.store.release.set()
    (engine_record,) = s.wait_for("fd-engine", "prefetch")
    (rank_record,) = s.ended("fd-rank0", "prefetch")
    assert (engine_record.outcome, engine_record.blocks, rank_record.outcome) == ("ok", 4, "ok")
    assert s.rank_caps[0].value("kvobs_nan_checks_total", path="prefetch", result="clean") == 1
    assert lock_is_free_from_other_thread(s.engine_obs.lock) and lock_is_free_from_other_thread(rank_obs.lock)
    keys, values = s.cluster.gpu()
    assert (keys[1][3:7] == 1).all() and (values[0][3:7] == 1).all()


def test_a_partial_storage_hit_raises_no_false_alarm(setup):
    s = setup()
    s.cluster.fill(KEYS[:4])  # storage matches 4 of the 6 full blocks...
    s.cluster.store.vanish.add("prefix_h2_0_value")  # ...and one is evicted before it is read: 2 load
    for block in range(2, 9):
        s.cluster.poison(block)  # freshly allocated blocks hold garbage until something is written
    # 6 keys for 7 blocks: FastDeploy keys only full blocks, the last one is partial
    loaded = s.cluster.engine.issue_prefetch_storage_task(read_task("r2", KEYS[:6], [2, 3, 4, 5, 6, 7, 8]))
    assert loaded == [2, 3]
    (rank_record,) = s.wait_for("fd-rank0", "prefetch")
    (engine_record,) = s.ended("fd-engine", "prefetch")
    assert (rank_record.outcome, rank_record.blocks, rank_record.bad_block_ids) == ("ok", 2, ())
    assert (engine_record.outcome, engine_record.blocks) == ("ok", 2)


@pytest.mark.parametrize("n_ranks", [1, 2])
def test_a_nan_load_is_an_error_on_every_observer_and_reported_as_nothing_loaded(setup, n_ranks):
    s = setup(n_ranks=n_ranks)
    s.cluster.fill(KEYS[:3])
    s.cluster.store.blocks["prefix_h1_0_key"][1, 0, 0, 0] = np.nan  # poisoned in rank 0's storage
    loaded = s.cluster.engine.issue_prefetch_storage_task(read_task("r3", KEYS[:3], [5, 6, 7]))
    assert loaded == []  # the engine recomputes instead of using poisoned KV, and does not hang
    (rank_record, *_) = s.wait_for("fd-rank0", "prefetch")
    assert (rank_record.outcome, rank_record.bad_block_ids) == ("error", (6,))
    assert isinstance(rank_record.error, kvfd.CorruptLoad)
    assert s.rank_caps[0].value("kvobs_nan_checks_total", path="prefetch", result="nan") == 1
    (engine_record,) = s.wait_for("fd-engine", "prefetch")
    assert (engine_record.outcome, engine_record.bad_block_ids) == ("error", (6,))  # not "ok, 0 blocks": a miss
    assert isinstance(engine_record.error, kvfd.CorruptLoad) and "6" in str(engine_record.error)
    for cap in (s.engine_cap, s.rank_caps[0]):
        (span,) = [span for span in cap.spans if span.name == "kvobs.prefetch"]
        assert list(span.attributes[sc.ATTR_BAD_BLOCK_IDS]) == [6]


def test_a_nan_store_is_stopped_and_its_done_signal_still_sent(setup):
    s = setup()
    s.cluster.poison(9)
    s.cluster.engine.issue_write_back_storage_task(write_task("w1", KEYS[:3], [8, 9, 10]))  # returns: no hang
    (rank_record,) = s.wait_for("fd-rank0", "write_back")
    assert (rank_record.outcome, rank_record.bad_block_ids) == ("rejected", (9,))
    assert not any(key.startswith("prefix_h") for key in s.cluster.store.blocks)  # nothing was stored
    (engine_record,) = s.wait_for("fd-engine", "write_back")
    assert (engine_record.outcome, engine_record.blocks) == ("ok", 0)  # the done signal said: nothing written


def test_a_clean_write_back_then_prefetch_round_trip(setup):
    s = setup()
    keys, _ = s.cluster.gpu()
    keys[0][8:10] = 2.5
    s.cluster.engine.issue_write_back_storage_task(write_task("w2", KEYS[:2], [8, 9]))
    assert s.cluster.engine.issue_prefetch_storage_task(read_task("r4", KEYS[:2], [12, 13])) == [12, 13]
    assert (keys[0][12:14] == 2.5).all()
    assert [r.outcome for r in s.records] == ["ok"] * 4


def test_a_lost_done_signal_is_abandoned_at_the_deadline(setup):
    s = setup(deadline=0.3)
    s.cluster.ranks[0].stop()  # the transfer process is gone: no done signal will ever come
    s.cluster.engine.issue_prefetch_storage_task(read_task("r5", KEYS[:2], [1, 2]), is_sync=False)
    assert not lock_is_free_from_other_thread(s.engine_obs.lock)
    (record,) = s.wait_for("fd-engine", "prefetch")
    assert record.outcome == "abandoned"
    assert lock_is_free_from_other_thread(s.engine_obs.lock)


def test_a_hung_copy_is_abandoned_and_its_late_end_changes_nothing(setup):
    s = setup(deadline=0.3)
    s.cluster.fill(KEYS[:2])
    s.cluster.store.hang.set()
    s.cluster.engine.issue_prefetch_storage_task(read_task("r6", KEYS[:2], [1, 2]), is_sync=False)
    (record,) = s.wait_for("fd-rank0", "prefetch")
    assert record.outcome == "abandoned"
    assert lock_is_free_from_other_thread(s.rank_caps[0].observer.lock)  # the forward pass can go on
    s.cluster.store.release.set()
    assert len(s.wait_for("fd-engine", "prefetch")) == 1  # the late done signal still reaches the engine
    assert len(s.ended("fd-rank0", "prefetch")) == 1


def test_two_ranks_complete_on_the_shortest_answer(setup):
    s = setup(n_ranks=2)
    s.cluster.fill(KEYS[:4], ranks=[0])
    s.cluster.fill(KEYS[:2], ranks=[1])  # rank 1's shard has fewer blocks in storage
    assert s.cluster.engine.issue_prefetch_storage_task(read_task("r7", KEYS[:4], [1, 2, 3, 4])) == [1, 2]
    (engine_record,) = s.wait_for("fd-engine", "prefetch")
    assert engine_record.blocks == 2
    assert sorted(r.blocks for r in s.records if r.engine.startswith("fd-rank")) == [2, 4]


def _scenario(s: Setup) -> tuple:
    """Every storage path once, clean; what the engine and the storage end up with."""
    keys, _ = s.cluster.gpu()
    keys[0][4:6] = 3.0
    s.cluster.fill(KEYS[:3])
    s.cluster.store.vanish.add("prefix_h2_0_key")
    engine = s.cluster.engine
    engine.issue_write_back_storage_task(write_task("w", KEYS[4:6], [4, 5]))
    loaded = engine.issue_prefetch_storage_task(read_task("r", KEYS[:4], [10, 11, 12, 13]))
    missing = engine.issue_prefetch_storage_task(read_task("m", ["x"], [14]))
    stored = sorted((k, v.tobytes()) for k, v in s.cluster.store.blocks.items())
    return loaded, missing, stored, [bytes(t) for t in keys]


def test_the_engine_behaves_exactly_as_without_kvobs(setup):
    assert _scenario(setup(instrument=False)) == _scenario(setup())


def test_undo_restores_every_object_and_instrumenting_twice_wraps_once():
    cluster = make_cluster()
    engine, rank = cluster.engine, cluster.ranks[0]
    before = (dict(vars(engine)), dict(vars(rank)), dict(vars(engine.cache_task_queue)),
              dict(vars(rank.cache_task_queue)))
    with capture("fd-undo") as cap:
        first = kvfd.instrument_prefix_cache_manager(engine, cap.observer)
        second = kvfd.instrument_prefix_cache_manager(engine, cap.observer)
        transfer = kvfd.instrument_cache_transfer_manager(rank, cap.observer)
        assert first.active and not second.active
        assert engine.issue_prefetch_storage_task.__wrapped__ == type(engine).issue_prefetch_storage_task.__get__(engine)
        transfer()
        first()
    after = (vars(engine), vars(rank), vars(engine.cache_task_queue), vars(rank.cache_task_queue))
    assert after == before


def test_without_a_storage_backend_the_call_passes_straight_through(setup):
    s = setup()
    s.cluster.engine.kvcache_storage_backend = None
    assert s.cluster.engine.issue_prefetch_storage_task(read_task("r8", KEYS[:1], [1])) == []
    assert s.engine_obs.open_transfer(sc.PATH_PREFETCH, "r8") is None and s.records == []


def test_a_cache_that_cannot_be_checked_is_still_transferred(setup):
    s = setup()
    s.cluster.fill(KEYS[:2])
    rank = s.cluster.ranks[0]
    rank.gpu_cache_k_tensors.clear()  # RL clears the cache (and block-wise fp8 caches are uint8)
    rank.gpu_cache_v_tensors.clear()
    assert s.cluster.engine.issue_prefetch_storage_task(read_task("r9", KEYS[:2], [1, 2])) == [1, 2]
    assert s.wait_for("fd-rank0", "prefetch")[0].outcome == "ok"
    assert not s.rank_caps[0].value("kvobs_nan_checks_total", path="prefetch", result="clean")


def test_a_second_observer_is_refused_and_the_same_one_changes_nothing():
    cluster = make_cluster()
    engine, rank = cluster.engine, cluster.ranks[0]
    with capture("fd-engine") as first, capture("fd-engine-2") as second:
        undo = [kvfd.instrument_prefix_cache_manager(engine, first.observer),
                kvfd.instrument_cache_transfer_manager(rank, first.observer)]
        assert not kvfd.instrument_prefix_cache_manager(engine, first.observer).active
        before = dict(vars(engine)), dict(vars(rank))
        with pytest.raises(kvobs.AlreadyInstrumented, match="for observer 'fd-engine'"):
            kvfd.instrument_prefix_cache_manager(engine, second.observer)
        with pytest.raises(kvobs.AlreadyInstrumented, match="_run_read_storage is already instrumented"):
            kvfd.instrument_cache_transfer_manager(rank, second.observer)
        assert (dict(vars(engine)), dict(vars(rank))) == before  # nothing half-applied
        for u in undo:
            u()


def test_a_done_signal_kvobs_cannot_read_reaches_the_engine_and_is_counted_once_logged():
    cluster = make_cluster()
    engine = cluster.engine
    unreadable = (types.SimpleNamespace(name="STORAGE2GPU"), "task-without-blocks")
    engine.cache_task_queue.get_transfer_done_signal = lambda: unreadable
    with capture("fd-engine") as cap:
        undo = kvfd.instrument_prefix_cache_manager(engine, cap.observer)
        assert engine.cache_task_queue.get_transfer_done_signal() is unreadable  # the engine gets its signal
        assert engine.cache_task_queue.get_transfer_done_signal() is unreadable
        undo()
    assert cap.value("kvobs_telemetry_errors_total", stage="hook") == 2
    (logged,) = [e for e in cap.logs if e["event"] == "kvobs.telemetry.failed"]
    assert (logged["where"], logged["error_type"]) == ("done_signal", "ValueError")
