"""`EarlySignalBuffer`: early layer0 signals buffered until their transfer task registers, recovered exactly once.

Why: on a prefill node the model runner's "layer 0 is ready" signal for a batch slot can arrive before the
cache messager has registered the transfer task for that slot. Dropping it hangs the request on the decode
node; asserting kills the send thread. This buffer decides at each call, atomically under its own lock:
check-registered-or-buffer, register-and-recover, finish-and-drop, expire and overflow. Metrics, logs, span
events and `on_recovered` run after the lock is released, so a caller may hold its own lock around any call and
`on_recovered` may call back into the buffer.

Tensor-parallel ranks must not use it: two ranks can see a signal and a registration in different orders and
release different batches. They use `StepAlignedSignalBuffer`, which takes the same decisions once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvobs.signals._core import DEFAULT_MAX_SLOTS, SignalBufferCore
from kvobs.signals._inputs import step_batch
from kvobs.signals._records import Decision, ReadySignal, ready_signal
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics


class EarlySignalBuffer(SignalBufferCore):
    """Registered slots and the early layer0 signals waiting for them, decided at each call.

    `ttl_s`: a pending signal older than this expires (checked lazily by every call, and by `expire()`).
    `max_pending`: signals waiting at most; one more evicts the oldest. `max_slots`: tasks registered at most;
    one more `register()` raises SignalBufferFull. `on_recovered`: receives recovered signals (a ReadySignal,
    with its slot and wait) instead of the caller of `register()`. `log_level`: drops log at warning,
    recoveries at debug, when this level allows.

    `signal()`, `register()` and `finish()` are the shared core's (kvobs.signals._core), and `signal_batch()`
    makes the core's signal decision for each slot under one lock: each takes the lock with `with`, never
    acquire() then try (an asynchronous exception such as Ctrl-C raised as acquire() returns would leave it held).
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
                         clock=clock, decision_clock=clock, on_recovered=on_recovered, log_level=log_level)

    def signal_batch(self, layer: int, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
                     count: int | None = None) -> list[ReadySignal]:
        """One model-runner step for `layer`: the first `count` slots (all when None; -1 or 0: none). The
        signals whose send starts now, in slot order given.

        Every value is validated before any is decided, so a bad batch changes nothing; then each is decided
        as `signal()` decides it, all under one lock.
        """
        layer, slot_list, token_list = step_batch(layer, slots, tokens, count)
        if not slot_list:
            return []
        out: list[Decision] = []
        ready: list[ReadySignal] = []
        decide = self._signal_locked
        with self._held:
            for slot, slot_tokens in zip(slot_list, token_list):
                decided = decide(slot, layer, slot_tokens)
                if decided:  # the common outcome, progress or a signal kept, is False: one test
                    if decided is True:
                        ready.append(ready_signal(slot, slot_tokens, 0.0))
                    else:
                        out += decided
        if out:
            self._describe(out)
        return ready

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
            self._describe(out)
        return len(out)
