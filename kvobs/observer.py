"""KVObserver: one per engine process. Owns the configuration, the cache lock and the telemetry handles.

Every configuration problem is raised here, at construction, never at the first transfer.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvobs import semconv as sc
from kvobs.guard import Transfer, TransferRecord, _Call
from kvobs.lock_section import LockSection
from kvobs.locks import CacheLock, LockTimeout, NullLock, ThreadLock
from kvobs.signals import EarlySignalBuffer
from kvobs.telemetry import metrics as tm
from kvobs.telemetry.logs import default_logger, level_number, trace_fields
from kvobs.telemetry.tracing import TracerSource

DEFAULT_LOCK_TIMEOUT_S = 30.0
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_FALSY = {"0", "false", "no", "off"}
Hook = Callable[[TransferRecord], None]
_OUTCOME_LOG_LEVEL = {sc.OUTCOME_OK: logging.DEBUG, sc.OUTCOME_REJECTED: logging.WARNING,
                      sc.OUTCOME_ERROR: logging.ERROR}


class KVObserver:
    """Guards and observes one engine's KV transfers.

    engine: a low-cardinality label value naming the engine (never a request or node id).
    lock: the cache lock the transfers take (`ThreadLock()` by default; `ProcessLock(name)` across worker
        processes; `None` for no lock at all, kvobs only observing).
    lock_timeout: seconds to wait for the lock before raising LockTimeout (env KVOBS_LOCK_TIMEOUT, default 30).
    registry / tracer_provider / logger: injected telemetry back-ends (defaults: prometheus_client's global
        registry, the global OpenTelemetry provider as configured by the application, structlog's logger).
    enabled: False (or env KVOBS_ENABLED=0) keeps validation, the lock and integrity checks, and registers
        and records no telemetry at all.
    capacity: number of GPU blocks, so block ids past it are rejected before locking.
    block_bytes: bytes per KV block, for kvobs_transfer_bytes_total when a call does not say.
    block_dim: the block dimension of the cache tensors handed to integrity checks.
    integrity: the NaN/Inf policy ("raise", "skip", "count", an IntegrityPolicy, None for off), or a mapping
        from path to one of those.
    sync_required: paths that refuse `is_sync=False` calls (default prefetch and write_back).
    extra_paths: more path names beside prefetch, write_back and send.
    hooks: callables receiving a TransferRecord after each transfer; one that raises is counted, not raised.
    log_level: the level below which kvobs emits nothing (default info: successful calls are debug).
    buckets: histogram bucket bounds in seconds for this registry.
    """

    def __init__(
        self,
        engine: str = "default",
        *,
        lock: CacheLock | None | str = "thread",
        lock_timeout: float | None = None,
        registry: CollectorRegistry | None = None,
        tracer_provider: Any = None,
        logger: Any = None,
        enabled: bool | None = None,
        capacity: int | None = None,
        block_bytes: int | None = None,
        block_dim: int = 0,
        integrity: Any = "raise",
        sync_required: Iterable[str] = (sc.PATH_PREFETCH, sc.PATH_WRITE_BACK),
        extra_paths: Iterable[str] = (),
        hooks: Iterable[Hook] = (),
        log_level: str | int = "info",
        buckets: Iterable[float] | None = None,
    ) -> None:
        self.engine = _label_value("engine", engine)
        self.paths = tuple(sc.PATHS) + tuple(_label_value("path", p) for p in extra_paths)
        self.lock: CacheLock = ThreadLock() if lock == "thread" else NullLock() if lock is None else lock
        if not all(hasattr(self.lock, a) for a in ("acquire", "release", "name", "held_for")):
            raise TypeError(f"lock must be a kvobs lock (ThreadLock, ProcessLock, NullLock), got {lock!r}")
        self.lock_timeout = _lock_timeout(lock_timeout)
        self.capacity = _optional_positive_int("capacity", capacity)
        self.block_bytes = _optional_positive_int("block_bytes", block_bytes)
        if not isinstance(block_dim, int) or isinstance(block_dim, bool):
            raise TypeError(f"block_dim must be an int, got {block_dim!r}")
        self.block_dim = block_dim
        self.sync_required = frozenset(self._known_path(p, "sync_required") for p in sync_required)
        self._integrity = self._integrity_by_path(integrity)
        self.hooks = tuple(hooks)
        if not all(callable(h) for h in self.hooks):
            raise TypeError("every hook must be callable")
        self.log_level = level_number(log_level)
        self.logger = logger if logger is not None else default_logger()
        self.telemetry = _enabled(enabled)
        self.tracer_source = TracerSource(tracer_provider)
        self.metrics: tm.EngineMetrics | None = None
        if self.telemetry:
            self.metrics = tm.EngineMetrics(tm.MetricFamilies.of(registry, buckets), self.engine, self.lock.name)
            for path in self.paths[len(sc.PATHS):]:
                self.metrics.add_path(path)
            tm.bind_scrape_time(
                self.metrics.lock_held, self.lock.held_for, lambda: self.metrics.count_telemetry_error("scrape")
            )

    # -- the public decorators ---------------------------------------------------------------------------

    def prefetch(self, **specs: Any) -> Transfer:
        """Guard a storage -> GPU prefetch. Destination blocks are checked after the call."""
        return self.transfer(sc.PATH_PREFETCH, **specs)

    def write_back(self, **specs: Any) -> Transfer:
        """Guard a GPU -> storage write-back. Source blocks are checked before the call."""
        return self.transfer(sc.PATH_WRITE_BACK, **specs)

    def send(self, **specs: Any) -> Transfer:
        """Guard a prefill -> decode send. Blocks are checked before the call."""
        return self.transfer(sc.PATH_SEND, **specs)

    def transfer(self, path: str, **specs: Any) -> Transfer:
        """A guard for `path`. Specs (`keys`, `block_ids`, `sync`, `cache`, `nbytes`, `request_id`) are each a
        parameter name, an attribute path such as "task.gpu_block_ids", a callable taking the call's
        arguments, or (for context managers) the value itself; `check=` overrides the integrity policy."""
        return Transfer(self, self._known_path(path, "path"), **specs)

    def locked(self, holder: str = "forward") -> LockSection:
        """The observer's lock for a holder that is not a transfer (the GPU worker's forward pass), as a
        decorator or context manager: timed, released in finally, its wait and hold recorded under
        `path=holder` in kvobs_lock_wait_seconds / kvobs_lock_hold_seconds."""
        return LockSection(self, _label_value("holder", holder))

    def signal_buffer(self, **options: Any) -> EarlySignalBuffer:
        """An EarlySignalBuffer reporting through this observer's metrics and logger. One per observer: the
        pending-signal gauges of an engine show the buffer built last."""
        options.setdefault("log_level", self.log_level)
        return EarlySignalBuffer(metrics=self.metrics, logger=self.logger, **options)

    # -- configuration helpers ---------------------------------------------------------------------------

    def _known_path(self, path: str, what: str) -> str:
        if path not in self.paths:
            raise ValueError(f"{what}: unknown transfer path {path!r}; known paths: {', '.join(self.paths)}")
        return path

    def _integrity_by_path(self, integrity: Any) -> dict[str, Any]:
        if isinstance(integrity, Mapping):
            for path in integrity:
                self._known_path(path, "integrity")
            return {p: _policy(integrity.get(p)) for p in self.paths}
        policy = _policy(integrity)
        return {p: policy for p in self.paths}

    def integrity_policy(self, path: str, override: Any = None) -> Any:
        """The policy for one guard: its own `check=` override, else the observer's for the path."""
        if override is None:
            return self._integrity[path]
        return None if override is False else _policy(override)

    # -- recording (called by guards; never raises into the engine) --------------------------------------

    def record_rejected(self, path: str, exc: Exception) -> None:
        if not self.telemetry:
            return
        try:
            self.metrics.paths[path].transfers[sc.OUTCOME_REJECTED].inc()
        except Exception:  # noqa: BLE001
            self.metrics.count_telemetry_error("metrics")
        self._log(logging.WARNING, "kvobs.transfer.rejected", path=path, reason=str(exc))

    def record_timeout(self, guard: Transfer, call: _Call, exc: LockTimeout, waited: float) -> None:
        m = guard.metrics
        try:
            m.lock_timeouts.inc()
            m.lock_wait.observe(waited)
            m.transfers[sc.OUTCOME_TIMEOUT].inc()
            m.duration[sc.OUTCOME_TIMEOUT].observe(waited)
        except Exception:  # noqa: BLE001
            self.metrics.count_telemetry_error("metrics")
        self._log(logging.WARNING, "kvobs.lock.timeout", path=guard.path, lock=exc.lock_name, waited_s=waited)

    def record_check(self, guard: Transfer, call: _Call, result: Any) -> None:
        if not self.telemetry:
            return
        m = guard.metrics
        try:
            m.nan_checks[result.result].inc()
            if not result.clean:
                m.nan_blocks.inc(len(result.bad_block_ids))
        except Exception:  # noqa: BLE001
            self.metrics.count_telemetry_error("metrics")
        if result.clean:
            return
        bad = list(result.bad_block_ids[:64])
        span = call.span
        if span is not None:
            try:
                span.add_event(sc.EVENT_INTEGRITY_BAD_BLOCKS, {sc.ATTR_BAD_BLOCK_IDS: bad})
            except Exception:  # noqa: BLE001
                self.metrics.count_telemetry_error("tracing")
        self._log(
            logging.ERROR, "kvobs.integrity.bad_blocks", path=guard.path, result=result.result,
            bad_blocks=len(result.bad_block_ids), bad_block_ids=bad, policy=guard.policy.mode,
        )

    def record_transfer(self, guard: Transfer, call: _Call, t_end: float) -> None:
        error = call.error
        outcome = sc.OUTCOME_OK if error is None and not call.skipped else (
            sc.OUTCOME_ERROR if error is not None else sc.OUTCOME_REJECTED)
        wait = call.t_acquired - call.t_start
        hold = t_end - call.t_acquired
        span = call.span
        ids = call.ids
        blocks = len(ids) if ids is not None else 0
        nbytes = call.nbytes if call.nbytes is not None else blocks * (self.block_bytes or 0)
        try:
            m = guard.metrics
            m.in_flight.finish()
            if span is not None and span.is_recording():
                exemplar = trace_fields(span)
                tm.observe(m.lock_wait, wait, exemplar)
                tm.observe(m.duration[outcome], wait + hold, exemplar)
            else:
                m.lock_wait.observe(wait)
                m.duration[outcome].observe(wait + hold)
            m.lock_hold.observe(hold)
            m.transfers[outcome].inc()
            if blocks and outcome == sc.OUTCOME_OK:
                m.blocks.inc(blocks)
                if nbytes:
                    m.bytes.inc(nbytes)
        except Exception:  # noqa: BLE001
            self.metrics.count_telemetry_error("metrics")
        if span is not None:
            try:
                if span.is_recording():
                    span.set_attributes({sc.ATTR_LOCK_WAIT_S: wait, sc.ATTR_LOCK_HOLD_S: hold, sc.ATTR_OUTCOME: outcome})
                    if nbytes:
                        span.set_attribute(sc.ATTR_BYTES, nbytes)
            except Exception:  # noqa: BLE001
                self.metrics.count_telemetry_error("tracing")
            guard._end_span(call, error)
        level = _OUTCOME_LOG_LEVEL[outcome]
        if level >= self.log_level:
            self._log(
                level, "kvobs.transfer", path=guard.path, outcome=outcome, blocks=blocks, duration_s=wait + hold,
                lock_wait_s=wait, lock_hold_s=hold, error=repr(error) if error is not None else None,
                request_id=call.request_id, span=span,
            )
        if self.hooks:
            self._run_hooks(TransferRecord(
                self.engine, guard.path, outcome, wait + hold, wait, hold, blocks, nbytes, error, call.bad_ids
            ))

    def _run_hooks(self, record: TransferRecord) -> None:
        for hook in self.hooks:
            try:
                hook(record)
            except Exception:  # noqa: BLE001
                self.metrics.count_telemetry_error("hook")

    def _log(self, level: int, event: str, span: Any = None, **fields: Any) -> None:
        if level < self.log_level:
            return
        try:
            fields.update(trace_fields(span))
            method = logging.getLevelName(level).lower()
            getattr(self.logger, method)(event, engine=self.engine, **fields)
        except Exception:  # noqa: BLE001
            self.metrics.count_telemetry_error("logging")


def _label_value(what: str, value: Any) -> str:
    if not isinstance(value, str) or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{what}={value!r} is not a valid label value: use 1-64 characters of letters, digits, '_.:-' "
            "(a low-cardinality name, never a request or block id)"
        )
    return value


def _lock_timeout(value: float | None) -> float:
    if value is None:
        env = os.environ.get(sc.ENV_LOCK_TIMEOUT)
        if env is None:
            return DEFAULT_LOCK_TIMEOUT_S
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{sc.ENV_LOCK_TIMEOUT}={env!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"lock_timeout must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _optional_positive_int(what: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _enabled(value: bool | None) -> bool:
    if value is not None:
        return bool(value)
    return os.environ.get(sc.ENV_ENABLED, "1").strip().lower() not in _FALSY


def _policy(value: Any) -> Any:
    if value is None or value is False:
        return None
    from kvobs.policy import IntegrityPolicy

    if isinstance(value, IntegrityPolicy):
        return value
    if isinstance(value, str):
        return IntegrityPolicy(mode=value)
    raise TypeError(f"integrity policy must be 'raise', 'skip', 'count', an IntegrityPolicy or None, got {value!r}")
