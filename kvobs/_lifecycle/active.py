"""The transfers holding a lock for the code running in this context: decorated calls and with-blocks.

A guarded call made from inside another on the same lock (and overlapping blocks) would wait for itself
until its timeout; the lifecycle looks here to refuse it at once. A context variable, so threads and asyncio
tasks each have their own. Entries that have ended are ignored and pruned, so one left behind by an
interrupted exit, or by a with-block exited in another context, does no harm.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol


class Holding(Protocol):
    def holds(self) -> bool: ...


ACTIVE: ContextVar[tuple[Any, ...]] = ContextVar("kvobs_active_transfers", default=())


def with_added(t: Holding, active: tuple[Any, ...]) -> tuple[Any, ...]:
    """`active` with `t` added, ended transfers pruned."""
    return tuple(a for a in active if a.holds()) + (t,) if active else (t,)


def enter(t: Holding) -> None:
    """Mark `t` active in the current context."""
    ACTIVE.set(with_added(t, ACTIVE.get()))


def forget(t: Holding) -> None:
    """Remove `t` from the current context's active transfers, whichever context that is."""
    active = ACTIVE.get()
    if t in active:
        ACTIVE.set(tuple(a for a in active if a is not t))
