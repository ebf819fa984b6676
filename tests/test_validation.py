"""Each bad input gets a clear error naming the problem and never touches the lock.

The lock is held by the test while the bad call is made: a call that reached the lock would time out with
LockTimeout; a rejected call fails at once with TransferRejected instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvobs
from kvobs import semconv as sc
from support import lock_is_free


class Task:
    def __init__(self, keys, ids):
        self.keys = keys
        self.gpu_block_ids = ids


BAD_CALLS = [
    ("mismatched lengths", dict(keys=["a", "b"], ids=[1]), "2 storage keys but 1 block ids"),
    ("negative id", dict(keys=None, ids=[1, -2]), "block id -2 is negative"),
    ("duplicate id", dict(keys=None, ids=[4, 5, 4]), "block id 4 appears more than once"),
    ("past capacity", dict(keys=None, ids=[1, 100]), "block id 100 is out of range for a cache of 100 blocks"),
    ("float id", dict(keys=None, ids=[1.5]), "block id 1.5 is a float, not an int"),
    ("bool id", dict(keys=None, ids=[True]), "block id True is a bool, not an int"),
    ("str ids", dict(keys=None, ids="12"), "block ids must be a sequence of ints, got str"),
    ("2-D tensor", dict(keys=None, ids=torch.zeros(2, 2, dtype=torch.int64)), "must be one-dimensional"),
    ("meta tensor", dict(keys=None, ids=torch.tensor([1, 2], device="meta")),
     "block ids are a meta tensor: it holds no values to read"),
    ("keys as a str", dict(keys="abc", ids=[1, 2, 3]), "keys must be a sequence of storage keys, got str"),
    ("async call", dict(keys=None, ids=[1], is_sync=False), "asynchronous transfers (is_sync=False) need"),
    ("non-bool sync", dict(keys=None, ids=[1], is_sync="yes"), "is_sync must be a bool"),
    ("missing attribute", dict(keys=None, ids=None, task=object()), "object object has no attribute 'keys'"),
]


@pytest.mark.parametrize("name, call, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("path", ["prefetch", "write_back"])
def test_bad_input_is_rejected_before_the_lock(cap, path, name, call, message):
    obs = kvobs.KVObserver("v", registry=cap.registry, capacity=100, lock=cap.observer.lock, lock_timeout=5.0,
                           integrity=None)
    ran = []

    @obs.guard(path, keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync")
    def transfer(task, is_sync=True):
        ran.append(task)

    task = call.get("task") or Task(call["keys"], call["ids"])
    assert obs.lock.acquire(0)
    try:
        with pytest.raises(kvobs.TransferRejected) as info:
            transfer(task, is_sync=call.get("is_sync", True))
    finally:
        obs.lock.release()
    assert message in str(info.value)
    assert path in str(info.value)
    assert ran == []
    assert lock_is_free(obs.lock)
    assert cap.registry.get_sample_value(
        sc.TRANSFERS_TOTAL, {"engine": "v", "path": path, "outcome": "rejected"}) == 1


@pytest.mark.parametrize("values", [dict(block_ids=torch.tensor([1, 2], device="meta")),
                                    dict(requests={"r1": torch.tensor([1], device="meta")})])
def test_meta_tensor_ids_given_to_a_transfer_are_rejected_and_counted(cap, values):
    cache = torch.zeros(8, 4)
    with pytest.raises(kvobs.TransferRejected, match="a meta tensor: it holds no values to read"):
        with cap.observer.transfer("send", cache=cache, **values):
            pass
    with pytest.raises(kvobs.TransferRejected, match="a meta tensor"):
        cap.observer.begin("prefetch", cache=cache, **values)
    assert lock_is_free(cap.observer.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="rejected") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="rejected") == 1


def test_send_accepts_async_calls_by_default(cap):
    @cap.observer.send(block_ids="ids", sync="is_sync")
    def send(ids, is_sync=True):
        return "ok"

    assert send([1], is_sync=False) == "ok"


@pytest.mark.parametrize("ids", [[1, 2], (1, 2), range(1, 3), np.array([1, 2]), torch.tensor([1, 2]),
                                 [np.int64(1), np.int32(2)]])
def test_block_id_containers_are_accepted(cap, ids):
    @cap.observer.prefetch(block_ids="ids")
    def fetch(ids):
        return "ok"

    assert fetch(ids) == "ok"
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 2


def test_rejection_is_logged_with_the_reason(cap):
    @cap.observer.prefetch(block_ids="ids")
    def fetch(ids):
        pass

    with pytest.raises(kvobs.TransferRejected):
        fetch([-1])
    assert cap.logs[-1]["event"] == "kvobs.transfer.rejected"
    assert "negative" in cap.logs[-1]["reason"]


BAD_CONFIG = [
    (dict(lock_timeout=-1), ValueError, "lock_timeout=-1 is not understood: use a positive finite number"),
    (dict(lock_timeout=float("inf")), ValueError, "lock_timeout"),
    (dict(lock_timeout=True), ValueError, "lock_timeout"),
    (dict(engine="has space"), ValueError, "engine='has space' is not a valid label value"),
    (dict(engine=""), ValueError, "not a valid label value"),
    (dict(sync_required=["prefech"]), ValueError, "unknown transfer path 'prefech'"),
    (dict(integrity={"writeback": "raise"}), ValueError, "unknown transfer path 'writeback'"),
    (dict(integrity="explode"), ValueError, "explode"),
    (dict(capacity=0), ValueError, "capacity must be a positive int"),
    (dict(block_bytes=-4), ValueError, "block_bytes must be a positive int"),
    (dict(lock=object()), TypeError, "lock must be a kvobs lock"),
    (dict(hooks=[42]), TypeError, "every hook must be callable"),
    (dict(log_level="loud"), ValueError, "unknown log level 'loud'"),
    (dict(extra_paths=["bad path"]), ValueError, "path='bad path'"),
]


@pytest.mark.parametrize("options, error, message", BAD_CONFIG, ids=[str(c[0]) for c in BAD_CONFIG])
def test_bad_configuration_fails_at_construction(registry, options, error, message):
    options.setdefault("engine", "cfg")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        kvobs.KVObserver(registry=registry, **options)


def test_lock_timeout_from_environment(registry, monkeypatch):
    monkeypatch.setenv("KVOBS_LOCK_TIMEOUT", "2.5")
    assert kvobs.KVObserver("env", registry=registry).lock_timeout == 2.5
    monkeypatch.setenv("KVOBS_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KVOBS_LOCK_TIMEOUT='soon'"):
        kvobs.KVObserver("env2", registry=registry)


@pytest.mark.parametrize("value", ["false", "0", "on", 1, 0.0])
def test_enabled_argument_must_be_a_bool(registry, value):
    with pytest.raises(kvobs.InvalidOption) as caught:
        kvobs.KVObserver("on-off", registry=registry, enabled=value)
    assert str(caught.value) == (
        f"enabled={value!r} is not understood: use True, False, or None to read KVOBS_ENABLED")


@pytest.mark.parametrize("text, telemetry", [
    ("0", False), ("false", False), ("No", False), (" OFF ", False),
    ("1", True), ("true", True), ("Yes", True), ("on", True), ("", True),
])
def test_enabled_from_environment_understood_values(registry, monkeypatch, text, telemetry):
    monkeypatch.setenv("KVOBS_ENABLED", text)
    assert kvobs.KVObserver("env-on-off", registry=registry).telemetry is telemetry


@pytest.mark.parametrize("text", ["maybe", "2", "disabled", "tru"])
def test_enabled_from_environment_not_understood_is_an_error_naming_the_variable(registry, monkeypatch, text):
    monkeypatch.setenv("KVOBS_ENABLED", text)
    with pytest.raises(kvobs.InvalidOption) as caught:
        kvobs.KVObserver("env-maybe", registry=registry)
    assert str(caught.value) == f"KVOBS_ENABLED={text!r} is not understood: use 1/true/yes/on or 0/false/no/off"


@pytest.mark.parametrize("variable, option", [("KVOBS_LOCK_TIMEOUT", "lock_timeout"),
                                              ("KVOBS_TRANSFER_DEADLINE", "deadline")])
@pytest.mark.parametrize("text", ["-1", "0", "inf", "nan"])
def test_bad_seconds_from_environment_name_the_variable(registry, monkeypatch, variable, option, text):
    monkeypatch.setenv(variable, text)
    with pytest.raises(kvobs.InvalidOption) as caught:
        kvobs.KVObserver("env-seconds", registry=registry)
    assert str(caught.value) == f"{variable}={text!r} is not understood: use a positive finite number of seconds"
    monkeypatch.delenv(variable)
    with pytest.raises(kvobs.InvalidOption) as caught:
        kvobs.KVObserver("env-seconds", registry=registry, **{option: -1})
    assert str(caught.value) == f"{option}=-1 is not understood: use a positive finite number of seconds"


def test_unknown_path_for_transfer_and_extra_paths(registry):
    obs = kvobs.KVObserver("paths", registry=registry, extra_paths=["swap_in"], integrity=None)
    with pytest.raises(ValueError, match="unknown transfer path 'swap'"):
        obs.guard("swap")

    @obs.guard("swap_in", block_ids="ids")
    def swap_in(ids):
        return 1

    assert swap_in([1]) == 1
    assert registry.get_sample_value(
        sc.TRANSFERS_TOTAL, {"engine": "paths", "path": "swap_in", "outcome": "ok"}) == 1
