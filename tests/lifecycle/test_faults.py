"""Faults injected at every stage of a guarded call: the lock is always released, the engine's exception
always comes through unchanged, and a telemetry fault never changes the call's result."""

from __future__ import annotations

import asyncio
import inspect
import random
import signal
import sys
import threading

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from support import lock_is_free

import kvobs
import kvobs._lifecycle.fast_lane
from kvobs import semconv as sc
from kvobs._lifecycle import active


class Armed:
    """One switch shared by the faulty telemetry parts below; `fire` is what they raise when armed."""

    def __init__(self):
        self.stage = None
        self.fire: BaseException | None = None

    def trip(self, stage):
        if self.stage == stage:
            raise self.fire


class FaultySpan:
    def __init__(self, span, armed):
        self._span = span
        self._armed = armed

    def __getattr__(self, name):
        return getattr(self._span, name)

    def end(self, *a, **k):
        self._armed.trip("span_end")
        return self._span.end(*a, **k)

    def set_attributes(self, attrs):
        self._armed.trip("span_attributes")
        return self._span.set_attributes(attrs)


class FaultyTracerProvider:
    def __init__(self, armed):
        self._armed = armed
        self._real = TracerProvider()

    def get_tracer(self, *a, **k):
        provider = self

        class Tracer:
            def start_span(self, name, *args, **kwargs):
                provider._armed.trip("span_start")
                return FaultySpan(provider._real.get_tracer("t").start_span(name, *args, **kwargs), provider._armed)

        return Tracer()


class FaultyLogger:
    def __init__(self, armed):
        self._armed = armed
        self._real = structlog.wrap_logger(structlog.PrintLogger(), processors=[structlog.testing.LogCapture()])

    def __getattr__(self, level):
        def log(*a, **k):
            self._armed.trip("log")

        return log


class FaultyChild:
    def __init__(self, child, armed):
        self._child = child
        self._armed = armed

    def inc(self, *a):
        self._armed.trip("metric")
        return self._child.inc(*a)

    def dec(self, *a):
        return self._child.dec(*a)

    def observe(self, *a):
        self._armed.trip("metric")
        return self._child.observe(*a)


class Boom(Exception):
    pass


class HardStop(BaseException):
    pass


ENGINE_STAGES = ("spec", "body")
TELEMETRY_STAGES = ("hook", "span_start", "span_attributes", "span_end", "log", "metric")
RAISES = (lambda: Boom("engine"), lambda: KeyboardInterrupt(), lambda: HardStop(), lambda: SystemExit(3),
          lambda: ValueError("bad"))


@pytest.fixture
def rig():
    armed = Armed()
    registry = CollectorRegistry()
    obs = kvobs.KVObserver(
        "faults", registry=registry, tracer_provider=FaultyTracerProvider(armed), logger=FaultyLogger(armed),
        hooks=[lambda record: armed.trip("hook")], log_level="debug", integrity=None, lock_timeout=1.0,
    )

    def spec(ids):
        armed.trip("spec")
        return ids

    @obs.write_back(block_ids=spec)
    def write(ids):
        armed.trip("body")
        return ("written", tuple(ids))

    for path in obs.metrics.paths.values():
        path.transfers[sc.OUTCOME_OK] = FaultyChild(path.transfers[sc.OUTCOME_OK], armed)
        path.duration[sc.OUTCOME_ERROR] = FaultyChild(path.duration[sc.OUTCOME_ERROR], armed)
    return armed, obs, write, registry


def errors(registry, stage):
    return registry.get_sample_value(sc.TELEMETRY_ERRORS_TOTAL, {"engine": "faults", "stage": stage}) or 0


@pytest.mark.parametrize("stage", ENGINE_STAGES)
@pytest.mark.parametrize("make", RAISES, ids=["exception", "KeyboardInterrupt", "BaseException", "SystemExit", "ValueError"])
def test_engine_fault_is_reraised_unchanged_and_lock_released(rig, stage, make):
    armed, obs, write, _ = rig
    armed.stage = stage
    armed.fire = make()
    with pytest.raises(BaseException) as info:
        write([1, 2])
    assert info.value is armed.fire
    assert lock_is_free(obs.lock)


