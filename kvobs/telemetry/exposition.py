"""Serve the metrics: loopback by default, and correct under PROMETHEUS_MULTIPROC_DIR."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from kvobs.telemetry.multiprocess import check_multiprocess_dir, multiprocess_enabled


def scrape_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The registry a scrape should read: every worker's files in multiprocess mode, else `registry`.

    A multiprocess directory that is missing or unreadable is a MultiprocessDirError naming the variable.
    """
    if multiprocess_enabled():
        check_multiprocess_dir(writable=False)
        aggregated = CollectorRegistry()
        MultiProcessCollector(aggregated)
        return aggregated
    return REGISTRY if registry is None else registry


def start_metrics_server(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> Any:
    """Start an HTTP /metrics server on `addr:port` (loopback unless told otherwise); returns (server, thread).

    OpenMetrics is negotiated from the scraper's Accept header, so exemplars reach Prometheus.
    """
    return start_http_server(port, addr=addr, registry=scrape_registry(registry))
