"""Replace attributes of FastDeploy's objects (methods of one instance, a queue client's methods, a module's
function) and put every one back: the undo every integration returns.

Why not `kvobs.instrument` alone: FastDeploy reports completions through methods that are not transfers (a
queue's done signal, a messager's task registration); those are wrapped here, with the same two rules as
`instrument`: wrapping twice changes nothing, and the handle restores exactly what its own call replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_WRAPPED = "__kvobs_fastdeploy_original__"
_MISSING = object()


class Patches:
    """What an integration replaced, in order; `undo()` (or calling the handle) restores it. Idempotent."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, target: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
        """Set `target.<name>` to `wrap(current)`; False (nothing done) when kvobs already wrapped it."""
        current = getattr(target, name)
        if getattr(current, _WRAPPED, None) is not None:
            return False
        own = vars(target).get(name, _MISSING) if hasattr(target, "__dict__") else _MISSING
        replacement = wrap(current)
        setattr(replacement, _WRAPPED, current)  # wrappers are plain functions: the mark is theirs alone
        setattr(target, name, replacement)
        self._undo.append(lambda: _restore(target, name, own))
        return True

    def add(self, undo: Callable[[], None]) -> None:
        """Another undo step (an `Instrumentation`, a bridge's unregistration), run in reverse order."""
        self._undo.append(undo)

    @property
    def active(self) -> bool:
        """Whether anything is left to undo."""
        return bool(self._undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    __call__ = undo

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def _restore(target: Any, name: str, own: Any) -> None:
    if own is _MISSING:
        delattr(target, name)  # it was inherited (a class method seen through the instance): drop the override
    else:
        setattr(target, name, own)


def is_wrapped(function: Any) -> bool:
    """Whether kvobs's FastDeploy integration wrapped `function`."""
    return getattr(function, _WRAPPED, None) is not None