@pytest.mark.parametrize("stage", TELEMETRY_STAGES)
def test_telemetry_fault_never_changes_the_result(rig, stage):
    armed, obs, write, registry = rig
    armed.stage = stage
    armed.fire = RuntimeError(f"telemetry broke at {stage}")
    assert write([1, 2]) == ("written", (1, 2))
    assert lock_is_free(obs.lock)
    counted = sum(errors(registry, s) for s in ("metrics", "tracing", "logging", "hook"))
    assert counted >= 1


def test_telemetry_fault_while_the_engine_fails_keeps_the_engine_exception(rig):
    armed, obs, write, _ = rig
    armed.stage = "body"
    armed.fire = Boom("engine")

    @obs.send(block_ids="ids")
    def send(ids):
        raise armed.fire

    # the error-duration child is faulty too: the engine's exception must still be the one raised
    armed_metric = obs.metrics.paths["send"].duration[sc.OUTCOME_ERROR]
    armed_metric._armed = Armed()
    armed_metric._armed.stage = "metric"
    armed_metric._armed.fire = RuntimeError("metric broke")
    with pytest.raises(Boom) as info:
        send([1])
    assert info.value is armed.fire
    assert lock_is_free(obs.lock)


def test_ten_thousand_random_faults_leak_no_lock(rig):
    armed, obs, write, _ = rig
    rng = random.Random(20261130)
    stages = ENGINE_STAGES + TELEMETRY_STAGES + (None,)
    outcomes = {"raised": 0, "returned": 0}
    for i in range(10_000):
        armed.stage = rng.choice(stages)
        armed.fire = rng.choice(RAISES)() if armed.stage in ENGINE_STAGES else RuntimeError("telemetry")
        use_cm = rng.random() < 0.3
        try:
            if use_cm:
                with obs.transfer("write_back", block_ids=[i % 7]):
                    armed.trip("body")
                result = ("written", (i % 7,))
            else:
                result = write([i % 7])
        except BaseException as exc:  # noqa: BLE001 - the point is to see every kind
            assert armed.stage in ENGINE_STAGES and exc is armed.fire, (i, armed.stage, exc)
            outcomes["raised"] += 1
        else:
            assert armed.stage not in ENGINE_STAGES or (use_cm and armed.stage == "spec")
            assert result == ("written", (i % 7,))
            outcomes["returned"] += 1
        assert lock_is_free(obs.lock), f"lock leaked at iteration {i} (stage {armed.stage})"
    assert outcomes["raised"] > 1000 and outcomes["returned"] > 5000
    in_flight = rig[3].get_sample_value(sc.TRANSFERS_IN_FLIGHT, {"engine": "faults", "path": "write_back"})
    assert in_flight == 0


# -- a second interrupt while the failure is recorded: the lock was released before anything else ------------


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C again, while the failure is being recorded


def test_an_interrupt_on_entry_then_another_while_failing_leaves_the_lock_free(checked, monkeypatch):
    monkeypatch.setattr(active, "enter", _interrupted)  # Ctrl-C right after the lock was taken
    monkeypatch.setattr(kvobs._lifecycle.transfer.Transfer, "fail", _interrupted)
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        raise AssertionError("never entered")
    assert lock_is_free(checked.observer.lock)


def test_an_interrupt_right_after_the_lock_was_taken_is_a_recorded_failure(checked, monkeypatch):
    monkeypatch.setattr(active, "enter", _interrupted)
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        raise AssertionError("never entered")
    assert lock_is_free(checked.observer.lock)
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    (span,) = checked.spans  # ended, with what ended it
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "KeyboardInterrupt"


def test_a_with_block_that_raises_then_an_interrupt_while_failing_leaves_the_lock_free(checked, monkeypatch):
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        monkeypatch.setattr(kvobs._lifecycle.transfer.Transfer, "fail", _interrupted)
        raise OSError("the copy failed")
    assert lock_is_free(checked.observer.lock)


