"""Spread one kernel check over several threads, so a large check reads memory as fast as torch does.

Why: one core cannot saturate memory bandwidth; torch's own reductions use all of its intra-op threads
(`torch.get_num_threads()`), and so does this, for checks of at least `MIN_BYTES_PER_THREAD` per thread.
Each thread marks its own flags array (no shared writes, no locks); the caller takes part in the work, so
a check makes progress even while other checks keep the pool busy. The pool is rebuilt in a forked child
(its threads do not survive a fork).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvobs.integrity.kernel import KernelPlan

MIN_BYTES_PER_THREAD = 8 << 20

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def mark(plans: list[KernelPlan], ids: np.ndarray) -> np.ndarray:
    """Per id (int64, distinct, in range): 2 if that block holds a NaN in any plan's tensor, else 1 if an
    Inf, else 0."""
    import torch

    per_block = sum(plan.block_bytes for plan in plans)
    threads = min(torch.get_num_threads(), len(ids) * per_block // MIN_BYTES_PER_THREAD)
    if threads <= 1:
        return _mark_group([(plan, 0, len(ids)) for plan in plans], ids)
    groups = _split(plans, len(ids), threads)
    futures = [_executor().submit(_mark_group, group, ids) for group in groups[1:]]
    flags = _mark_group(groups[0], ids)
    for future in futures:
        np.maximum(flags, future.result(), out=flags)
    return flags


def _mark_group(group: list[tuple[KernelPlan, int, int]], ids: np.ndarray) -> np.ndarray:
    flags = np.zeros(ids.shape[0], dtype=np.uint8)
    for plan, lo, hi in group:
        plan.mark(ids[lo:hi], flags[lo:hi])
    return flags


def _split(plans: list[KernelPlan], count: int, threads: int) -> list[list[tuple[KernelPlan, int, int]]]:
    """(plan, first id index, end id index) ranges cut into `threads` groups of about equal bytes."""
    share = sum(plan.block_bytes for plan in plans) * count / threads
    groups: list[list[tuple[KernelPlan, int, int]]] = [[] for _ in range(threads)]
    done = 0.0
    for plan in plans:
        lo = 0
        while lo < count:
            group = min(int(done // share), threads - 1)
            room = -int(-((group + 1) * share - done) // plan.block_bytes)  # blocks left in this group
            hi = min(count, lo + max(1, room))
            groups[group].append((plan, lo, hi))
            done += (hi - lo) * plan.block_bytes
            lo = hi
    return groups


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvobs-integrity")
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)

