"""`StepAlignedSignalBuffer`: the early-signal buffer for tensor-parallel ranks, deciding once per step.

Why: each TP rank runs its own buffer, and the ranks' send barriers deadlock unless every rank releases the
same batch at the same step. A rank's threads may see a signal and a registration in either order; decided at
each call (as `EarlySignalBuffer` does), one rank would recover a signal that another sees as ready. So here
`signal()`, `signal_batch()`, `register()` and `finish()` only check and record, and `end_step()` decides, through
the very decisions `EarlySignalBuffer` makes at each call (`SignalBufferCore._signal_locked`, `register`, `finish`),
in a canonical order that ignores arrival order across threads:
expire by step age; then slot by slot (ascending) that slot's registrations and finishes in arrival order; then
slot by slot the step's signals (repeats merged: the largest token count). It returns the step's batch:
recovered signals, then ready ones, each group by slot.

The TTL counts steps (`ttl_steps`), not seconds, and overflow evicts in canonical order, so no rank-local clock
or thread timing enters a decision. Guarantee: ranks that record the same events before the same `end_step()`,
and for each slot its registrations and finishes in the same order, release identical batches
(slot, layer, tokens). The caller must deliver a step's registrations before that step's `end_step()` on every
rank (e.g. register when the scheduler, which TP ranks run in lockstep, schedules the request).
`buffered_s` stays this rank's own measurement, counted from the boundary that buffered the signal.

Bounds: a step in which more than `max_pending` distinct slots signal keeps the lowest-numbered ones on every
rank; the rest are `overflow` (that count alone may differ by rank, as it depends on arrival order). A
registration applied while `max_slots` tasks are live is `refused` at `end_step()`, identically on every rank.
Calls recorded without `end_step()` are bounded too: beyond 2 * `max_slots` registrations and finishes in one
step, `register()`/`finish()` raise SignalBufferFull.

Locks: recording and `end_step()` hold the step lock, and `end_step()` takes the core's lock within it for each
registration and finish and once for all the step's signals (step lock -> core lock, never the reverse); the
decisions' descriptions and recovered signals are collected and released with the step's batch, once the step
lock is released.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvobs import semconv as sc
from kvobs.errors import SignalBufferFull
from kvobs.signals._core import DEFAULT_MAX_SLOTS, SignalBufferCore, held
from kvobs.signals._inputs import as_int, step_batch
from kvobs.signals._records import NO_PROGRESS, Decision, Progress, ReadySignal, decision, ready_signal
from kvobs.signals._reporting import OVERFLOW, REFUSED
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics

_FINISH = None  # a staged finish() in a slot's list of staged calls; a registration stages its need_tokens


class _StagedSignals:
    """One slot's signals recorded this step, merged: the largest layer0 count and the furthest other layer."""

    __slots__ = ("layer0_tokens", "furthest")

    def __init__(self) -> None:
        self.layer0_tokens = -1
        self.furthest: tuple[int, int] = NO_PROGRESS  # (tokens, layer) of layers > 0


