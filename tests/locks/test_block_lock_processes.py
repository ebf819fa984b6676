"""BlockLock across real processes: forked, spawned and separate interpreters, SIGKILL included."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from support import process_holding

from kvobs._runtime.atomic import release_now
from kvobs.locks import _ofd as ofd
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import Claim

BLOCKS = 32

HOLDER = """
import sys, time
from collections import deque
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import Claim
name, directory, holder, exclusive, *blocks = sys.argv[1:]
lock = BlockLock(name, 32, directory=directory)
held = deque()
if not lock.acquire_into(held, Claim(holder, tuple(map(int, blocks)), exclusive == "1"), 10):
    sys.exit(3)
print("held", flush=True)
time.sleep(60)
"""


def holder_process(
    directory: Path, blocks: tuple[int, ...], exclusive: bool = True, holder: str = "prefetch"
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """A separate interpreter that claims `blocks`, says so, then sleeps until killed."""
    return process_holding(HOLDER, "kv", str(directory), holder, "1" if exclusive else "0", *map(str, blocks))


def try_claim(lock: BlockLock, blocks: tuple[int, ...], exclusive: bool = True, timeout: float = 0,
              conflicts: list[str] | None = None) -> deque[Any] | None:
    held: deque[Any] = deque()
    on_conflict = conflicts.append if conflicts is not None else None
    return held if lock.acquire_into(held, Claim("test", blocks, exclusive), timeout, on_conflict) else None


@pytest.mark.parametrize("exclusive", [True, False], ids=["exclusive", "shared"])
def test_sigkilled_holder_frees_its_blocks(tmp_path: Path, exclusive: bool) -> None:
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    with holder_process(tmp_path, (4, 5, 6, 20), exclusive, holder="write_back") as proc:
        conflicts: list[str] = []
        assert try_claim(lock, (6, 7), conflicts=conflicts) is None
        assert conflicts == ["write_back"]  # the holder's path, read across processes
        beside = try_claim(lock, (7, 8, 19, 21))  # blocks beside the claim are free
        assert beside is not None
        release_now(beside)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        after = try_claim(lock, (4, 5, 6, 20), timeout=10)
        assert after is not None
        release_now(after)
    lock.close()


def _count_under_claims(
    lock: BlockLock, row: int, writer_inside: Any, readers_inside: Any, counts: Any, overlaps: Any,
    exclusive_claims: Any, rounds: int,
) -> None:
    """Random claims; writers bump a per-block counter with a read-modify-write that only exclusion keeps
    exact, and every holder checks that no conflicting holder is inside its blocks."""
    rng = random.Random(row)
    for _ in range(rounds):
        blocks = tuple(sorted(rng.sample(range(BLOCKS), rng.randint(1, 6))))
        exclusive = rng.random() < 0.5
        held = try_claim(lock, blocks, exclusive, timeout=30)
        assert held is not None
        for block in blocks:
            if writer_inside[block]:
                overlaps.value += 1
            if exclusive:
                if any(readers_inside[r * BLOCKS + block] for r in range(4)):
                    overlaps.value += 1
                writer_inside[block] = 1
            else:
                readers_inside[row * BLOCKS + block] = 1
        time.sleep(0)
        for block in blocks:
            if exclusive:
                value = counts[block]
                time.sleep(0)
                counts[block] = value + 1
                exclusive_claims[row * BLOCKS + block] += 1
                writer_inside[block] = 0
            else:
                readers_inside[row * BLOCKS + block] = 0
        release_now(held)


def _spawned_worker(lock: BlockLock, *args: Any) -> None:
    _count_under_claims(lock, *args)


def test_overlapping_and_disjoint_claims_across_processes(tmp_path: Path) -> None:
    """Two forked processes, one spawned and the parent: 0 overlaps, every read-modify-write kept."""
    fork, spawn = multiprocessing.get_context("fork"), multiprocessing.get_context("spawn")
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)  # opened before fork: children get their own pools
    writer_inside = fork.Array("b", BLOCKS, lock=False)
    readers_inside = fork.Array("b", 4 * BLOCKS, lock=False)
    counts = fork.Array("i", BLOCKS, lock=False)
    exclusive_claims = fork.Array("i", 4 * BLOCKS, lock=False)
    overlaps = fork.Value("i", 0, lock=False)
    rounds = 300
    shared = (writer_inside, readers_inside, counts, overlaps, exclusive_claims, rounds)
    procs = [fork.Process(target=_count_under_claims, args=(lock, row, *shared)) for row in (1, 2)]
    procs.append(spawn.Process(target=_spawned_worker, args=(lock, 3, *shared)))
    for proc in procs:
        proc.start()
    _count_under_claims(lock, 0, *shared)
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert overlaps.value == 0
    expected = [sum(exclusive_claims[row * BLOCKS + block] for row in range(4)) for block in range(BLOCKS)]
    assert list(counts) == expected and sum(expected) > 0


def _child_of_holder(lock: BlockLock, inherited: deque[Any], results: Any, released: Any) -> None:
    results.put(("inherited", lock.blocks_claimed(), lock.held_for()))
    results.put(("while parent holds", try_claim(lock, (3,), timeout=0.1) is not None))
    release_now(inherited)  # an undo copied from the parent must not free the parent's claim
    results.put(("after undoing the copy", try_claim(lock, (3,), timeout=0.1) is not None))
    released.wait(30)
    held = try_claim(lock, (3,), timeout=10)
    results.put(("after parent released", held is not None))


def test_claim_held_at_fork_stays_the_parents(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    results, released = ctx.Queue(), ctx.Event()
    held = try_claim(lock, (2, 3, 4))
    assert held is not None
    proc = ctx.Process(target=_child_of_holder, args=(lock, held, results, released))
    proc.start()
    try:
        assert results.get(timeout=30) == ("inherited", {"shared": 0, "exclusive": 0}, 0.0)
        assert results.get(timeout=30) == ("while parent holds", False)
        assert results.get(timeout=30) == ("after undoing the copy", False)
        assert lock.blocks_claimed() == {"shared": 0, "exclusive": 3}
        release_now(held)
        released.set()
        assert results.get(timeout=30) == ("after parent released", True)
    finally:
        released.set()
        proc.join(timeout=30)
    assert proc.exitcode == 0
    # The child exited holding block 3: the kernel dropped its range.
    again = try_claim(lock, (3,), timeout=10)
    assert again is not None
    release_now(again)


def _spawned_claimer(lock: BlockLock, results: Any, go: Any) -> None:
    results.put((lock.path, try_claim(lock, (1,)) is not None))
    go.wait(30)
    results.put(try_claim(lock, (1,), timeout=10) is not None)


def test_spawned_worker_attaches_and_excludes_the_parent(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    results, go = ctx.Queue(), ctx.Event()
    held = try_claim(lock, (1,))
    assert held is not None
    proc = ctx.Process(target=_spawned_claimer, args=(lock, results, go))
    proc.start()
    try:
        assert results.get(timeout=60) == (lock.path, False)
        release_now(held)
        go.set()
        assert results.get(timeout=30) is True
    finally:
        go.set()
        proc.join(timeout=30)
    assert proc.exitcode == 0


def _read_forever(lock: BlockLock, stop: Any, turns: Any) -> None:
    while not stop.is_set():
        held = try_claim(lock, (9, 10), exclusive=False, timeout=10)
        if held is not None:
            turns.value += 1
            time.sleep(0.002)
            release_now(held)


def test_writer_is_not_starved_by_readers_in_other_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    stop, turns = ctx.Event(), ctx.Value("i", 0)
    readers = [ctx.Process(target=_read_forever, args=(lock, stop, turns)) for _ in range(3)]
    for proc in readers:
        proc.start()
    try:
        deadline = time.monotonic() + 30
        while turns.value < 30 and time.monotonic() < deadline:  # the stream is flowing
            time.sleep(0.01)
        writer = try_claim(lock, (10,), timeout=20)
        if writer is not None:
            release_now(writer)
    finally:
        stop.set()
        for proc in readers:
            proc.join(timeout=30)
    assert writer is not None, "the writer starved behind readers in other processes"
    assert all(proc.exitcode == 0 for proc in readers)


READERS = """
import sys, time
from collections import deque
from kvobs._runtime.atomic import release_now
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import Claim
directory, stagger = sys.argv[1], float(sys.argv[2])
lock = BlockLock.attach("kv", 32, directory=directory)
claim = Claim("send", (20, 21, 22), exclusive=False)
time.sleep(stagger)
print("held", flush=True)
while True:  # back to back: a reader is always inside, one of these or another process's
    held = deque()
    if lock.acquire_into(held, claim, 10):
        time.sleep(0.003)
        release_now(held)
