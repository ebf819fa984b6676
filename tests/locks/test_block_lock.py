"""BlockLock in one process: claim semantics, the kernel struct, telemetry, with real threads and files."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

import kvobs
from kvobs._runtime.atomic import release_now
from kvobs.errors import LockTimeout
from kvobs.locks import _ofd as ofd
from kvobs.locks._block_descriptions import DescriptionPool
from kvobs.locks._block_lock import _MAX_BLOCKS, BlockLock
from kvobs.locks._cache_lock import CacheLock, Claim
from kvobs.locks._lockfile import PROC_FD, UnsafeLockFile

NUM_BLOCKS = 256


@pytest.fixture
def lock(tmp_path: Path) -> Any:
    block_lock = BlockLock("kv", NUM_BLOCKS, directory=tmp_path)
    yield block_lock
    block_lock.close()


def claim(lock: BlockLock, blocks: tuple[int, ...], exclusive: bool = True, holder: str = "prefetch",
          timeout: float | None = 0, conflicts: list[str] | None = None) -> deque[Any] | None:
    """The claim's undo deque when granted, None when refused."""
    held: deque[Any] = deque()
    on_conflict = conflicts.append if conflicts is not None else None
    return held if lock.acquire_into(held, Claim(holder, blocks, exclusive), timeout, on_conflict) else None


def idle(lock: BlockLock) -> bool:
    """Nothing claimed in this process: no record, every description back in the pool exactly once."""
    pool = lock._descriptions
    return not lock._active and len(pool.idle) == len(set(pool.idle)) == len(pool.opened)


# --- the kernel's struct flock ---------------------------------------------------------------------------


def test_flock_layout_matches_the_kernel(tmp_path: Path) -> None:
    """A classic lock taken by fcntl.lockf (which packs struct flock in C) reads back field by field."""
    path = tmp_path / "layout"
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    second = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(first, fcntl.LOCK_EX | fcntl.LOCK_NB, 3, 5)  # bytes [5, 8)
        raw = fcntl.fcntl(second, ofd.F_OFD_GETLK, ofd.pack(fcntl.F_WRLCK, 0, 100))
        assert ofd.FLOCK.size == len(raw) == 32
        assert ofd.FLOCK.unpack(raw) == (fcntl.F_WRLCK, os.SEEK_SET, 5, 3, os.getpid())
        fcntl.lockf(first, fcntl.LOCK_UN, 3, 5)
        fcntl.lockf(first, fcntl.LOCK_SH | fcntl.LOCK_NB, 2, 40)
        assert ofd.conflict(second, fcntl.F_WRLCK, 0, 100) == ofd.Conflict(False, 40, 2)
        assert ofd.conflict(second, fcntl.F_RDLCK, 0, 100) is None  # shared does not conflict with shared
        fcntl.lockf(first, fcntl.LOCK_UN, 2, 40)

        # The other way round: an OFD lock packed here is where lockf finds it.
        fcntl.fcntl(second, ofd.F_OFD_SETLK, ofd.pack(fcntl.F_WRLCK, 10, 2))
        with pytest.raises(OSError) as caught:
            fcntl.lockf(first, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 11)
        assert caught.value.errno in (errno.EAGAIN, errno.EACCES)
        fcntl.lockf(first, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 12)
        fcntl.lockf(first, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 9)
        fcntl.lockf(first, fcntl.LOCK_UN, 0, 0)
        fcntl.fcntl(second, ofd.F_OFD_SETLK, ofd.UNLOCK_ALL)

        # l_pid sits where the kernel reads it: OFD requests must carry 0 there.
        with pytest.raises(OSError) as caught:
            fcntl.fcntl(second, ofd.F_OFD_SETLK, ofd.FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 1))
        assert caught.value.errno == errno.EINVAL
    finally:
        os.close(first)
        os.close(second)


# --- claim semantics -------------------------------------------------------------------------------------


def test_is_a_cache_lock(lock: BlockLock) -> None:
    assert isinstance(lock, CacheLock) and lock.name == "kv" and lock.num_blocks == NUM_BLOCKS


