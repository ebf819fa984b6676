"""Multiprocess mode with real processes: forked workers refresh their gauges, counts add up across workers,
and the refresher never keeps a dropped observer alive.

Each scenario runs in a fresh interpreter: prometheus_client picks multiprocess mode when it is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from kvobs import semconv as sc

PRELUDE = textwrap.dedent("""
    import gc, os, select, sys, time, weakref
    from prometheus_client import CollectorRegistry
    from kvobs.telemetry._metrics.exposition import scrape_registry
    from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
    from kvobs.telemetry._metrics.families import MetricFamilies
    from kvobs.telemetry._metrics.refresher import Refresher

    Refresher.interval_s = 0.05

    def value(name, **labels):
        return scrape_registry().get_sample_value(name, labels)

    def wait_for(predicate, what, limit_s=30.0):
        deadline = time.monotonic() + limit_s
        while not predicate():
            if time.monotonic() > deadline:
                sys.exit("never happened: " + what)
            time.sleep(0.02)

    class CacheLock:
        '''Stands for the cache lock: how long its current holder has held it.'''
        def __init__(self):
            self.since = None
        def held_for(self):
            return 0.0 if self.since is None else time.monotonic() - self.since
""")


def run(tmp_path, body: str) -> str:
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = {**os.environ, sc.ENV_MULTIPROC_DIR: str(mp_dir)}
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env, check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


FORKED_HOLDER = """
    lock = CacheLock()
    metrics = EngineMetrics(MetricFamilies.of(CollectorRegistry()), "forked", "cache")
    metrics.bind_lock_held(lock, CacheLock.held_for)
    send = metrics.path("send")
    parent_reads, child_writes = os.pipe()
    child_reads, parent_writes = os.pipe()
    workers = []
    for n in (3, 4):
        pid = os.fork()
        if pid == 0:  # a worker forked after the observer was created
            for _ in range(n):
                send.finished("ok", 0.25, 0.0, 0.25, 2, 10, None)
            if n == 4:
                lock.since = time.monotonic()  # holds the lock until the parent has seen it
                os.write(child_writes, b"h")
                select.select([child_reads], [], [], 40)  # until the parent is done (or gave up)
            os._exit(0)
        workers.append(pid)
    os.read(parent_reads, 1)
    wait_for(lambda: (value("kvobs_lock_held_seconds", engine="forked", lock="cache") or 0) > 0,
             "the forked worker's lock_held_seconds above 0")
    first = value("kvobs_lock_held_seconds", engine="forked", lock="cache")
    wait_for(lambda: value("kvobs_lock_held_seconds", engine="forked", lock="cache") > first,
             "lock_held_seconds growing while the worker holds")
    os.write(parent_writes, b"x")
    for pid in workers:
        os.waitpid(pid, 0)
    print(value("kvobs_transfers_total", engine="forked", path="send", outcome="ok"))
    print(value("kvobs_transfer_blocks_total", engine="forked", path="send"))
"""


def test_forked_workers_refresh_their_gauges_and_their_counts_add_up(tmp_path):
    assert run(tmp_path, FORKED_HOLDER).split() == ["7.0", "14.0"]


DROPPED = """
    refresher = Refresher.shared()
    families = MetricFamilies.of(CollectorRegistry())
    observers, refs = [], []
    for i in range(20):
        lock = CacheLock()
        lock.since = time.monotonic() - 5
        metrics = EngineMetrics(families, f"dropped-{i}", "cache")
        metrics.bind_lock_held(lock, CacheLock.held_for)
        metrics.bind_pending_signals(lock, lambda owner: 2, lambda owner: 1.0)
        observers.append((lock, metrics))
        refs.append((weakref.ref(lock), weakref.ref(metrics)))
    refresher.refresh()
    print(value("kvobs_lock_held_seconds", engine="dropped-7", lock="cache") >= 5)
    print(value("kvobs_pending_signals", engine="dropped-7"))
    del observers, lock, metrics
    gc.collect()
    print(sum(a() is not None or b() is not None for a, b in refs))
    refresher.refresh()
    print(value("kvobs_lock_held_seconds", engine="dropped-7", lock="cache"))
    print(value("kvobs_pending_signals", engine="dropped-7"))
    print(len(refresher._entries))
"""


def test_the_refresher_holds_observers_weakly_and_zeroes_their_series(tmp_path):
    assert run(tmp_path, DROPPED).split() == ["True", "2.0", "0", "0.0", "0.0", "0"]


FORKED_SIGNALS = """
    from kvobs.signals import EarlySignalBuffer

    metrics = EngineMetrics(MetricFamilies.of(CollectorRegistry()), "signals", "cache")
    buf = EarlySignalBuffer(metrics=metrics)
    for slot in range(10):
        buf.signal(slot, 0, 5)  # pending in the parent at the fork: the parent's, not the worker's
    parent_reads, child_writes = os.pipe()
    child_reads, parent_writes = os.pipe()
    pid = os.fork()
    if pid == 0:
        buf.signal(100, 0, 5)
        buf.signal(101, 0, 5)
        Refresher.shared().refresh()
        os.write(child_writes, b"w")
        select.select([child_reads], [], [], 40)  # until the parent has scraped
        os._exit(0)  # as multiprocessing's workers end: no atexit, no clean-up
    os.read(parent_reads, 1)
    for slot in range(10):
        buf.finish(slot)
    Refresher.shared().refresh()
    print(value("kvobs_pending_signals", engine="signals"))
    print(value("kvobs_pending_signal_oldest_age_seconds", engine="signals") > 0)
    os.close(child_writes)
    os.write(parent_writes, b"x")
    os.read(parent_reads, 1)  # end of file: the worker has exited; not reaped yet, it is a zombie
    wait_for(lambda: open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z", "a zombie worker")
    print(value("kvobs_pending_signals", engine="signals"))
    print(value("kvobs_pending_signal_oldest_age_seconds", engine="signals"))
    os.waitpid(pid, 0)
    print(value("kvobs_pending_signals", engine="signals"))
"""


def test_a_forked_worker_reports_only_its_own_signals_and_a_dead_ones_gauges_clear(tmp_path):
    """The worker's 2 pending signals while it lives (not the parent's 10 again); nothing once it has ended,
    reaped or not, so the stale-signal alert cannot fire on a worker that is gone."""
    assert run(tmp_path, FORKED_SIGNALS).split() == ["2.0", "True", "0.0", "0.0", "0.0"]
