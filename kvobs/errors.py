"""Every error kvobs raises into the engine on purpose, under one base class.

All of them pickle with their fields intact: engines carry exceptions across worker processes
(`multiprocessing`, `concurrent.futures.ProcessPoolExecutor`), and an error that cannot be unpickled turns
into a confusing failure far from its cause. So an error declares only its fields and its message; the
base class stores the fields, builds the message and pickles the error from its fields.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar


class KVObsError(Exception):
    """Base of every error kvobs raises on purpose; `except kvobs.KVObsError` catches exactly those.

    A subclass declares its fields as annotations, in constructor order (a class attribute gives one a
    default), and its message as a `template` over them, or in `message()` when a template cannot say it.
    A subclass that declares no fields takes its arguments as a plain exception does.
    """

    fields: ClassVar[tuple[str, ...]] = ()
    template: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = [name for name, kind in inspect.get_annotations(cls).items() if "ClassVar" not in str(kind)]
        cls.fields = (*cls.fields, *own)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not self.fields:
            super().__init__(*args, **kwargs)
            return
        self.__dict__.update(self._bind(args, kwargs))
        # One message argument: given several, OSError would read them as (errno, strerror, filename).
        super().__init__(self.message())

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The fields' values from the call's arguments, refused as a function with those parameters would."""
        name = type(self).__name__
        fields = self.fields
        if len(args) > len(fields):
            raise TypeError(f"{name} takes {len(fields)} arguments ({', '.join(fields)}), got {len(args)}")
        values = dict(zip(fields, args))
        for key, value in kwargs.items():
            if key not in fields or key in values:
                problem = "got multiple values for" if key in values else "has no field"
                raise TypeError(f"{name} {problem} {key!r}")
            values[key] = value
        missing = [field for field in fields if field not in values and not hasattr(type(self), field)]
        if missing:
            raise TypeError(f"{name} missing {', '.join(map(repr, missing))}")
        return values

    def message(self) -> str:
        """What went wrong: the template filled in with the fields."""
        return self.template.format_map({field: getattr(self, field) for field in self.fields})

    def __reduce__(self) -> str | tuple[Any, ...]:
        if not self.fields:
            return super().__reduce__()
        # OSError's own reduce rebuilds from args (the message), which is not what these constructors take.
        return type(self), tuple(getattr(self, field) for field in self.fields)


class TransferRejected(KVObsError, ValueError):
    """A transfer refused before the lock was touched: bad arguments, or a mode the path does not support.

    Raised instead of `assert`, so the guard holds under `python -O`.
    """

    path: str
    reason: str

    template = "kvobs rejected {path} transfer: {reason}"


class LockTimeout(KVObsError, TimeoutError):
    """The cache lock was not acquired in time."""

    lock_name: str
    waited_s: float
    path: str | None = None

    def message(self) -> str:
        where = f" (path={self.path})" if self.path else ""
        return f"cache lock {self.lock_name!r} not acquired within {self.waited_s:.3f} s{where}"


class LockInitTimeout(LockTimeout):
    """Opening a BlockLock waited `waited_s` for the byte that guards its file's header: another opener holds
    it, stopped or hung while it writes or checks the header. `lock_name` is the lock file; `holder` says
    which processes hold the byte, as far as /proc shows them."""

    holder: str = "holder not found"

    def message(self) -> str:
        return (
            f"block lock file {self.lock_name} not opened within {self.waited_s:.3f} s: another opener holds the "
            f"byte that guards its header ({self.holder}); a process stopped (SIGSTOP, a debugger) or hung while "
            "opening the lock: resume or end it"
        )


class ReentrantLockError(KVObsError, RuntimeError):
    """A guarded call asked for a lock its own context already holds: waiting would only time out."""

    lock_name: str
    path: str
    holder: str

    template = (
        "cache lock {lock_name!r} requested by {path} while this context already holds it for {holder}; "
        "a guarded call must not call another guarded call on the same lock"
    )