def test_shared_claims_share_and_exclude_writers(lock: BlockLock) -> None:
    first = claim(lock, (1, 2, 3), exclusive=False, holder="write_back")
    second = claim(lock, (2, 3, 4), exclusive=False, holder="send")
    assert first is not None and second is not None
    conflicts: list[str] = []
    assert claim(lock, (3,), conflicts=conflicts) is None
    assert conflicts in (["write_back"], ["send"])
    assert claim(lock, (4, 5)) is None  # 4 is still shared by `second`
    exclusive = claim(lock, (5, 6))
    assert exclusive is not None
    assert claim(lock, (6,), exclusive=False) is None  # a reader waits for a writer too
    for held in (first, second, exclusive):
        release_now(held)
    assert idle(lock)
    everything = claim(lock, ())
    assert everything is not None
    release_now(everything)


def test_disjoint_exclusive_claims_interleave_block_by_block(lock: BlockLock) -> None:
    evens = claim(lock, tuple(range(0, 64, 2)))
    odds = claim(lock, tuple(range(1, 64, 2)))
    assert evens is not None and odds is not None
    assert lock.blocks_claimed() == {"shared": 0, "exclusive": 64}
    release_now(evens)
    release_now(odds)


def test_whole_cache_claims(lock: BlockLock) -> None:
    reader = claim(lock, (), exclusive=False)
    assert reader is not None
    assert lock.blocks_claimed() == {"shared": NUM_BLOCKS, "exclusive": 0}
    assert claim(lock, (NUM_BLOCKS - 1,)) is None
    other_reader = claim(lock, (7, 8), exclusive=False)
    assert other_reader is not None
    release_now(reader)
    release_now(other_reader)
    writer = claim(lock, ())
    assert writer is not None and claim(lock, (0,), exclusive=False) is None
    release_now(writer)
    assert idle(lock)


def test_timeout_leaves_nothing_claimed_and_held_as_it_was(lock: BlockLock) -> None:
    blocker = claim(lock, (50,), holder="write_back")
    assert blocker is not None
    sentinel = object()
    held: deque[Any] = deque([sentinel])
    wanted = Claim("prefetch", (*range(1, 11), 50, *range(60, 71)))
    started = time.monotonic()
    assert lock.acquire_into(held, wanted, 0.05) is False
    assert time.monotonic() - started >= 0.05
    assert list(held) == [sentinel]
    # Runs 1..10 were taken before the wait at 50 and 50's turnstile while waiting: all released.
    left = claim(lock, tuple(range(1, 11)))
    assert left is not None
    right = claim(lock, tuple(range(60, 71)))
    assert right is not None
    release_now(blocker)
    reader = claim(lock, (50,), exclusive=False)  # no queued writer left behind
    assert reader is not None
    for undo in (left, right, reader):
        release_now(undo)
    assert idle(lock) and lock.held_for() == 0.0


def test_zero_timeout_tries_once(lock: BlockLock) -> None:
    blocker = claim(lock, (9,))
    assert blocker is not None
    started = time.monotonic()
    assert claim(lock, (9,), timeout=0) is None
    assert claim(lock, (9,), timeout=-1.0) is None
    assert time.monotonic() - started < 0.5
    release_now(blocker)
    granted = claim(lock, (9,), timeout=-1.0)  # an expired deadline still tries once
    assert granted is not None
    release_now(granted)


def test_waiting_claim_gets_the_blocks_when_released(lock: BlockLock) -> None:
    blocker = claim(lock, (3, 4), exclusive=False)
    assert blocker is not None
    timer = threading.Timer(0.05, release_now, args=(blocker,))
    timer.start()
    got = claim(lock, (4, 5), timeout=10)
    timer.join()
    assert got is not None
    release_now(got)


def test_release_from_another_thread(lock: BlockLock) -> None:
    helds: list[deque[Any]] = []
    taker = threading.Thread(target=lambda: helds.append(claim(lock, (1, 2, 3, 100))))  # type: ignore[arg-type]
    taker.start()
    taker.join(timeout=10)
    assert helds and helds[0] is not None
    releaser = threading.Thread(target=release_now, args=(helds[0],))
    releaser.start()
    releaser.join(timeout=10)
    assert idle(lock)
    again = claim(lock, (1, 2, 3, 100))
    assert again is not None
    release_now(again)


