"""BlockLock against a model of granted claims: hypothesis drives interleavings of claims and releases by
several holders (two lock objects on one file, as two processes would have, and threads releasing)."""

from __future__ import annotations

import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvobs._runtime.atomic import release_now
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import Claim

BLOCKS = 8


@dataclass
class Granted:
    owner: int  # which lock object took it
    blocks: frozenset[int]
    exclusive: bool
    held: deque[Any]


def conflicts(blocks: frozenset[int], exclusive: bool, other: Granted) -> bool:
    return (exclusive or other.exclusive) and bool(blocks & other.blocks)


class BlockLockModel(RuleBasedStateMachine):
    granted = Bundle("granted")

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        first = BlockLock("kv", BLOCKS, directory=self.directory.name)
        self.locks = (first, BlockLock.attach("kv", BLOCKS, directory=self.directory.name))
        self.model: list[Granted] = []

    @rule(
        target=granted,
        owner=st.sampled_from([0, 1]),
        blocks=st.sets(st.integers(0, BLOCKS - 1), max_size=BLOCKS),
        exclusive=st.booleans(),
    )
    def claim(self, owner: int, blocks: set[int], exclusive: bool) -> Any:
        wanted = frozenset(blocks) if blocks else frozenset(range(BLOCKS))  # no blocks: the whole cache
        expected = not any(conflicts(wanted, exclusive, other) for other in self.model)
        held: deque[Any] = deque()
        reported: list[str] = []
        got = self.locks[owner].acquire_into(held, Claim("p", tuple(sorted(blocks)), exclusive), 0, reported.append)
        assert got is expected
        assert len(reported) == (0 if got else 1)
        if not got:
            assert not held
            return None
        entry = Granted(owner, wanted, exclusive, held)
        self.model.append(entry)
        return entry

    @rule(entry=consumes(granted), on_another_thread=st.booleans())
    def release(self, entry: Granted | None, on_another_thread: bool) -> None:
        if entry is None:
            return
        if on_another_thread:
            thread = threading.Thread(target=release_now, args=(entry.held,))
            thread.start()
            thread.join(timeout=10)
        else:
            release_now(entry.held)
        self.model.remove(entry)

    @invariant()
    def counts_match(self) -> None:
        for owner, lock in enumerate(self.locks):
            mine = [entry for entry in self.model if entry.owner == owner]
            expected = {
                "shared": sum(len(e.blocks) for e in mine if not e.exclusive),
                "exclusive": sum(len(e.blocks) for e in mine if e.exclusive),
            }
            assert lock.blocks_claimed() == expected
            assert (lock.held_for() > 0.0) is bool(mine)

    def teardown(self) -> None:
        for entry in self.model:
            release_now(entry.held)
        for lock in self.locks:
            lock.close()
        self.directory.cleanup()


TestBlockLockModel = BlockLockModel.TestCase
TestBlockLockModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
