"""OpenTelemetry tracing: find a tracer cheaply per call, and a `configure_tracing` helper for applications.

Library code never sets the global provider. When no provider is configured (the API's proxy/no-op one),
kvobs skips span work entirely, so metrics-only users do not pay for a no-op span on every call. kvobs's own
tracer never draws ids from the global `random` (see trace_ids.py), whoever built the provider.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Tracer, TracerProvider

from kvobs._version import __version__

INSTRUMENTATION_NAME = "kvobs"
RECHECK_S = 1.0
DEFAULT_EXPORT_TIMEOUT_S = 10.0
_ENV_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
_ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"


class TracerSource:
    """The tracer to use now: the explicit provider's, or the global one once an application sets it."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self._explicit = provider is not None
        self._provider: Any = None
        self.tracer: Tracer | None = None  # read directly on the fast lane, with `recheck_at`
        self.recheck_at = float("inf") if self._explicit else 0.0  # perf_counter() time of the next lookup
        if provider is not None:
            self._adopt(provider)

    def _adopt(self, provider: Any) -> None:
        self._provider = provider
        if isinstance(provider, (ProxyTracerProvider, NoOpTracerProvider)):
            self.tracer = None
        else:
            self.tracer = _with_unique_ids(provider.get_tracer(INSTRUMENTATION_NAME, __version__))

    def get(self) -> Tracer | None:
        """None while only the no-op API is in place. The global provider is looked up at most once per
        `RECHECK_S` (the lookup reads os.environ: too slow for every call), so a provider set later is picked up
        within it."""
        if not self._explicit:
            now = perf_counter()
            if now >= self.recheck_at:
                self.recheck_at = now + RECHECK_S
                provider = trace.get_tracer_provider()
                if provider is not self._provider:
                    self._adopt(provider)
        return self.tracer


def _with_unique_ids(tracer: Tracer) -> Tracer:
    """`tracer` (kvobs's own, a new object per `get_tracer` call) with ids unique per process, when its
    provider left it the SDK's default generator. Only this tracer changes: the provider, and the
    application's own tracers, keep theirs."""
    from kvobs.telemetry._trace_ids import UNIQUE_IDS, draws_from_global_random

    if draws_from_global_random(getattr(tracer, "id_generator", None)):
        tracer.id_generator = UNIQUE_IDS  # type: ignore[attr-defined]
    return tracer


def call_in_span(span: Any, func: Callable[..., Any], args: tuple, kwargs: dict, context: Any = None) -> Any:
    """Run `func` with a transfer's span current, so the engine's own spans and logs nest under it. `context`: the
    current Context when the caller read it already (for the span's parent), so it is not read again."""
    token = otel_context.attach(trace.set_span_in_context(span, context))
    try:
        return func(*args, **kwargs)
    finally:
        otel_context.detach(token)


def configure_tracing(
    service_name: str | None = None,
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    exporter: Any = None,
    timeout: float | None = None,
    set_global: bool = True,
) -> TracerProvider:
    """Build an SDK TracerProvider exporting over OTLP, for applications (never called by kvobs itself).

    Honours the standard variables: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (resource),
    OTEL_TRACES_SAMPLER[_ARG] (sampler), OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT (endpoint) and
    OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL (`grpc`, the default, or `http/protobuf`), and
    OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT (`timeout`, seconds per export). Arguments win over them.

    Trace and span ids come from a generator of kvobs's own, unique per process even when the application seeds
    `random` alike everywhere (vLLM seeds it with 0). Every failed export and every span dropped from the full
    queue is counted in kvobs_telemetry_errors_total{engine="", stage="export"} and logged once per interval;
    `force_flush(ms)` returns within its timeout, True only when everything ended before it was exported;
    shutting the provider down (at exit, too) takes at most about `timeout` seconds even when the collector is
    unreachable.
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    from kvobs.telemetry._export import BoundedBatchSpanProcessor, CountingSpanExporter
    from kvobs.telemetry._process_failures import process_failures
    from kvobs.telemetry._trace_ids import UNIQUE_IDS

    timeout_s = export_timeout(timeout)
    attributes = {SERVICE_NAME: service_name} if service_name else {}
    provider = SdkTracerProvider(resource=Resource.create(attributes), id_generator=UNIQUE_IDS)
    if exporter is None:
        exporter = otlp_exporter(endpoint=endpoint, protocol=protocol, timeout=timeout_s)
    failed = process_failures()
    provider.add_span_processor(BoundedBatchSpanProcessor(CountingSpanExporter(exporter, failed), timeout_s, failed))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def export_timeout(timeout: float | None = None) -> float:
    """Seconds allowed per export: `timeout`, else OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, else
    OTEL_EXPORTER_OTLP_TIMEOUT (seconds, as the Python OTLP exporters read them), else 10."""
    source = "timeout"
    value: Any = timeout
    if value is None:
        for variable in (_ENV_TRACES_TIMEOUT, _ENV_TIMEOUT):
            if os.environ.get(variable):
                source = variable
                value = os.environ[variable]
                break
        else:
            return DEFAULT_EXPORT_TIMEOUT_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (0 < seconds < math.inf):
        raise ValueError(f"{source}={value!r} is not a positive number of seconds")
    return seconds


def otlp_exporter(endpoint: str | None = None, protocol: str | None = None, timeout: float | None = None) -> Any:
    """An OTLP span exporter for `protocol` (`grpc` or `http/protobuf`), reading OTEL_* variables for defaults."""
    protocol = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if endpoint is not None:
            options.update(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        return OTLPSpanExporter(**options)
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if endpoint is not None:
            options["endpoint"] = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else (
                endpoint.rstrip("/") + "/v1/traces")
        return HttpExporter(**options)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}: use 'grpc' or 'http/protobuf'")