class CorruptKVError(KVObsError, RuntimeError):
    """The 'raise' integrity policy found NaN or Inf in the blocks a transfer touched.

    `result` is the `kvobs.CheckResult` of the check (any object with `bad_block_ids`, `nan_block_ids`,
    `inf_block_ids` and `checked_blocks`).
    """

    path: str
    result: Any
    shown_ids = 8

    @property
    def bad_block_ids(self) -> tuple[int, ...]:
        return tuple(self.result.bad_block_ids)

    def message(self) -> str:
        bad = self.bad_block_ids
        result = self.result
        shown = ", ".join(map(str, bad[: self.shown_ids]))
        more = ", ..." if len(bad) > self.shown_ids else ""
        return (
            f"corrupt KV cache on path {self.path!r}: {len(bad)} of {result.checked_blocks} checked blocks hold "
            f"non-finite values ({len(result.nan_block_ids)} NaN, {len(result.inf_block_ids)} Inf); "
            f"bad block ids: [{shown}{more}]"
        )


class MetricNameConflict(KVObsError, ValueError):
    """The registry already holds metrics named like kvobs's; nothing of kvobs was registered on it."""

    detail: str

    template = (
        "this Prometheus registry already holds metric names kvobs needs ({detail}); nothing of kvobs was "
        "registered on it: unregister those collectors, or give kvobs its own registry "
        "(KVObserver(registry=CollectorRegistry()))"
    )


class DuplicateEngine(KVObsError, ValueError):
    """A second live observer asked for an engine label already used on the same registry."""

    engine: str

    template = (
        "engine label {engine!r} is already used by a live kvobs observer on this registry; two observers "
        "would share its series (and one's gauges would hide the other's): give each observer a distinct "
        "engine label (e.g. '{engine}-2'), or drop the first observer before creating another"
    )


class MultiprocessDirError(KVObsError, ValueError):
    """PROMETHEUS_MULTIPROC_DIR does not name a directory this process can write its metric files into."""

    variable: str
    path: str
    reason: str

    template = (
        "{variable}={path!r} {reason}: in multiprocess mode every worker writes its metrics there; create the "
        "directory (writable by this user, emptied before the workers start), or unset {variable} for a "
        "single process"
    )


class InvalidOption(KVObsError, ValueError):
    """An observer option, given as an argument or a KVOBS_* variable, that kvobs does not understand.

    `name` is what the user wrote: the argument's name, or the variable's when the value came from the
    environment, so the message points at the line to fix.
    """

    name: str
    value: object
    expected: str

    template = "{name}={value!r} is not understood: {expected}"


class MultiprocessDirFull(KVObsError):
    """A metric file in PROMETHEUS_MULTIPROC_DIR could not get its space: kvobs records no new series there
    (a file left without its space would kill the process with SIGBUS at the next write)."""

    path: str
    size: int
    reason: str
    consequence: str

    template = (
        "cannot reserve {size} bytes for the metric file {path!r} ({reason}): {consequence}; free space in the "
        "multiprocess directory or give its filesystem more (Docker's /dev/shm is 64 MB by default)"
    )


class UnsafeLockFile(KVObsError, PermissionError):
    """A lock file or lock directory kvobs refuses to use; `reason` says why, `path` says which."""

    path: str
    reason: str

    template = "refusing cache lock path {path}: {reason}"


class InvalidLockName(KVObsError, ValueError):
    """A lock name that cannot become a lock file name (bad characters, or too long for the file system)."""

    name: object
    reason: str

    template = "invalid cache lock name {name!r}: {reason}"


class SignalBufferFull(KVObsError, RuntimeError):
    """A signal buffer refused a call because one of its bounds is reached; the call changed nothing.

    `limit` names the bound (`max_slots` registered tasks, or the step record of a step-aligned buffer) and
    `size` its value. Reaching it means a task is never finished, or `end_step()` is never called.
    """

    limit: str
    size: int
    hint: str

    template = "signal buffer full: {limit}={size} reached; {hint}"


