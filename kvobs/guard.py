"""One guarded transfer: validate -> acquire (timed) -> span -> check -> call -> check -> release -> record.

`Transfer` is what `obs.prefetch(...)`, `obs.write_back(...)` and `obs.send(...)` return: a decorator for
functions, methods and `async def` functions, and a context manager (`with` / `async with`) for code that is
not a function. As a context manager its per-call state lives in a context variable, so one guard object
may be entered from several threads or asyncio tasks at once. The lock is released in `finally` whatever happens (exception, KeyboardInterrupt, a
cancelled coroutine); telemetry runs after the release and can never raise into the engine.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
from contextvars import ContextVar
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvobs import semconv as sc
from kvobs.arguments import SpecError, compile_spec
from kvobs.errors import TransferRejected
from kvobs.locks import LockTimeout
from kvobs.validation import validate_transfer

if TYPE_CHECKING:
    from kvobs.observer import KVObserver

MAX_IDS_ON_SPAN = 64


@dataclass(frozen=True)
class TransferRecord:
    """What one transfer did, handed to the observer's hooks after the lock is released."""

    engine: str
    path: str
    outcome: str
    duration_s: float
    lock_wait_s: float
    lock_hold_s: float
    blocks: int
    bytes: int
    error: BaseException | None
    bad_block_ids: tuple[int, ...]


class _Call:
    """Per-call state; one per guarded call, never shared. Defaults live on the class so that creating
    one costs no __init__ call."""

    t_start = 0.0
    t_acquired = 0.0
    span: Any = None
    token: Any = None
    keys: Any = None
    ids: list[int] | None = None
    cache: Any = None
    nbytes: int | None = None
    request_id: Any = None
    error: BaseException | None = None
    skipped = False
    bad_ids: tuple[int, ...] = ()
    check_result: Any = None


