"""The values the signal buffers hand out and the records they keep, each as cheap as its use allows.

Named tuples where a value leaves the buffer (batches, `on_recovered`, descriptions): immutable and read by
name. Plain tuples and lists for the records kept inside, created on the hot path: a named tuple or a slotted
object costs about as much to build as the whole decision that creates it.
"""

from __future__ import annotations

from typing import NamedTuple


class ReadySignal(NamedTuple):
    """A layer0 signal whose send may start now. `buffered_s` is 0.0 when it never waited."""

    slot: int
    layer: int
    tokens: int
    buffered_s: float


def ready_signal(slot: int, tokens: int, buffered_s: float) -> ReadySignal:
    """ReadySignal(slot, 0, tokens, buffered_s) without the generated __new__'s argument handling."""
    return tuple.__new__(ReadySignal, (slot, 0, tokens, buffered_s))


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

# A registered slot's task: the list [need_tokens, tokens, layer], the last two the furthest (tokens, layer)
# signalled for it, (-1, -1) before any. A list: progress updates it in place on every signal.
NEED = 0
TOKENS = 1
LAYER = 2
# A pending early signal: the tuple (tokens, since, wall), `since` in decision time (seconds, or steps when
# step-aligned), `wall` in clock seconds for ages. A repeat replaces it, keeping `since` and `wall`.
KEPT_TOKENS = 0
SINCE = 1
WALL = 2
