"""structlog integration: kvobs logs through structlog without configuring it, and carries trace ids.

The default logger is structlog's lazy proxy, so an application that configures structlog after creating
an observer still gets its configuration. Successful calls log at debug only when the observer's level
allows it, checked by kvobs itself, so unconfigured structlog never floods an engine's stdout.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanContext

LOGGER_NAME = "kvobs"


def default_logger() -> Any:
    return structlog.get_logger(LOGGER_NAME)


def level_number(level: str | int) -> int:
    """`"debug"`/`"INFO"`/`20` -> a logging level number; unknown names are a clear error."""
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    return number


def trace_fields(span: Any = None) -> dict[str, str]:
    """`trace_id`/`span_id` of `span` (default: the current span) in the W3C hex form; empty when none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return context_fields(ctx) if ctx.is_valid else {}


def context_fields(ctx: SpanContext) -> dict[str, str]:
    """`trace_id`/`span_id` of a valid span context in the W3C hex form (log fields, exemplar labels)."""
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def add_trace_context(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor for applications: adds the current trace and span ids to every event."""
    for key, value in trace_fields().items():
        event_dict.setdefault(key, value)
    return event_dict
