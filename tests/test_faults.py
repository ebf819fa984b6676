"""Faults injected at every stage of a guarded call: the lock is always released, the engine's exception
always comes through unchanged, and a telemetry fault never changes the call's result."""

from __future__ import annotations

import random

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

import kvobs
from kvobs import semconv as sc
from support import lock_is_free


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
        self._span, self._armed = span, armed

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
        self._child, self._armed = child, armed

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
    armed.stage, armed.fire = stage, make()
    with pytest.raises(BaseException) as info:
        write([1, 2])
    assert info.value is armed.fire
    assert lock_is_free(obs.lock)


@pytest.mark.parametrize("stage", TELEMETRY_STAGES)
def test_telemetry_fault_never_changes_the_result(rig, stage):
    armed, obs, write, registry = rig
    armed.stage, armed.fire = stage, RuntimeError(f"telemetry broke at {stage}")
    assert write([1, 2]) == ("written", (1, 2))
    assert lock_is_free(obs.lock)
    counted = sum(errors(registry, s) for s in ("metrics", "tracing", "logging", "hook"))
    assert counted >= 1


def test_telemetry_fault_while_the_engine_fails_keeps_the_engine_exception(rig):
    armed, obs, write, _ = rig
    armed.stage, armed.fire = "body", Boom("engine")

    @obs.send(block_ids="ids")
    def send(ids):
        raise armed.fire

    # the error-duration child is faulty too: the engine's exception must still be the one raised
    armed_metric = obs.metrics.paths["send"].duration[sc.OUTCOME_ERROR]
    armed_metric._armed = Armed()
    armed_metric._armed.stage, armed_metric._armed.fire = "metric", RuntimeError("metric broke")
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
