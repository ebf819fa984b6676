"""Guards: decorators that turn each call of an engine method into one Transfer.

`obs.prefetch(...)`, `obs.write_back(...)`, `obs.send(...)` and `obs.guard(path, ...)` return a `Guard`.
Its specs name where the call's keys, block ids, cache, key, ... are found (see `kvobs._lifecycle.arguments`), compiled
once per decorated function. A call validates, takes the lock, checks the sources of a reading transfer,
runs the function with the transfer's span current, then either completes the transfer (checking the
destinations of a writing transfer) or, with `complete_later=`, leaves it open under its key until
`obs.complete(path, key, ...)` ends it from wherever the engine learns the copy is done. A synchronous guard
naming at most block ids, keys, `sync`, a byte count and a request id, on a ThreadLock or NullLock, holds the
lock of its calls' transfers through the lifecycle's fast path (`kvobs._lifecycle.fast_lane`).

Generators and async generators are refused at decoration: a guard would cover only the creation of the
generator object, not the copy it performs while iterated. A plain function that returns a coroutine is
refused when it does, for the same reason (decorate the `async def` itself).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from kvobs._lifecycle import fast_lane
from kvobs._lifecycle.active import ACTIVE, with_added
from kvobs._lifecycle.arguments import Resolver, SpecError, compile_specs
from kvobs._lifecycle.fast_lane import refuse_awaitable
from kvobs._lifecycle.route import Route
from kvobs._lifecycle.transfer import UNSET, CorruptHandler, Transfer
from kvobs.errors import TransferRejected
from kvobs.telemetry._tracing import call_in_span

SPEC_FIELDS = ("keys", "block_ids", "requests", "sync", "cache", "nbytes", "request_id", "group_sizes",
               "complete_later", "trace_context")


class Guard:
    """A decorator for one path. One guard may decorate several functions (specs compile per function)."""

    def __init__(
        self,
        route: Route,
        specs: dict[str, Any],
        *,
        result: Callable[[Any], Any] | None = None,
        on_corrupt: CorruptHandler | None = None,
        observer: Any = None,
    ) -> None:
        unknown = set(specs) - set(SPEC_FIELDS)
        if unknown:
            raise TypeError(f"unknown guard spec(s) {sorted(unknown)}; known: {', '.join(SPEC_FIELDS)}")
        for name, value in (("result", result), ("on_corrupt", on_corrupt)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {value!r}")
        self.route = route
        self.specs = specs
        self.result = result
        self.on_corrupt = on_corrupt
        self.observer = observer  # whom `kvobs.instrument` instruments for: one observer per engine method

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"kvobs cannot guard generator {getattr(func, '__qualname__', func)!r}: the lock would cover "
                "only the creation of the generator, not the copy it performs while iterated; guard the "
                "function that performs the copy"
            )
        resolvers = compile_specs(self.specs, func)
        if inspect.iscoroutinefunction(func):
            return functools.wraps(func)(self._async_wrapper(func, resolvers))
        general = self._sync_wrapper(func, resolvers)
        fast = None if self.result is not None else fast_lane.guarded(self.route, func, resolvers, general)
        return functools.wraps(func)(general if fast is None else fast)

    def __enter__(self) -> None:
        raise TypeError(
            "a guard is a decorator; for a block of code use `with obs.transfer(path, block_ids=[...], ...)`, "
            "which takes the values themselves"
        )

    def __exit__(self, *exc_info: object) -> None:  # never reached: __enter__ refuses
        return None

    def _sync_wrapper(self, func: Callable[..., Any], resolvers: dict[str, Resolver]) -> Callable[..., Any]:
        new = self._factory(resolvers)
        later = "complete_later" in resolvers

        def guarded(*args: Any, **kwargs: Any) -> Any:
            """Written out flat: every guarded call of the engine runs it."""
            t = new(args, kwargs)
            try:
                t.acquire(skippable=True)
                if t.skipped_result is not UNSET:
                    return t.skip()
                previous = ACTIVE.get()
                ACTIVE.set(with_added(t, previous) if previous else (t,))
                try:
                    if t.span is None:
                        result = func(*args, **kwargs)
                    else:
                        result = call_in_span(t.span, func, args, kwargs)
                finally:
                    ACTIVE.set(previous)
                if result is not None and inspect.isawaitable(result):
                    refuse_awaitable(func, result)
                return t.returned(result, later) if later else t.complete(result)
            except BaseException as exc:
                t._release()
                t.fail(exc)
                raise

        return guarded

    def _async_wrapper(self, func: Callable[..., Any], resolvers: dict[str, Resolver]) -> Callable[..., Any]:
        new = self._factory(resolvers)
        later = "complete_later" in resolvers

        async def guarded(*args: Any, **kwargs: Any) -> Any:
            t = new(args, kwargs)
            try:
                await t.acquire_async(skippable=True)
                if t.skipped:
                    return t.skip()
                return t.returned(await _await_under(t, func, args, kwargs), later)
            except BaseException as exc:
                t._release()
                t.fail(exc)
                raise

        return guarded

    def _factory(self, resolvers: dict[str, Resolver]) -> Callable[[tuple, dict], Transfer]:
        """What builds each call's Transfer: the quick one when the guard names nothing to resolve or to read
        from the result (the transfer claims the whole cache and checks nothing)."""
        if resolvers or self.result is not None:
            return functools.partial(self._new, resolvers)
        return self._new_without_specs

    def _new_without_specs(self, args: tuple, kwargs: dict) -> Transfer:
        """A guard that names nothing in the call: the transfer claims the whole cache, nothing to check."""
        return Transfer(self.route)

    def _new(self, resolvers: dict[str, Resolver], args: tuple, kwargs: dict) -> Transfer:
        """The call's validated Transfer; a spec that does not resolve is a recorded TransferRejected."""
        try:
            values = {name: resolve(args, kwargs) for name, resolve in resolvers.items()}
        except SpecError as exc:
            rejected = TransferRejected(self.route.path, str(exc))
            Transfer(self.route).reject(rejected)
            raise rejected from None
        get = values.get
        t = Transfer(self.route, keys=get("keys"), cache=get("cache"), nbytes=get("nbytes"),
                     request_id=get("request_id"), key=get("complete_later"), trace_context=get("trace_context"),
                     moved_from=self.result, on_corrupt=self.on_corrupt)
        return t.validate(block_ids=get("block_ids", UNSET), requests=get("requests", UNSET), sync=get("sync"),
                          group_sizes=get("group_sizes"), completes_later="complete_later" in values)


async def _await_under(t: Transfer, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Await `func` as the code under `t`: active in this context (re-entry refused), its span current."""
    previous = ACTIVE.get()
    ACTIVE.set(with_added(t, previous))
    token = None if t.span is None else otel_context.attach(trace.set_span_in_context(t.span))
    try:
        return await func(*args, **kwargs)
    finally:
        if token is not None:
            otel_context.detach(token)
        ACTIVE.set(previous)
