"""Signal buffers under floods: bounded memory, a handful of log lines, exact counts, nothing kept alive.

Each test here failed on the buffer before these bounds existed (registrations grew without limit, every
overflow printed a warning, a dropped buffer stayed alive through its gauges).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from signals_support import ENGINE, FakeClock, RecordingLogger, counts, make_metrics, outcome_count

from kvobs import semconv as sc
from kvobs.signals import EarlySignalBuffer, SignalBufferFull, StepAlignedSignalBuffer
from kvobs.signals._reporting import FLUSH_AT, LOG_INTERVAL_S
from kvobs.telemetry._ratelimit import SUPPRESSED_FIELD

ROOT = Path(__file__).resolve().parents[2]


def test_register_without_finish_is_bounded_refused_clearly_and_loses_nothing():
    registry, metrics = make_metrics()
    buf = EarlySignalBuffer(metrics=metrics, max_slots=8, clock=FakeClock())
    for slot in range(8):
        buf.register(slot, 10)
    buf.signal(100, 0, 7)  # an early signal for the slot that will be refused
    with pytest.raises(SignalBufferFull, match=r"max_slots=8 reached; finish\(\) every slot") as refused:
        buf.register(100, 10)
    assert isinstance(refused.value, RuntimeError)
    assert pickle.loads(pickle.dumps(refused.value)).args == refused.value.args
    assert buf.registered_slots() == frozenset(range(8)) and buf.pending_count == 1  # nothing changed
    assert outcome_count(registry, "refused") == 1
    buf.finish(0)
    assert buf.register(100, 10) == 7  # the kept signal is recovered once room exists


def test_a_flood_of_registrations_keeps_memory_flat():
    buf = EarlySignalBuffer(max_slots=1024)
    tracemalloc.start()
    try:
        for slot in range(2048):
            try:
                buf.register(slot, 10)
            except SignalBufferFull:
                pass
        full = tracemalloc.get_traced_memory()[0]
        for slot in range(2048, 40_000):
            try:
                buf.register(slot, 10)
            except SignalBufferFull:
                pass
        later = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(buf.registered_slots()) == 1024
    assert later - full < 64 * 1024  # 38,000 more refusals kept (almost) nothing


def test_overflow_floods_write_a_handful_of_lines_and_count_exactly():
    registry, metrics = make_metrics()
    logger, clock = RecordingLogger(), FakeClock()
    buf = EarlySignalBuffer(metrics=metrics, logger=logger, max_pending=64, clock=clock)
    for slot in range(20_000):
        buf.signal(slot, 0, 1)
    assert counts(registry)["overflow"] == 20_000 - 64 and counts(registry)["buffered"] == 20_000
    assert [kw[sc.ATTR_SLOT] for _, _, kw in logger.records] == [0]  # one line for 19,936 evictions
    clock.advance(LOG_INTERVAL_S)
    buf.signal(20_000, 0, 1)
    assert len(logger.records) == 2
    assert logger.records[-1][2][SUPPRESSED_FIELD] == 20_000 - 64 - 1  # the next line says what was left out
    buf.finish(19_999)  # another kind of drop has its own line
    assert [kw[sc.ATTR_OUTCOME] for _, _, kw in logger.records] == ["overflow", "overflow", "dropped_finished"]


def test_step_record_flood_without_end_step_is_bounded_and_quiet():
    registry, metrics = make_metrics()
    logger = RecordingLogger()
    buf = StepAlignedSignalBuffer(metrics=metrics, logger=logger, max_slots=100, max_pending=50, clock=FakeClock())
    refused = 0
    for slot in range(5000):
        buf.signal(slot, 0, 1)
        try:
            buf.register(slot, 1)
        except SignalBufferFull:
            refused += 1
    assert refused == 5000 - 200 and outcome_count(registry, "refused") == refused
    assert outcome_count(registry, "overflow") == 5000 - 50  # staged signals beyond max_pending slots
    assert [kw[sc.ATTR_OUTCOME] for _, _, kw in logger.records] == ["overflow", "refused"]


@pytest.mark.parametrize("kind", [EarlySignalBuffer, StepAlignedSignalBuffer])
def test_a_dropped_buffer_is_collected_and_its_counts_are_kept(kind):
    registry, metrics = make_metrics()
    buf = kind(metrics=metrics)
    buf.signal(1, 0, 5)
    if kind is StepAlignedSignalBuffer:
        buf.end_step()
    assert registry.get_sample_value(sc.PENDING_SIGNALS, {"engine": ENGINE}) == 1.0
    buf.signal(2, 0, 5)  # not flushed yet: no scrape since
    if kind is StepAlignedSignalBuffer:
        buf.end_step()
    alive = weakref.ref(buf)
    del buf
    gc.collect()
    assert alive() is None  # the scrape-time gauges hold it weakly
    text = generate_latest(registry).decode()
    assert f'{sc.PENDING_SIGNALS}{{engine="{ENGINE}"}} 0.0' in text
    assert f'{sc.SIGNALS_TOTAL}{{engine="{ENGINE}",outcome="buffered"}} 2.0' in text  # flushed on collection


def test_thousands_of_dropped_buffers_do_not_accumulate():
    registry, metrics = make_metrics()
    refs = []
    for _ in range(2000):
        buf = EarlySignalBuffer(metrics=metrics)
        buf.signal(1, 0, 1)
        refs.append(weakref.ref(buf))
    del buf
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert outcome_count(registry, "buffered") == 2000


def forked_child_exit_code(child, timeout_s: float = 20.0) -> int:
    """Fork; the child runs `child()` and exits 0 if it returns True. The child's exit code (-9: it hung)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if child() else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def test_a_forked_child_can_use_a_buffer_whose_lock_another_thread_held_at_the_fork():
    registry, metrics = make_metrics()
    buf = EarlySignalBuffer(metrics=metrics, logger=RecordingLogger(), max_pending=1, clock=FakeClock())
    held, release = threading.Event(), threading.Event()

    def hold_the_locks():
        with buf._lock, buf._reporter._log._lock:  # as a thread inside a decision and a log line would
            held.set()
            release.wait()

    holder = threading.Thread(target=hold_the_locks)
    holder.start()
    held.wait()
    try:
        def child() -> bool:
            buf.signal(1, 0, 5)
            buf.signal(2, 0, 5)  # an overflow: logged through the rate-limited log
            ready = buf.register(2, 5) is not None
            return ready and outcome_count(registry, "overflow") == 1  # the scrape flushes the child's counts
        assert forked_child_exit_code(child) == 0
    finally:
        release.set()
        holder.join()


