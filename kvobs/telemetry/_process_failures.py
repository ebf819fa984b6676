"""Telemetry failures that belong to the process, not to one observer: span export, and metric files that
could not get their space (multiprocess mode).

One tracer provider serves every observer of a process, and one set of metric files, so their failures are
counted once, under engine label "", and shown as kvobs_telemetry_errors_total{engine="", stage=...} on every
registry holding kvobs's families (in multiprocess mode, through prometheus_client children of their own).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from prometheus_client import Counter

from kvobs import semconv as sc
from kvobs._runtime.forks import in_forked_child
from kvobs.telemetry._failures import STAGE_EXPORT, STAGE_METRICS, TELEMETRY_ERRORS_HELP, TelemetryFailures
from kvobs.telemetry._metrics.accumulators import CounterCell, CounterFamily
from kvobs.telemetry._metrics.multiprocess import (
    FILE_SPACE,
    ReservedMetric,
    check_multiprocess_dir,
    multiprocess_enabled,
)

__all__ = ["process_failures", "show_process_failures"]

_STAGES = (STAGE_EXPORT, STAGE_METRICS)  # metric files fail only in multiprocess mode


class _ProcessFailures:
    """The process's reporter, made on first use, and the registries' telemetry-error families showing it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reporter: TelemetryFailures | None = None
        self.counters: dict[str, Any] = {}
        self.families: weakref.WeakSet[CounterFamily] = weakref.WeakSet()

    def get(self) -> TelemetryFailures:
        with self.lock:
            if self.reporter is None:
                self.counters = _new_counters()
                self.reporter = TelemetryFailures("", self.counters)
                if multiprocess_enabled():
                    FILE_SPACE.count_in(self.counters[STAGE_METRICS])
            reporter = self.reporter
            families = list(self.families)
        for family in families:
            self.show_on(family)
        return reporter

    def show_on(self, family: Any) -> None:
        """Let `family` show the process's count, now if it is counting and otherwise once it starts."""
        if not isinstance(family, CounterFamily):
            return  # multiprocess mode: the count has a child of its own in the files
        self.families.add(family)
        for stage, counter in list(self.counters.items()):
            if isinstance(counter, CounterCell):
                family.show(("", stage), counter)

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        for counter in self.counters.values():
            if isinstance(counter, CounterCell):
                counter.lock = threading.Lock()


def _new_counters() -> dict[str, Any]:
    if not multiprocess_enabled():
        return {STAGE_EXPORT: CounterCell(threading.Lock())}
    check_multiprocess_dir()
    name = sc.TELEMETRY_ERRORS_TOTAL
    labelnames = sc.METRIC_LABELS[name]
    family = ReservedMetric(Counter(name.removesuffix("_total"), TELEMETRY_ERRORS_HELP, labelnames, registry=None),
                            "counter", name, TELEMETRY_ERRORS_HELP, labelnames)
    return {stage: family.labels("", stage) for stage in _STAGES}


_PROCESS = _ProcessFailures()
in_forked_child(_PROCESS.after_fork_in_child)


def process_failures() -> TelemetryFailures:
    """The reporter of process-wide telemetry failures (span export, metric files), counted under engine
    label ""."""
    return _PROCESS.get()


def show_process_failures(family: Any) -> None:
    """Let a registry's telemetry-error family (kvobs_telemetry_errors_total) show the process-wide count."""
    _PROCESS.show_on(family)
