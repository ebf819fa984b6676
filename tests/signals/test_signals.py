"""EarlySignalBuffer: decisions, inputs, telemetry, a stateful model and real threads.

The step-aligned buffer is in test_signals_step_aligned.py, bounds and floods in test_signals_bounds.py; the
helpers they share with this file are in signals_support.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from signals_support import (
    ENGINE,
    FakeClock,
    RecordingLogger,
    counts,
    make_metrics,
    nothing_but,
    outcome_count,
)

from kvobs import semconv as sc
from kvobs.signals import EarlySignalBuffer, Progress, ReadySignal, SignalBufferFull
from kvobs.signals._core import SignalBufferCore
from kvobs.signals._reporting import ATTR_WAITED_S, LOG_INTERVAL_S
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics


def telemetry_errors(registry: CollectorRegistry, stage: str, engine: str = ENGINE) -> float:
    return registry.get_sample_value(sc.TELEMETRY_ERRORS_TOTAL, {"engine": engine, "stage": stage}) or 0.0


def waited(registry: CollectorRegistry, engine: str = ENGINE) -> float:
    """The summed waits of the recovered signals, from one scrape."""
    return registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_sum", {"engine": engine}) or 0.0


@pytest.fixture
def env():
    registry, metrics = make_metrics()
    clock = FakeClock()
    logger = RecordingLogger()
    buf = EarlySignalBuffer(metrics=metrics, logger=logger, clock=clock, ttl_s=10.0, max_pending=4,
                            log_level="debug")
    return buf, registry, clock, logger


# -- decisions ------------------------------------------------------------------------------------------------


def test_registered_slot_is_ready_at_once_and_early_signal_is_recovered_exactly_once(env):
    buf, registry, clock, _ = env
    assert buf.register(1, need_tokens=100) is None
    assert buf.signal(1, 0, 64) is True
    assert buf.signal(2, 0, 32) is False  # task not registered yet: buffered
    assert buf.pending_count == 1
    clock.advance(2.5)
    assert buf.register(2, need_tokens=32) == 32  # the recovered signal's tokens: its send starts now
    assert buf.pending_count == 0
    buf.finish(2)
    assert buf.register(2, need_tokens=32) is None  # nothing recovered twice
    assert counts(registry) == nothing_but(ready=1, buffered=1, recovered=1)
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_sum", {"engine": ENGINE}) == 2.5
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_bucket", {"engine": ENGINE, "le": "2.5"}) == 1
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_bucket", {"engine": ENGINE, "le": "1.0"}) == 0


def test_other_layers_only_update_progress_in_the_order_it_is_compared(env):
    buf, registry, _, _ = env
    assert buf.signal(5, 3, 16) is False  # unregistered, not layer 0: ignored, never buffered
    assert buf.pending_count == 0
    buf.register(5, 100)
    assert buf.progress(5) is None
    assert buf.signal(5, 3, 16) is False
    assert buf.progress(5) == Progress(tokens=16, layer=3)
    buf.signal(5, 1, 16)  # an older layer arriving late does not move progress back
    assert buf.progress(5) == Progress(16, 3)
    assert buf.signal(5, 0, 48) is True  # the next chunk: more tokens, layer 0
    assert buf.progress(5) == Progress(48, 0)
    buf.signal(5, 0, 40)  # an older chunk's layer0 signal is still sent, but is not progress
    assert buf.progress(5) == Progress(48, 0)
    buf.signal(5, 2, 48)
    assert buf.progress(5) == Progress(48, 2)
    assert buf.progress(6) is None
    assert sum(counts(registry).values()) == 2  # only the layer0 signals were decisions


def test_repeated_early_signals_keep_the_largest_cumulative_count(env):
    buf, registry, clock, _ = env
    buf.signal(7, 0, 64)
    clock.advance(1)
    buf.signal(7, 0, 128)
    buf.signal(7, 0, 96)  # older, smaller count arriving out of order
    assert buf.pending_count == 1
    clock.advance(1)
    assert buf.register(7, 128) == 128
    assert waited(registry) == 2.0  # age counts from the first signal
    assert buf.progress(7) == Progress(128, 0)
    assert outcome_count(registry, "buffered") == 1
    assert outcome_count(registry, "recovered") == 1


def test_stale_signal_is_dropped_counted_and_logged_without_touching_other_slots(env):
    buf, registry, clock, logger = env
    buf.signal(1, 0, 500)
    buf.signal(2, 0, 20)
    clock.advance(0.5)
    assert buf.register(1, need_tokens=100) is None
    assert buf.progress(1) is None  # the dropped signal is not progress of the new task
    assert outcome_count(registry, "dropped_invalid") == 1
    assert buf.pending_count == 1  # slot 2 untouched
    assert buf.register(2, need_tokens=20) == 20
    dropped = [r for r in logger.records if r[1] == sc.EVENT_SIGNAL_DROPPED]
    assert dropped == [(
        "warning", sc.EVENT_SIGNAL_DROPPED,
        {sc.ATTR_SLOT: 1, sc.ATTR_TOKENS: 500, sc.ATTR_NEED_TOKENS: 100, sc.ATTR_OUTCOME: "dropped_invalid",
         ATTR_WAITED_S: 0.5},
    )]
    recovered = [r for r in logger.records if r[1] == sc.EVENT_SIGNAL_RECOVERED]
    assert recovered == [("debug", sc.EVENT_SIGNAL_RECOVERED, {
        sc.ATTR_SLOT: 2, sc.ATTR_TOKENS: 20, sc.ATTR_NEED_TOKENS: 20, sc.ATTR_OUTCOME: "recovered",
        ATTR_WAITED_S: 0.5})]
    # a live slot's signal that claims more than its task needs is invalid too; it never waited
    clock.advance(LOG_INTERVAL_S)  # past the rate limit of dropped_invalid lines
    assert buf.signal(2, 0, 21) is False
    assert outcome_count(registry, "dropped_invalid") == 2
    assert logger.records[-1] == ("warning", sc.EVENT_SIGNAL_DROPPED, {
        sc.ATTR_SLOT: 2, sc.ATTR_TOKENS: 21, sc.ATTR_NEED_TOKENS: 20, sc.ATTR_OUTCOME: "dropped_invalid",
        ATTR_WAITED_S: 0.0})


def test_a_signal_of_zero_tokens_is_progress_too():
    buf = EarlySignalBuffer(clock=FakeClock())
    buf.register(1, 8)
    assert buf.progress(1) is None
    assert buf.signal(1, 0, 0) is True  # no prompt token computed yet, still the layer0 signal
    assert buf.progress(1) == Progress(0, 0)


def test_log_level_is_checked_by_the_buffer():
    logger = RecordingLogger()
    buf = EarlySignalBuffer(logger=logger, clock=FakeClock())  # default "info": no debug line per recovery
    buf.signal(1, 0, 5)
    buf.register(1, 5)
    buf.signal(2, 0, 5)
    buf.finish(2)
    assert [(level, kw[sc.ATTR_OUTCOME]) for level, _, kw in logger.records] == [("warning", "dropped_finished")]
    quiet = EarlySignalBuffer(logger=logger, log_level="error")
    quiet.signal(3, 0, 5)
    quiet.finish(3)
    assert len(logger.records) == 1


def test_registering_a_live_slot_is_an_error_that_changes_nothing(env):
    buf, registry, _, _ = env
    buf.register(3, 10)
    buf.signal(3, 0, 4)
    with pytest.raises(ValueError, match="slot 3 is already registered"):
        buf.register(3, 99)
    assert buf.progress(3) == Progress(4, 0)
    assert buf.signal(3, 0, 11) is False  # the first task's need (10) still holds
    buf.finish(3)
    buf.register(3, 10)
    assert outcome_count(registry, "refused") == 0


def test_finish_drops_pending_and_a_late_signal_is_not_kept_forever(env):
    buf, registry, clock, _ = env
    buf.signal(4, 0, 10)
    buf.finish(4)  # the task failed before it registered
    assert buf.pending_count == 0
    assert outcome_count(registry, "dropped_finished") == 1
    buf.register(4, 10)
    buf.finish(4)
    assert buf.registered_slots() == frozenset()
    buf.signal(4, 0, 10)  # late signal for the finished task: buffered like an early one ...
    assert buf.pending_count == 1
    clock.advance(10.5)
    assert buf.expire() == 1  # ... and expires
    assert buf.pending_count == 0
    assert outcome_count(registry, "expired") == 1
    buf.finish(99)  # unknown slot: no error


def test_expiry_is_lazy_on_every_call_that_touches_pending_signals(env):
    buf, registry, clock, _ = env
    buf.signal(1, 0, 1)
    clock.advance(6)
    buf.signal(2, 0, 1)
    clock.advance(5)  # slot 1 is 11 s old, slot 2 is 5 s old
    buf.register(9, 1)  # nothing pending for slot 9: no clock read, no sweep
    assert buf.signal(9, 0, 1) is True
    assert buf.pending_count == 2
    assert buf.register(1, 1) is None  # touches slot 1's signal: the sweep comes first, so it is not recovered
    assert buf.pending_count == 1 and outcome_count(registry, "expired") == 1
    assert buf.register(2, 1) == 1 and waited(registry) == 5.0
    buf.signal(3, 0, 1)
    clock.advance(10.5)
    buf.signal(4, 0, 1)  # a new buffered signal sweeps too
    assert buf.pending_count == 1 and outcome_count(registry, "expired") == 2
    clock.advance(10.5)
    buf.finish(4)  # so does a finish of a slot with a pending signal: expired, not dropped_finished
    assert counts(registry)["expired"] == 3 and counts(registry)["dropped_finished"] == 0


def test_a_quiet_buffer_never_recovers_an_expired_signal_on_its_fast_path():
    """Without a logger nothing describes a recovery, so register() recovers inline: the expiry due comes first."""
    registry, metrics = make_metrics()
    clock = FakeClock()
    buf = EarlySignalBuffer(metrics=metrics, clock=clock, ttl_s=10.0)
    buf.signal(1, 0, 1)
    clock.advance(6)
    buf.signal(2, 0, 1)
    clock.advance(5)  # slot 1 is 11 s old, slot 2 is 5 s old
    assert buf.register(1, 1) is None
    assert buf.pending_count == 1 and outcome_count(registry, "expired") == 1
    assert buf.register(2, 1) == 1 and waited(registry) == 5.0


def test_overflow_drops_the_oldest_with_its_age_and_memory_is_bounded(env):
    buf, registry, clock, logger = env
    for slot in range(10):
        buf.signal(slot, 0, slot)
        clock.advance(0.25)
    assert buf.pending_count == 4
    assert outcome_count(registry, "overflow") == 6
    evicted = [kw for _, _, kw in logger.records if kw[sc.ATTR_OUTCOME] == "overflow"]
    # the first eviction is logged with the evicted signal's own age (slot 0, buffered 4 signals earlier)
    assert evicted == [{sc.ATTR_SLOT: 0, sc.ATTR_TOKENS: 0, sc.ATTR_OUTCOME: "overflow", ATTR_WAITED_S: 1.0}]
    assert buf.register(5, 100) is None  # among the six oldest: dropped
    assert buf.register(6, 100) == 6 and waited(registry) == 1.0


def test_oldest_age_gauge_is_fresh_at_scrape_time(env):
    buf, registry, clock, _ = env
    age = lambda: registry.get_sample_value(sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS, {"engine": ENGINE})  # noqa: E731
    pending = lambda: registry.get_sample_value(sc.PENDING_SIGNALS, {"engine": ENGINE})  # noqa: E731
    assert age() == 0.0 and pending() == 0.0
    buf.signal(3, 0, 8)
    clock.advance(1.5)
    buf.signal(4, 0, 8)
    assert pending() == 2.0
    assert age() == 1.5
    clock.advance(3.0)  # nothing else happens: a stuck signal keeps ageing
    text = generate_latest(registry).decode()
    assert f'{sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS}{{engine="{ENGINE}"}} 4.5' in text
    clock.advance(4.0)
    assert age() == 8.5
    buf.register(3, 8)
    assert age() == 7.0 and pending() == 1.0


# -- inputs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.0, "1", None, True, [1]])
def test_wrong_types_are_clear_errors(bad):
    buf = EarlySignalBuffer()
    with pytest.raises(TypeError, match="slot must be an int"):
        buf.signal(bad, 0, 1)
    with pytest.raises(TypeError, match="layer must be an int"):
        buf.signal(1, bad, 1)
    with pytest.raises(TypeError, match="tokens must be an int"):
        buf.signal(1, 0, bad)
    with pytest.raises(TypeError, match="need_tokens must be an int"):
        buf.register(1, bad)
    with pytest.raises(TypeError, match="slot must be an int"):
        buf.finish(bad)


def test_negative_values_are_clear_errors():
    buf = EarlySignalBuffer()
    for call, name in ((lambda: buf.signal(-1, 0, 1), "slot"), (lambda: buf.signal(1, -1, 1), "layer"),
                       (lambda: buf.signal(1, 0, -5), "tokens"), (lambda: buf.register(-2, 1), "slot"),
                       (lambda: buf.register(1, -1), "need_tokens"), (lambda: buf.finish(-3), "slot")):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            call()
    assert buf.pending_count == 0 and buf.registered_slots() == frozenset()


def test_numpy_and_torch_values_are_read_as_python_ints():
    buf = EarlySignalBuffer()
    assert buf.signal(np.int64(2), np.int32(0), torch.tensor(9)) is False
    tokens = buf.register(torch.tensor(2), np.int64(9))
    assert tokens == 9 and type(tokens) is int
    ready = buf.signal_batch(0, torch.tensor([2, 3, 4]), np.array([5, 11, 12]), count=torch.tensor(2))
    assert [(s.slot, s.tokens) for s in ready] == [(2, 5)]
    assert all(type(s.slot) is int and type(s.tokens) is int for s in ready)
    assert buf.pending_count == 1  # slot 3 buffered, slot 4 beyond count
    with pytest.raises(TypeError):
        buf.signal_batch(0, torch.tensor([1.0]), [1])


def test_a_batch_layer_is_checked_and_read_as_a_python_int(env):
    buf, registry, _, _ = env
    with pytest.raises(ValueError, match="layer must be >= 0"):
        buf.signal_batch(-1, [1], [3])
    with pytest.raises(TypeError, match="layer must be an int"):
        buf.signal_batch("0", [1], [3])
    assert buf.pending_count == 0
    buf.register(1, 10)
    (ready,) = buf.signal_batch(np.int64(0), [1], [3])
    assert ready == ReadySignal(1, 0, 3, 0.0) and type(ready.layer) is int


def test_empty_batch_markers_are_noops_and_a_bad_batch_changes_nothing(env):
    buf, registry, _, _ = env
    assert buf.signal_batch(0, [1, 2], [3, 4], count=-1) == []
    assert buf.signal_batch(0, [1, 2], [3, 4], count=0) == []
    assert buf.signal_batch(0, [], []) == []
    for bad in (dict(count=3), dict(count=-2)):
        with pytest.raises(ValueError):
            buf.signal_batch(0, [1, 2], [3, 4], **bad)
    with pytest.raises(ValueError, match="2 slots but 1 token"):
        buf.signal_batch(0, [1, 2], [3])
    with pytest.raises(ValueError):
        buf.signal_batch(0, [1, 2, 3], [3, -4, 5])
    assert buf.pending_count == 0 and sum(counts(registry).values()) == 0
    buf.register(2, 10)
    assert buf.signal_batch(0, [1, 2], [3, 4]) == [ReadySignal(2, 0, 4, 0.0)]
    buf.signal_batch(1, [2], [4])
    assert buf.progress(2) == Progress(4, 1)


def test_constructor_rejects_bad_settings():
    for kwargs in (dict(ttl_s=0), dict(ttl_s=float("nan")), dict(max_pending=0), dict(max_slots=0)):
        with pytest.raises(ValueError):
            EarlySignalBuffer(**kwargs)
    with pytest.raises(TypeError, match="step_aligned"):
        EarlySignalBuffer(step_aligned=True)  # its own class now: StepAlignedSignalBuffer


# -- telemetry ------------------------------------------------------------------------------------------------


def test_without_metrics_the_buffer_still_works():
    buf = EarlySignalBuffer(max_pending=1, ttl_s=1, clock=FakeClock())
    buf.signal(1, 0, 1)
    buf.signal(2, 0, 1)
    assert buf.register(2, 1) is not None and buf.register(1, 1) is None
    assert buf.oldest_pending_age() == 0.0


class Boom:
    def __getattr__(self, name):
        raise RuntimeError("telemetry is broken")


def recover_after(metrics: EngineMetrics, clock: FakeClock, waits: list[float]) -> list[float]:
    """Buffer then recover one signal per wait; the waits as the buffer measured them."""
    recovered: list[ReadySignal] = []
    buf = EarlySignalBuffer(metrics=metrics, clock=clock, on_recovered=recovered.append)
    for slot, wait in enumerate(waits):
        buf.signal(slot, 0, 1)
        clock.advance(wait)
        assert buf.register(slot, 1) is None  # handed to on_recovered instead
    assert [s.slot for s in recovered] == list(range(len(waits)))
    return [s.buffered_s for s in recovered]


@pytest.mark.parametrize("kind", ["kvobs cell", "prometheus_client child (multiprocess mode)"])
def test_recovered_waits_reach_the_histogram_in_one_batch_as_observe_would_put_them(kind):
    kvobs_registry, metrics = make_metrics()
    if kind == "kvobs cell":
        registry = kvobs_registry
        reference_registry, reference = make_metrics()
        reference_child = reference.signal_buffered
    else:
        def child(target: CollectorRegistry):
            return Histogram(sc.SIGNAL_BUFFERED_SECONDS, "waits", ["engine"], registry=target,
                             buckets=sc.DEFAULT_LATENCY_BUCKETS).labels(ENGINE)

        registry, reference_registry = CollectorRegistry(), CollectorRegistry()
        metrics.signal_buffered, reference_child = child(registry), child(reference_registry)
    observed: list[float] = []
    metrics.signal_buffered.observe = observed.append  # any observe() call would land here
    clock = FakeClock()
    waits = recover_after(metrics, clock, [0.25, 0.0001, 0.3, 0.3, 7.0])
    generate_latest(kvobs_registry)  # the scrape that flushes the buffer's tally
    text = generate_latest(registry).decode()
    assert observed == []  # one batch, not one observe() per value
    for wait in waits:
        reference_child.observe(wait)
    reference_text = generate_latest(reference_registry).decode()

    def series(exposition: str, suffix: str) -> list[str]:
        return [line for line in exposition.splitlines() if line.startswith(sc.SIGNAL_BUFFERED_SECONDS + suffix)]

    assert series(text, "_bucket") == series(reference_text, "_bucket")
    assert series(text, "_count") == series(reference_text, "_count") == [
        f'{sc.SIGNAL_BUFFERED_SECONDS}_count{{engine="{ENGINE}"}} 5.0']
    total = registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_sum", {"engine": ENGINE})
    assert total == pytest.approx(sum(waits))


def test_a_histogram_child_of_another_shape_gets_one_observe_per_wait():
    registry, metrics = make_metrics()

    class Histogram:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, value: float) -> None:
            self.values.append(value)

    metrics.signal_buffered = Histogram()
    clock = FakeClock()
    waits = recover_after(metrics, clock, [0.5, 0.0, 2.0])
    generate_latest(registry)
    assert metrics.signal_buffered.values == waits


def test_a_raising_metric_child_or_logger_changes_no_decision_and_is_counted():
    registry, metrics = make_metrics()
    metrics.signals = {o: Boom() for o in sc.SIGNAL_OUTCOMES}
    metrics.signal_buffered = Boom()
    buf = EarlySignalBuffer(metrics=metrics, logger=Boom(), clock=FakeClock(), log_level="debug")
    assert buf.signal(1, 0, 5) is False
    assert buf.register(1, 4) is None  # stale: dropped and logged (the logger raises)
    buf.signal(2, 0, 5)
    assert buf.register(2, 5) == 5  # recovered and logged at debug (raises)
    assert buf.registered_slots() == frozenset({1, 2}) and buf.pending_count == 0
    generate_latest(registry)  # the scrape flushes: every outcome counted (buffered, dropped_invalid,
    assert telemetry_errors(registry, "metrics") == 4  # recovered) and the histogram fail, one error each
    assert telemetry_errors(registry, "logging") == 2  # the drop's warning and the recovery's debug line
    assert outcome_count(registry, "recovered") == 0  # the counter itself was the broken part
    generate_latest(registry)
    assert telemetry_errors(registry, "metrics") == 4  # a failed delta is dropped, not retried at every scrape


def test_a_raising_span_and_gauge_read_are_counted_and_the_scrape_still_works():
    registry, metrics = make_metrics()

    class BreakableClock(FakeClock):
        broken = False

        def __call__(self) -> float:
            if self.broken:
                raise RuntimeError("clock is broken")
            return super().__call__()

    clock = BreakableClock()
    buf = EarlySignalBuffer(metrics=metrics, clock=clock)

    class BrokenSpan(trace.NonRecordingSpan):
        def is_recording(self):
            return True

        def add_event(self, *args, **kwargs):
            raise RuntimeError("exporter is broken")

    with trace.use_span(BrokenSpan(trace.INVALID_SPAN_CONTEXT)):
        buf.signal(1, 0, 5)
        buf.finish(1)  # dropped_finished: a span event that raises
    assert outcome_count(registry, "dropped_finished") == 1
    assert telemetry_errors(registry, "tracing") == 1
    buf.signal(2, 0, 5)
    clock.broken = True  # the scrape-time age read raises from now on
    assert registry.get_sample_value(sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS, {"engine": ENGINE}) == 0.0
    assert telemetry_errors(registry, "scrape") >= 1
    assert registry.get_sample_value(sc.PENDING_SIGNALS, {"engine": ENGINE}) == 1.0


def test_a_span_that_cannot_say_whether_it_records_gets_no_event_and_one_counted_error():
    registry, metrics = make_metrics()
    logger = RecordingLogger()
    buf = EarlySignalBuffer(metrics=metrics, logger=logger, clock=FakeClock())
    events: list[str] = []

    class UnsureSpan(trace.NonRecordingSpan):
        def is_recording(self):
            raise RuntimeError("tracer is broken")

        def add_event(self, name, *args, **kwargs):
            events.append(name)

    with trace.use_span(UnsureSpan(trace.INVALID_SPAN_CONTEXT)):
        buf.signal(1, 0, 5)
        buf.finish(1)  # dropped_finished: described while the span cannot be asked
    assert events == []
    assert telemetry_errors(registry, "tracing") == 1
    assert [event for _, event, _ in logger.records] == [sc.EVENT_SIGNAL_DROPPED]  # the log line still goes out


def test_drops_are_span_events_on_the_current_span_with_their_age():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # local: no process-wide state changed
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = FakeClock()
    buf = EarlySignalBuffer(clock=clock)
    buf.signal(1, 0, 10)
    buf.signal(2, 0, 10)
    clock.advance(0.75)
    with provider.get_tracer("t").start_as_current_span("kvobs.send"):
        assert buf.register(1, 10) is not None  # a recovery is returned, not an event
        buf.register(2, 9)
    (span,) = exporter.get_finished_spans()
    assert [(e.name, dict(e.attributes)) for e in span.events] == [
        (sc.EVENT_SIGNAL_DROPPED,
         {sc.ATTR_SLOT: 2, sc.ATTR_TOKENS: 10, sc.ATTR_NEED_TOKENS: 9, sc.ATTR_OUTCOME: "dropped_invalid",
          ATTR_WAITED_S: 0.75}),
    ]


def test_the_early_buffer_decides_with_the_shared_core_itself():
    """Each decision is written once (issue 23): the early buffer's calls are the core's decisions, not a copy
    of them kept in front for speed."""
    for name in ("signal", "register", "finish"):
        assert getattr(EarlySignalBuffer, name) is getattr(SignalBufferCore, name), name


def test_signal_batch_decides_each_slot_as_signal_does(monkeypatch):
    """Each decision is written once (issue 23): signal() and signal_batch() make the one lock-free decision of
    the core, the batch once per slot under one lock."""
    decided: list[tuple[int, int, int]] = []
    decide = SignalBufferCore._signal_locked

    def spy(self, slot, layer, tokens):
        assert self._lock.locked()
        decided.append((slot, layer, tokens))
        return decide(self, slot, layer, tokens)

    monkeypatch.setattr(SignalBufferCore, "_signal_locked", spy)
    buf = EarlySignalBuffer()
    assert buf.register(4, 10) is None
    assert buf.signal(7, 0, 3) is False
    assert buf.signal_batch(0, [4, 7, 9], [6, 5, 1]) == [ReadySignal(4, 0, 6, 0.0)]
    assert decided == [(7, 0, 3), (4, 0, 6), (7, 0, 5), (9, 0, 1)]
    assert buf.pending_count == 2 and buf.register(7, 5) == 5


def test_on_recovered_gets_the_signal_once_outside_the_lock():
    got: list[ReadySignal] = []

    def on_recovered(sig: ReadySignal) -> None:
        got.append(sig)
        buf.finish(sig.slot)  # re-entering the buffer must not deadlock: callbacks run after the lock

    buf = EarlySignalBuffer(on_recovered=on_recovered, clock=FakeClock())
    buf.signal(8, 0, 3)
    assert buf.register(8, 3) is None
    assert got == [ReadySignal(8, 0, 3, 0.0)]
    assert buf.registered_slots() == frozenset()


# -- hypothesis: a stateful model ----------------------------------------------------------------------------

SLOTS = st.integers(0, 5)
TOKENS = st.integers(0, 8)
TTL = 10.0
MAX_PENDING = 4
MAX_SLOTS = 4


class SignalModel(RuleBasedStateMachine):
    """The buffer against plain dicts: same decisions, same returns, same counters, bounds always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.registry, metrics = make_metrics()
        self.families = metrics.families
        self.clock = FakeClock()
        self.buf = EarlySignalBuffer(metrics=metrics, clock=self.clock, ttl_s=TTL, max_pending=MAX_PENDING,
                                     max_slots=MAX_SLOTS)
        self.live: dict[int, int] = {}
        self.progress: dict[int, tuple[int, int]] = {}
        self.pending: dict[int, list[float]] = {}  # slot -> [tokens, since], oldest first
        self.counts: Counter[str] = Counter()
        self.invalid_from_pending = 0
        self.waits: list[float] = []  # of the recovered signals
        self.swept = True

    def sweep(self) -> int:
        """What every call that touches a pending signal does first."""
        now, expired = self.clock.now, 0
        for slot, (_, since) in list(self.pending.items()):
            if now > since + TTL:
                del self.pending[slot]
                expired += 1
        self.counts["expired"] += expired
        self.swept = True
        return expired

    def model_signal(self, slot: int, layer: int, tokens: int) -> bool:
        if slot in self.live:
            if layer == 0 and tokens > self.live[slot]:
                self.counts["dropped_invalid"] += 1
                return False
            self.progress[slot] = max(self.progress.get(slot, (-1, -1)), (tokens, layer))
            if layer == 0:
                self.counts["ready"] += 1
                return True
        elif layer == 0 and slot in self.pending:
            self.pending[slot][0] = max(self.pending[slot][0], tokens)
        elif layer == 0:
            self.sweep()
            if len(self.pending) >= MAX_PENDING:
                del self.pending[next(iter(self.pending))]
                self.counts["overflow"] += 1
            self.pending[slot] = [tokens, self.clock.now]
            self.counts["buffered"] += 1
        return False

    @rule(slot=SLOTS, layer=st.integers(0, 2), tokens=TOKENS)
    def signal(self, slot, layer, tokens):
        assert self.buf.signal(slot, layer, tokens) is self.model_signal(slot, layer, tokens)

    @rule(layer=st.integers(0, 1), batch=st.lists(st.tuples(SLOTS, TOKENS), max_size=4))
    def signal_batch(self, layer, batch):
        expected = [ReadySignal(s, 0, t, 0.0) for s, t in batch if self.model_signal(s, layer, t)]
        assert self.buf.signal_batch(layer, [s for s, _ in batch], [t for _, t in batch]) == expected

    @rule(slot=SLOTS, need=TOKENS)
    def register(self, slot, need):
        if slot in self.live:
            with pytest.raises(ValueError):
                self.buf.register(slot, need)
            return
        if len(self.live) >= MAX_SLOTS:
            self.counts["refused"] += 1
            with pytest.raises(SignalBufferFull, match="max_slots=4"):
                self.buf.register(slot, need)
            return
        if slot in self.pending:
            self.sweep()
        self.live[slot] = need
        expected = None
        if slot in self.pending:
            tokens, since = self.pending.pop(slot)
            if tokens > need:
                self.counts["dropped_invalid"] += 1
                self.invalid_from_pending += 1
            else:
                self.counts["recovered"] += 1
                self.progress[slot] = (tokens, 0)
                expected = tokens
                self.waits.append(self.clock.now - since)
        assert self.buf.register(slot, need) == expected

    @rule(slot=SLOTS)
    def finish(self, slot):
        self.live.pop(slot, None)
        self.progress.pop(slot, None)
        if slot in self.pending:
            self.sweep()
        if self.pending.pop(slot, None) is not None:
            self.counts["dropped_finished"] += 1
        self.buf.finish(slot)

    @rule(seconds=st.sampled_from([0.0, 0.5, 5.0, 10.0, 10.0, 25.0]))
    def advance(self, seconds):
        self.clock.advance(seconds)
        self.swept = False

    @rule()
    def expire(self):
        assert self.buf.expire() == self.sweep()

    @invariant()
    def matches_model(self):
        # the two families a scrape reads, in the registry's order: the pending gauge's read flushes the
        # buffer's counts, then the counter shows them (a full registry scan costs ~3 ms per step)
        list(self.families.pending.collect())
        real = {s.labels["outcome"]: s.value for m in self.families.signals.collect() for s in m.samples
                if s.name == sc.SIGNALS_TOTAL and s.labels["engine"] == ENGINE}
        assert real == {o: float(self.counts[o]) for o in sc.SIGNAL_OUTCOMES}
        (histogram,) = self.families.signal_buffered.collect()
        observed = {s.name: s.value for s in histogram.samples if s.labels.get("engine") == ENGINE}
        assert observed.get(sc.SIGNAL_BUFFERED_SECONDS + "_count", 0.0) == len(self.waits)
        assert observed.get(sc.SIGNAL_BUFFERED_SECONDS + "_sum", 0.0) == pytest.approx(sum(self.waits))
        assert self.buf.pending_count == len(self.pending) <= MAX_PENDING
        assert self.buf.registered_slots() == frozenset(self.live)
        for slot in self.live:
            assert self.buf.progress(slot) == (Progress(*self.progress[slot]) if slot in self.progress else None)
        # every buffered signal is recovered exactly once, dropped with a counted reason, or still pending
        settled = (real["recovered"] + self.invalid_from_pending + real["dropped_finished"] + real["expired"]
                   + real["overflow"] + self.buf.pending_count)
        assert real["buffered"] == settled
        if self.swept:
            assert self.buf.oldest_pending_age() <= TTL  # nothing pends past its TTL once swept


