"""Trace and span ids that are unique in every process, whatever the application does to `random`.

Why: the OpenTelemetry SDK's default id generator draws from Python's global `random`, and engines seed it (vLLM
calls `random.seed(0)` in every engine process), so every process produced the same sequence of trace and span
ids. These ids come from a private `random.Random`, seeded from os.urandom and reseeded in every forked child:
nothing the application does to `random` reaches it, and a fork does not duplicate its state. It costs what the
SDK's default costs per id (os.urandom per id would be a system call each; see docs/benchmarks.md).
"""

from __future__ import annotations

import os
import random

from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

from kvobs._runtime.forks import in_forked_child

__all__ = ["UNIQUE_IDS", "ProcessUniqueIdGenerator", "draws_from_global_random"]

_SEED_BYTES = 32
_source = random.Random(os.urandom(_SEED_BYTES))  # noqa: S311 - ids must be unique, not secret
_draw = _source.getrandbits


def _reseed_in_child() -> None:
    """A forked child starts from its parent's state: without a fresh seed it repeats the parent's next ids."""
    _source.seed(os.urandom(_SEED_BYTES))


in_forked_child(_reseed_in_child)


class ProcessUniqueIdGenerator(IdGenerator):
    """The SDK's id generator interface over the private source above."""

    def generate_span_id(self) -> int:
        span_id = _draw(64)
        while span_id == INVALID_SPAN_ID:
            span_id = _draw(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = _draw(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = _draw(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True  # every bit is random, as W3C's random-trace-id flag and ratio samplers expect


UNIQUE_IDS = ProcessUniqueIdGenerator()


def draws_from_global_random(generator: object) -> bool:
    """True for the SDK's default generator (exactly that class: a generator of the user's own is kept)."""
    return type(generator) is RandomIdGenerator
