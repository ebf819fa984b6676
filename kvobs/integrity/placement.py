"""Keep a check's pool threads off the CPU of the thread that hands them their share.

Why: Linux often wakes a thread on the CPU of the thread that woke it (wake-affine), expecting the waker to
sleep soon. A check's caller does not sleep: it goes straight on to read its own share, so the woken pool
thread shares the caller's CPU until the load balancer moves one of them, and two threads read no faster than
one. Measured on 2 vCPUs: the pool thread started on the caller's CPU in most checks, and two threads read
256 random blocks at 1.00-1.01x one thread (`benchmarks/integrity_threads.py`); kept off the caller's CPU,
1.21-1.46x, and `benchmarks/integrity.py` reads them at 18.2-19.6 GB/s against 14.1-15.3 (three paired runs).

A pool thread therefore narrows its own CPU mask, when it takes a share, to the CPUs it was allowed when it
started minus the caller's current one: one `sched_setaffinity` call, made only when that mask changes (a
caller that stays on its CPU costs nothing after its first check). Only kvobs's own pool threads are touched,
never the engine's, and never beyond the CPUs they were given. Where the platform lacks `sched_getcpu` or
`sched_setaffinity`, or the kernel refuses the mask, nothing is done and the check runs as before.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable


def _cpu_reader() -> Callable[[], int] | None:
    """libc's sched_getcpu (about 0.2 us through ctypes), or None where there is none."""
    try:
        reader = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (AttributeError, OSError):
        return None
    reader.restype, reader.argtypes = ctypes.c_int, []
    return reader


_read_cpu = _cpu_reader()


def current_cpu() -> int:
    """The CPU the calling thread runs on now; -1 where that cannot be known."""
    return -1 if _read_cpu is None else _read_cpu()


class CpuAvoider:
    """One pool thread's mask: the CPUs it may use, less the one its current caller runs on."""

    def __init__(self) -> None:
        try:
            self.allowed: frozenset[int] = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux, or not permitted: leave placement to the OS
            self.allowed = frozenset()
        self.mask = self.allowed

    def avoid(self, cpu: int) -> None:
        """Run off `cpu` from now on (the caller's CPU, -1 if unknown), as far as the allowed CPUs permit."""
        wanted = self.allowed - {cpu} if cpu in self.allowed and len(self.allowed) > 1 else self.allowed
        if wanted == self.mask:
            return
        try:
            os.sched_setaffinity(0, wanted)
        except (OSError, ValueError):  # a cpuset changed under the process, or a CPU number out of range: stop
            # steering; the check itself is unaffected
            self.allowed = self.mask = frozenset()
            return
        self.mask = wanted
