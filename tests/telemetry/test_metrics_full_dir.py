"""A full multiprocess directory never kills the process: no metric file is ever written where it has no space.

prometheus_client grows its memory-mapped files with truncate, which allocates nothing; on a full tmpfs the
first write into such a page raised SIGBUS: in the main process when it created an observer, in a forked
worker at its first guarded call. Each scenario runs on a real tmpfs (mounted here: needs root) in fresh
interpreters (prometheus_client picks multiprocess mode when it is imported), with real forked workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvobs import semconv as sc

PRELUDE = textwrap.dedent("""
    import os, sys
    import kvobs

    def fill(directory):
        '''Leave no free byte in the filesystem of `directory`.'''
        fd = os.open(os.path.join(directory, "filler"), os.O_CREAT | os.O_WRONLY | os.O_APPEND)
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"x" * chunk)
            except OSError:
                pass
        os.close(fd)

    def guarded(obs):
        @obs.send(block_ids="ids")
        def send(ids):
            return len(ids)
        return send

    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
""")


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run(directory: Path, body: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, sc.ENV_MULTIPROC_DIR: str(directory)}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def died_of(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}"
    return f"exit {proc.returncode}: {proc.stderr[-2000:]}"


def scrape(directory: Path) -> CollectorRegistry:
    """What the scraping process reads (any file left empty or corrupt would raise here)."""
    (directory / "filler").unlink(missing_ok=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    registry.get_sample_value("kvobs_build_info", {"version": "0"})  # collects every file
    return registry


def refusals_logged(proc: subprocess.CompletedProcess[str]) -> int:
    return (proc.stdout + proc.stderr).count("error_type=MultiprocessDirFull")


FULL_FROM_THE_START = """
    fill(directory)
    obs = kvobs.KVObserver("full", integrity=None)
    send = guarded(obs)
    print("results", sum(send([1, 2, 3]) for _ in range(50)), flush=True)
"""


def test_a_full_directory_never_kills_the_process_that_creates_an_observer(tmpfs):
    proc = run(tmpfs, FULL_FROM_THE_START)
    assert proc.returncode == 0, died_of(proc)
    assert "results 150" in proc.stdout  # every guarded call behaved as without kvobs
    assert refusals_logged(proc) == 1  # logged once, not once per series
    scrape(tmpfs)


FILLS_UP = """
    first = kvobs.KVObserver("first", integrity=None)
    send = guarded(first)
    for _ in range(5):
        send([1, 2])
    fill(directory)
    second = kvobs.KVObserver("second", integrity=None)  # its series need the files to grow
    send_second = guarded(second)
    print("results", sum(send([1, 2]) + send_second([1, 2, 3]) for _ in range(10)), flush=True)
"""


def test_a_directory_that_fills_up_refuses_new_series_counts_them_and_keeps_the_old_ones(tmpfs):
    proc = run(tmpfs, FILLS_UP)
    assert proc.returncode == 0, died_of(proc)
    assert "results 50" in proc.stdout
    assert refusals_logged(proc) == 1
    registry = scrape(tmpfs)
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "first", "path": "send", "outcome": "ok"}) == 15
    assert registry.get_sample_value(sc.TELEMETRY_ERRORS_TOTAL, {"engine": "", "stage": "metrics"}) >= 1


FORKED_WORKERS = """
    from prometheus_client import REGISTRY, generate_latest

    obs = kvobs.KVObserver("forked", integrity=None)
    send = guarded(obs)
    send([1])
    fill(directory)
    statuses = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            total = sum(send([1, 2, 3]) for _ in range(20))
            generate_latest(REGISTRY)  # a scrape of the worker's own registry reads kvobs's values too
            os._exit(0 if total == 60 else 3)
        statuses.append(os.waitpid(pid, 0)[1])
    send([1])
    print("statuses", statuses, flush=True)
"""


def test_forked_workers_on_a_full_directory_survive_their_guarded_calls(tmpfs):
    proc = run(tmpfs, FORKED_WORKERS)
    assert proc.returncode == 0, died_of(proc)
    assert "statuses [0, 0]" in proc.stdout, proc.stdout + proc.stderr  # SIGBUS would show as status 7
    registry = scrape(tmpfs)
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "forked", "path": "send", "outcome": "ok"}) == 2


FORKED_WITH_ROOM = """
    obs = kvobs.KVObserver("roomy", integrity=None)
    send = guarded(obs)
    send([1])
    pid = os.fork()
    if pid == 0:
        for _ in range(4):
            send([1, 2, 3])
        os._exit(0)
    print("status", os.waitpid(pid, 0)[1], flush=True)
"""


def test_a_forked_worker_with_room_still_records_its_calls(tmpfs):
    proc = run(tmpfs, FORKED_WITH_ROOM)
    assert proc.returncode == 0 and "status 0" in proc.stdout, died_of(proc)
    registry = scrape(tmpfs)
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "roomy", "path": "send", "outcome": "ok"}) == 5
    assert registry.get_sample_value(sc.TRANSFER_BLOCKS_TOTAL, {"engine": "roomy", "path": "send"}) == 13


TEMPLATE_GONE = """
    import glob

    obs = kvobs.KVObserver("orphan", integrity=None)
    send = guarded(obs)
    send([1])
    for path in glob.glob(os.path.join(directory, f"*_{os.getpid()}.db")):
        os.unlink(path)  # as a scraper clears a parent that ended before its worker first wrote
    fill(directory)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if sum(send([1, 2, 3]) for _ in range(20)) == 60 else 3)
    print("status", os.waitpid(pid, 0)[1], flush=True)
"""


def test_a_forked_worker_whose_parent_files_are_gone_still_never_writes_into_a_hole(tmpfs):
    """The worker sizes its files from the series kvobs created, when the parent's files are not there."""
    proc = run(tmpfs, TEMPLATE_GONE)
    assert proc.returncode == 0, died_of(proc)
    assert "status 0" in proc.stdout, proc.stdout + proc.stderr
