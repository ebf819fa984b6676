"""Guard an engine's existing methods by name, without editing the engine's source; and undo it.

    undo = kvobs.instrument(PrefixCacheManager, {
        "issue_prefetch_storage_task": obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids"),
        "issue_write_back_storage_task": obs.write_back(keys="task.keys", block_ids="task.gpu_block_ids"),
    })
    ...
    undo()   # the class is exactly as before

A class or a single instance can be instrumented; on an instance the method is guarded with `self` still
in the call, so specs such as "self.gpu_cache" work.

`Instrumentation` is the one way kvobs replaces an engine's attributes, here and in every integration: each
replacement carries one mark (what it replaced, and for which observer), so every patcher sees what every
other one did. Instrumenting a method kvobs already replaced for the same observer changes nothing (as
OpenTelemetry's `instrument()` does); for another observer it is refused (`AlreadyInstrumented`): that
observer would see none of the calls. A handle undoes exactly what its own calls replaced.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

from kvobs.errors import AlreadyInstrumented
from kvobs.guard import Guard

_ORIGINAL = "__kvobs_original__"  # on every replacement kvobs installs: the attribute it replaced
_OWNER = "__kvobs_owner__"  # ... and the observer (or other owner) it was installed for
_MISSING = object()

# hook(original_function, self, *args, **kwargs) -> what the method returns
Hook = Callable[..., Any]


class Instrumentation:
    """What one instrumentation replaced, in order; call it (or `undo()`) to restore it. Idempotent.

    owner: the observer the replacements report to; a method already replaced for another owner is refused.
    """

    def __init__(self, owner: Any = None) -> None:
        self.owner = owner
        self._undo: list[Callable[[], None]] = []
        self._methods: list[str] = []

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this handle replaced (and will restore)."""
        return tuple(self._methods)

    @property
    def active(self) -> bool:
        """Whether anything is left to undo."""
        return bool(self._undo)

    def replace(self, target: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
        """Set `target.<name>` (on a class, an object or a module) to `wrap(current)`. False (nothing done) when
        kvobs already replaced it for this handle's owner; AlreadyInstrumented when for another one."""
        current = getattr(target, name, _MISSING)
        if current is _MISSING:
            raise AttributeError(f"{_describe(target)} has no attribute {name!r} to instrument")
        if not self._claims(target, name, current):
            return False
        own = vars(target).get(name, _MISSING) if hasattr(target, "__dict__") else _MISSING
        replacement = wrap(current)
        mark = getattr(replacement, "__func__", replacement)  # a bound method's attributes are its function's
        setattr(mark, _ORIGINAL, current)
        setattr(mark, _OWNER, self.owner)
        setattr(target, name, replacement)
        self._undo.append(functools.partial(_restore, target, name, own))
        self._methods.append(f"{_describe(target)}.{name}")
        return True

    def wrap_method(self, target: Any, name: str, hook: Hook) -> bool:
        """Make `target.<name>(...)` run `hook(original, self, ...)`; `target` is a class or one object (whose
        method then stays bound to it). For completions that are not a call kvobs can decorate: the hook runs
        the original method and reads what it did."""
        current = getattr(target, name, None)
        if not callable(current):
            raise AttributeError(f"{_describe(target)} has no method {name!r} to instrument")  # noqa: TRY004
        on_class = isinstance(target, type)
        function = current if on_class else getattr(current, "__func__", None)
        if not isinstance(function, types.FunctionType):
            raise TypeError(f"{_describe(target)}.{name}: only plain methods can be instrumented")

        def hooking(_: Any) -> Any:
            @functools.wraps(function)
            def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
                return hook(function, self, *args, **kwargs)

            return hooked if on_class else types.MethodType(hooked, target)

        return self.replace(target, name, hooking)

    def add(self, undo: Callable[[], None]) -> None:
        """Another undo step (restoring an engine object's lists, ending what is still open); run in reverse."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._methods.clear()

    __call__ = undo

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    @staticmethod
    def is_instrumented(attribute: Any) -> bool:
        """Whether kvobs replaced `attribute` (a function, or a method of a class or object)."""
        return getattr(attribute, _ORIGINAL, None) is not None

    def claims(self, target: Any, *names: str) -> bool:
        """Whether `target`'s attributes `names` are this handle's to replace: True when kvobs has replaced none
        of them, False when it did for this owner (nothing to do); AlreadyInstrumented when for another owner.
        For integrations that set up state before replacing, so that a refusal changes nothing."""
        free = [self._claims(target, name, getattr(target, name, None)) for name in names]  # each one checked
        return all(free)

    def _claims(self, target: Any, name: str, current: Any) -> bool:
        """True when `current` is not kvobs's yet; False when it is this owner's; refused for another owner."""
        if not self.is_instrumented(current):
            return True
        owner = getattr(current, _OWNER, None)
        if owner is self.owner:
            return False
        raise AlreadyInstrumented(_describe(target), name, _describe_owner(owner))


def instrument(target: Any, guards: Mapping[str, Guard]) -> Instrumentation:
    """Replace `target.<name>` (on a class or an instance) by the guarded version, for every name given:
    all of them, or none (a refused name leaves everything as it was)."""
    for name, guard in guards.items():
        if not isinstance(guard, Guard):
            raise TypeError(f"{name}: expected obs.prefetch(...)/write_back(...)/send(...)/locked(...), got {guard!r}")
    owners = {id(guard.observer): guard.observer for guard in guards.values()}
    handle = Instrumentation(next(iter(owners.values())) if len(owners) == 1 else None)
    try:
        for name, guard in guards.items():
            function = getattr(target, name, None)
            if function is None or not callable(function):
                raise AttributeError(f"{_describe(target)} has no method {name!r} to instrument")
            current = _own_attribute(target, name)
            if isinstance(current, (classmethod, staticmethod)):
                raise TypeError(f"{_describe(target)}.{name}: only plain methods and functions can be instrumented")
            handle.replace(target, name, functools.partial(_guarded, target, guard, current))
    except BaseException:
        handle.undo()
        raise
    return handle


def _guarded(target: Any, guard: Guard, current: Any, function: Any) -> Any:
    bound = not isinstance(target, type) and isinstance(function, types.MethodType)
    # an instance's method: guard the function (with `self`), then bind it to this instance only
    guarded = guard(function.__func__ if bound else current if current is not None else function)
    return types.MethodType(guarded, target) if bound else guarded


def _own_attribute(target: Any, name: str) -> Any:
    """The attribute as defined on `target` itself (None when inherited or missing)."""
    namespace = target.__dict__ if hasattr(target, "__dict__") else {}
    return namespace.get(name)


def _restore(target: Any, name: str, own: Any) -> None:
    if own is _MISSING:
        delattr(target, name)  # it was inherited: dropping the override shows the inherited attribute again
    else:
        setattr(target, name, own)


def _describe(target: Any) -> str:
    if isinstance(target, types.ModuleType):
        return target.__name__
    return target.__qualname__ if isinstance(target, type) else f"{type(target).__qualname__} object"


def _describe_owner(owner: Any) -> str:
    engine = getattr(owner, "engine", None)
    return f"observer {engine!r}" if isinstance(engine, str) else repr(owner)
