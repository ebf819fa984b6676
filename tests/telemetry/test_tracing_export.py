"""configure_tracing against a collector that is down: failed exports are counted, and exit stays bounded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry
from support import otlp_receiver

import kvobs
from kvobs.telemetry._export import CountingSpanExporter
from kvobs.telemetry._metrics.families import MetricFamilies
from kvobs.telemetry._tracing import export_timeout


def closed_port() -> int:
    """A local port nothing listens on: bound once to find it free, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_errors(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("kvobs_telemetry_errors_total", {"engine": "", "stage": "export"}) or 0.0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_to_a_closed_port_is_counted(protocol):
    registry = CollectorRegistry()
    MetricFamilies.of(registry)
    provider = kvobs.configure_tracing("down", endpoint=f"http://127.0.0.1:{closed_port()}", protocol=protocol,
                                       timeout=0.5, set_global=False)
    before = export_errors(registry)
    try:
        provider.get_tracer("test").start_span("kvobs.send").end()
        provider.force_flush()
        assert export_errors(registry) == before + 1
    finally:
        provider.shutdown()


class Raising(SpanExporter):
    """An exporter with a bug."""

    def export(self, spans):
        raise RuntimeError("exporter bug")

    def shutdown(self):
        pass


class Refusing(SpanExporter):
    def export(self, spans):
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def test_an_exporter_that_raises_or_fails_is_counted_never_raised():
    seen = []
    for exporter in (Raising(), Refusing()):
        counted = CountingSpanExporter(exporter, lambda stage, exc: seen.append((stage, type(exc).__name__)))
        assert counted.export([]) is SpanExportResult.FAILURE
    assert seen == [("export", "RuntimeError"), ("export", "SpanExportFailed")]


def test_export_timeout_reads_the_otel_variables(monkeypatch):
    assert export_timeout(2.5) == 2.5
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "4")
    assert export_timeout() == 4.0
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3")
    assert export_timeout() == 3.0
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='soon'"):
        export_timeout()
    with pytest.raises(ValueError, match="timeout=0"):
        export_timeout(0)


DEAD_COLLECTOR = textwrap.dedent("""
    import sys, kvobs
    provider = kvobs.configure_tracing("exit", endpoint=f"http://127.0.0.1:{sys.argv[1]}", timeout=float(sys.argv[2]))
    tracer = provider.get_tracer("test")
    for _ in range(50):  # one span per batch (OTEL_BSP_MAX_EXPORT_BATCH_SIZE=1): 50 exports still queued
        tracer.start_span("kvobs.send").end()
    print("spans ended", flush=True)
""")


def test_exit_with_a_dead_collector_is_bounded_by_the_export_timeout():
    """Without a bound the SDK keeps exporting queued batches, each retried until its timeout, for up to 30 s
    at exit. The bound here is generous: the timeout plus 5 s."""
    timeout_s = 1.5
    env = {**os.environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", DEAD_COLLECTOR, str(closed_port()), str(timeout_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "spans ended"
        started = time.monotonic()
        proc.wait(timeout=60)
        exit_s = time.monotonic() - started
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert exit_s < timeout_s + 5, f"exit took {exit_s:.1f} s"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_flush_with_the_collector_down_is_bounded_honest_and_counts_every_dropped_span(monkeypatch, protocol):
    """The real OTLP exporter against a closed port, its timeout 10 s: a burst larger than the queue drops spans,
    each counted; force_flush(3000 ms) returns within its timeout, and False, since nothing was exported."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")
    registry = CollectorRegistry()
    MetricFamilies.of(registry)
    provider = kvobs.configure_tracing("down", endpoint=f"http://127.0.0.1:{closed_port()}", protocol=protocol,
                                       timeout=10, set_global=False)
    before = export_errors(registry)
    try:
        tracer = provider.get_tracer("test")
        for _ in range(1000):
            tracer.start_span("kvobs.send").end()
        dropped = export_errors(registry) - before
        started = time.monotonic()
        flushed = provider.force_flush(3000)
        flush_s = time.monotonic() - started
    finally:
        provider.shutdown()
    assert flushed is False
    assert flush_s < 3.0 + 1.0, f"force_flush(3000) took {flush_s:.1f} s"
    assert dropped >= 1000 - 64 - 16  # all but what the queue and the batch in flight hold


def test_flush_to_a_live_receiver_exports_every_span_and_says_so():
    registry = CollectorRegistry()
    MetricFamilies.of(registry)
    with otlp_receiver() as (receiver, port):
        provider = kvobs.configure_tracing("up", endpoint=f"http://127.0.0.1:{port}", protocol="grpc", timeout=10,
                                           set_global=False)
        before = export_errors(registry)
        try:
            tracer = provider.get_tracer("test")
            for _ in range(1500):
                tracer.start_span("kvobs.send").end()
            assert provider.force_flush(10_000) is True
            assert len(receiver.spans) == 1500
        finally:
            provider.shutdown()
    assert export_errors(registry) == before