class StepAlignedSignalBuffer(SignalBufferCore):
    """Registered slots and early layer0 signals of one TP rank, decided at `end_step()`; see the module
    docstring. `pending_count`, `registered_slots()` and `progress()` read the state as of the last step."""

    def __init__(
        self,
        *,
        metrics: EngineMetrics | None = None,
        logger: Any | None = None,
        ttl_steps: int = 1000,
        max_pending: int = 4096,
        max_slots: int = DEFAULT_MAX_SLOTS,
        clock: Callable[[], float] = time.monotonic,
        log_level: str | int = "info",
    ) -> None:
        if as_int(ttl_steps, "ttl_steps") < 1:
            raise ValueError("ttl_steps must be >= 1")
        self._step_recoveries: list[ReadySignal] = []  # of the step end_step() is deciding
        self._step_descriptions: list[Decision] = []
        super().__init__(metrics=metrics, logger=logger, ttl=ttl_steps, max_pending=max_pending,
                         max_slots=max_slots, clock=clock, decision_clock=self._step_now,
                         on_recovered=self._step_recoveries.append, log_level=log_level)
        self._describe = self._step_descriptions.extend
        # held by every recording call and by end_step() throughout: the core's decisions, which end_step() makes
        # as EarlySignalBuffer makes them, take the core's lock within it
        self._step_lock = threading.Lock()
        self._step_held = held(self._step_lock)
        self._step = 0
        self._wall = clock()  # the clock at the last end_step(): when this step's decisions were taken
        self._max_staged_calls = 2 * max_slots
        self._staged_calls: dict[int, list[int | None]] = {}  # slot -> need_tokens or _FINISH, arrival order
        self._staged_call_count = 0
        self._staged_signals: dict[int, _StagedSignals] = {}
        self._staged_heap: list[int] = []  # negated staged slots: the highest one in O(1)

    def signal(self, slot: int, layer: int, tokens: int) -> None:
        """Record that layer `layer` of `slot` holds `tokens` prompt tokens (cumulative), for `end_step()`."""
        slot = as_int(slot, "slot")
        layer = as_int(layer, "layer")
        tokens = as_int(tokens, "tokens")
        out: list[Decision] = []
        with self._step_held:
            self._stage_signal_locked(slot, layer, tokens, out)
        if out:
            self._reporter.describe(out)

    def signal_batch(self, layer: int, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
                     count: int | None = None) -> None:
        """Record one model-runner step for `layer`: the first `count` slots (all when None; -1 or 0: none).
        Every value is validated first, so a bad batch records nothing."""
        layer, slot_list, token_list = step_batch(layer, slots, tokens, count)
        out: list[Decision] = []
        with self._step_held:
            for slot, slot_tokens in zip(slot_list, token_list):
                self._stage_signal_locked(slot, layer, slot_tokens, out)
        if out:
            self._reporter.describe(out)

    def register(self, slot: int, need_tokens: int) -> None:
        """Record the registration of `slot`'s task for `end_step()`. A slot live after the calls recorded so
        far raises ValueError at once, the same on every rank given the same calls per slot."""
        self._stage_call(as_int(slot, "slot"), as_int(need_tokens, "need_tokens"))

    def finish(self, slot: int) -> None:
        """Record that `slot`'s task finished or failed, for `end_step()`."""
        self._stage_call(as_int(slot, "slot"), _FINISH)

    def end_step(self) -> list[ReadySignal]:
        """Decide this step's recorded calls in canonical order; the batch every rank releases."""
        ready: list[ReadySignal] = []
        recovered = self._step_recoveries
        described = self._step_descriptions
        register = super().register
        finish = super().finish
        with self._step_held:
            recovered.clear()  # what an interrupted step left here is dropped, as its own locals would be
            described.clear()
            self._step += 1
            wall = self._clock()
            self._wall = wall
            calls = self._staged_calls
            signals = self._staged_signals
            self._staged_calls = {}
            self._staged_signals = {}
            self._staged_heap = []
            self._staged_call_count = 0
            with self._held:
                self._now_locked(described)  # expires what is due by this step
            for slot in sorted(calls):
                for need in calls[slot]:
                    if need is _FINISH:
                        finish(slot)
                    else:
                        try:
                            register(slot, need)  # a recovered signal goes to `recovered`
                        except SignalBufferFull:
                            pass  # refused: counted and described as every refusal is
            with self._held:
                for slot in sorted(signals):
                    staged = signals[slot]
                    if staged.furthest[1] > 0:
                        tokens, layer = staged.furthest
                        self._signal_locked(slot, layer, tokens)  # progress only: nothing to describe
                    tokens = staged.layer0_tokens
                    if tokens >= 0:
                        decided = self._signal_locked(slot, 0, tokens)
                        if decided is True:
                            ready.append(ready_signal(slot, tokens, 0.0))
                        elif decided:
                            described += decided
            batch = recovered + ready
            out = described[:]
            recovered.clear()
            described.clear()
        if out:
            self._reporter.describe(out)
        return batch

    def _step_now(self) -> int:
        return self._step

    def _now_locked(self, out: list[Decision]) -> tuple[float, float]:
        if self._step > self._expire_at:  # at the start of end_step(), or after an interrupted sweep
            self._expire_locked(self._step, self._wall, out)
        return self._step, self._wall

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        self._step_lock = threading.Lock()
        self._step_held = held(self._step_lock)

    def registered_slots(self) -> frozenset[int]:
        """Slots with a live task as of the last step."""
        with self._step_held:
            return super().registered_slots()

    def progress(self, slot: int) -> Progress | None:
        """The furthest (tokens, layer) signalled for live `slot` as of the last step; None if unregistered or
        no signal yet."""
        with self._step_held:
            return super().progress(slot)

    # -- recording, under self._step_lock -----------------------------------------------------------------------

    def _stage_call(self, slot: int, need: int | None) -> None:
        out: list[Decision] = []
        duplicate = False
        full = False
        with self._step_held:
            calls = self._staged_calls.get(slot)
            if need is not _FINISH and (calls[-1] is not _FINISH if calls else slot in self._live):
                duplicate = True
            elif self._staged_call_count >= self._max_staged_calls:
                full = True
                self._counts[REFUSED] += 1
                out.append(decision(sc.SIGNAL_REFUSED, slot, None, need, 0.0))
            else:
                self._staged_calls.setdefault(slot, []).append(need)
                self._staged_call_count += 1
        if out:
            self._reporter.describe(out)
        if duplicate:
            raise ValueError(f"slot {slot} is already registered; finish() it before registering it again")
        if full:
            raise SignalBufferFull("2*max_slots", self._max_staged_calls, "registrations and finishes recorded in "
                                   "one step; call end_step() once per model-runner step")

    def _stage_signal_locked(self, slot: int, layer: int, tokens: int, out: list[Decision]) -> None:
        """Merge into the step's record; beyond max_pending slots keep the lowest-numbered ones (order-free)."""
        staged = self._staged_signals.get(slot)
        if staged is None:
            # Every heap entry has its record (records first, heap second, eviction the other way round), so an
            # asynchronous exception between two steps leaves at worst a record the heap cannot evict until
            # end_step() clears them all, never a heap entry without its record.
            if len(self._staged_signals) >= self._max_pending and self._staged_heap:
                highest = -self._staged_heap[0]
                self._counts[OVERFLOW] += 1  # counted first: interrupted, a drop is over-counted, never lost
                if slot > highest:
                    out.append(decision(sc.SIGNAL_OVERFLOW, slot, tokens, None, 0.0))
                    return
                heapq.heappop(self._staged_heap)
                evicted = self._staged_signals.pop(highest)
                out.append(decision(sc.SIGNAL_OVERFLOW, highest, max(evicted.layer0_tokens, evicted.furthest[0]),
                                    None, 0.0))
            staged = self._staged_signals[slot] = _StagedSignals()
            heapq.heappush(self._staged_heap, -slot)
        if layer == 0:
            if tokens > staged.layer0_tokens:
                staged.layer0_tokens = tokens
        elif (tokens, layer) > staged.furthest:
            staged.furthest = (tokens, layer)