"""


def _async_writer(lock: BlockLock, timeout: float, cancel_after: float | None = None) -> bool | None:
    """An exclusive claim of block 21 through the asyncio waiter (what `async with obs.transfer` uses):
    whether it got the block within `timeout` (released at once); None when cancelled after `cancel_after`
    seconds, once it was seen queued at the block's turnstile."""
    from kvobs.locks import _async_wait as async_wait

    async def write() -> bool:
        held: deque[Any] = deque()
        try:
            acquired = await async_wait.acquire_async(lock, held, Claim("prefetch", (21,)), timeout, None)
        finally:
            release_now(held)
        return acquired

    async def main() -> bool | None:
        task = asyncio.create_task(write())
        if cancel_after is None:
            return await task
        await asyncio.sleep(cancel_after)
        assert _turnstile_taken(lock, 21), "the waiting async writer is not queued"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return None

    return asyncio.run(main())


def _turnstile_taken(lock: BlockLock, block: int) -> bool:
    return ofd.conflict(lock._descriptions.base, fcntl.F_WRLCK, lock.num_blocks + block, 1) is not None


def test_async_writer_is_not_starved_by_readers_in_other_processes(tmp_path: Path) -> None:
    """Three reader processes overlap so that block 21 is never free of readers. A waiting writer queues at
    the turnstile and the readers drain; an async writer must queue the same way, though it waits holding
    no block between its tries (the event loop must not block)."""
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    with contextlib.ExitStack() as readers:
        for stagger in ("0", "0.001", "0.002"):
            readers.enter_context(process_holding(READERS, str(tmp_path), stagger))
        time.sleep(0.1)
        got = [_async_writer(lock, timeout=3.0) for _ in range(3)]
    assert got == [True, True, True], "the async writer starved behind the readers"
    assert not _turnstile_taken(lock, 21)
    lock.close()


