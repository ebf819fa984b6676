"""Spread one kernel check over several threads, so a large check reads memory as fast as torch does.

Why: one core cannot saturate memory bandwidth; torch's own reductions use all of its intra-op threads
(`torch.get_num_threads()`), and so does this, for checks of at least `MIN_BYTES_PER_THREAD` per thread.
The threads share the work dynamically: each takes the next chunk of blocks from a per-tensor counter
(see `kernel_numba.block_flags`), so a thread that gets its core late (another process, or torch's own
OpenMP threads still spinning after the last torch op) only leaves more chunks to the others instead of
holding up the check. Each thread marks its own flags array (no shared writes, no locks); the caller takes
part in the work, so a check makes progress even while other checks keep the pool busy.

The pool is a few daemon threads on one `queue.SimpleQueue`: handing them a share costs about 25 us where
`ThreadPoolExecutor.submit` cost about 110 us (measured on 2 vCPUs, workers parked), time the caller's own
share waits for. It is rebuilt in a forked child (its threads do not survive a fork).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np

from kvobs.integrity.kernel import KernelPlan

MIN_BYTES_PER_THREAD = 8 << 20

_pool_lock = threading.Lock()
_jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
_started = 0


def mark(plans: list[KernelPlan], ids: np.ndarray) -> np.ndarray:
    """Per id (int64, distinct, in range): 2 if that block holds a NaN in any plan's tensor, else 1 if an
    Inf, else 0."""
    import torch

    counters = np.zeros(len(plans), dtype=np.int64)  # per plan: the next chunk of ids to claim
    per_block = sum(plan.block_bytes for plan in plans)
    helpers = min(torch.get_num_threads(), len(ids) * per_block // MIN_BYTES_PER_THREAD) - 1
    replies: queue.SimpleQueue[tuple[np.ndarray | None, BaseException | None]] = queue.SimpleQueue()
    claims = [threading.Lock() for _ in range(helpers)]
    if claims:
        _start_workers(len(claims))
    for claim in claims:
        _jobs.put((claim, plans, ids, counters, replies))
    flags = _mark_share(plans, ids, counters)
    # A share no pool thread has begun has nothing left to read: take it back rather than wait for a thread.
    for _ in range(sum(not claim.acquire(blocking=False) for claim in claims)):
        share, error = replies.get()
        if error is not None:
            raise error
        np.maximum(flags, share, out=flags)
    return flags


def _mark_share(plans: list[KernelPlan], ids: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One thread's share: the chunks of every plan it claims before the other threads do."""
    flags = np.zeros(ids.shape[0], dtype=np.uint8)
    for i, plan in enumerate(plans):
        plan.mark(ids, flags, counters[i : i + 1])
    return flags


def _work(jobs: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """A pool thread: runs shares forever, each one it claims answered on its check's reply queue (errors
    too)."""
    while True:
        claim, plans, ids, counters, replies = jobs.get()
        if not claim.acquire(blocking=False):
            continue  # taken back by the checking thread: it read every chunk itself
        try:
            replies.put((_mark_share(plans, ids, counters), None))
        except BaseException as exc:  # noqa: BLE001 - raised in the checking thread
            replies.put((None, exc))


def pool_size() -> int:
    """Pool threads at most: one core is left to the engine that runs the checks."""
    return max(1, (os.cpu_count() or 2) - 1)


def _start_workers(wanted: int) -> None:
    """Start pool threads until `wanted` (at most `pool_size()`) exist."""
    global _started
    if _started >= wanted:
        return  # the common case, without the lock or os.cpu_count() (a file read: ~80 us on a cold VM)
    with _pool_lock:
        while _started < min(wanted, pool_size()):
            threading.Thread(target=_work, args=(_jobs,), name=f"kvobs-integrity-{_started}", daemon=True).start()
            _started += 1


def _forget_pool_in_child() -> None:
    global _jobs, _started, _pool_lock
    _jobs, _started, _pool_lock = queue.SimpleQueue(), 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
