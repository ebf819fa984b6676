"""A cache lock whose unit is the block: transfers and the forward pass exclude each other only where
their blocks overlap.

One global lock serialises every forward pass behind storage I/O, yet the conflicts are per block: a
prefetch writes a few newly allocated blocks, a write-back reads a finished request's blocks, the forward
pass touches its batch's blocks. `BlockLock` locks one byte per block of a lock file with Linux OFD
byte-range locks (see `kvobs.locks._ofd`), runs of consecutive ids coalesced into one range:

- cross-process and crash-safe: the kernel drops a dead holder's ranges, even after SIGKILL;
- thread-safe: every claim takes its own open file description of the lock file (from a per-process pool,
  since opening one per claim costs), so two claims of one process exclude each other in the kernel exactly
  as two processes do, and any thread may release a claim (OFD locks belong to no thread);
- shared and exclusive: readers (write-back, send) take ``F_RDLCK`` ranges, writers ``F_WRLCK``;
- deadlock-free: a claim takes its runs in ascending block order, holding the earlier ones while it waits,
  and a claim that holds anything waits only for blocks;
- writers do not starve: a writer that has to wait takes the run's "turnstile" bytes (block b's turnstile
  is byte ``num_blocks + b``) as soon as they are free and holds them until it gets the blocks; every
  reader first checks the turnstile bytes of its runs and waits (holding nothing) while a writer is queued
  there, so the readers already inside drain and no new ones pass the writer. A writer never waits for a
  turnstile: the writer queued there may be waiting for a block this one holds;
- timed and all-or-nothing: waiting polls with short exponential back-off up to the deadline; a timeout
  releases whatever the claim took.

Every acquisition step records its undo in the same C-level call that performs it (see `kvobs._runtime.atomic`):
taking a pooled description pushes "return it to the pool" (see `kvobs.locks._block_descriptions`), then "unlock
everything on it" is pushed before any range is locked, so however an asynchronous exception interrupts a
claim, running the undo steps frees exactly what it holds.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import time
import weakref
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import Any, NamedTuple

from kvobs._runtime.atomic import CALL, Held, push_unless_raises
from kvobs._runtime.forks import renewed_after_fork
from kvobs.locks import _ofd as ofd
from kvobs.locks._block_claim import BlockClaim
from kvobs.locks._block_descriptions import DescriptionPool
from kvobs.locks._block_holders import HolderTable
from kvobs.locks._block_plan import BlockPlanner, Plan
from kvobs.locks._cache_lock import UNKNOWN_HOLDER, Claim, OnConflict
from kvobs.locks._lockfile import PROC_FD, lock_directory, lock_path, open_lock_file
from kvobs.locks._polling import poll
from kvobs.semconv import CLAIM_EXCLUSIVE, CLAIM_SHARED

__all__ = ["DEFAULT_MAX_RANGES", "BlockClaim", "BlockLock"]

_FIRST_PAUSE_S = 50e-6
_MAX_PAUSE_S = 1e-3
DEFAULT_MAX_RANGES = 64  # a forward step's 256 blocks in 64 runs stay exact (benchmarks/block_lock.py)
_MAX_BLOCKS = 1 << 40  # data and turnstile bytes stay far below the init byte (1 << 62)
_SUFFIX = ".blocks"
_POPLEFT = deque.popleft


class _Record(NamedTuple):
    since: float
    blocks: int
    exclusive: bool


class BlockLock:
    """A cross-process cache lock over `num_blocks` blocks, claimed per block, shared or exclusive.

    Every process of the engine opens it by the same `name` and `num_blocks` (the first one creates the
    lock file; `attach` only opens an existing one; pickling attaches). Linux only (OFD locks, kernel 3.15+).

    Each run of consecutive ids costs one kernel call. `coalesce_gap=g` locks runs separated by at most `g`
    unclaimed blocks as one range: fewer calls for a fragmented batch, at the price of also claiming those
    gap blocks (a transfer touching only them waits for the claim). 0, the default, claims exactly the
    blocks asked for.

    `max_ranges` bounds the ranges of one claim. Every kernel call scans all the locks already on the file,
    so a claim of n scattered runs would cost O(n^2) (thousands of runs take seconds, past any timeout); a
    claim of more runs than `max_ranges` bridges its narrowest gaps until it fits, so its cost stays linear
    in its runs. The trade-off is the same as `coalesce_gap`'s: the bridged gap blocks are locked too, so a
    transfer touching only them waits for the claim. Raise it to claim very fragmented batches more exactly,
    at a kernel cost that grows with its square.
    """

    def __init__(
        self,
        name: str,
        num_blocks: int,
        *,
        directory: str | os.PathLike[str] | None = None,
        create: bool = True,
        coalesce_gap: int = 0,
        max_ranges: int = DEFAULT_MAX_RANGES,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= _MAX_BLOCKS:
            raise ValueError(f"num_blocks must be an int from 1 to {_MAX_BLOCKS}, got {num_blocks!r}")
        if isinstance(coalesce_gap, bool) or not isinstance(coalesce_gap, int) or coalesce_gap < 0:
            raise ValueError(f"coalesce_gap must be an int >= 0, got {coalesce_gap!r}")
        if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or max_ranges < 1:
            raise ValueError(f"max_ranges must be an int >= 1, got {max_ranges!r}")
        self.coalesce_gap = coalesce_gap
        self.max_ranges = max_ranges
        self.directory = lock_directory(directory)
        self.path = lock_path(name, self.directory, _SUFFIX)
        self.name = name
        self.num_blocks = num_blocks
        fd = open_lock_file(self.path, create=create)
        try:
            ofd.check_supported(fd)
            if not os.path.isdir(PROC_FD):
                raise ofd.OFDUnsupported(errno.ENOTSUP, f"BlockLock re-opens its lock file through {PROC_FD}")
            self._holders = HolderTable(fd, num_blocks, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._planner = BlockPlanner(name, num_blocks, coalesce_gap, max_ranges)
        self._descriptions = DescriptionPool(fd, repr(self))
        self._finalizer = weakref.finalize(self, _close_all, self._descriptions, self._holders)
        self._active: dict[int, _Record] = {}  # descriptor -> the granted claim it holds
        _LOCKS.add(self)

    @classmethod
    def attach(
        cls, name: str, num_blocks: int, *, directory: str | os.PathLike[str] | None = None
    ) -> BlockLock:
        """Open a block lock whose file its owner already created; a missing file is a FileNotFoundError."""
        return cls(name, num_blocks, directory=directory, create=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned worker attaches by name to the same file; it never creates one.
        attach = functools.partial(BlockLock, directory=self.directory, create=False, coalesce_gap=self.coalesce_gap,
                                   max_ranges=self.max_ranges)
        return attach, (self.name, self.num_blocks)

    # --- the cache-lock protocol ----------------------------------------------------------------------

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool:
        plan = self._planner.plan(claim)
        deadline = None if timeout is None else time.monotonic() + timeout
        before = len(held)
        fd = self._descriptions.take(held)
        # Before any range: from here one call frees everything the claim holds.
        held.appendleft(functools.partial(fcntl.fcntl, fd, ofd.F_OFD_SETLK, ofd.UNLOCK_ALL))
        if not self._lock(fd, plan, claim, deadline, on_conflict):
            _undo_newest(held, len(held) - before)
            return False
        self._holders.stamp(plan.starts, self._holders.code(claim.holder))
        record = _Record(time.monotonic(), plan.blocks, claim.exclusive)
        push_unless_raises(held, functools.partial(self._active.pop, fd, None), self._active.__setitem__, fd, record)
        return True

    def overlaps(self, a: Claim, b: Claim) -> bool:
        """Whether a context holding `a` must not wait for `b`: the blocks they lock meet (no blocks: all;
        with `coalesce_gap`, the gap blocks they lock count too), whatever their modes: even two shared
        claims, since the second would queue behind a waiting writer that waits for the first."""
        if not a.blocks or not b.blocks:
            return True
        return not self._planner.locked_blocks(a).isdisjoint(self._planner.locked_blocks(b))

    def held_for(self) -> float:
        """Seconds the oldest claim this process holds now has been held; 0.0 when it holds none."""
        records = list(self._active.values())
        return time.monotonic() - min(record.since for record in records) if records else 0.0

    def blocks_claimed(self) -> dict[str, int]:
        """Blocks this process holds now, per claim mode (``shared``, ``exclusive``); cheap at scrape time.

        A block held by two shared claims counts twice: these are claimed blocks, not distinct ones.
        """
        counts = {CLAIM_SHARED: 0, CLAIM_EXCLUSIVE: 0}
        for record in list(self._active.values()):
            counts[CLAIM_EXCLUSIVE if record.exclusive else CLAIM_SHARED] += record.blocks
        return counts

    # --- direct use, outside kvobs's guards -------------------------------------------------------------

    def claim(
        self,
        blocks: Sequence[int] = (),
        *,
        exclusive: bool = True,
        timeout: float | None = None,
        holder: str = "direct",
    ) -> BlockClaim:
        """A context manager holding `blocks` (sorted distinct ids; empty: the whole cache); LockTimeout
        when they cannot be had within `timeout` seconds."""
        return BlockClaim(self, Claim(holder, tuple(blocks), exclusive), timeout)

    def queue_writer(self, queued: Held, claim: Claim) -> None:
        """Queue a writer that waits holding no block (an async waiter between its zero-timeout tries): hold
        the turnstile of every run of `claim` that is free, on a description of its own whose undo steps
        `queued` keeps across calls, so readers arriving from now on wait behind it and those inside drain.
        Without it such a writer finds the blocks free only if the readers happen to leave a gap. Readers
        (shared claims) never queue: a no-op for them.

        Safe to hold for as long as the writer waits: only a reader that holds nothing waits for a turnstile.
        """
        if not claim.exclusive:
            return
        plan = self._planner.plan(claim)
        if not queued:
            taken = self._descriptions.take(queued)
            queued.appendleft(functools.partial(fcntl.fcntl, taken, ofd.F_OFD_SETLK, ofd.UNLOCK_ALL))
        fd: int = queued[0].args[0]  # type: ignore[attr-defined]  # the newest step: unlock everything on fd
        setlk = functools.partial(fcntl.fcntl, fd, ofd.F_OFD_SETLK)
        code = self._holders.code(claim.holder)
        for start, length in zip(plan.starts, plan.lengths):
            gate = self.num_blocks + start
            if ofd.granted(setlk, ofd.pack(fcntl.F_WRLCK, gate, length)):
                self._holders.stamp([gate], code)

    # --- inside a claim ------------------------------------------------------------------------------

    def _lock(
        self, fd: int, plan: Plan, claim: Claim, deadline: float | None, on_conflict: OnConflict | None
    ) -> bool:
        """Lock every run of `plan` on the description `fd`; False when the deadline passed first."""
        if not claim.exclusive:
            gate = self._queued_writer(fd, plan)
            if gate is not None:
                if on_conflict is not None:
                    on_conflict(gate)
                    on_conflict = None
                if not _poll(functools.partial(self._no_queued_writer, fd, plan), deadline):
                    return False
        setlk = functools.partial(fcntl.fcntl, fd, ofd.F_OFD_SETLK)
        try:
            deque(map(setlk, plan.requests), 0)  # uncontended: every run in one C-level pass
            return True
        except OSError as exc:
            if not ofd.is_contention(exc):
                raise
        return self._wait_for_runs(fd, setlk, plan, claim, deadline, on_conflict)

    def _wait_for_runs(
        self,
        fd: int,
        setlk: functools.partial[Any],
        plan: Plan,
        claim: Claim,
        deadline: float | None,
        on_conflict: OnConflict | None,
    ) -> bool:
        """Take the runs in ascending order, waiting where one is held (runs already held re-lock at once).

        Only blocks are waited for, always in ascending order, so no two claims can wait for each other. A
        writer holds the turnstile of the run it waits for whenever it is free, but never waits for it: a
        writer queued there may itself wait for a block this one holds.
        """
        exclusive = claim.exclusive
        for request, start, length in zip(plan.requests, plan.starts, plan.lengths):
            if ofd.granted(setlk, request):
                continue
            if on_conflict is not None:
                kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
                on_conflict(self._holder_of(fd, kind, start, length))
                on_conflict = None
            attempt = functools.partial(ofd.granted, setlk, request)
            if exclusive:
                gate = (self.num_blocks + start, length)
                code = self._holders.code(claim.holder)
                attempt = functools.partial(self._queue_then_try, setlk, gate, code, attempt)
            if not _poll(attempt, deadline):
                return False
            if exclusive:  # through: the turnstile is for the next writer (UNLOCK_ALL would free it at the end)
                setlk(ofd.pack(fcntl.F_UNLCK, *gate))
        return True

    def _queue_then_try(self, setlk: functools.partial[Any], gate: tuple[int, int], code: int,
                        attempt: functools.partial[bool]) -> bool:
        """Hold the run's turnstile if it is free (readers arriving from now on wait behind this writer), then
        try the run itself."""
        if ofd.granted(setlk, ofd.pack(fcntl.F_WRLCK, *gate)):
            self._holders.stamp([gate[0]], code)
        return attempt()

    def _queued_writer(self, fd: int, plan: Plan) -> str | None:
        """The holder of a writer queued at the turnstile of one of the plan's runs, or None if there is none.

        One probe over the whole span first (the common case: no writer queued anywhere near); only when it
        finds one are the runs probed one by one, so a writer queued on a block between them holds no one back.
        """
        turnstile = self.num_blocks
        span_start = plan.starts[0]
        span = plan.starts[-1] + plan.lengths[-1] - span_start
        found = ofd.conflict(fd, fcntl.F_RDLCK, turnstile + span_start, span)
        if found is not None and len(plan.starts) > 1:
            for start, length in zip(plan.starts, plan.lengths):
                found = ofd.conflict(fd, fcntl.F_RDLCK, turnstile + start, length)
                if found is not None:
                    break
        return None if found is None else self._holders.holder_at(found.start)

    def _no_queued_writer(self, fd: int, plan: Plan) -> bool:
        return self._queued_writer(fd, plan) is None

    def _holder_of(self, fd: int, kind: int, start: int, length: int) -> str:
        """Who holds (some of) [start, start + length): the stamp where the kernel's conflict starts."""
        found = ofd.conflict(fd, kind, start, length)
        return UNKNOWN_HOLDER if found is None else self._holders.holder_at(found.start)

    # --- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every descriptor (which drops any range still claimed through this lock). Idempotent."""
        _LOCKS.discard(self)
        self._finalizer()

    def _forget_parent_claims(self) -> None:
        """In a forked child: the claims are the parent's (see DescriptionPool.forget_parent)."""
        self._descriptions.forget_parent()
        self._active = {}

    def __repr__(self) -> str:
        return f"BlockLock({self.name!r}, {self.num_blocks}, path={self.path!r})"


def _poll(attempt: functools.partial[bool], deadline: float | None) -> bool:
    return poll(attempt, deadline, _FIRST_PAUSE_S, _MAX_PAUSE_S)


def _undo_newest(held: Held, count: int) -> None:
    """Run and drop the `count` newest undo steps, in one C call: the rest of `held` is left as it was."""
    deque(map(CALL, map(_POPLEFT, repeat(held, count))), 0)


def _close_all(descriptions: DescriptionPool, holders: HolderTable) -> None:
    holders.close()
    descriptions.close()


# Every open BlockLock, so a forked child can drop the parent's claims.
_LOCKS: weakref.WeakSet[BlockLock] = renewed_after_fork(BlockLock._forget_parent_claims)
