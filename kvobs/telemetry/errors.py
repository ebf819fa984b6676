"""Configuration errors of kvobs's metrics, raised when an observer is built, never while it records.

Each names what is wrong and what to do; all pickle with their fields, like every kvobs error.
"""

from __future__ import annotations

from typing import Any

from kvobs.errors import KVObsError


class MetricNameConflict(KVObsError, ValueError):
    """The registry already holds metrics named like kvobs's; nothing of kvobs was registered on it."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"this Prometheus registry already holds metric names kvobs needs ({detail}); nothing of kvobs "
            "was registered on it: unregister those collectors, or give kvobs its own registry "
            "(KVObserver(registry=CollectorRegistry()))"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.detail,)


class DuplicateEngine(KVObsError, ValueError):
    """A second live observer asked for an engine label already used on the same registry."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        super().__init__(
            f"engine label {engine!r} is already used by a live kvobs observer on this registry; two observers "
            "would share its series (and one's gauges would hide the other's): give each observer a distinct "
            f"engine label (e.g. {engine + '-2'!r}), or drop the first observer before creating another"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.engine,)


class MultiprocessDirError(KVObsError, ValueError):
    """PROMETHEUS_MULTIPROC_DIR does not name a directory this process can write its metric files into."""

    def __init__(self, variable: str, path: str, reason: str) -> None:
        self.variable = variable
        self.path = path
        self.reason = reason
        super().__init__(
            f"{variable}={path!r} {reason}: in multiprocess mode every worker writes its metrics there; "
            f"create the directory (writable by this user, emptied before the workers start), or unset "
            f"{variable} for a single process"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.variable, self.path, self.reason)