def test_claims_of_one_thread_exclude_each_other(lock: BlockLock) -> None:
    """Every claim has its own open file description: OFD locks of one description would merge."""
    first = claim(lock, (10,))
    assert first is not None and claim(lock, (10,)) is None
    assert len(lock._descriptions.opened) == 2
    release_now(first)


def test_held_for_and_blocks_claimed(lock: BlockLock) -> None:
    assert lock.held_for() == 0.0 and lock.blocks_claimed() == {"shared": 0, "exclusive": 0}
    old = claim(lock, (1, 2), exclusive=False)
    time.sleep(0.02)
    new = claim(lock, (2, 3, 4), exclusive=False)
    writer = claim(lock, tuple(range(10, 20)))
    assert old is not None and new is not None and writer is not None
    assert lock.held_for() >= 0.02
    assert lock.blocks_claimed() == {"shared": 5, "exclusive": 10}
    release_now(old)
    assert lock.held_for() < 0.02
    release_now(new)
    release_now(writer)
    assert lock.held_for() == 0.0 and lock.blocks_claimed() == {"shared": 0, "exclusive": 0}


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Claim("x", (1, 2), True), Claim("y", (2, 3), True), True),
        (Claim("x", (1, 2), True), Claim("y", (3, 4), True), False),
        (Claim("x", (1, 2), False), Claim("y", (1, 2), False), True),  # would queue behind a writer
        (Claim("x", (1, 2), False), Claim("y", (3,), False), False),
        (Claim("x", (1, 2), False), Claim("y", (2,), True), True),
        (Claim("x", (), False), Claim("y", (9,), True), True),
        (Claim("x", (), False), Claim("y", (), False), True),
        (Claim("x", (5,), True), Claim("y", (), True), True),
    ],
)
def test_overlaps(lock: BlockLock, a: Claim, b: Claim, expected: bool) -> None:
    assert lock.overlaps(a, b) is expected and lock.overlaps(b, a) is expected


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ((3, 2), "sorted and distinct"),
        ((1, 2, 2, 3), "sorted and distinct"),
        ((1, 3, 2, 4), "sorted and distinct"),  # spans exactly len(ids) blocks, yet is not one run
        ((1, 2, 2, 4), "sorted and distinct"),
        ((-1, 0), "from 0 to 255"),
        ((0, NUM_BLOCKS), "from 0 to 255"),
        ((0.0,), "must be ints"),
    ],
)
def test_bad_block_ids_are_refused_before_anything_is_taken(
    lock: BlockLock, blocks: tuple[Any, ...], message: str
) -> None:
    held: deque[Any] = deque()
    with pytest.raises(ValueError, match=message):
        lock.acquire_into(held, Claim("prefetch", blocks), 0)
    assert not held and idle(lock)


# --- who held the blocks ---------------------------------------------------------------------------------


def test_conflict_names_the_holder_once_per_wait(lock: BlockLock) -> None:
    blocker = claim(lock, tuple(range(10, 21)), exclusive=False, holder="write_back")
    assert blocker is not None
    conflicts: list[str] = []
    assert claim(lock, (5, 15), timeout=0.05, conflicts=conflicts) is None  # polled many times
    assert conflicts == ["write_back"]
    conflicts.clear()
    granted = claim(lock, (5, 6), timeout=0.05, conflicts=conflicts)
    assert granted is not None
    assert conflicts == []  # no wait, no report
    release_now(granted)
    release_now(blocker)


def test_custom_holder_names_are_shared_through_the_file(lock: BlockLock, tmp_path: Path) -> None:
    other_view = BlockLock.attach("kv", NUM_BLOCKS, directory=tmp_path)  # as another process would
    blocker = claim(lock, (42,), holder="my-storage-flush")
    assert blocker is not None
    conflicts: list[str] = []
    assert claim(other_view, (40, 41, 42), conflicts=conflicts) is None
    assert conflicts == ["my-storage-flush"]
    release_now(blocker)
    other_view.close()


