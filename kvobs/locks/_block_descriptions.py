"""The open file descriptions a BlockLock claims through: one per claim, pooled, never leaked.

OFD locks belong to an open file description, so two claims of one process exclude each other in the kernel
exactly as two processes do only if each claim has a description of its own. Opening one per claim costs a
system call, so idle descriptions are pooled. Each is re-opened through ``/proc/self/fd/N`` of the checked
lock file, which hands back exactly that file, never another one planted at its path since.

The pool keeps at most `MAX_IDLE` idle descriptions: a burst of open claims (each holds one until it ends)
would otherwise keep its descriptors for the life of the process. Surplus is closed on the next claim.

Interrupt safety (see `kvobs._runtime.atomic`): taking an idle description pushes "return it to the pool" onto the
claim's undo deque in the same C call that pops it, growing the pool opens a description and pools it in one
C call, and shrinking it un-pools and closes one in one C call too, so however an asynchronous exception
interrupts any of them, nothing is lost or leaked.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
from collections import deque
from itertools import repeat, tee

from kvobs._runtime.atomic import CALL, Held
from kvobs.errors import OutOfDescriptors
from kvobs.locks._lockfile import PROC_FD

__all__ = ["MAX_IDLE", "DescriptionPool"]

MAX_IDLE = 16

_REOPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC


class DescriptionPool:
    """The descriptions of the lock file open at `base` (which this pool closes with the rest); `label`
    names their lock in errors."""

    def __init__(self, base: int, label: str) -> None:
        self.label = label
        self.base = base  # the checked lock file; new descriptions are re-opened from it
        self.opened: dict[int, int] = {}  # fd -> fd: every description this process opened for claims
        self.inherited: list[int] = []  # a forked child's copies of its parent's claim descriptors
        self._reopen_path = f"{PROC_FD}/{base}"
        self._fresh()

    def _fresh(self) -> None:
        """New containers: undo steps copied from elsewhere (a parent process) keep pointing at the old ones."""
        self.idle: deque[int] = deque()  # most recently used on the right
        self._pop = (self.idle.pop,)
        self._pop_oldest = self.idle.popleft
        self._returner = functools.partial(functools.partial, self.idle.append)

    def take(self, held: Held) -> int:
        """Pop an idle description and push its return to the pool, in one C call; open one if none is idle."""
        if len(self.idle) > MAX_IDLE:
            self.shrink()
        while True:
            try:
                held.extendleft(map(self._returner, map(CALL, self._pop)))
            except IndexError:
                self.grow()
                continue
            return held[0].args[0]  # type: ignore[no-any-return]

    def grow(self) -> None:
        """Open a new description and pool it in one C call: interrupted before, nothing was opened."""
        if self.base < 0:
            raise ValueError(f"{self.label} is closed")
        opened = tee(map(os.open, (self._reopen_path,), (_REOPEN_FLAGS,)))
        try:
            self.idle.extend(map(self.opened.setdefault, *opened))  # setdefault(fd, fd) returns fd
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            in_use = len(self.opened) - len(self.idle)
            raise OutOfDescriptors(self.label, in_use, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) from exc

    def shrink(self) -> None:
        """Close the least recently used idle descriptions beyond `MAX_IDLE`, each un-pooled and closed in
        one C call."""
        surplus = len(self.idle) - MAX_IDLE
        if surplus > 0:
            deque(map(os.close, map(self.opened.pop, map(CALL, repeat(self._pop_oldest, surplus)))), 0)

    def close(self) -> None:
        """Close every descriptor (which drops every range still locked through them). Idempotent."""
        self.idle.clear()
        for fd in (*self.opened, *self.inherited, self.base):
            if fd >= 0:
                os.close(fd)
        self.opened.clear()
        self.inherited.clear()
        self.base = -1

    def forget_parent(self) -> None:
        """In a forked child: the pooled descriptions are the parent's, and so are the ranges on them.

        The child must neither use them (its claims would merge with the parent's) nor unlock them (an
        undo step copied from the parent would free the parent's claim). Each inherited descriptor number is
        pointed at /dev/null, where such an undo unlocks nothing, and the child starts an empty pool.
        """
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            for fd in self.opened:
                os.dup2(devnull, fd, inheritable=False)
        finally:
            os.close(devnull)
        self.inherited.extend(self.opened)
        self.opened = {}
        self._fresh()