class Transfer:
    """A guard for one path, configured with where to find the call's keys, block ids, sync flag and cache."""

    def __init__(
        self,
        observer: KVObserver,
        path: str,
        *,
        keys: Any = None,
        block_ids: Any = None,
        sync: Any = None,
        cache: Any = None,
        nbytes: Any = None,
        request_id: Any = None,
        check: Any = None,
    ) -> None:
        self.observer = observer
        self.path = path
        self.specs = {
            "keys": keys, "block_ids": block_ids, "sync": sync,
            "cache": cache, "nbytes": nbytes, "request_id": request_id,
        }
        self.policy = observer.integrity_policy(path, check)
        self.sampler = self.policy.sampler() if self.policy is not None else None
        self.metrics = observer.metrics.paths[path] if observer.telemetry else None
        self.span_name = sc.span_name(path)
        self._static_attributes = {
            sc.ATTR_ENGINE: observer.engine, sc.ATTR_PATH: path, sc.ATTR_LOCK_NAME: observer.lock.name,
        }
        self.sync_required = path in observer.sync_required
        self._resolvers: dict[str, Callable[[tuple, dict], Any] | None] = {}
        self._cm_calls: ContextVar[tuple[_Call, ...]] = ContextVar(f"kvobs.{path}.{id(self):x}", default=())

    # -- decorator ---------------------------------------------------------------------------------------

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Decorate `func`. Specs are compiled against its signature, in a copy of this guard, so one guard
        object may decorate several functions."""
        guard = copy.copy(self)
        guard._resolvers = {name: compile_spec(name, spec, func) for name, spec in self.specs.items()}
        guard._has_specs = any(guard._resolvers.values())
        if inspect.iscoroutinefunction(func):
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                return await guard._run_async(func, args, kwargs)

            return functools.wraps(func)(guarded_async)
        if not self.observer.telemetry and self.policy is None:
            return functools.wraps(func)(guard._bare_wrapper(func))

        def guarded(*args: Any, **kwargs: Any) -> Any:
            return guard._run(func, args, kwargs)

        return functools.wraps(func)(guarded)

    def _bare_wrapper(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Disabled mode without checks: validation and the lock, nothing else (the cheapest safe path)."""
        lock, timeout, path = self.observer.lock, self.observer.lock_timeout, self.path
        needs_inputs = self._has_specs
        inputs = self._inputs

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if needs_inputs:
                inputs(args, kwargs)
            if not lock.acquire(timeout):
                raise LockTimeout(lock.name, timeout, path)
            try:
                return func(*args, **kwargs)
            finally:
                lock.release()

        return guarded

    # -- context manager ---------------------------------------------------------------------------------

    def __enter__(self) -> Transfer:
        self._compile_values()
        call = self._begin((), {})
        self._acquire_sync(call)
        self._enter_cm(call)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        stack = self._cm_calls.get()
        self._cm_calls.set(stack[:-1])
        self._exit_locked(stack[-1], exc)

    async def __aenter__(self) -> Transfer:
        self._compile_values()
        call = self._begin((), {})
        await self._acquire_async(call)
        self._enter_cm(call)
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    def _enter_cm(self, call: _Call) -> None:
        """A with-block body cannot be skipped, so the `skip` policy raises here like `raise` does."""
        try:
            self._enter_locked(call)
            if call.skipped:
                from kvobs.integrity import CorruptKVError

                raise CorruptKVError(self.path, call.check_result)
        except BaseException as exc:
            call.error = exc
            self._release_and_record(call)
            raise
        self._cm_calls.set(self._cm_calls.get() + (call,))

    def _compile_values(self) -> None:
        """As a context manager every spec is the value itself (a callable is called with no arguments)."""
        if not self._resolvers:
            for name, spec in self.specs.items():
                self._resolvers[name] = None if spec is None else (
                    (lambda args, kwargs, f=spec: f()) if callable(spec) else (lambda args, kwargs, v=spec: v))
            self._has_specs = any(self._resolvers.values())

    # -- the guarded call --------------------------------------------------------------------------------

    def _run(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The synchronous guarded call, written out flat: it is the hot path every transfer takes."""
        obs = self.observer
        call = self._begin(args, kwargs)
        lock = obs.lock
        acquired = lock.acquire(obs.lock_timeout)
        call.t_acquired = perf_counter()
        if not acquired:
            self._timed_out(call)
        metrics = self.metrics
        try:
            if metrics is not None:
                metrics.in_flight.start()
            if self.sampler is None:
                return func(*args, **kwargs)
            if self.path != sc.PATH_PREFETCH:
                self._check(call)
            result = None if call.skipped else func(*args, **kwargs)
            self._after_call(call)
            return result
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            try:
                lock.release()
            finally:
                if metrics is not None:
                    obs.record_transfer(self, call, perf_counter())

    async def _run_async(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        call = self._begin(args, kwargs)
        await self._acquire_async(call)
        try:
            self._enter_locked(call)
            result = None if call.skipped else await func(*args, **kwargs)
            self._after_call(call)
            return result
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            self._release_and_record(call)

    def _inputs(self, args: tuple, kwargs: dict) -> _Call:
        """Resolve and validate the call's inputs; a problem is a TransferRejected, before any lock."""
        call = _Call()
        r = self._resolvers
        try:
            keys = r["keys"](args, kwargs) if r.get("keys") else None
            ids = r["block_ids"](args, kwargs) if r.get("block_ids") else None
            sync = r["sync"](args, kwargs) if r.get("sync") else None
            call.cache = r["cache"](args, kwargs) if r.get("cache") else None
            call.nbytes = r["nbytes"](args, kwargs) if r.get("nbytes") else None
            call.request_id = r["request_id"](args, kwargs) if r.get("request_id") else None
        except SpecError as exc:
            raise TransferRejected(self.path, str(exc)) from None
        call.keys = keys
        call.ids = validate_transfer(
            self.path, keys, ids, sync, sync_required=self.sync_required, capacity=self.observer.capacity
        )
        return call

    def _begin(self, args: tuple, kwargs: dict) -> _Call:
        obs = self.observer
        if not self._has_specs:
            call = _Call()
        else:
            try:
                call = self._inputs(args, kwargs)
            except TransferRejected as exc:
                obs.record_rejected(self.path, exc)
                raise
        if obs.telemetry:
            tracer = obs.tracer_source.get()
            if tracer is not None:
                self._start_span(tracer, call)
        call.t_start = perf_counter()
        return call

    def _start_span(self, tracer: Any, call: _Call) -> None:
        try:
            span = tracer.start_span(self.span_name, attributes=self._span_attributes(call))
            call.span = span
            call.token = otel_context.attach(trace.set_span_in_context(span))
        except Exception:  # noqa: BLE001 - telemetry never breaks the engine
            self.observer.metrics.count_telemetry_error("tracing")

    def _span_attributes(self, call: _Call) -> dict[str, Any]:
        """Attributes known at the start: the guard's fixed ones, plus this call's ids when it has them."""
        if call.ids is None and call.keys is None and call.request_id is None:
            return self._static_attributes
        attrs = dict(self._static_attributes)
        if call.ids is not None:
            attrs[sc.ATTR_BLOCKS] = len(call.ids)
            attrs[sc.ATTR_BLOCK_IDS] = call.ids[:MAX_IDS_ON_SPAN]
        if call.keys is not None:
            attrs[sc.ATTR_KEYS] = [str(k) for k in call.keys[:MAX_IDS_ON_SPAN]]
        if call.request_id is not None:
            attrs[sc.ATTR_REQUEST_ID] = str(call.request_id)
        return attrs

    def _acquire_sync(self, call: _Call) -> None:
        obs = self.observer
        self._acquired(call, obs.lock.acquire(obs.lock_timeout))

    async def _acquire_async(self, call: _Call) -> None:
        """Acquire without blocking the event loop; a cancelled waiter never leaves the lock held."""
        lock, timeout = self.observer.lock, self.observer.lock_timeout
        if lock.acquire(0):
            self._acquired(call, True)
            return
        loop = asyncio.get_running_loop()
        pending = loop.run_in_executor(None, lock.acquire, timeout)
        try:
            acquired = await asyncio.shield(pending)
        except BaseException:
            pending.add_done_callback(_release_if_acquired(lock))
            self._end_span(call, asyncio.CancelledError())
            raise
        self._acquired(call, acquired)

    def _acquired(self, call: _Call, acquired: bool) -> None:
        call.t_acquired = perf_counter()
        if not acquired:
            self._timed_out(call)

    def _timed_out(self, call: _Call) -> None:
        obs = self.observer
        waited = call.t_acquired - call.t_start
        exc = LockTimeout(obs.lock.name, waited, self.path)
        if obs.telemetry:
            obs.record_timeout(self, call, exc, waited)
        self._end_span(call, exc)
        raise exc

    def _enter_locked(self, call: _Call) -> None:
        if self.metrics is not None:
            self.metrics.in_flight.start()
        if self.sampler is not None and self.path != sc.PATH_PREFETCH:
            self._check(call)

    def _after_call(self, call: _Call) -> None:
        if self.sampler is not None and self.path == sc.PATH_PREFETCH:
            self._check(call)

    def _exit_locked(self, call: _Call, exc: BaseException | None) -> None:
        try:
            if exc is None:
                self._after_call(call)
        except BaseException as check_error:
            call.error = check_error
            raise
        finally:
            if exc is not None:
                call.error = exc
            self._release_and_record(call)

    def _check(self, call: _Call) -> None:
        """NaN/Inf check of the touched blocks under the lock; the policy decides what a bad result does."""
        if call.cache is None or not call.ids or not self.sampler.should_check():
            return
        from kvobs.integrity import CorruptKVError, check_blocks

        result = check_blocks(call.cache, call.ids, block_dim=self.observer.block_dim)
        call.check_result = result
        self.observer.record_check(self, call, result)
        if result.clean or self.policy.mode == "count":
            return
        call.bad_ids = result.bad_block_ids
        if self.policy.mode == "skip" and self.path != sc.PATH_PREFETCH:
            call.skipped = True
            return
        raise CorruptKVError(self.path, result)

    def _release_and_record(self, call: _Call) -> None:
        try:
            self.observer.lock.release()
        finally:
            if self.observer.telemetry:
                self.observer.record_transfer(self, call, perf_counter())

    def _end_span(self, call: _Call, exc: BaseException | None) -> None:
        span = call.span
        if span is None:
            return
        call.span = None
        try:
            if exc is not None and span.is_recording():
                span.set_attribute(sc.ATTR_ERROR_TYPE, type(exc).__qualname__)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
            if call.token is not None:
                otel_context.detach(call.token)
            span.end()
        except Exception:  # noqa: BLE001
            self.observer.metrics.count_telemetry_error("tracing")


def _release_if_acquired(lock: Any) -> Callable[[asyncio.Future], None]:
    def release(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            lock.release()

    return release

