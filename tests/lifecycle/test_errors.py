"""Every error in kvobs.errors pickles with its fields and message, and keeps its builtin base."""

from __future__ import annotations

import errno
import inspect
import pickle

import pytest

import kvobs
from kvobs import errors
from kvobs.integrity import CheckResult

SAMPLES = {
    "path": "prefetch", "reason": "why", "lock_name": "kv", "waited_s": 0.25, "holder": "forward",
    "result": CheckResult(40, nan_block_ids=(3,), inf_block_ids=tuple(range(10, 20))), "detail": "kvobs_x",
    "engine": "e0", "variable": "PROMETHEUS_MULTIPROC_DIR", "name": "a/b", "limit": "max_slots", "size": 8,
    "hint": "finish tasks", "exporter": "OTLPSpanExporter", "spans": 3, "value": "maybe", "expected": "use 0 or 1",
    "consequence": "not recorded", "in_use": 40, "target": "HiCacheController", "method": "write",
    "owner": "observer 'sglang'", "integration": "instrument_hicache", "lock": "ThreadLock('thread')",
    "why": "SGLang keeps many copies in flight", "key": ("job", 7), "remote_gpu_id": 1, "layer_idx": 3, "code": 1,
    "request_id": "req-1", "status": "write cache error", "task_id": "task-1", "bad_block_ids": (6, 7),
}
ERROR_CLASSES = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
                 if issubclass(cls, errors.KVObsError) and cls.__module__ == errors.__name__]


def build(cls: type[errors.KVObsError]) -> errors.KVObsError:
    if not cls.fields:
        return cls(errno.ENOTSUP, "no support") if issubclass(cls, OSError) else cls("plain message")
    return cls(*(SAMPLES[field] for field in cls.fields))


def test_every_error_class_is_covered() -> None:
    names = {cls.__name__ for cls in ERROR_CLASSES}
    assert {"KVObsError", "LockTimeout", "TransferRejected", "CorruptKVError", "OFDUnsupported"} <= names
    assert all(field in SAMPLES for cls in ERROR_CLASSES for field in cls.fields)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_round_trips_through_pickle_with_its_fields(cls: type[errors.KVObsError]) -> None:
    error = build(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and isinstance(copy, kvobs.KVObsError)
    assert str(copy) == str(error) and copy.args == error.args
    for field in cls.fields:
        assert getattr(copy, field) == getattr(error, field)
    if isinstance(error, OSError):
        assert copy.errno == error.errno


def test_builtin_bases_kept() -> None:
    assert issubclass(errors.LockTimeout, TimeoutError) and issubclass(errors.TransferRejected, ValueError)
    assert issubclass(errors.UnsafeLockFile, PermissionError) and issubclass(errors.OFDUnsupported, OSError)


def test_a_default_field_may_be_left_out_and_named_fields_work() -> None:
    assert errors.LockTimeout("kv", 0.5).path is None
    named = errors.LockTimeout(lock_name="kv", waited_s=0.5, path="send")
    assert str(named) == "cache lock 'kv' not acquired within 0.500 s (path=send)"
    assert pickle.loads(pickle.dumps(named)).path == "send"


@pytest.mark.parametrize("args, kwargs, problem", [
    (("prefetch",), {}, "missing 'reason'"),
    (("prefetch", "why", "extra"), {}, "takes 2 arguments (path, reason), got 3"),
    (("prefetch", "why"), {"reason": "again"}, "got multiple values for 'reason'"),
    (("prefetch", "why"), {"cause": "x"}, "has no field 'cause'"),
])
def test_wrong_arguments_are_refused_by_name(args: tuple, kwargs: dict, problem: str) -> None:
    with pytest.raises(TypeError, match="TransferRejected") as refused:
        errors.TransferRejected(*args, **kwargs)
    assert problem in str(refused.value)