def test_async_writer_leaves_no_turnstile_when_cancelled_or_timed_out(tmp_path: Path) -> None:
    lock = BlockLock("kv", BLOCKS, directory=tmp_path)
    with holder_process(tmp_path, (21,), exclusive=True):
        assert _async_writer(lock, timeout=30.0, cancel_after=0.2) is None
        assert not _turnstile_taken(lock, 21)
        assert _async_writer(lock, timeout=0.2) is False
        assert not _turnstile_taken(lock, 21)
        assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0}
    assert try_claim(lock, (21,)) is not None
    lock.close()


OUT_OF_DESCRIPTORS = """
import json, os, resource, sys
from prometheus_client import CollectorRegistry
import kvobs
from kvobs import semconv as sc
from kvobs.locks._block_lock import BlockLock

directory = sys.argv[1]
lock = BlockLock("kv", 32_768, directory=directory)
registry = CollectorRegistry()
obs = kvobs.KVObserver("fd", registry=registry, lock=lock, lock_timeout=1, integrity=None)
fds = lambda: len(os.listdir("/proc/self/fd"))
before = fds()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (before + 40, hard))
transfers, error = [], None
for block in range(1000):
    try:
        transfers.append(obs.begin("prefetch", block_ids=[block]))
    except Exception as exc:
        error = exc
        break
opened_at_the_limit = len(lock._descriptions.opened)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # room to look, and for a leak to show
for transfer in transfers:
    transfer.complete()
with obs.transfer("prefetch", block_ids=[0]):  # the next claim finds the pool over its bound
    pass
whole = lock.claim((), timeout=0)
with whole:
    whole_free = True
print(json.dumps({
    "open": len(transfers), "error_type": type(error).__name__, "kvobs_error": isinstance(error, kvobs.KVObsError),
    "message": str(error), "opened_at_the_limit": opened_at_the_limit,
    "opened_after": len(lock._descriptions.opened), "fds_grown_by": fds() - before,
    "claimed": lock.blocks_claimed(), "whole_free": whole_free,
    "ok": registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "fd", "path": "prefetch", "outcome": "ok"}),
}))
"""


def test_running_out_of_descriptors_is_a_clear_error_and_the_pool_shrinks(tmp_path: Path) -> None:
    """Each open BlockLock transfer holds a description of the lock file until it ends. A process out of
    file descriptors gets a kvobs error naming the lock and the limit (not a raw EMFILE), nothing leaks, and
    once the transfers end the pool gives the descriptors back instead of keeping them forever."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS, str(tmp_path)], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])  # after whatever kvobs logged
    assert 20 <= report["open"] < 1000, report
    assert report["kvobs_error"], report
    assert "out of file descriptors" in report["message"] and "kvobs-kv.blocks" in report["message"], report
    assert report["ok"] == report["open"] + 1
    assert report["claimed"] == {"shared": 0, "exclusive": 0} and report["whole_free"], report
    assert report["opened_at_the_limit"] >= report["open"]
    assert report["opened_after"] <= 16 + 1, report  # shrunk to the idle bound (+ the one just used)
    assert report["fds_grown_by"] <= 16 + 1, report


STOPPED_OPENER = """
import fcntl, os, signal, sys
from kvobs.locks import _ofd as ofd
from kvobs.locks._block_holders import INIT_LOCK_BYTE
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.fcntl(fd, ofd.F_OFD_SETLK, ofd.pack(fcntl.F_WRLCK, INIT_LOCK_BYTE, 1))  # as an opener does
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # stopped in the middle of checking the header
"""


def test_an_opener_stopped_while_initialising_is_named_when_opening_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped (SIGSTOP) while it holds the byte that guards the header: opening the lock waits
    the initialisation timeout, then says who holds it and that it is stopped (the kernel reports no pid
    for OFD locks through F_OFD_GETLK)."""
    from kvobs.errors import LockInitTimeout
    from kvobs.locks import _block_holders as block_holders

    monkeypatch.setattr(block_holders, "_INIT_WAIT_S", 0.5)
    BlockLock("kv", BLOCKS, directory=tmp_path).close()
    path = str(tmp_path / "kvobs-kv.blocks")
    with process_holding(STOPPED_OPENER, path) as stopped:
        deadline = time.monotonic() + 10
        while _state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(LockInitTimeout) as caught:
            BlockLock.attach("kv", BLOCKS, directory=tmp_path)
        waited = time.monotonic() - started
        message = str(caught.value)
        assert f"pid {stopped.pid} (stopped)" in message and path in message, message
        assert caught.value.waited_s == 0.5
        assert 0.5 <= waited < 5, waited  # the timeout is honoured, the holder found in far less
    BlockLock.attach("kv", BLOCKS, directory=tmp_path).close()  # killed: the kernel dropped its byte


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]
