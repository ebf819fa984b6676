"""Guard an engine's existing methods by name, without editing the engine's source; and undo it.

    undo = kvobs.instrument(PrefixCacheManager, {
        "issue_prefetch_storage_task": obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids"),
        "issue_write_back_storage_task": obs.write_back(keys="task.keys", block_ids="task.gpu_block_ids"),
    })
    ...
    undo()   # the class is exactly as before

A class or a single instance can be instrumented; on an instance the method is guarded with `self` still
in the call, so specs such as "self.gpu_cache" work. Instrumenting a method that kvobs already guards does
nothing (as OpenTelemetry's `instrument()` does), so calling `instrument` twice never wraps twice; the
handle undoes only what its own call did.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from kvobs.guard import Guard

_ORIGINAL = "__kvobs_original__"


class Instrumentation:
    """The handle `instrument` returns: call it (or `undo()`) to restore the original methods. Idempotent."""

    def __init__(self, target: Any, originals: dict[str, Any]) -> None:
        self._target = target
        self._originals = originals

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this handle instrumented (and will restore)."""
        return tuple(self._originals)

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


def instrument(target: Any, guards: Mapping[str, Guard]) -> Instrumentation:
    """Replace `target.<name>` (on a class or an instance) by the guarded version, for every name given."""
    originals: dict[str, Any] = {}
    wrapped: dict[str, Any] = {}
    for name, guard in guards.items():
        if not isinstance(guard, Guard):
            raise TypeError(f"{name}: expected obs.prefetch(...)/write_back(...)/send(...)/locked(...), got {guard!r}")
        current = _own_attribute(target, name)
        function = getattr(target, name, None)
        if function is None or not callable(function):
            raise AttributeError(f"{_describe(target)} has no method {name!r} to instrument")
        if hasattr(function, _ORIGINAL):
            continue  # already guarded by kvobs: instrumenting again changes nothing
        if isinstance(current, (classmethod, staticmethod)):
            raise TypeError(f"{_describe(target)}.{name}: only plain methods and functions can be instrumented")
        wrapped[name] = _guarded(target, guard, current, function)
        originals[name] = current
    for name, guarded in wrapped.items():
        setattr(target, name, guarded)
    return Instrumentation(target, originals)


def _guarded(target: Any, guard: Guard, current: Any, function: Any) -> Any:
    bound = not isinstance(target, type) and isinstance(function, types.MethodType)
    # an instance's method: guard the function (with `self`), then bind it to this instance only
    guarded = guard(function.__func__ if bound else current if current is not None else function)
    setattr(guarded, _ORIGINAL, function)
    return types.MethodType(guarded, target) if bound else guarded


def _own_attribute(target: Any, name: str) -> Any:
    """The attribute as defined on `target` itself (None when inherited or missing), so undo restores it."""
    namespace = target.__dict__ if hasattr(target, "__dict__") else {}
    return namespace.get(name)


def _describe(target: Any) -> str:
    return target.__qualname__ if isinstance(target, type) else f"{type(target).__qualname__} instance"