def test_a_reader_waits_behind_a_queued_writer_and_names_it(lock: BlockLock) -> None:
    """Writer preference: once a writer waits for readers, a new reader waits for the writer."""
    reader = claim(lock, (7, 8), exclusive=False, holder="send")
    assert reader is not None
    writer_result: list[deque[Any] | None] = []
    writer = threading.Thread(target=lambda: writer_result.append(claim(lock, (8,), holder="forward", timeout=10)))
    writer.start()
    try:
        conflicts: list[str] = []
        deadline = time.monotonic() + 10
        while conflicts != ["forward"] and time.monotonic() < deadline:  # until the writer has queued
            conflicts.clear()  # "unknown": the turnstile was read between the writer's lock and its stamp
            passed = claim(lock, (8,), exclusive=False, holder="write_back", conflicts=conflicts)
            if passed is not None:  # the writer had not queued yet
                release_now(passed)
            time.sleep(0.005)
        assert conflicts == ["forward"]
        for blocks in ((8,), (6, 8), (8, 10)):  # no reader passes the queued writer, whichever run meets it
            assert claim(lock, blocks, exclusive=False, timeout=0.05) is None, blocks
        elsewhere = claim(lock, (7,), exclusive=False)  # only the writer's blocks queue
        assert elsewhere is not None
        release_now(elsewhere)
        around = claim(lock, (6, 7, 9), exclusive=False)  # runs on both sides of 8
        assert around is not None
        release_now(around)
    finally:
        release_now(reader)
        writer.join(timeout=10)
    assert writer_result and writer_result[0] is not None
    release_now(writer_result[0])
    # The writer left its turnstile: readers pass at once again, through every pooled description (the
    # writer's, reused first, and the others, which would see a turnstile left locked on it).
    first = claim(lock, (8,), exclusive=False)
    second = claim(lock, (8,), exclusive=False)
    assert first is not None and second is not None
    release_now(second)
    release_now(first)


def test_two_writers_queued_on_overlapping_runs_do_not_deadlock(lock: BlockLock) -> None:
    """Writer A queues at the turnstile of run 2-4; writer B holds block 2 and has to wait for block 4.
    B must not wait for A's turnstile (A waits for B's block 2): writers never wait for a turnstile."""
    probe = BlockLock.attach("kv", NUM_BLOCKS, directory=lock.directory)  # another description, to look
    readers = [claim(lock, (3,), exclusive=False, holder="send"), claim(lock, (4,), exclusive=False, holder="send")]
    granted: dict[str, bool] = {}

    def write(name: str, blocks: tuple[int, ...]) -> None:
        held = claim(lock, blocks, timeout=20)
        granted[name] = held is not None
        if held is not None:
            release_now(held)

    writer_a = threading.Thread(target=write, args=("a", (2, 3, 4)))
    writer_b = threading.Thread(target=write, args=("b", (2, 4)))
    fd = probe._descriptions.take(deque())
    try:
        writer_a.start()
        wait_until(lambda: ofd.conflict(fd, fcntl.F_RDLCK, NUM_BLOCKS + 2, 3) is not None, "A queues at 2-4")
        writer_b.start()
        wait_until(lambda: ofd.conflict(fd, fcntl.F_RDLCK, 2, 1) is not None, "B holds block 2")
        time.sleep(0.05)  # B now waits for block 4
    finally:
        for reader in readers:
            release_now(reader)
        writer_a.join(timeout=60)
        writer_b.join(timeout=60)
        probe.close()
    assert granted == {"a": True, "b": True}, "the writers deadlocked until their timeouts"
    assert idle(lock)


def test_writer_is_not_starved_by_a_stream_of_readers(lock: BlockLock) -> None:
    """Readers overlap so that the blocks are never free of readers: without writer preference a writer
    would never find a gap. With it, the readers inside drain and new ones queue behind the writer."""
    stop = threading.Event()
    reader_turns = [0]
    errors: list[BaseException] = []

    def read_forever() -> None:
        try:
            while not stop.is_set():
                held = claim(lock, (20, 21, 22), exclusive=False, holder="send", timeout=10)
                if held is None:
                    continue
                reader_turns[0] += 1
                time.sleep(0.002)
                release_now(held)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    readers = [threading.Thread(target=read_forever) for _ in range(4)]
    for thread in readers:
        thread.start()
        time.sleep(0.0005)  # staggered: at every instant some reader is inside
    try:
        time.sleep(0.05)
        turns_before = reader_turns[0]
        writer = claim(lock, (21,), holder="forward", timeout=20)
        turns_during = reader_turns[0] - turns_before
        if writer is not None:
            release_now(writer)
    finally:
        stop.set()
        for thread in readers:
            thread.join(timeout=30)
    assert not errors
    assert writer is not None, "the writer starved behind the readers"
    assert turns_during < 200  # the readers inside finish; a bounded few more got in first