@pytest.mark.parametrize("form", ["sync", "async", "fast lane"])
def test_a_decorated_call_that_raises_then_an_interrupt_while_failing_leaves_the_lock_free(checked, monkeypatch,
                                                                                          form):
    obs = checked.observer
    if form == "sync":
        @obs.prefetch(block_ids="ids", group_sizes="groups")  # naming KV groups: the general lifecycle
        def load(ids, groups=(1,)):
            monkeypatch.setattr(kvobs._lifecycle.transfer.Transfer, "fail", _interrupted)
            raise OSError("the copy failed")

        call = load
    elif form == "fast lane":
        @obs.prefetch(block_ids="ids")
        def load_fast(ids):
            monkeypatch.setattr(kvobs._lifecycle.fast_lane, "_record", _interrupted)
            raise OSError("the copy failed")

        call = load_fast
    else:
        @obs.prefetch(block_ids="ids")
        async def load_async(ids):
            monkeypatch.setattr(kvobs._lifecycle.transfer.Transfer, "fail", _interrupted)
            raise OSError("the copy failed")

        def call(ids):
            return asyncio.run(load_async(ids))
    with pytest.raises(KeyboardInterrupt):
        call([1])
    assert lock_is_free(obs.lock)


def _interrupt_at(func, statement: str):
    """A trace function that raises KeyboardInterrupt in `func` just before `statement` runs: Ctrl-C landing
    exactly there, deterministically (an exception raised by a trace function surfaces in the traced frame)."""
    lines, first = inspect.getsourcelines(func)
    (target,) = [first + i for i, line in enumerate(lines) if line.strip() == statement]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target:
            sys.settrace(None)
            raise KeyboardInterrupt
        return local

    return lambda frame, event, arg: local if frame.f_code is func.__code__ else None


def test_an_ending_interrupted_before_it_says_how_it_ended_is_recorded_as_a_failure(checked, monkeypatch):
    t = checked.observer.begin("prefetch", block_ids=[1])

    def check_fails(self, result, moved):
        raise OSError("the check could not read the cache")

    monkeypatch.setattr(kvobs._lifecycle.transfer.Transfer, "_finish", check_fails)
    sys.settrace(_interrupt_at(kvobs._lifecycle.transfer.Transfer.complete, "self.state = FAILED"))
    try:
        with pytest.raises(KeyboardInterrupt):
            t.complete()
    finally:
        sys.settrace(None)
    assert (t.state, t.outcome) == ("failed", "error")
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    assert lock_is_free(checked.observer.lock)


# -- odd exceptions and Ctrl-C during the lock wait ----------------------------------------------------------


class BadRepr(Exception):
    def __repr__(self):
        raise RuntimeError("repr fails")


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str fails")


@pytest.mark.parametrize("make", [BadRepr, BadStr])
def test_odd_exception_passes_through_unchanged_and_no_span_stays_current(cap, make):
    obs = cap.observer
    raised = make()

    @obs.send(block_ids="ids")
    def send(ids):
        raise raised

    with pytest.raises(make) as info:
        send([1])
    assert info.value is raised
    assert not trace.get_current_span().get_span_context().is_valid
    assert lock_is_free(obs.lock)
    (span,) = cap.spans
    assert span.attributes[sc.ATTR_ERROR_TYPE] == make.__qualname__
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1


def test_ctrl_c_during_the_lock_wait_leaves_no_span_current(cap):
    obs = cap.observer
    assert obs.lock.acquire(0)  # held by the test, so the guarded call waits

    @obs.send(block_ids="ids")
    def send(ids):
        return "sent"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            send([1])
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        obs.lock.release()
    assert not trace.get_current_span().get_span_context().is_valid
    assert lock_is_free(obs.lock)
    assert [s.attributes[sc.ATTR_ERROR_TYPE] for s in cap.spans] == ["KeyboardInterrupt"]
