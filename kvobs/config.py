"""Parsing of KVObserver options and KVOBS_* variables: every problem is a clear error at construction."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from kvobs import semconv as sc
from kvobs.policy import IntegrityPolicy

DEFAULT_LOCK_TIMEOUT_S = 30.0
DEFAULT_DEADLINE_S = 60.0
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_FALSY = {"0", "false", "no", "off"}


def label_value(what: str, value: Any) -> str:
    """A low-cardinality Prometheus label value (engine, path, holder names)."""
    if not isinstance(value, str) or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{what}={value!r} is not a valid label value: use 1-64 characters of letters, digits, '_.:-' "
            "(a low-cardinality name, never a request or block id)"
        )
    return value


def seconds(what: str, value: float | None, env: str, default: float) -> float:
    """A positive finite number of seconds: the argument, else the variable `env`, else `default`."""
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{env}={text!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def cache_lock(lock: Any) -> Any:
    """"thread" -> a ThreadLock, None -> a NullLock (observe only), else a kvobs lock (checked)."""
    from kvobs.locks import NullLock, ThreadLock

    chosen = ThreadLock() if lock == "thread" else NullLock() if lock is None else lock
    if not all(hasattr(chosen, a) for a in ("acquire_into", "overlaps", "held_for", "name")):
        raise TypeError(f"lock must be a kvobs lock (ThreadLock, ProcessLock, BlockLock, NullLock), got {lock!r}")
    return chosen


def block_dim(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"block_dim must be an int, got {value!r}")
    return value


def hooks(values: Any) -> tuple[Any, ...]:
    chosen = tuple(values)
    if not all(callable(h) for h in chosen):
        raise TypeError("every hook must be callable")
    return chosen


def optional_positive_int(what: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def enabled(value: bool | None) -> bool:
    """The `enabled` argument, else KVOBS_ENABLED (0/false/no/off turn telemetry off)."""
    if value is not None:
        return bool(value)
    return os.environ.get(sc.ENV_ENABLED, "1").strip().lower() not in _FALSY


def policy(value: Any) -> IntegrityPolicy | None:
    """'raise' / 'skip' / 'count' / an IntegrityPolicy / None or False (off)."""
    if value is None or value is False:
        return None
    if isinstance(value, IntegrityPolicy):
        return value
    if isinstance(value, str):
        return IntegrityPolicy(mode=value)
    raise TypeError(f"integrity policy must be 'raise', 'skip', 'count', an IntegrityPolicy or None, got {value!r}")