MULTIPROCESS_SCRIPT = textwrap.dedent("""
    import os, sys
    from prometheus_client import CollectorRegistry
    from kvobs.signals import EarlySignalBuffer
    from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
    from kvobs.telemetry._metrics.families import MetricFamilies
    from kvobs.telemetry._metrics.refresher import Refresher

    Refresher.interval_s = 3600  # no periodic flush: what reaches the files is flushed at exit
    metrics = EngineMetrics(MetricFamilies.of(CollectorRegistry()), engine="mp", lock_name="cache")
    buf = EarlySignalBuffer(metrics=metrics)
    for slot in range(5):
        buf.register(slot, 10)
        buf.signal(slot, 0, 5)  # 5 ready, counted in this process and not flushed yet
    for slot in (10, 11):
        buf.signal(slot, 0, 5)  # 2 buffered here, still pending at the fork
    pid = os.fork()
    if pid == 0:
        for slot in range(5, 8):
            buf.signal(slot, 0, 5)  # 3 buffered in the child, which must not count the parent's 7 again
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
""")


def test_multiprocess_counts_reach_the_files_at_exit_once_even_across_fork(tmp_path):
    env = {**os.environ, sc.ENV_MULTIPROC_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", MULTIPROCESS_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    value = lambda outcome: registry.get_sample_value(  # noqa: E731
        sc.SIGNALS_TOTAL, {"engine": "mp", "outcome": outcome})
    assert value("ready") == 5 and value("buffered") == 5


def test_waits_noted_by_fast_recoveries_stay_bounded_without_a_scrape_and_all_reach_the_histogram():
    """register() notes a recovery's wait without counting them; finish() flushes past FLUSH_AT, and the live
    slots (at most max_slots) bound what is noted between two finish() calls."""
    registry, metrics = make_metrics()
    clock, slots = FakeClock(), 300
    buf = EarlySignalBuffer(metrics=metrics, max_slots=slots, clock=clock)
    most = 0
    for _ in range(10):
        for slot in range(slots):
            buf.signal(slot, 0, 4)
        clock.advance(0.25)
        for slot in range(slots):
            assert buf.register(slot, 8) == 4
        most = max(most, len(buf._waits))
        for slot in range(slots):
            buf.finish(slot)
        assert len(buf._waits) < FLUSH_AT + slots
    assert FLUSH_AT <= most < FLUSH_AT + slots  # register() alone went past FLUSH_AT; finish() flushed
    found = counts(registry)  # one scrape: the rest is flushed
    assert found["recovered"] == found["buffered"] == 10 * slots
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_count", {"engine": ENGINE}) == 10 * slots
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_sum", {"engine": ENGINE}) == 10 * slots * 0.25
