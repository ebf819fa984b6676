"""Counts stay exact when many threads record at once while another thread scrapes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from prometheus_client import CollectorRegistry, generate_latest

from kvobs import semconv as sc
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import MetricFamilies

THREADS = 8
PER_THREAD = 50_000
DURATIONS = [k / 2**12 for k in range(7)]  # 0 .. 1.46 s, dyadic: sums are exact in any order


def run_threads(target, count: int = THREADS) -> None:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


class Scraper:
    """Scrapes in a loop while the workers record; every count it sees only ever grows."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels
        self.stop = threading.Event()
        self.seen: list[float] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                generate_latest(self.registry)
                self.seen.append(self.registry.get_sample_value(sc.LOCK_WAIT_SECONDS + "_count", self.labels) or 0)
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()
        assert self.errors == []
        assert self.seen == sorted(self.seen) and len(self.seen) >= 2


def test_finished_counts_stay_exact_under_8_threads_and_a_scraper():
    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "threads", "cache")
    send = metrics.path(sc.PATH_SEND)

    def record(index: int) -> None:
        finished = send.finished
        for k in range(PER_THREAD):
            outcome = sc.OUTCOME_ERROR if k % 10 == 0 else sc.OUTCOME_OK
            finished(outcome, DURATIONS[k % 7], 2**-20, 2**-14, 2, 100, None)

    with Scraper(registry, {"engine": "threads", "lock": "cache", "path": "send"}):
        run_threads(record)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"engine": "threads", **labels})

    total = THREADS * PER_THREAD
    errors = THREADS * (PER_THREAD // 10)
    oks = total - errors
    assert value(sc.TRANSFERS_TOTAL, path="send", outcome="ok") == oks
    assert value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == errors
    assert value(sc.TRANSFER_BLOCKS_TOTAL, path="send") == 2 * oks
    assert value(sc.TRANSFER_BYTES_TOTAL, path="send") == 100 * oks
    wait = {"lock": "cache", "path": "send"}
    assert value(sc.LOCK_WAIT_SECONDS + "_count", **wait) == total
    assert value(sc.LOCK_WAIT_SECONDS + "_sum", **wait) == total * 2**-20
    assert value(sc.LOCK_HOLD_SECONDS + "_sum", **wait) == total * 2**-14
    expected_sum = sum(DURATIONS[k % 7] for k in range(PER_THREAD) if k % 10) * THREADS
    assert value(sc.TRANSFER_DURATION_SECONDS + "_sum", path="send", outcome="ok") == expected_sum
    for bound in ("0.0005", "0.001", "0.5", "1.0", "+Inf"):
        expected = THREADS * sum(1 for k in range(PER_THREAD) if k % 10 and DURATIONS[k % 7] <= float(bound))
        assert value(sc.TRANSFER_DURATION_SECONDS + "_bucket", path="send", outcome="ok", le=bound) == expected


def test_holders_signals_and_timeouts_stay_exact_under_threads():
    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "mixed", "cache")
    forward = metrics.holder(sc.HOLDER_FORWARD)
    prefetch = metrics.path(sc.PATH_PREFETCH)
    n = 10_000

    def record(index: int) -> None:
        for k in range(n):
            forward.held(2**-16, 2**-10, None)
            metrics.signals[sc.SIGNAL_READY].inc()
            metrics.signal_buffered.observe(2**-8)
            if k % 100 == 0:
                prefetch.timed_out(2**-4)
                prefetch.conflicted(sc.HOLDER_FORWARD)

    with Scraper(registry, {"engine": "mixed", "lock": "cache", "path": "forward"}):
        run_threads(record)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"engine": "mixed", **labels})

    total = THREADS * n
    assert value(sc.LOCK_WAIT_SECONDS + "_count", lock="cache", path="forward") == total
    assert value(sc.LOCK_HOLD_SECONDS + "_sum", lock="cache", path="forward") == total * 2**-10
    assert value(sc.SIGNALS_TOTAL, outcome="ready") == total
    assert value(sc.SIGNAL_BUFFERED_SECONDS + "_count") == total
    assert value(sc.LOCK_TIMEOUTS_TOTAL, lock="cache", path="prefetch") == total // 100
    assert value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="timeout") == total // 100
    assert value(sc.LOCK_CONFLICTS_TOTAL, lock="cache", path="prefetch", holder_path="forward") == total // 100


def test_records_of_ended_threads_are_kept_and_their_buffers_dropped():
    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "ended", "cache")
    write = metrics.path(sc.PATH_WRITE_BACK)
    for _ in range(20):  # short-lived threads, each leaving fewer records than a batch
        t = threading.Thread(target=lambda: [write.finished("ok", 0.25, 0.0, 0.25, 1, 1, None) for _ in range(3)])
        t.start()
        t.join()
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "ended", "path": "write_back",
                                                          "outcome": "ok"}) == 60
    assert write._buffers._buffers == []  # nothing kept for threads that are gone


FORK_WHILE_LOCKED = textwrap.dedent("""
    import os, threading
    from prometheus_client import CollectorRegistry
    from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
    from kvobs.telemetry._metrics.families import MetricFamilies

    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "forked", "cache")
    send = metrics.path("send")
    inside, leave = threading.Event(), threading.Event()

    def hold(lock):
        with lock:  # another thread inside a drain or a scrape at the moment of the fork
            inside.set()
            leave.wait()

    for lock in (metrics.families.lock, metrics.families.failure_lock):
        inside.clear()
        threading.Thread(target=hold, args=(lock,), daemon=True).start()
        inside.wait()
    pid = os.fork()
    if pid == 0:
        for _ in range(3000):  # more than a buffer holds: the child folds records in itself
            send.finished("ok", 0.5, 0.0, 0.5, 1, 1, None)
        metrics.signals["ready"].inc()
        metrics.count_telemetry_error("hook")
        print(registry.get_sample_value("kvobs_transfers_total",
                                        {"engine": "forked", "path": "send", "outcome": "ok"}), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    leave.set()
""")


def test_a_child_forked_while_another_thread_held_the_metrics_locks_records_and_scrapes():
    out = subprocess.run([sys.executable, "-c", FORK_WHILE_LOCKED], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "3000.0"  # after the failure's log line
