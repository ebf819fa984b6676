"""The kvobs options of the vLLM connector, read from `kv_connector_extra_config`.

vLLM hands a connector nothing but its config, so everything kvobs needs travels there, next to the wrapped
connector's own config (as `MultiConnector` keeps its children's under "connectors"). Every problem is a
ValueError naming the key, raised when vLLM builds the connector, never at the first transfer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONNECTOR = "connector"
ENGINE = "engine"
INTEGRITY = "integrity"
DEADLINE = "deadline"
CHECK_EVERY = "check_every"
TRACING = "tracing"
RECOMPUTE = "recompute"
KEYS = (CONNECTOR, ENGINE, INTEGRITY, CHECK_EVERY, DEADLINE, TRACING, RECOMPUTE)

# What a NaN/Inf finding does to vLLM:
#   report: a corrupt load is reported to vLLM as a load failure, which vLLM recomputes (kvobs sets its
#           kv_load_failure_policy to recompute unless `recompute` is false), and the corrupt stored copy is
#           never offered again; a corrupt store is not performed, and what it would have written is never
#           loaded (each load from there is reported as a load failure too);
#   raise:  CorruptKVError is raised into vLLM (the engine step fails; a corrupt store is never submitted);
#   count:  metrics, logs and spans only;
#   off:    no checks.
INTEGRITY_MODES = ("report", "raise", "count", "off")

# The key under which a prefill node's trace context travels in kv_transfer_params to the decode node.
TRACE_CONTEXT_KEY = "kvobs_trace_context"


@dataclass(frozen=True)
class Options:
    """The kvobs side of the connector's configuration."""

    connector: Mapping[str, Any]
    engine: str = "vllm"
    integrity: str = "report"
    check_every: int = 1  # check one transfer in N
    deadline: float | None = None
    tracing: bool = False  # export spans over OTLP, configured by the standard OTEL_* variables
    recompute: bool = True  # set vLLM's kv_load_failure_policy to recompute (mode `report`)


def read_options(extra_config: Mapping[str, Any] | None) -> Options:
    """Options from a KVObsConnector's `kv_connector_extra_config`; ValueError naming the first problem."""
    extra = dict(extra_config or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ValueError(f"KVObsConnector: unknown kv_connector_extra_config key(s) {unknown}; known: {', '.join(KEYS)}")
    return Options(
        connector=_connector(extra.get(CONNECTOR)),
        engine=_engine(extra.get(ENGINE, "vllm")),
        integrity=_integrity(extra.get(INTEGRITY, "report")),
        check_every=_check_every(extra.get(CHECK_EVERY, 1)),
        deadline=_deadline(extra.get(DEADLINE)),
        tracing=_flag(TRACING, extra.get(TRACING, False)),
        recompute=_flag(RECOMPUTE, extra.get(RECOMPUTE, True)),
    )


def _connector(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not isinstance(value.get("kv_connector"), str):
        raise ValueError(  # noqa: TRY004 - a configuration value, refused as vLLM refuses its own
            'KVObsConnector needs kv_connector_extra_config["connector"]: the wrapped connector\'s kv_transfer_config '
            'as a dict with at least "kv_connector", e.g. {"kv_connector": "OffloadingConnector", "kv_role": '
            f'"kv_both", "kv_connector_extra_config": {{...}}}}; got {value!r}'
        )
    return value


def _engine(value: Any) -> str:
    from kvobs import config

    return config.label_value("KVObsConnector engine", value)


def _integrity(value: Any) -> str:
    if value not in INTEGRITY_MODES:
        raise ValueError(f"KVObsConnector integrity={value!r}: use one of {', '.join(INTEGRITY_MODES)}")
    return value


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"KVObsConnector deadline={value!r}: use a positive number of seconds")
    return float(value)


def _check_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KVObsConnector check_every={value!r}: use an int >= 1 (1 checks every transfer)")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"KVObsConnector {key}={value!r}: use true or false")  # noqa: TRY004 - as above
    return value
