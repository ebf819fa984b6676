"""The values the signal buffers hand out and the records they keep, each a small named type.

Named tuples where a value is created on the hot path: building one costs a fraction of a frozen dataclass,
and it is still immutable and read by name.
"""

from __future__ import annotations

from typing import NamedTuple


class ReadySignal(NamedTuple):
    """A layer0 signal whose send may start now. `buffered_s` is 0.0 when it never waited."""

    slot: int
    layer: int
    tokens: int
    buffered_s: float


class Progress(NamedTuple):
    """The furthest signal seen for a live slot, ordered as compared: more tokens first (a later prefill chunk),
    then the higher layer within the same chunk."""

    tokens: int
    layer: int


class Decision(NamedTuple):
    """A decision taken under the buffer lock that is described (span event, log) after the lock is released.

    `tokens` is None when no signal is involved (a refused registration), `need_tokens` when no task is;
    `waited_s` is how long the signal had waited (0.0 when it never did)."""

    outcome: str
    slot: int
    tokens: int | None
    need_tokens: int | None
    waited_s: float


def decision(outcome: str, slot: int, tokens: int | None, need_tokens: int | None, waited_s: float) -> Decision:
    """Decision(...) without the generated __new__'s argument handling."""
    return tuple.__new__(Decision, (outcome, slot, tokens, need_tokens, waited_s))


NO_PROGRESS = Progress(-1, -1)


class Pending:
    """One early signal waiting for its task: `since` in decision time (seconds, or steps when step-aligned),
    `wall` in clock seconds for ages. Repeats raise `tokens` in place."""

    __slots__ = ("tokens", "since", "wall")

    def __init__(self, tokens: int, since: float, wall: float) -> None:
        self.tokens, self.since, self.wall = tokens, since, wall


