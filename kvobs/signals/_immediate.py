"""`EarlySignalBuffer`: early layer0 signals buffered until their transfer task registers, recovered exactly once.

Why: on a prefill node the model runner's "layer 0 is ready" signal for a batch slot can arrive before the
cache messager has registered the transfer task for that slot. Dropping it hangs the request on the decode
node; asserting kills the send thread. This buffer decides at each call, atomically under its own lock:
check-registered-or-buffer, register-and-recover, finish-and-drop, expire and overflow. Metrics, logs, span
events and `on_recovered` run after the lock is released, so a caller may hold its own lock around any call and
`on_recovered` may call back into the buffer.

Tensor-parallel ranks must not use it: two ranks can see a signal and a registration in different orders and
release different batches. They use `StepAlignedSignalBuffer`, which shares this buffer's decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvobs.errors import SignalBufferFull
from kvobs.signals._core import DEFAULT_MAX_SLOTS, SignalBufferCore
from kvobs.signals._inputs import as_int, step_batch
from kvobs.signals._records import Decision, ReadySignal, ready_signal
from kvobs.signals._reporting import FLUSH_AT, READY
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics


class EarlySignalBuffer(SignalBufferCore):
    """Registered slots and the early layer0 signals waiting for them, decided at each call.

    `ttl_s`: a pending signal older than this expires (checked lazily by every call, and by `expire()`).
    `max_pending`: signals waiting at most; one more evicts the oldest. `max_slots`: tasks registered at most;
    one more `register()` raises SignalBufferFull. `on_recovered`: receives recovered signals (a ReadySignal,
    with its slot and wait) instead of the caller of `register()`. `log_level`: drops log at warning,
    recoveries at debug, when this level allows.

    Why each call has a fast path: `signal`, `register` and `finish` run per request per step inside the
    engine's GIL. Each first tries the common outcomes that need no description (ready, progress, buffered,
    recovered, registered, finished), inline and without building anything it does not return; anything
    else (a drop, an expiry due, a bound reached, a recovery to describe or hand over) changes nothing there
    and is decided again from scratch by the shared core, under the lock taken anew. The lock is taken with
    `with`, never acquire() then try: an asynchronous exception (Ctrl-C) raised as acquire() returns would
    leave it held. A recovery notes its wait without checking how many are noted: each one makes a slot live,
    and only `finish()` ends a live slot, so `finish()` flushing past FLUSH_AT bounds them to FLUSH_AT +
    `max_slots`, never more than the live tasks themselves take.
    """

    def __init__(
        self,
        *,
        metrics: EngineMetrics | None = None,
        logger: Any | None = None,
        ttl_s: float = 60.0,
        max_pending: int = 4096,
        max_slots: int = DEFAULT_MAX_SLOTS,
        clock: Callable[[], float] = time.monotonic,
        on_recovered: Callable[[ReadySignal], None] | None = None,
        log_level: str | int = "info",
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        super().__init__(metrics=metrics, logger=logger, ttl=ttl_s, max_pending=max_pending, max_slots=max_slots,
                         clock=clock, log_level=log_level)
        self._on_recovered = on_recovered
        # live tasks below which register() recovers on its fast path: none when a recovery must be described or
        # handed to on_recovered, which the general path does
        self._quiet_room = max_slots if on_recovered is None and not self._describe_recoveries else 0

    def signal(self, slot: int, layer: int, tokens: int) -> bool:
        """Layer `layer` of `slot` holds `tokens` prompt tokens (cumulative). True if its send starts now
        (a layer0 signal for a registered task), with these tokens."""
        if not (type(slot) is int and type(layer) is int and type(tokens) is int
                and slot >= 0 and layer >= 0 and tokens >= 0):
            slot = as_int(slot, "slot")
            layer = as_int(layer, "layer")
            tokens = as_int(tokens, "tokens")
        lock = self._held
        with lock:  # the fast path: the same decisions as SignalBufferCore._signal_locked, see the class docstring
            live = self._live
            if slot in live:  # `in` then `[]`: cheaper than get() where the slot is not live
                task = live[slot]
                if layer:
                    if tokens > task[1] or (tokens == task[1] and layer > task[2]):  # task: [need, tokens, layer]
                        task[1] = tokens
                        task[2] = layer
                    return False
                if tokens <= task[0]:
                    if tokens > task[1]:
                        task[1] = tokens
                        task[2] = 0
                    self._counts[READY] += 1
                    return True
            elif layer:
                return False
            else:
                pending = self._pending
                if slot in pending:  # a repeat: the largest count wins (pending: (tokens, since, wall))
                    entry = pending[slot]
                    if tokens > entry[0]:
                        pending[slot] = (tokens, entry[1], entry[2])
                    return False
                clock = self._clock  # a local: an instance attribute called as self._clock() is not specialized
                now = clock()
                if now <= self._expire_at and len(pending) < self._max_pending:
                    pending[slot] = (tokens, now, now)  # counted by the pending dict itself, see Tally
                    return False
        out: list[Decision] = []
        with lock:
            ready = self._signal_locked(slot, layer, tokens, out)
        if out:
            self._reporter.describe(out)
        return ready

    def signal_batch(self, layer: int, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
                     count: int | None = None) -> list[ReadySignal]:
        """One model-runner step for `layer`: the first `count` slots (all when None; -1 or 0: none). The
        signals whose send starts now, in slot order given.

        Every value is validated before the lock is taken, so a bad batch changes nothing.
        """
        layer, slot_list, token_list = step_batch(layer, slots, tokens, count)
        if not slot_list:
            return []
        out: list[Decision] = []
        ready: list[ReadySignal] = []
        with self._held:
            for slot, slot_tokens in zip(slot_list, token_list):
                if self._signal_locked(slot, layer, slot_tokens, out):
                    ready.append(ready_signal(slot, slot_tokens, 0.0))
        if out:
            self._reporter.describe(out)
        return ready

    def register(self, slot: int, need_tokens: int) -> int | None:
        """Register the transfer task for `slot`; recover its pending signal exactly once.

        The recovered signal's tokens are returned (start the send with them; test `is not None`, a signal may
        carry 0 tokens), or the signal goes to `on_recovered` (then None is returned). An exception from
        `on_recovered` propagates: the registration already stands, and a lost send must not be silent.
        Registering a live slot raises ValueError (replacing it would orphan the first task's send); registering
        beyond `max_slots` raises SignalBufferFull. Neither changes anything.
        """
        if not (type(slot) is int and type(need_tokens) is int and slot >= 0 and need_tokens >= 0):
            slot = as_int(slot, "slot")
            need_tokens = as_int(need_tokens, "need_tokens")
        with self._held:  # the fast path: the same decisions as _registered() below, see the class docstring
            pending = self._pending
            entry = pending.get(slot)  # one lookup where a signal waits (`in` then `[]` is two)
            if entry is not None:  # so not live: a slot leaves `pending` before it enters `live`, never after
                clock = self._clock  # a local: an instance attribute called as self._clock() is not specialized
                now = clock()
                tokens = entry[0]  # pending: (tokens, since, wall)
                live = self._live
                if now <= self._expire_at and tokens <= need_tokens and len(live) < self._quiet_room:
                    del pending[slot]
                    live[slot] = [need_tokens, tokens, 0]
                    self._waits.append(now - entry[2])  # counts the recovery (see Tally); finish() bounds the waits
                    return tokens
            elif slot not in self._live and len(self._live) < self._max_slots:
                self._live[slot] = [need_tokens, -1, -1]
                return None
        return self._registered(slot, need_tokens)

    def _registered(self, slot: int, need_tokens: int) -> int | None:
        """register() for every outcome, described after the lock is released."""
        out: list[Decision] = []
        recovered = None
        duplicate = full = False
        with self._held:
            if slot in self._live:
                duplicate = True
            elif len(self._live) >= self._max_slots:
                full = True
                self._refuse_locked(slot, need_tokens, out)
            else:
                recovered = self._register_locked(slot, need_tokens, out)
        if out:
            self._reporter.describe(out)
        if duplicate:
            raise ValueError(f"slot {slot} is already registered; finish() it before registering it again")
        if full:
            raise SignalBufferFull("max_slots", self._max_slots, "finish() every slot whose task ended")
        if recovered is None:
            return None
        if self._on_recovered is not None:
            self._on_recovered(recovered)
            return None
        return recovered.tokens

    def finish(self, slot: int) -> None:
        """The task of `slot` finished or failed: unregister it and drop any signal still pending for it."""
        if not (type(slot) is int and slot >= 0):
            slot = as_int(slot, "slot")
        lock = self._held
        with lock:  # the fast path: nothing pending for the slot, nothing to describe
            if len(self._waits) >= FLUSH_AT:  # bounds the waits register() notes: see the class docstring
                self._tally.flush_locked()
            if slot not in self._pending:
                self._live.pop(slot, None)
                return
        out: list[Decision] = []
        with lock:
            self._finish_locked(slot, out)
        if out:
            self._reporter.describe(out)

    def _now_locked(self, out: list[Decision]) -> tuple[float, float]:
        now = self._clock()
        if now > self._expire_at:
            self._expire_locked(now, now, out)
        return now, now

    def expire(self) -> int:
        """Drop pending signals older than `ttl_s`; how many."""
        out: list[Decision] = []
        with self._held:
            now = self._clock()
            self._expire_locked(now, now, out)
        if out:
            self._reporter.describe(out)
        return len(out)
