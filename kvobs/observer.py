"""KVObserver: one per engine process. Owns the configuration, the cache lock, the open transfers and the
telemetry handles, and hands out guards and transfers.

Every configuration problem is raised here, at construction, never at the first transfer. The observer
only wires things together: the transfer lifecycle (`kvobs._lifecycle.transfer`) does the work, and telemetry is a
layer below it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvobs import config
from kvobs import semconv as sc
from kvobs._lifecycle.cache_checks import CacheCheck
from kvobs._lifecycle.checks import UNSET
from kvobs._lifecycle.open_transfers import OpenTransfers
from kvobs._lifecycle.route import Route
from kvobs._lifecycle.transfer import CorruptHandler, Transfer
from kvobs.errors import TransferRejected
from kvobs.guard import Guard
from kvobs.locks._cache_lock import CacheLock
from kvobs.signals import EarlySignalBuffer, StepAlignedSignalBuffer
from kvobs.telemetry._failures import STAGE_DEADLINE_THREAD, STAGE_HOOK, TelemetryFailures
from kvobs.telemetry._logs import default_logger, level_number
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import MetricFamilies
from kvobs.telemetry._recorder import Hook, Recorder
from kvobs.telemetry._tracing import TracerSource

# What `begin` / `transfer` take beside the path (see Transfer and Transfer.validate).
_TRANSFER_VALUES = frozenset(("block_ids", "requests", "keys", "cache", "nbytes", "request_id", "key",
                              "group_sizes", "trace_context"))
_BLOCK_VALUES = ("block_ids", "requests")  # None for these is refused: leaving them out claims the whole cache


class KVObserver:
    """Guards and observes one engine's KV transfers.

    engine: a low-cardinality label value naming the engine (never a request or node id).
    lock: the cache lock transfers take (`ThreadLock()` by default; `ProcessLock(name)` across worker
        processes; `BlockLock(name, num_blocks)` to lock blocks, not the whole cache; None: observe only).
    lock_timeout: seconds to wait for the lock before LockTimeout (default: the timeout the lock was built with,
        else env KVOBS_LOCK_TIMEOUT, else 30).
    deadline: seconds an open transfer (begun, or left open by `complete_later=`) may wait for its
        completion before it is abandoned and its lock released (env KVOBS_TRANSFER_DEADLINE, default 60).
    registry / tracer_provider / logger: injected telemetry back-ends (defaults: prometheus_client's global
        registry, the global OpenTelemetry provider once an application sets one, structlog's logger).
    enabled: False (or env KVOBS_ENABLED=0) keeps validation, the lock, integrity checks and hooks, and
        registers and records no metrics, spans or logs.
    capacity: number of GPU blocks (pages), so ids past it are rejected before locking (default: a BlockLock's
        num_blocks; never larger).
    block_bytes: bytes per KV block, for kvobs_transfer_bytes_total when a call does not say.
    block_dim: the block dimension of the cache tensors handed to integrity checks.
    page_size: ids are token slots and a block (page) holds this many (SGLang); None: ids are block ids.
    integrity: the NaN/Inf policy ("raise", "skip", "count", an IntegrityPolicy, None for off), or a mapping
        from path to one of those (paths left out keep the default, "raise").
    sync_required: paths that refuse `is_sync=False` unless the guard completes later (default prefetch
        and write-back).
    reading_paths: paths whose transfers read KV blocks: shared lock claims, sources checked before the copy
        (default write-back and send); the others (prefetch, receive, extra paths) write blocks: exclusive
        claims, destinations checked at completion.
    extra_paths: more path names beside prefetch, write_back and send.
    holders: names of lock holders that are not transfers, for `obs.locked` (default "forward").
    hooks: callables receiving a TransferRecord for every transfer that ends or is refused; one that raises
        is counted, never raised.
    log_level: the level below which kvobs emits nothing (default info: successful calls are debug).
    buckets: histogram bucket bounds in seconds for this registry.
    """

    def __init__(
        self,
        engine: str = "default",
        *,
        lock: CacheLock | None | str = "thread",
        lock_timeout: float | None = None,
        deadline: float | None = None,
        registry: CollectorRegistry | None = None,
        tracer_provider: Any = None,
        logger: Any = None,
        enabled: bool | None = None,
        capacity: int | None = None,
        block_bytes: int | None = None,
        block_dim: int = 0,
        page_size: int | None = None,
        integrity: Any = "raise",
        sync_required: Iterable[str] = (sc.PATH_PREFETCH, sc.PATH_WRITE_BACK),
        reading_paths: Iterable[str] = (sc.PATH_WRITE_BACK, sc.PATH_SEND),
        extra_paths: Iterable[str] = (),
        holders: Iterable[str] = (sc.HOLDER_FORWARD,),
        hooks: Iterable[Hook] = (),
        log_level: str | int = "info",
        buckets: Iterable[float] | None = None,
    ) -> None:
        self.engine = config.label_value("engine", engine)
        self.paths = tuple(sc.PATHS) + tuple(config.label_value("path", p) for p in extra_paths)
        self.holders = tuple(config.label_value("holder", h) for h in holders)
        self.lock = config.cache_lock(lock)
        # a lock built with a timeout of its own is waited for that long, unless lock_timeout says otherwise
        given_timeout = lock_timeout if lock_timeout is not None else getattr(self.lock, "timeout", None)
        self.lock_timeout = config.seconds("lock_timeout", given_timeout, sc.ENV_LOCK_TIMEOUT,
                                           config.DEFAULT_LOCK_TIMEOUT_S)
        self.deadline = config.seconds("deadline", deadline, sc.ENV_TRANSFER_DEADLINE, config.DEFAULT_DEADLINE_S)
        self.capacity = _capacity(config.optional_positive_int("capacity", capacity), self.lock)
        self.block_bytes = config.optional_positive_int("block_bytes", block_bytes)
        self.page_size = config.optional_positive_int("page_size", page_size)
        self.block_dim = config.block_dim(block_dim)
        self.sync_required = frozenset(self._known_path(p, "sync_required") for p in sync_required)
        self.reading_paths = frozenset(self._known_path(p, "reading_paths") for p in reading_paths)
        self._integrity = self._integrity_by_path(integrity)
        self.hooks = config.hooks(hooks)
        self.log_level = level_number(log_level)
        self.logger = logger if logger is not None else default_logger()
        self.telemetry = config.enabled(enabled)
        self.tracer_source = TracerSource(tracer_provider)
        self._wire(registry, buckets)

    # -- decorators: specs name where each value is found in the call --------------------------------------

    def prefetch(self, **options: Any) -> Guard:
        """Guard a storage -> GPU prefetch (a writing transfer: destinations checked at completion)."""
        return self.guard(sc.PATH_PREFETCH, **options)

    def write_back(self, **options: Any) -> Guard:
        """Guard a GPU -> storage write-back (a reading transfer: sources checked before the copy)."""
        return self.guard(sc.PATH_WRITE_BACK, **options)

    def send(self, **options: Any) -> Guard:
        """Guard a prefill -> decode send (a reading transfer: sources checked before the copy)."""
        return self.guard(sc.PATH_SEND, **options)

    def guard(
        self,
        path: str,
        *,
        check: Any = None,
        result: Callable[[Any], Any] | None = None,
        on_corrupt: CorruptHandler | None = None,
        **specs: Any,
    ) -> Guard:
        """A decorator for `path`. Specs (`keys`, `block_ids`, `requests`, `sync`, `cache`, `nbytes`,
        `request_id`, `group_sizes`, `complete_later`, `trace_context`) are parameter names or attribute paths ("task.gpu_block_ids"),
        callables taking the call's arguments, or fixed values. `complete_later` names the key under which
        the transfer stays open after the call returns, until `obs.complete(path, key)`. `result` maps the
        call's return value (or what `complete` is given) to the block ids that actually moved. `check`
        overrides the integrity policy; `on_corrupt(transfer, bad_ids)` replaces the result of a transfer
        found corrupt instead of raising."""
        return Guard(self._route_for(path, check), specs, result=result, on_corrupt=on_corrupt, observer=self)

    def locked(self, holder: str = sc.HOLDER_FORWARD, **specs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A decorator taking the cache lock for a holder that is not a transfer (the GPU worker's
        `execute_model`): timed, its wait and hold recorded under `path=holder`. `block_ids=` (a spec) names
        the blocks it writes, for a BlockLock."""
        return Guard(self._holder_route_for(holder), specs, observer=self)

    # -- values: for code that is not one decorated call ---------------------------------------------------

    def transfer(self, path: str, *, check: Any = None, **values: Any) -> Transfer:
        """A validated transfer for `with` / `async with` (values: `block_ids`, or `requests` mapping request
        ids to block ids for a batch counted per request; `keys`, `cache`, `nbytes`, `request_id`, `key`,
        `group_sizes`, `trace_context`): begun on entry, completed on a clean exit, failed otherwise."""
        return self._validated(self._route_for(path, check), values)

    def begin(self, path: str, *, check: Any = None, skippable: bool = False, **values: Any) -> Transfer:
        """Begin a transfer now and hold the lock until `t.complete(...)` / `t.fail(exc)` is called, from any
        thread, or the deadline passes. With `key=`, `obs.complete(path, key)` finds it too.

        skippable: when the sources of a reading transfer are corrupt and the policy is `skip` (or
        `on_corrupt` decides), return with `t.skipped` true instead of raising: the caller leaves its copy
        out and ends the transfer with `t.skip()` (counted `rejected`)."""
        return self._validated(self._route_for(path, check), values).start(skippable=skippable)

    def hold(self, holder: str = sc.HOLDER_FORWARD, *, block_ids: Any = None) -> Transfer:
        """The cache lock for a holder that is not a transfer, as a `with` block (values, not specs); without
        `block_ids` (None) the holder claims the whole cache, as the forward pass does."""
        return self._validated(self._holder_route_for(holder), {} if block_ids is None else {"block_ids": block_ids})

    def complete(self, path: str, key: Any, result: Any = None, *, moved: Any = None) -> Any:
        """Complete the open transfer under (path, key); see `Transfer.complete`. An unknown key (never
        opened, or already ended, e.g. abandoned) changes nothing and returns `result`."""
        t = self.open_transfer(path, key)
        return result if t is None else t.complete(result, moved=moved)

    def fail(self, path: str, key: Any, error: BaseException) -> bool:
        """Fail the open transfer under (path, key); False when none is open."""
        t = self.open_transfer(path, key)
        return False if t is None else t.fail(error)

    def open_transfer(self, path: str, key: Any) -> Transfer | None:
        """The transfer open under (path, key), if any."""
        try:
            t = self.open.find(path, key)
        except TypeError:  # an unhashable path or key
            self._known_path(path, "path")
            raise
        if t is None:
            self._known_path(path, "path")  # an unknown path is a mistake, not a missing transfer
        return t

    def signal_buffer(self, **options: Any) -> EarlySignalBuffer:
        """An EarlySignalBuffer reporting through this observer's metrics and logger."""
        options.setdefault("log_level", self.log_level)
        return EarlySignalBuffer(metrics=self.metrics, logger=self.logger, **options)

    def step_aligned_signal_buffer(self, **options: Any) -> StepAlignedSignalBuffer:
        """A StepAlignedSignalBuffer for one tensor-parallel rank, reporting through this observer's metrics
        and logger: calls only record, `end_step()` decides, identically on every rank."""
        options.setdefault("log_level", self.log_level)
        return StepAlignedSignalBuffer(metrics=self.metrics, logger=self.logger, **options)

    # -- wiring ----------------------------------------------------------------------------------------------

    def _wire(self, registry: CollectorRegistry | None, buckets: Iterable[float] | None) -> None:
        """Metrics, open transfers and a route per path and lock holder, from the checked options."""
        self._caches = CacheCheck(self.block_dim)
        self.metrics = self._engine_metrics(registry, buckets) if self.telemetry else None
        # telemetry off: failures (a raising hook) are still logged once per kind, with nothing to count
        self._failures: Callable[..., None] = (
            TelemetryFailures(self.engine, None, self.logger) if self.metrics is None
            else self.metrics.count_telemetry_error)
        count_restart = None if self.metrics is None else functools.partial(self.metrics.failures.count,
                                                                             STAGE_DEADLINE_THREAD)
        self.open = OpenTransfers(self.paths, self.deadline, count_restart)
        self._routes = {p: self._route(p) for p in self.paths}
        self._variants: dict[tuple[str, Any], Route] = {}
        self._holder_routes = {h: self._holder_route(h) for h in self.holders}

    def _engine_metrics(self, registry: CollectorRegistry | None, buckets: Iterable[float] | None) -> Any:
        metrics = EngineMetrics(MetricFamilies.of(registry, buckets), self.engine, self.lock.name,
                                   logger=self.logger)
        metrics.bind_lock_held(self.lock, _held_for)
        if hasattr(self.lock, "blocks_claimed"):  # a lock that claims blocks, not the whole cache
            for mode in sc.CLAIM_MODES:
                metrics.bind_blocks_claimed(mode, self.lock, functools.partial(_claimed, mode=mode))
        return metrics

    def _validated(self, route: Route, values: dict[str, Any]) -> Transfer:
        if not values:
            return Transfer(route)  # nothing to validate: the transfer claims the whole cache
        if not values.keys() <= _TRANSFER_VALUES:
            raise TypeError(f"unknown transfer value(s) {sorted(values.keys() - _TRANSFER_VALUES)}")
        get = values.get
        t = Transfer(route, keys=get("keys"), cache=get("cache"), nbytes=get("nbytes"), request_id=get("request_id"),
                     key=get("key"), trace_context=get("trace_context"))
        for name in _BLOCK_VALUES:
            if name in values and values[name] is None:  # as a decorator's spec resolving to None is refused
                rejected = TransferRejected(route.path, f"{name}=None names no blocks: pass them (an empty sequence "
                                                        f"for none), or leave {name} out to claim the whole cache")
                t.reject(rejected)
                raise rejected
        return t.validate(block_ids=get("block_ids", UNSET), requests=get("requests", UNSET),
                          group_sizes=get("group_sizes"))

    def _route(self, path: str) -> Route:
        policy = self._integrity[path]
        recorder = self._recorder(path, holder=False)
        if self.metrics is not None:
            self.metrics.bind_open_transfers(path, self.open, lambda table: table.count(path),
                                             lambda table: table.oldest_age(path))
        return Route(
            path=path, lock=self.lock, lock_timeout=self.lock_timeout, deadline_s=self.deadline,
            reads_blocks=path in self.reading_paths, policy=policy,
            sampler=policy.sampler() if policy is not None else None, capacity=self.capacity,
            page_size=self.page_size, sync_required=path in self.sync_required,
            recorder=recorder, open=self.open, caches=self._caches,
        )

    def _holder_route(self, holder: str) -> Route:
        return Route(
            path=holder, lock=self.lock, lock_timeout=self.lock_timeout, deadline_s=self.deadline,
            reads_blocks=False, policy=None, sampler=None, capacity=self.capacity, page_size=self.page_size,
            sync_required=False,
            recorder=self._recorder(holder, holder=True), open=None, caches=self._caches,
        )

    def _recorder(self, path: str, *, holder: bool) -> Recorder:
        metrics = None
        if self.metrics is not None:
            metrics = self.metrics.holder(path) if holder else self.metrics.path(path)
        return Recorder(
            self.engine, path, metrics=metrics, tracer_source=self.tracer_source, logger=self.logger,
            log_level=self.log_level, hooks=self.hooks, failures=self._telemetry_failed,
            lock_name=self.lock.name, block_bytes=self.block_bytes, holder=holder,
        )

    def _route_for(self, path: str, check: Any) -> Route:
        """The path's route, or its variant with another integrity policy, built once per policy so that a
        sampling policy (`every=N`, `fraction`) samples across calls."""
        try:
            route = self._routes.get(path)
        except TypeError:  # unhashable: not a path
            route = None
        if route is None:
            self._known_path(path, "path")  # raises, naming the known paths
        if check is None:
            return route
        # by identity for a policy object (the route keeps it alive): equal policies may differ in skip_result
        key = (path, check if isinstance(check, (str, bool)) else id(check))
        variant = self._variants.get(key)
        if variant is None:
            policy = None if check is False else config.policy(check)
            variant = dataclasses.replace(route, policy=policy,
                                          sampler=policy.sampler() if policy is not None else None)
            self._variants[key] = variant
        return variant

    def _holder_route_for(self, holder: str) -> Route:
        route = self._holder_routes.get(holder)
        if route is None:
            raise ValueError(
                f"holder={holder!r} is not declared: declare lock holders up front, "
                f"KVObserver(holders=[...]) (declared: {', '.join(self.holders) or 'none'})"
            )
        return route

    def _telemetry_failed(self, stage: str, exc: BaseException) -> None:
        self._failures(stage, exc)

    def hook_failed(self, error: BaseException, *, where: str) -> None:
        """An engine integration's own hook raised inside an engine call and swallowed it, so the engine goes on
        exactly as without kvobs: counted in kvobs_telemetry_errors_total{stage="hook"} and logged at most once
        per interval per (where, error type). Never raises."""
        self._failures(STAGE_HOOK, error, where=where)

    def _known_path(self, path: str, what: str) -> str:
        if path not in self.paths:
            raise ValueError(f"{what}: unknown transfer path {path!r}; known paths: {', '.join(self.paths)}")
        return path

    def _integrity_by_path(self, integrity: Any) -> dict[str, Any]:
        """A mapping sets the policy of the paths it names; the others keep the default ("raise")."""
        if isinstance(integrity, Mapping):
            for path in integrity:
                self._known_path(path, "integrity")
            default = config.policy("raise")
            return {p: config.policy(integrity[p]) if p in integrity else default for p in self.paths}
        policy = config.policy(integrity)
        return {p: policy for p in self.paths}


def _capacity(capacity: int | None, lock: CacheLock | None) -> int | None:
    """The cache's size in blocks: a lock that locks per block knows it, so an id past it is rejected like
    any bad input before the lock is touched, rather than failing inside the lock."""
    lock_blocks = getattr(lock, "num_blocks", None)
    if lock_blocks is None:
        return capacity
    if capacity is not None and capacity > lock_blocks:
        raise ValueError(f"capacity={capacity} is larger than the {lock_blocks} blocks of {lock!r}")
    return lock_blocks if capacity is None else capacity


def _held_for(lock: CacheLock) -> float:
    return lock.held_for()


def _claimed(lock: Any, mode: str) -> int:
    return lock.blocks_claimed()[mode]
