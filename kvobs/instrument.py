"""Guard an engine's existing methods by name, without editing the engine's source; and undo it.

    undo = kvobs.instrument(PrefixCacheManager, {
        "issue_prefetch_storage_task": obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids"),
        "issue_write_back_storage_task": obs.write_back(keys="task.keys", block_ids="task.gpu_block_ids"),
    })
    ...
    undo()   # the class is exactly as before

A method is never wrapped twice: instrumenting one that is already instrumented is a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvobs.guard import Transfer

_ORIGINAL = "__kvobs_original__"


class Instrumentation:
    """The handle `instrument` returns: call it (or `undo()`) to restore the original methods. Idempotent."""

    def __init__(self, target: Any, originals: dict[str, Any]) -> None:
        self._target = target
        self._originals = originals

    def undo(self) -> None:
        for name, original in self._originals.items():
            if original is None:
                delattr(self._target, name)
            else:
                setattr(self._target, name, original)
        self._originals = {}

    __call__ = undo

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def instrument(target: Any, guards: Mapping[str, Transfer]) -> Instrumentation:
    """Replace `target.<name>` (a class or an instance) by the guarded version, for every name given."""
    originals: dict[str, Any] = {}
    wrapped: dict[str, Any] = {}
    for name, guard in guards.items():
        if not isinstance(guard, Transfer):
            raise TypeError(f"{name}: expected obs.prefetch(...)/write_back(...)/send(...), got {guard!r}")
        current = _own_attribute(target, name)
        function = getattr(target, name, None)
        if function is None or not callable(function):
            raise AttributeError(f"{_describe(target)} has no method {name!r} to instrument")
        if hasattr(function, _ORIGINAL):
            raise ValueError(f"{_describe(target)}.{name} is already instrumented by kvobs; undo that first")
        if isinstance(current, (classmethod, staticmethod)):
            raise TypeError(f"{_describe(target)}.{name}: only plain methods and functions can be instrumented")
        guarded = guard(current if current is not None else function)
        setattr(guarded, _ORIGINAL, function)
        originals[name] = current
        wrapped[name] = guarded
    for name, guarded in wrapped.items():
        setattr(target, name, guarded)
    return Instrumentation(target, originals)


def _own_attribute(target: Any, name: str) -> Any:
    """The attribute as defined on `target` itself (None when inherited or missing), so undo restores it."""
    namespace = target.__dict__ if hasattr(target, "__dict__") else {}
    return namespace.get(name)


def _describe(target: Any) -> str:
    return target.__qualname__ if isinstance(target, type) else f"{type(target).__qualname__} instance"
