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
from kvobs.signals.core import DEFAULT_MAX_SLOTS, SignalBufferCore
from kvobs.signals.inputs import as_int, step_batch
from kvobs.signals.records import Decision, ReadySignal
from kvobs.telemetry.engine_metrics import EngineMetrics


class EarlySignalBuffer(SignalBufferCore):
    """Registered slots and the early layer0 signals waiting for them, decided at each call.

    `ttl_s`: a pending signal older than this expires (checked lazily by every call, and by `expire()`).
    `max_pending`: signals waiting at most; one more evicts the oldest. `max_slots`: tasks registered at most;
    one more `register()` raises SignalBufferFull. `on_recovered`: receives recovered signals instead of the
    caller of `register()`. `log_level`: drops log at warning, recoveries at debug, when this level allows.
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

    def signal(self, slot: int, layer: int, tokens: int) -> ReadySignal | None:
        """Layer `layer` of `slot` holds `tokens` prompt tokens (cumulative). A ReadySignal if its send starts now."""
        if not (type(slot) is int and type(layer) is int and type(tokens) is int and slot | layer | tokens >= 0):
            slot, layer, tokens = as_int(slot, "slot"), as_int(layer, "layer"), as_int(tokens, "tokens")
        out: list[Decision] = []
        with self._lock:
            ready = self._signal_locked(slot, layer, tokens, out)
        if out:
            self._reporter.describe(out)
        return ready

    def signal_batch(self, layer: int, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
                     count: int | None = None) -> list[ReadySignal]:
        """One model-runner step for `layer`: the first `count` slots (all when None); count -1 or 0 is empty.

        Every value is validated before the lock is taken, so a bad batch changes nothing.
        """
        layer, slot_list, token_list = step_batch(layer, slots, tokens, count)
        if not slot_list:
            return []
        out: list[Decision] = []
        ready: list[ReadySignal] = []
        with self._lock:
            for slot, slot_tokens in zip(slot_list, token_list):
                sig = self._signal_locked(slot, layer, slot_tokens, out)
                if sig is not None:
                    ready.append(sig)
        if out:
            self._reporter.describe(out)
        return ready

    def register(self, slot: int, need_tokens: int) -> ReadySignal | None:
        """Register the transfer task for `slot`; recover its pending signal exactly once.

        The recovered signal is returned, or handed to `on_recovered` (then None is returned). An exception
        from `on_recovered` propagates: the registration already stands, and a lost send must not be silent.
        Registering a live slot raises ValueError (replacing it would orphan the first task's send); registering
        beyond `max_slots` raises SignalBufferFull. Neither changes anything.
        """
        if not (type(slot) is int and type(need_tokens) is int and slot | need_tokens >= 0):
            slot, need_tokens = as_int(slot, "slot"), as_int(need_tokens, "need_tokens")
        out: list[Decision] = []
        recovered = None
        duplicate = full = False
        with self._lock:
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
        if recovered is not None and self._on_recovered is not None:
            self._on_recovered(recovered)
            return None
        return recovered

    def finish(self, slot: int) -> None:
        """The task of `slot` finished or failed: unregister it and drop any signal still pending for it."""
        if not (type(slot) is int and slot >= 0):
            slot = as_int(slot, "slot")
        out: list[Decision] = []
        with self._lock:
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
        with self._lock:
            now = self._clock()
            self._expire_locked(now, now, out)
        if out:
            self._reporter.describe(out)
        return len(out)