def _hammer(lock: BlockLock, inside: list[int], overlaps: list[int], rounds: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    for _ in range(rounds):
        blocks = tuple(sorted(rng.sample(range(16), rng.randint(1, 4))))
        exclusive = rng.random() < 0.5
        held = claim(lock, blocks, exclusive=exclusive, timeout=None)  # a deadlock shows as threads still alive
        assert held is not None
        for block in blocks:
            if exclusive:
                if inside[block] != 0:
                    overlaps[0] += 1
                inside[block] = -1
            else:
                if inside[block] < 0:
                    overlaps[0] += 1
        time.sleep(0)
        for block in blocks:
            if exclusive:
                inside[block] = 0
        release_now(held)


def test_threads_never_overlap_and_never_deadlock(lock: BlockLock) -> None:
    """Random multi-run claims from 4 threads, each holding runs while waiting for later ones."""
    inside = [0] * 16
    overlaps = [0]
    finished: list[int] = []

    def hammer(seed: int) -> None:
        _hammer(lock, inside, overlaps, 400, seed)
        finished.append(seed)

    threads = [threading.Thread(target=hammer, args=(seed,), daemon=True) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "deadlock"
    assert sorted(finished) == [0, 1, 2, 3]  # none raised
    assert overlaps == [0]
    assert idle(lock)


# --- the lock file and lifetime -------------------------------------------------------------------------


def test_direct_claim_context_manager(lock: BlockLock) -> None:
    with lock.claim([1, 2, 3], exclusive=False, holder="send") as held_claim:
        assert lock.blocks_claimed() == {"shared": 3, "exclusive": 0}
        with pytest.raises(LockTimeout, match="'kv'"), lock.claim([3], timeout=0.01):
            pytest.fail("entered blocks another claim holds")
        held_claim.release()  # released early (any thread may); leaving the block is then a no-op
        assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0}
    assert idle(lock)


def test_num_blocks_must_match_the_file(lock: BlockLock, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"created for {NUM_BLOCKS} blocks, not 100"):
        BlockLock("kv", 100, directory=tmp_path)


@pytest.mark.parametrize("num_blocks", [0, -1, True, 2.0, "8", 1 << 41])
def test_invalid_num_blocks(tmp_path: Path, num_blocks: Any) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockLock("kv", num_blocks, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_attach_never_creates(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="create it first"):
        BlockLock.attach("kv", 8, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_foreign_file_at_the_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvobs-kv.blocks"
    path.write_bytes(b"not a block lock file")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="not a kvobs block lock file"):
        BlockLock("kv", 8, directory=tmp_path)


def test_planted_lock_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvobs-kv.blocks"
    path.touch()
    path.chmod(0o666)
    with pytest.raises(UnsafeLockFile, match="mode 0666"):
        BlockLock("kv", 8, directory=tmp_path)
    target = tmp_path / "target"
    target.touch(mode=0o600)
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(UnsafeLockFile, match="symlink"):
        BlockLock("kv", 8, directory=tmp_path)


def test_too_long_name_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than the"):
        BlockLock("k" * 300, 8, directory=tmp_path)


def test_pickles_by_attaching(lock: BlockLock) -> None:
    copy = pickle.loads(pickle.dumps(lock))
    assert (copy.name, copy.num_blocks, copy.path) == (lock.name, lock.num_blocks, lock.path)
    held = claim(lock, (1,))
    assert held is not None and claim(copy, (1,)) is None
    release_now(held)
    copy.close()
    assert repr(lock) == f"BlockLock('kv', {NUM_BLOCKS}, path={lock.path!r})"


def test_close_drops_claims_and_refuses_new_ones(tmp_path: Path) -> None:
    first = BlockLock("kv", 8, directory=tmp_path)
    second = BlockLock.attach("kv", 8, directory=tmp_path)
    assert claim(first, (1,)) is not None
    assert claim(second, (1,)) is None
    first.close()
    first.close()
    held = claim(second, (1,))  # closing the descriptions dropped the ranges
    assert held is not None
    release_now(held)
    with pytest.raises(ValueError, match="closed"):
        claim(first, (1,))
    second.close()


def test_coalesce_gap_locks_small_gaps_too(tmp_path: Path) -> None:
    lock = BlockLock("gaps", 64, directory=tmp_path, coalesce_gap=2)
    held = claim(lock, (1, 4, 10))  # 1..4 in one range (gap of 2), 10 alone (gap of 5)
    assert held is not None
    assert lock.blocks_claimed() == {"shared": 0, "exclusive": 3}  # the blocks asked for, not the gaps
    assert claim(lock, (2,)) is None and claim(lock, (3,)) is None
    beyond = claim(lock, (5, 6, 7, 8, 9))
    assert beyond is not None
    release_now(beyond)
    assert lock.overlaps(Claim("a", (1, 4)), Claim("b", (3,)))  # so a context never waits on itself
    assert not lock.overlaps(Claim("a", (1, 4)), Claim("b", (5,)))
    copy = pickle.loads(pickle.dumps(lock))
    assert copy.coalesce_gap == 2
    copy.close()
    release_now(held)
    lock.close()


def _ranges_on_file(path: str) -> int:
    """Byte ranges locked on the file now, as the kernel lists them."""
    info = os.stat(path)
    inode = f" {os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino} "
    with open("/proc/locks") as locks:
        return sum(inode in line for line in locks)


def test_a_fragmented_claim_bridges_its_narrowest_gaps_to_fit_max_ranges(tmp_path: Path) -> None:
    lock = BlockLock("bridged", 512, directory=tmp_path, max_ranges=4)
    other = BlockLock.attach("bridged", 512, directory=tmp_path)
    blocks = (0, 2, 4, 100, 102, 200, 202, 300)  # 8 runs in 4 clusters
    held = claim(lock, blocks)
    assert held is not None
    assert _ranges_on_file(lock.path) == 4  # 0-4, 100-102, 200-202, 300: the three widest gaps kept
    assert lock.blocks_claimed() == {"shared": 0, "exclusive": 8}  # the blocks asked for, not the gaps
    for block in (*blocks, 1, 3, 101, 201):  # the claim's blocks, and the gaps bridged between them
        assert claim(other, (block,)) is None, block
    free = claim(other, (5, 50, 99, 103, 199, 203, 299, 301))
    assert free is not None
    release_now(free)
    assert lock.overlaps(Claim("a", blocks), Claim("b", (101,)))  # so a context never waits on itself
    assert not lock.overlaps(Claim("a", blocks), Claim("b", (50,)))
    copy = pickle.loads(pickle.dumps(lock))
    assert copy.max_ranges == 4
    copy.close()
    release_now(held)
    assert _ranges_on_file(lock.path) == 0
    other.close()
    lock.close()


def test_a_claim_of_thousands_of_scattered_blocks_honours_its_timeout(tmp_path: Path) -> None:
    """20,000 blocks with a gap after each: one kernel call per run, each scanning the locks already on the
    file, took 12-24 s against this 2 s timeout, uncontended. Bounded ranges keep it linear."""
    lock = BlockLock("scattered", 40_000, directory=tmp_path)
    other = BlockLock.attach("scattered", 40_000, directory=tmp_path)
    blocks = tuple(range(0, 40_000, 2))
    started = time.monotonic()
    held = claim(lock, blocks, timeout=2.0)
    elapsed = time.monotonic() - started
    assert held is not None
    assert elapsed < 2.0 + 2.0, f"a claim with a 2 s timeout took {elapsed:.1f} s"
    assert _ranges_on_file(lock.path) <= lock.max_ranges
    assert claim(other, (0,)) is None and claim(other, (39_998,)) is None
    release_now(held)
    assert claim(other, (0, 39_998), timeout=0) is not None
    other.close()
    lock.close()


@pytest.mark.parametrize("ranges", [0, -1, True, 1.5])
def test_invalid_max_ranges(tmp_path: Path, ranges: Any) -> None:
    with pytest.raises(ValueError, match="max_ranges"):
        BlockLock("kv", 8, directory=tmp_path, max_ranges=ranges)


@pytest.mark.parametrize("gap", [-1, True, 1.5])
def test_invalid_coalesce_gap(tmp_path: Path, gap: Any) -> None:
    with pytest.raises(ValueError, match="coalesce_gap"):
        BlockLock("kv", 8, directory=tmp_path, coalesce_gap=gap)


def test_direct_claim_interrupted_while_waiting_holds_nothing(lock: BlockLock) -> None:
    import signal

    class Interrupt(Exception):
        pass

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupt

    blocker = claim(lock, (5,), exclusive=False)
    assert blocker is not None
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        # Holds 1-2 and the turnstile at 5 while it waits for the reader.
        with pytest.raises(Interrupt), lock.claim([1, 2, 5], timeout=10):
            pytest.fail("entered blocks a reader holds")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    release_now(blocker)
    assert idle(lock)
    everything = claim(lock, ())
    assert everything is not None
    release_now(everything)


def test_a_lock_nobody_stamped_is_named_unknown(lock: BlockLock) -> None:
    """Another program locking the whole file (lockf to EOF) blocks every claim; kvobs cannot name it."""
    fd = os.open(lock.path, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 0, 0)
        conflicts: list[str] = []
        assert claim(lock, (3,), conflicts=conflicts) is None
        assert conflicts == ["unknown"]
    finally:
        os.close(fd)


def test_a_stuck_initialisation_times_out_instead_of_hanging(
    lock: BlockLock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvobs.locks import _block_holders as block_holders

    monkeypatch.setattr(block_holders, "_INIT_WAIT_S", 0.05)
    stuck = os.open(lock.path, os.O_RDWR)  # another opener stopped while it checks the header
    try:
        fcntl.fcntl(stuck, ofd.F_OFD_SETLK, ofd.pack(fcntl.F_WRLCK, block_holders.INIT_LOCK_BYTE, 1))
        with pytest.raises(LockTimeout, match="initialisation"):
            BlockLock.attach("kv", NUM_BLOCKS, directory=tmp_path)
    finally:
        os.close(stuck)
    BlockLock.attach("kv", NUM_BLOCKS, directory=tmp_path).close()


# --- through an observer: a transfer naming no blocks claims the whole cache, shared for reading paths -----


def test_transfers_naming_no_blocks_share_the_whole_cache_when_they_read_and_exclude_when_they_write(tmp_path,
                                                                                                 registry):
    lock = BlockLock("whole", 16, directory=tmp_path)
    obs = kvobs.KVObserver("whole", registry=registry, integrity=None, lock=lock, lock_timeout=0.2)
    inside = threading.Event()
    leave = threading.Event()

    @obs.write_back()
    def write_all():
        inside.set()
        leave.wait(10)

    @obs.send()
    def send_all():
        return "sent"

    @obs.prefetch()
    def fetch_all():
        return "fetched"

    writer = threading.Thread(target=write_all)
    writer.start()
    try:
        assert inside.wait(10)
        assert send_all() == "sent"  # another reader of the whole cache: shared
        with pytest.raises(kvobs.LockTimeout):
            fetch_all()  # a writer of the whole cache: excluded while the reader holds
    finally:
        leave.set()
        writer.join()
    assert fetch_all() == "fetched"
    lock.close()


# --- who a waiting claim is told of; zero timeouts; ids in range; the sizes of a lock ----------------------


def test_a_waiting_reader_is_told_of_the_writer_not_of_a_reader_beside_it(lock: BlockLock) -> None:
    """A reader waits only for writers: among the holders of its run, the one it names must be a writer,
    even when another reader, which it shares with, holds part of the same run (and locked it first)."""
    reader = claim(lock, (0,), exclusive=False, holder="send")
    writer = claim(lock, (2,), exclusive=True, holder="prefetch")
    assert reader is not None and writer is not None
    conflicts: list[str] = []
    try:
        assert claim(lock, (0, 1, 2), exclusive=False, holder="write_back", timeout=0.05,
                     conflicts=conflicts) is None
    finally:
        release_now(writer)
    assert conflicts == ["prefetch"]
    granted = claim(lock, (0, 1, 2), exclusive=False, holder="write_back")
    assert granted is not None  # shares block 0 with the other reader
    release_now(granted)
    release_now(reader)


@pytest.mark.parametrize("block", [0, NUM_BLOCKS - 1])
def test_a_whole_cache_claim_waits_for_and_names_the_holder_of_the_first_and_last_block(lock: BlockLock,
                                                                                      block: int) -> None:
    reader = claim(lock, (block,), exclusive=False, holder="send")
    assert reader is not None
    conflicts: list[str] = []
    try:
        assert claim(lock, (), exclusive=True, holder="forward", timeout=0.05, conflicts=conflicts) is None
    finally:
        release_now(reader)
    assert conflicts == ["send"]
    whole = claim(lock, (), exclusive=True, holder="forward")
    assert whole is not None
    assert claim(lock, (block,), exclusive=False, holder="send") is None
    release_now(whole)


def test_a_claim_with_a_zero_timeout_on_held_blocks_raises_at_once_saying_zero_seconds(lock: BlockLock) -> None:
    with lock.claim([3, 4], holder="prefetch"), pytest.raises(LockTimeout) as info, \
            lock.claim([4], timeout=0, holder="send"):
        raise AssertionError("never entered")
    assert info.value.waited_s == 0.0
    assert "within 0.000 s" in str(info.value)


@pytest.mark.parametrize("blocks", [[1, 2.0], [1.0, 2], [-1, 2], [1, NUM_BLOCKS]])
def test_a_claim_of_anything_but_ids_in_range_is_refused_by_name(lock: BlockLock, blocks: list[Any]) -> None:
    refused = rf"block ids of .* must be ints from 0 to {NUM_BLOCKS - 1}"
    with pytest.raises(ValueError, match=refused), lock.claim(blocks):
        raise AssertionError("never entered")
    with lock.claim([1, 2]):  # nothing was left claimed
        pass


def test_locks_of_one_block_and_of_the_most_blocks_are_accepted_and_nothing_beyond(tmp_path: Path) -> None:
    single = BlockLock("single", 1, directory=tmp_path)
    with single.claim([0]):
        pass
    single.close()
    with pytest.raises(ValueError, match=f"num_blocks must be an int from 1 to {_MAX_BLOCKS}, got 0"):
        BlockLock("empty", 0, directory=tmp_path)
    largest = BlockLock("largest", _MAX_BLOCKS, directory=tmp_path)
    with largest.claim([0, _MAX_BLOCKS - 1]):
        pass
    largest.close()
    with pytest.raises(ValueError, match=f"num_blocks must be an int from 1 to {_MAX_BLOCKS}"):
        BlockLock("too-large", _MAX_BLOCKS + 1, directory=tmp_path)


# --- close(): no description handed out again, none left open, none closed twice ---------------------------


def test_a_closed_lock_refuses_claims_even_with_descriptions_that_were_idle(tmp_path: Path) -> None:
    """close() closes the pooled descriptions too: none may be handed to a later claim (its number may by then
    belong to another file)."""
    lock = BlockLock("kv", 8, directory=tmp_path)
    held = claim(lock, (1,), exclusive=True, holder="prefetch")
    assert held is not None
    release_now(held)  # its description is back in the pool, idle
    lock.close()
    with pytest.raises(ValueError, match="closed"):
        claim(lock, (1,), exclusive=True, holder="prefetch")


def test_closing_the_descriptions_twice_closes_nothing_the_second_time(tmp_path: Path) -> None:
    """A closed descriptor's number is soon another file's: a second close must not touch it."""
    path = tmp_path / "lock"
    path.write_bytes(b"\0" * 8)
    pool = DescriptionPool(os.open(path, os.O_RDWR), "test lock")
    pool.take(held := deque())
    release_now(held)
    pool.close()
    reused = [os.open(path, os.O_RDONLY) for _ in range(4)]  # takes the numbers just freed
    try:
        pool.close()
        for fd in reused:
            os.fstat(fd)  # still open
    finally:
        for fd in reused:
            os.close(fd)


def test_a_closed_lock_leaves_no_descriptor_open(tmp_path: Path) -> None:
    before = set(os.listdir(PROC_FD))
    lock = BlockLock("fds", 8, directory=tmp_path)
    with lock.claim([1, 2]), lock.claim([5], exclusive=False):  # two descriptions in the pool
        pass
    lock.close()
    assert set(os.listdir(PROC_FD)) <= before