SignalModel.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSignalModel = SignalModel.TestCase


# -- real threads ---------------------------------------------------------------------------------------------


def run_all(*functions) -> None:
    """Run each function on its own thread, together; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(f)) for f in functions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_hammering_keep_every_invariant_and_scrapes_see_exact_counts():
    registry, metrics = make_metrics()
    buf = EarlySignalBuffer(metrics=metrics, ttl_s=0.002, max_pending=16)
    slots, per_thread = 64, 35_000
    tokens = itertools.count(1)  # unique per signal: a token value released twice means a double send
    released: list[list[ReadySignal]] = [[], []]
    workers_done = threading.Event()
    scraped: list[dict[str, float]] = []

    # each thread yields the GIL every 16 calls, so the three interleave finely (not in 5 ms slices)
    def signaller():
        rng, out = random.Random(1), released[0]
        for i in range(per_thread):
            if i % 16 == 0:
                time.sleep(0)
            if i % 8 == 0:
                batch = rng.sample(range(slots), 4)
                out.extend(buf.signal_batch(0, batch, [next(tokens) for _ in batch]))
            else:
                slot, slot_tokens = rng.randrange(slots), next(tokens)
                if buf.signal(slot, 0 if i % 4 else 2, slot_tokens):
                    out.append(ReadySignal(slot, 0, slot_tokens, 0.0))

    def registerer():
        rng, out = random.Random(2), released[1]
        for i in range(per_thread):
            if i % 16 == 0:
                time.sleep(0)
            slot = rng.randrange(slots)
            try:
                recovered = buf.register(slot, need_tokens=10**12)
            except ValueError:
                continue
            if recovered is not None:
                out.append(ReadySignal(slot, 0, recovered, 0.0))

    def finisher():
        rng = random.Random(3)
        for i in range(per_thread):
            if i % 16 == 0:
                time.sleep(0)
            buf.finish(rng.randrange(slots))
            if i % 1000 == 0:
                buf.expire()

    def workers():
        try:
            run_all(signaller, registerer, finisher)
        finally:
            workers_done.set()

    def scraper():
        while not workers_done.is_set():
            scraped.append(counts(registry))
            assert buf.pending_count <= 16
            workers_done.wait(0.005)

    run_all(workers, scraper)
    for earlier, later in zip(scraped, scraped[1:]):
        assert all(later[o] >= earlier[o] for o in sc.SIGNAL_OUTCOMES)  # counters only grow, scrape to scrape

    ready, recovered = released
    c = counts(registry)  # one more scrape after the threads: every decision is in it, exactly
    assert c["ready"] == len(ready) and c["recovered"] == len(recovered)
    assert all(c[o] > 0 for o in ("ready", "recovered", "expired", "overflow", "dropped_finished"))
    assert c["dropped_invalid"] == 0 and c["refused"] == 0
    assert registry.get_sample_value(sc.SIGNAL_BUFFERED_SECONDS + "_count", {"engine": ENGINE}) == len(recovered)
    all_tokens = [s.tokens for s in ready + recovered]
    assert len(all_tokens) == len(set(all_tokens))  # nothing released twice
    assert c["buffered"] == (c["recovered"] + c["dropped_finished"] + c["expired"] + c["overflow"]
                             + buf.pending_count)
    assert buf.pending_count <= 16
    for slot in range(slots):
        buf.finish(slot)
    assert buf.registered_slots() == frozenset() and buf.pending_count == 0
