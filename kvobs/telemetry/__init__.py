"""Telemetry back-ends: Prometheus metrics, OpenTelemetry tracing, structlog logs."""
