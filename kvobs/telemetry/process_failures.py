"""Telemetry failures that belong to the process, not to one observer: span export.

One tracer provider serves every observer of a process, so its export failures are counted once, under
engine label "", and shown as kvobs_telemetry_errors_total{engine="", stage="export"} on every registry
holding kvobs's families (in multiprocess mode, through a prometheus_client child of its own).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from prometheus_client import Counter

from kvobs import semconv as sc
from kvobs.telemetry.accumulators import CounterCell, CounterFamily
from kvobs.telemetry.failures import STAGE_EXPORT, TELEMETRY_ERRORS_HELP, TelemetryFailures
from kvobs.telemetry.multiprocess import check_multiprocess_dir, multiprocess_enabled

__all__ = ["process_failures", "show_process_failures"]

_KEY = ("", STAGE_EXPORT)  # label values (engine, stage)


class _ProcessFailures:
    """The process's reporter, made on first use, and the registries' telemetry-error families showing it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reporter: TelemetryFailures | None = None
        self.counter: Any = None
        self.families: weakref.WeakSet[CounterFamily] = weakref.WeakSet()

    def get(self) -> TelemetryFailures:
        with self.lock:
            if self.reporter is None:
                self.counter = _new_counter()
                self.reporter = TelemetryFailures("", {STAGE_EXPORT: self.counter})
            reporter, families = self.reporter, list(self.families)
        for family in families:
            self.show_on(family)
        return reporter

    def show_on(self, family: Any) -> None:
        """Let `family` show the process's count, now if it is counting and otherwise once it starts."""
        if not isinstance(family, CounterFamily):
            return  # multiprocess mode: the count has a child of its own in the files
        self.families.add(family)
        counter = self.counter
        if isinstance(counter, CounterCell):
            family.show(_KEY, counter)

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        if isinstance(self.counter, CounterCell):
            self.counter.lock = threading.Lock()


def _new_counter() -> Any:
    if not multiprocess_enabled():
        return CounterCell(threading.Lock())
    check_multiprocess_dir()
    name = sc.TELEMETRY_ERRORS_TOTAL
    family = Counter(name.removesuffix("_total"), TELEMETRY_ERRORS_HELP, sc.METRIC_LABELS[name], registry=None)
    return family.labels(*_KEY)


_PROCESS = _ProcessFailures()
os.register_at_fork(after_in_child=_PROCESS.after_fork_in_child)


def process_failures() -> TelemetryFailures:
    """The reporter of process-wide telemetry failures (span export), counted under engine label ""."""
    return _PROCESS.get()


def show_process_failures(family: Any) -> None:
    """Let a registry's telemetry-error family (kvobs_telemetry_errors_total) show the process-wide count."""
    _PROCESS.show_on(family)
