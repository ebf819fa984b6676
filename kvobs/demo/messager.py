"""The prefill node's cache messager thread: registers each slot's transfer task after the request's
registration delay, starts the send on the layer0 signal, finishes the task when the send is done.

Unguarded, a layer0 signal for a slot whose task is not registered yet is dropped, the send never starts and
the request hangs (detected here by a deadline, then aborted so the run goes on). Guarded, kvobs's
EarlySignalBuffer keeps the signal until the task registers. A send is hung only once its layer0 signal was
given: a forward pass that has not reached layer0 by the deadline (a loaded machine) is waited for, so the
count measures lost signals, not the machine's speed.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, Union

import kvobs
from kvobs.demo.messages import LayerReady, Registration, SendEnded
from kvobs.demo.stats import RunStats
from kvobs.demo.worker import QueueWorker
from kvobs.demo.workload import Request

PHANTOM_SLOT = 100_000  # the `--fault stale-signal` slot: no task ever registers for it
MAX_WAIT_S = 0.005  # the messager looks at registrations due and hang deadlines at least this often
EXPIRE_EVERY_S = 0.5

MessagerEvent = Union[Registration, LayerReady, SendEnded]


class SignalRoute(Protocol):
    """What the messager does with a layer signal, depending on whether early signals are buffered."""

    def register(self, req: Request) -> bool:
        """The task of `req.slot` registers; True if a signal kept for it starts the send now."""

    def layer_ready(self, event: LayerReady, registered: bool) -> bool:
        """True if the signal starts the send of its (registered) slot."""

    def hung(self, slot: int) -> None:
        """The slot's send never started before its deadline (`finish` follows)."""

    def finish(self, slot: int) -> None: ...

    def expire(self) -> None: ...

    def pending(self) -> int: ...


class DroppingSignals:
    """An engine without kvobs's buffer: a layer0 signal for a slot with no registered task is lost."""

    def __init__(self, stats: RunStats) -> None:
        self.stats = stats

    def register(self, req: Request) -> bool:
        return False

    def layer_ready(self, event: LayerReady, registered: bool) -> bool:
        if registered:
            return event.layer == 0
        if event.layer == 0 and event.slot != PHANTOM_SLOT:
            self.stats.add(lost_layer0_signals=1)  # dropped: the send never starts
        return False

    def hung(self, slot: int) -> None:
        """Its layer0 signal was counted as lost when it was dropped."""

    def finish(self, slot: int) -> None:
        """Nothing kept per slot."""

    def expire(self) -> None:
        """Nothing kept to expire."""

    def pending(self) -> int:
        return 0


class BufferedSignals:
    """kvobs's EarlySignalBuffer keeps an early signal and hands it back when the task registers."""

    def __init__(self, buffer: kvobs.EarlySignalBuffer, stats: RunStats) -> None:
        self.buffer = buffer
        self.stats = stats

    def register(self, req: Request) -> bool:
        if self.buffer.register(req.slot, req.tokens) is None:
            return False
        self.stats.add(signals_recovered=1)
        return True

    def layer_ready(self, event: LayerReady, registered: bool) -> bool:
        return self.buffer.signal(event.slot, event.layer, event.tokens) and registered

    def hung(self, slot: int) -> None:
        self.stats.add(lost_layer0_signals=1)  # buffered or never seen: it never reached the send

    def finish(self, slot: int) -> None:
        self.buffer.finish(slot)

    def expire(self) -> None:
        self.buffer.expire()

    def pending(self) -> int:
        return self.buffer.pending_count


@dataclass(eq=False, kw_only=True)
class CacheMessager(QueueWorker[MessagerEvent]):
    """Registrations (after each request's delay), layer signals, send completions, hang deadlines."""

    signals: SignalRoute
    stats: RunStats
    start_send: Callable[[Request], None]
    ended: Callable[[SendEnded], None]  # hands the request back to the scheduler
    send_deadline_s: float
    _due: list[tuple[float, int, Request]] = field(default_factory=list, init=False)  # a heap: not yet due
    _order: Iterator[int] = field(default_factory=itertools.count, init=False)
    _registered: dict[int, Request] = field(default_factory=dict, init=False)
    _deadline: dict[int, float] = field(default_factory=dict, init=False)
    _started: set[int] = field(default_factory=set, init=False)
    _layer0_given: set[int] = field(default_factory=set, init=False)  # slots whose layer0 signal came
    _next_expire: float = field(default=0.0, init=False)

    def wait_s(self) -> float:
        if not self._due:
            return MAX_WAIT_S
        return min(MAX_WAIT_S, max(0.0, self._due[0][0] - time.monotonic()))

    def handle(self, event: MessagerEvent) -> None:
        self._register_due(time.monotonic())
        match event:
            case Registration():
                heapq.heappush(self._due, (event.due, next(self._order), event.request))
                self._register_due(time.monotonic())  # a zero delay registers before any signal queued after it
            case LayerReady():
                if event.layer == 0:
                    self._layer0_given.add(event.slot)
                started = event.slot in self._started
                if self.signals.layer_ready(event, event.slot in self._registered) and not started:
                    self._start(self._registered[event.slot])
            case SendEnded():
                self._close(event.request.slot)
                self.ended(event)

    def tick(self) -> None:
        now = time.monotonic()
        self._register_due(now)
        self._abort_hung(now)
        if now >= self._next_expire:
            self.signals.expire()
            self._next_expire = now + EXPIRE_EVERY_S

    def _register_due(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            _, _, req = heapq.heappop(self._due)
            self._registered[req.slot] = req
            self._deadline[req.slot] = now + self.send_deadline_s
            if self.signals.register(req):
                self._start(req)

    def _start(self, req: Request) -> None:
        self._started.add(req.slot)
        self.start_send(req)

    def _abort_hung(self, now: float) -> None:
        for slot in [s for s, due in self._deadline.items() if s not in self._started and due <= now]:
            if slot not in self._layer0_given:  # the forward pass is late, not the signal lost: wait again
                self._deadline[slot] = now + self.send_deadline_s
                continue
            req = self._registered[slot]
            self.stats.add(hung_sends=1)
            self.signals.hung(slot)
            self._close(slot)
            self.ended(SendEnded(req, sent=False))

    def _close(self, slot: int) -> None:
        """The slot's task is over, sent or aborted."""
        self.signals.finish(slot)
        self._registered.pop(slot, None)
        self._deadline.pop(slot, None)
        self._started.discard(slot)
        self._layer0_given.discard(slot)
