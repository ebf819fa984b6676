"""Parsing of KVObserver options and KVOBS_* variables: every problem is a clear error at construction."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from kvobs import semconv as sc
from kvobs.errors import InvalidOption
from kvobs.policy import IntegrityPolicy

DEFAULT_LOCK_TIMEOUT_S = 30.0
DEFAULT_DEADLINE_S = 60.0
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_TRUTHY = {"1", "true", "yes", "on"}
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
    """A positive finite number of seconds: the argument, else the variable `env`, else `default`.

    InvalidOption names the argument or the variable, whichever the bad value came from."""
    expected = "use a positive finite number of seconds"
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return default
        try:
            parsed = float(text)
        except ValueError:
            raise InvalidOption(env, text, expected) from None
        if not math.isfinite(parsed) or parsed <= 0:
            raise InvalidOption(env, text, expected)
        return parsed
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidOption(what, value, expected)
    return float(value)


def cache_lock(lock: Any) -> Any:
    """"thread" -> a ThreadLock, None -> a NullLock (observe only), else a kvobs lock (checked)."""
    from kvobs.locks._cache_lock import NullLock, ThreadLock

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
    """The `enabled` argument (True, False, or None for the environment), else KVOBS_ENABLED, else on.

    Anything else is an error: a typo such as `enabled="false"` or `KVOBS_ENABLED=maybe` silently meaning
    "on" would leave an operator believing telemetry is off (or the reverse)."""
    if value is not None:
        if not isinstance(value, bool):
            raise InvalidOption("enabled", value, f"use True, False, or None to read {sc.ENV_ENABLED}")
        return value
    text = os.environ.get(sc.ENV_ENABLED, "").strip().lower()
    if not text:
        return True
    if text in _TRUTHY or text in _FALSY:
        return text in _TRUTHY
    raise InvalidOption(sc.ENV_ENABLED, os.environ[sc.ENV_ENABLED], "use 1/true/yes/on or 0/false/no/off")


def policy(value: Any) -> IntegrityPolicy | None:
    """'raise' / 'skip' / 'count' / an IntegrityPolicy / None or False (off)."""
    if value is None or value is False:
        return None
    if isinstance(value, IntegrityPolicy):
        return value
    if isinstance(value, str):
        return IntegrityPolicy(mode=value)
    raise TypeError(f"integrity policy must be 'raise', 'skip', 'count', an IntegrityPolicy or None, got {value!r}")
