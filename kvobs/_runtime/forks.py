"""What a forked child must renew: locks that other threads held at the fork, and open file descriptions
it would otherwise share with its parent.

Only the forking thread lives on in the child, so a lock another thread held at the fork stays held there
forever; and locks that belong to an open file description (``flock``, OFD byte-range locks) are shared with
the parent through every inherited descriptor. Each kind of object registers its renewal once, and every
instance still alive is renewed in the child before it runs anything else. This module is kvobs's one door to
`os.register_at_fork`: a module-level state (a pool, a seed, a singleton) registers its renewal with
`in_forked_child`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TypeVar

__all__ = ["in_forked_child", "renewed_after_fork"]

T = TypeVar("T")


def in_forked_child(renew: Callable[[], object]) -> None:
    """Call `renew` in every child this process forks from now on, before the child runs anything else
    (renewals run in the order they were registered)."""
    os.register_at_fork(after_in_child=renew)


def renewed_after_fork(renew: Callable[[T], object]) -> weakref.WeakSet[T]:
    """A set (held weakly) of objects on each of which a forked child calls `renew`; add every instance."""
    live: weakref.WeakSet[T] = weakref.WeakSet()

    def renew_all() -> None:
        for item in list(live):
            renew(item)

    in_forked_child(renew_all)
    return live
