"""BlockLock behaviours that a sampled mutation run of kvobs.block_lock showed no test pinned down.

Each test here fails on a mutant the other block-lock tests let through; tools/mutate.py reruns them.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from kvobs.atomic import release_now
from kvobs.block_descriptions import DescriptionPool
from kvobs.block_lock import _MAX_BLOCKS, BlockLock
from kvobs.errors import LockTimeout
from kvobs.lockfile import PROC_FD
from kvobs.locks import Claim


@pytest.fixture
def lock(tmp_path: Path) -> Any:
    block_lock = BlockLock("kv", 64, directory=tmp_path)
    yield block_lock
    block_lock.close()


def claim(lock: BlockLock, blocks: tuple[int, ...], *, exclusive: bool, holder: str, timeout: float = 0,
          conflicts: list[str] | None = None) -> deque[Any] | None:
    held: deque[Any] = deque()
    on_conflict = conflicts.append if conflicts is not None else None
    return held if lock.acquire_into(held, Claim(holder, blocks, exclusive), timeout, on_conflict) else None


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


@pytest.mark.parametrize("block", [0, 63])
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


def test_a_claim_with_a_zero_timeout_on_held_blocks_raises_at_once_saying_zero_seconds(lock: BlockLock) -> None:
    with lock.claim([3, 4], holder="prefetch"), pytest.raises(LockTimeout) as info, \
            lock.claim([4], timeout=0, holder="send"):
        raise AssertionError("never entered")
    assert info.value.waited_s == 0.0
    assert "within 0.000 s" in str(info.value)


@pytest.mark.parametrize("blocks", [[1, 2.0], [1.0, 2], [-1, 2], [1, 64]])
def test_a_claim_of_anything_but_ids_in_range_is_refused_by_name(lock: BlockLock, blocks: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"block ids of .* must be ints from 0 to 63"), lock.claim(blocks):
        raise AssertionError("never entered")
    with lock.claim([1, 2]):  # nothing was left claimed
        pass


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


def test_a_closed_lock_leaves_no_descriptor_open(tmp_path: Path) -> None:
    before = set(os.listdir(PROC_FD))
    lock = BlockLock("fds", 8, directory=tmp_path)
    with lock.claim([1, 2]), lock.claim([5], exclusive=False):  # two descriptions in the pool
        pass
    lock.close()
    assert set(os.listdir(PROC_FD)) <= before
