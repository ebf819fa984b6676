"""Find a transfer's keys, block ids, sync flag, cache and key in the decorated call's arguments.

A decorator spec is a parameter name (`"block_ids"`), an attribute path rooted at a parameter
(`"task.gpu_block_ids"`, `"self.gpu_cache"`), a callable receiving the call's own arguments, or any other
object, taken as the value itself (a cache tensor shared by every call). A string always names a parameter
here; code that passes values (`obs.transfer(...)`, `obs.begin(...)`) never goes through specs.
The parameter's position is resolved once, at decoration time, so the hot path is a tuple index or a dict
lookup, never `inspect.Signature.bind`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

Resolver = Callable[[tuple, dict], Any]
_MISSING = object()


class SpecError(LookupError):
    """A spec could not be resolved against the call's arguments."""


def compile_specs(specs: Mapping[str, Any], func: Callable[..., Any]) -> dict[str, Resolver]:
    """Resolvers for every spec that is set; a spec that cannot fit `func` is a ValueError now."""
    return {field: compile_spec(field, spec, func) for field, spec in specs.items() if spec is not None}


def compile_spec(field: str, spec: Any, func: Callable[..., Any]) -> Resolver | None:
    """Turn `spec` into a resolver for calls of `func`. Errors in a spec that cannot fit `func` surface now."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return _compile_path(field, spec, func)
    if callable(spec):
        return lambda args, kwargs: spec(*args, **kwargs)
    return lambda args, kwargs: spec


def _compile_path(field: str, spec: str, func: Callable[..., Any]) -> Resolver:
    root, *attrs = spec.split(".")
    params = inspect.signature(func).parameters
    if root not in params:
        raise ValueError(
            f"{field}={spec!r}: {getattr(func, '__qualname__', func)!r} has no parameter {root!r} "
            f"(parameters: {', '.join(params) or 'none'})"
        )
    param = params[root]
    positional = [
        name for name, p in params.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    index = positional.index(root) if root in positional else None
    default = param.default if param.default is not param.empty else _MISSING

    def resolve(args: tuple, kwargs: dict) -> Any:
        if index is not None and index < len(args):
            value = args[index]
        else:
            value = kwargs.get(root, default)
            if value is _MISSING:
                raise SpecError(f"{field}={spec!r}: argument {root!r} was not passed")
        for attr in attrs:
            value = _step(value, attr, field, spec)
        return value

    return resolve


def _step(value: Any, attr: str, field: str, spec: str) -> Any:
    if isinstance(value, Mapping):
        try:
            return value[attr]
        except KeyError:
            raise SpecError(f"{field}={spec!r}: mapping has no key {attr!r}") from None
    try:
        return getattr(value, attr)
    except AttributeError:
        raise SpecError(f"{field}={spec!r}: {type(value).__name__} object has no attribute {attr!r}") from None