class OFDUnsupported(KVObsError, OSError):
    """This platform has no OFD locks in the layout kvobs packs (it needs 64-bit Linux >= 3.15).

    Built as an OSError is, `(errno, strerror)`, so its errno says which support is missing."""


class SpanExportFailed(KVObsError):
    """An exporter reported FAILURE for a batch (it raises nothing itself, so this names the kind in logs)."""

    exporter: str
    spans: int
    reason: str

    template = "{exporter} failed to export {spans} spans: {reason}"


class OutOfDescriptors(KVObsError, OSError):
    """A BlockLock claim needs a description of its own of the lock file and the process has no file
    descriptor left; nothing was claimed."""

    lock_name: str
    in_use: int
    limit: int

    template = (
        "{lock_name}: cannot open a description of the lock file for a claim: the process is out of file "
        "descriptors (limit {limit}; {in_use} are this lock's open claims, one per claim until it ends): end "
        "open transfers, or raise the limit (ulimit -n / RLIMIT_NOFILE)"
    )


class AlreadyInstrumented(KVObsError, RuntimeError):
    """An engine method kvobs already instrumented for one observer was asked to be instrumented for another;
    nothing was changed. The second observer would see none of the method's calls (the first one keeps them)."""

    target: str
    method: str
    owner: str

    template = (
        "{target}.{method} is already instrumented by kvobs for {owner}; a second observer would see none of its "
        "calls: undo the first instrumentation (call the handle it returned), or instrument with that observer"
    )


class SharingLockRequired(KVObsError, ValueError):
    """An integration that keeps many copies open at once was given one lock for the whole cache: every open
    copy would wait for the one before it to end, which the engine does only later (a lock timeout inside the
    engine). Refused when the integration is set up, not at the first copy."""

    integration: str
    lock: str
    why: str

    template = (
        "{integration}: the observer's lock {lock} is one lock for the whole cache, held by every copy until it "
        "ends; {why}, so they would wait on each other and time out. Build the observer with lock=None (observe "
        "and check only) or a kvobs.BlockLock (copies of different blocks never wait on each other)"
    )


class CopyNotConfirmed(KVObsError):
    """SGLang reported a transfer failed, aborted it, or dropped its acknowledgement before the copy finished.

    Recorded on the transfer (`outcome="error"`), never raised into SGLang.
    """

    path: str
    reason: str

    template = "SGLang did not confirm the {path} copy: {reason}"


class EngineReportedFailure(KVObsError):
    """vLLM said a copy failed (a failed receive, a failed or refused job): the transfer's recorded error."""

    path: str
    key: Any
    reason: str

    template = "vLLM reported the {path} transfer {key!r} as failed: {reason}"


class StaleSource(KVObsError):
    """A vLLM load read from where a corrupt store was left out: what it brought is not what vLLM thinks it is."""

    key: Any

    template = "load {key!r} read from where a corrupt store was left out: its data is stale"


class LaunchFailed(KVObsError, RuntimeError):
    """FastDeploy's `write_cache` returned an error code: the copy was not launched (the send transfer's error)."""

    remote_gpu_id: Any
    layer_idx: Any
    code: Any

    template = "write_cache to GPU {remote_gpu_id}, layer {layer_idx}, returned {code}: not launched"


class SendFailed(KVObsError, RuntimeError):
    """FastDeploy's prefill cache messagers reported an error status for the request's send."""

    request_id: Any
    status: Any

    template = "the cache send of request {request_id!r} ended with status {status!r}"


class CorruptLoad(KVObsError, RuntimeError):
    """A FastDeploy storage read loaded NaN/Inf: the read failed as FastDeploy fails one (nothing loaded, the
    engine recomputes), on the rank that copied and on the engine that asked."""

    task_id: Any
    bad_block_ids: tuple[int, ...]

    template = "storage task {task_id!r} loaded NaN/Inf into GPU blocks {bad_block_ids}: reported as nothing loaded"
