"""Spread one kernel check over several threads, so a large check reads memory as fast as torch does.

Why: one core cannot saturate memory bandwidth; torch's own reductions use all of its intra-op threads
(`torch.get_num_threads()`; without torch, the CPUs this process may use), and so does this, for checks of
at least `MIN_BYTES_PER_THREAD` per thread.
The threads share the work dynamically: each takes the next chunk of blocks from a per-tensor counter
(see `kernel_numba.block_flags`), so a thread that gets its core late (another process, or torch's own
OpenMP threads still spinning after the last torch op) only leaves more chunks to the others instead of
holding up the check. All threads raise the same flags array (atomically, in the kernel); the caller
takes part in the work, so a check makes progress even while other checks keep the pool busy.

A share is claimed with a lock that the pool thread holds while it reads: the caller, done with its own
chunks, takes each lock back (no pool thread began that share: it will skip it) or waits on it (one is
reading its last chunk). Nothing is allocated per check beyond that lock and the flags.

The pool is a few daemon threads on one `queue.SimpleQueue`, not a `ThreadPoolExecutor`: handing a share
over is time the caller's own share waits for, and a bare queue hands it over several times faster (see
docs/benchmarks.md). It is rebuilt in a forked child (its threads do not survive a fork).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np

from kvobs._runtime.forks import in_forked_child
from kvobs.integrity._arrays import installed_torch
from kvobs.integrity._kernel import KernelPlan

MIN_BYTES_PER_THREAD = 8 << 20

_pool_lock = threading.Lock()
_jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
_started = 0


def mark(plans: list[KernelPlan], ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(flags, found): per id (int64, distinct, in range), 2 if that block holds a NaN in any plan's tensor,
    else 1 if an Inf, else 0; `found` is 0 when every flag is 0."""
    counters = np.zeros(len(plans), dtype=np.int64)  # per plan: the next chunk of ids to claim
    flags = np.zeros(ids.shape[0], dtype=np.uint8)  # shared: the kernel raises flags atomically
    shares = ids.shape[0] * sum(plan.block_bytes for plan in plans) // MIN_BYTES_PER_THREAD
    if shares < 2:  # one thread's work: none of the pool's bookkeeping, whose cold cost dwarfs a small read
        return flags, _mark_share(plans, ids, flags, counters)
    helpers = min(_reading_threads(), shares) - 1
    outcomes: list[int | BaseException] = []
    claims = [threading.Lock() for _ in range(helpers)]
    if claims:
        _start_workers(len(claims))
    for claim in claims:
        _jobs.put((claim, plans, ids, flags, counters, outcomes))
    found = _mark_share(plans, ids, flags, counters)
    for claim in claims:
        # Taken at once: no pool thread began this share (it will skip it), or one finished it. Else one is
        # reading its last chunk: wait for it.
        if not claim.acquire(blocking=False):
            claim.acquire()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        found += outcome
    return flags, found


def _reading_threads() -> int:
    """Threads a large check may use: as many as torch's own reductions (its intra-op threads), or, where
    torch is not installed, the CPUs this process may run on."""
    torch = installed_torch()
    return torch.get_num_threads() if torch is not None else len(os.sched_getaffinity(0))


def _mark_share(plans: list[KernelPlan], ids: np.ndarray, flags: np.ndarray, counters: np.ndarray) -> int:
    """One thread's share: the chunks of every plan it claims before the other threads do."""
    found = 0
    for i, plan in enumerate(plans):
        found += plan.mark(ids, flags, counters[i : i + 1])
    return found


def _work(jobs: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """A pool thread: runs shares forever; each one it claims is held until done, its outcome (or error)
    left for the checking thread."""
    while True:
        claim, plans, ids, flags, counters, outcomes = jobs.get()
        if not claim.acquire(blocking=False):
            continue  # taken back by the checking thread: it read every chunk itself
        try:
            outcomes.append(_mark_share(plans, ids, flags, counters))
        except BaseException as exc:  # noqa: BLE001 - raised in the checking thread
            outcomes.append(exc)
        finally:
            claim.release()


def pool_size() -> int:
    """Pool threads at most: one core is left to the engine that runs the checks."""
    return max(1, (os.cpu_count() or 2) - 1)


def _start_workers(wanted: int) -> None:
    """Start pool threads until `wanted` (at most `pool_size()`) exist."""
    global _started
    if _started >= wanted:
        return  # the common case: neither the lock nor os.cpu_count(), which reads a file
    with _pool_lock:
        while _started < min(wanted, pool_size()):
            threading.Thread(target=_work, args=(_jobs,), name=f"kvobs-integrity-{_started}", daemon=True).start()
            _started += 1


def _forget_pool_in_child() -> None:
    global _jobs, _started, _pool_lock
    _jobs = queue.SimpleQueue()
    _started = 0
    _pool_lock = threading.Lock()


in_forked_child(_forget_pool_in_child)
