"""Replace methods of SGLang's classes (or of one object) by kvobs hooks, and put every one back.

Why not `kvobs.instrument` alone: SGLang's completions are not calls kvobs can decorate (an acknowledgement
popped from a list, a status read by `poll()`, a status message parsed on another node), so each hook here is
a function that runs the original method and reads what it did. The rules are `instrument`'s: wrapping a
method kvobs already wrapped changes nothing, and the handle restores exactly what its own call replaced.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

_ORIGINAL = "__kvobs_sglang_original__"
_MISSING = object()

# hook(original_function, self, *args, **kwargs) -> what the method returns
Hook = Callable[..., Any]


class Patches:
    """What one integration call replaced, in order; `undo()` (or calling the handle) restores it. Idempotent."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._methods: list[str] = []

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this handle replaced (and will restore), as "Class.method"."""
        return tuple(self._methods)

    def wrap_method(self, target: Any, name: str, hook: Hook) -> bool:
        """Make `target.<name>(...)` run `hook(original, self, ...)`; `target` is a class or one object.
        False (nothing done) when kvobs already wrapped that method."""
        current = getattr(target, name, None)
        if not callable(current):
            raise AttributeError(f"{_describe(target)} has no method {name!r} to instrument")  # noqa: TRY004
        if getattr(current, _ORIGINAL, None) is not None:
            return False
        on_class = isinstance(target, type)
        function = current if on_class else getattr(current, "__func__", None)
        if not isinstance(function, types.FunctionType):
            raise TypeError(f"{_describe(target)}.{name}: only plain methods can be instrumented")

        @functools.wraps(function)
        def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(function, self, *args, **kwargs)

        setattr(hooked, _ORIGINAL, function)
        own = vars(target).get(name, _MISSING)
        setattr(target, name, hooked if on_class else types.MethodType(hooked, target))
        self._undo.append(functools.partial(_restore, target, name, own))
        self._methods.append(f"{_describe(target)}.{name}")
        return True

    def add(self, undo: Callable[[], None]) -> None:
        """Another undo step (restoring an engine object's lists, ending what is still open); run in reverse."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._methods.clear()

    __call__ = undo

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def is_instrumented(method: Any) -> bool:
    """Whether kvobs's SGLang integration wrapped `method` (a function, or a method of a class or object)."""
    return getattr(method, _ORIGINAL, None) is not None


def _restore(target: Any, name: str, own: Any) -> None:
    if own is _MISSING:
        delattr(target, name)  # it was inherited: dropping the override shows the inherited method again
    else:
        setattr(target, name, own)


def _describe(target: Any) -> str:
    return target.__qualname__ if isinstance(target, type) else f"{type(target).__qualname__} object"
