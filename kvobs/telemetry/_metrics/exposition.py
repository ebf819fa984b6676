"""Serve the metrics: loopback by default, and correct under PROMETHEUS_MULTIPROC_DIR."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from kvobs.telemetry._metrics.multiprocess import check_multiprocess_dir, clear_dead_processes, multiprocess_enabled


def scrape_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The registry a scrape should read: every worker's files in multiprocess mode, else `registry`.

    In multiprocess mode each scrape first clears the gauges of workers that have ended (see
    `clear_dead_processes`). A multiprocess directory that is missing or unreadable is a MultiprocessDirError
    naming the variable.
    """
    if multiprocess_enabled():
        check_multiprocess_dir(writable=False)
        aggregated = CollectorRegistry()
        aggregated.register(_LiveWorkersCollector(MultiProcessCollector(None)))
        return aggregated
    return REGISTRY if registry is None else registry


class _LiveWorkersCollector:
    """prometheus_client's MultiProcessCollector, after the gauges of dead workers are cleared."""

    def __init__(self, files: MultiProcessCollector) -> None:
        self._files = files

    def collect(self) -> Iterator[Metric]:
        clear_dead_processes()
        return self._files.collect()


def start_metrics_server(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> Any:
    """Start an HTTP /metrics server on `addr:port` (loopback unless told otherwise); returns (server, thread).

    OpenMetrics is negotiated from the scraper's Accept header, so exemplars reach Prometheus.
    """
    return start_http_server(port, addr=addr, registry=scrape_registry(registry))
