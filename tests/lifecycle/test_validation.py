"""Each bad input gets a clear error naming the problem and never touches the lock.

The lock is held by the test while the bad call is made: a call that reached the lock would time out with
LockTimeout; a rejected call fails at once with TransferRejected instead.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch
from support import lock_is_free

import kvobs
from kvobs import semconv as sc
from kvobs._lifecycle.validation import resolve_blocks, validate_key


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
    assert cap.logs[-1]["event"] == "kvobs._lifecycle.transfer.rejected"
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


# -- every input is checked, also when it is the only one given ----------------------------------------------


@pytest.mark.parametrize("values, message", [
    pytest.param({"keys": "abc"}, "keys must be a sequence of storage keys", id="keys"),
    pytest.param({"nbytes": -1}, "nbytes must be a non-negative int", id="nbytes"),
    pytest.param({"key": ["not", "hashable"]}, "is not hashable", id="key"),
    pytest.param({"cache": object()}, "cache", id="cache"),
])
def test_an_input_given_without_block_ids_is_still_checked(checked, values, message):
    with pytest.raises(kvobs.TransferRejected, match=message):
        checked.observer.transfer("write_back", **values)
    assert checked.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1


def test_sync_given_without_block_ids_is_still_checked(cap):
    @cap.observer.prefetch(sync="is_sync")
    def load(is_sync=True):
        return "loaded"

    assert load(is_sync=True) == "loaded"
    with pytest.raises(kvobs.TransferRejected, match="asynchronous transfers"):
        load(is_sync=False)


@pytest.mark.parametrize("option", ["result", "on_corrupt"])
def test_a_guard_option_that_is_not_callable_is_refused_when_the_guard_is_made(checked, option):
    with pytest.raises(TypeError, match=f"{option} must be callable, got 5"):
        checked.observer.prefetch(block_ids="ids", **{option: 5})


# -- bad block ids and caches are refused before the lock ----------------------------------------------------


@pytest.mark.parametrize("ids", [None, {1, 2}, {1: "a"}, frozenset({3})], ids=["none", "set", "dict", "frozenset"])
def test_block_ids_that_are_not_a_sequence_are_rejected(cap, ids):
    obs = cap.observer
    ran = []

    @obs.send(block_ids="ids", cache="cache")
    def send(ids, cache):
        ran.append(ids)

    with pytest.raises(kvobs.TransferRejected, match="block ids"):
        send(ids, torch.zeros(4, 2))
    assert ran == []


@pytest.mark.parametrize("cache, message", [
    (torch.zeros(8, 2, dtype=torch.int32), "int32"),
    (torch.zeros(8, 2, dtype=torch.bool), "bool"),
    (torch.zeros(8, 2, dtype=torch.complex64), "complex64"),
    (torch.zeros(8, 2, device="meta"), "meta"),
    (torch.zeros(8, 2).to_sparse(), "sparse"),
    (torch.zeros(4, 2), "out of range"),
], ids=["int", "bool", "complex", "meta", "sparse", "too-small"])
def test_misconfigured_cache_is_rejected_before_any_lock_or_copy(cap, cache, message):
    obs = kvobs.KVObserver("c", registry=cap.registry, integrity="raise", lock=cap.observer.lock, lock_timeout=5)
    ran = []

    @obs.prefetch(block_ids="ids", cache="cache")
    def fetch(ids, cache):
        ran.append(ids)

    assert obs.lock.acquire(0)  # a call that reached the lock would wait 5 s and time out
    try:
        with pytest.raises(kvobs.TransferRejected, match=message):
            fetch([1, 6], cache)
    finally:
        obs.lock.release()
    assert ran == []


def test_bad_block_dim_is_rejected_before_the_lock(cap):
    obs = kvobs.KVObserver("d", registry=cap.registry, block_dim=5, lock=cap.observer.lock, lock_timeout=5)

    @obs.send(block_ids="ids", cache="cache")
    def send(ids, cache):
        return "sent"

    assert obs.lock.acquire(0)
    try:
        with pytest.raises(kvobs.TransferRejected, match="block_dim"):
            send([1], torch.zeros(8, 2))
    finally:
        obs.lock.release()


# -- block ids: duplicates named, any sequence in, a list of ints out, ranges to the last block or slot ------


@pytest.fixture
def obs(registry):
    return kvobs.KVObserver("validation", registry=registry, integrity=None, capacity=64, lock_timeout=2.0)


@pytest.mark.parametrize("ids, options, message", [
    ([3, 7, 5, 7], {}, "block id 7 appears more than once"),
    ([1, 2, 3, 4, 5, 6, 5], {}, "block id 5 appears more than once"),
    ([9, 10, 9, 10, 11, 12, 11], {"group_sizes": [2, 5]}, "KV group 1: block id 11 appears more than once"),
    ([0, 5, 9, 5], {"page_size": 4}, "token slot 5 appears more than once"),
], ids=["plain", "late", "kv group", "token slots"])
def test_the_duplicate_error_names_the_duplicate_not_the_first_id(ids, options, message):
    page_size = options.get("page_size")
    with pytest.raises(kvobs.TransferRejected, match=message):
        resolve_blocks("prefetch", ids, capacity=64, page_size=page_size, group_sizes=options.get("group_sizes"))


def test_a_duplicate_through_the_public_api_is_named(obs):
    with pytest.raises(kvobs.TransferRejected, match="block id 6 appears more than once"):
        obs.transfer("prefetch", block_ids=(2, 6, 4, 6))


SEQUENCES = [
    ("list", [4, 1, 3]),
    ("tuple", (4, 1, 3)),
    ("numpy", np.array([4, 1, 3], dtype=np.int64)),
    ("numpy int32", np.array([4, 1, 3], dtype=np.int32)),
    ("torch", torch.tensor([4, 1, 3])),
    ("numpy scalars", [np.int64(4), np.int32(1), np.int16(3)]),
]


@pytest.mark.parametrize("ids", [s[1] for s in SEQUENCES], ids=[s[0] for s in SEQUENCES])
def test_ids_come_back_as_a_list_of_python_ints_whatever_sequence_came_in(obs, ids):
    for blocks in (resolve_blocks("prefetch", ids, capacity=64), obs.transfer("prefetch", block_ids=ids).blocks):
        assert type(blocks.ids) is list
        assert blocks.ids == [4, 1, 3]
        assert [type(i) for i in blocks.ids] == [int, int, int]
        assert blocks.distinct == (1, 3, 4)
        assert blocks.count == 3


# Every part of kvobs that takes ids reads them alike: the lifecycle (a transfer's block ids), the integrity check
# (`check_blocks`' ids) and the signal buffers and integrations (slots, ids); each raises its own clear error.
def _read_by_every_part(ids):
    from kvobs.integrations._common import int_list
    from kvobs.integrity import validate_cache

    readers = {
        "lifecycle": lambda: resolve_blocks("prefetch", ids, capacity=64).ids,
        "integrity": lambda: validate_cache(torch.zeros(64, 2)).block_ids(ids).tolist(),
        "integrations": lambda: int_list(ids),
    }
    outcomes = {}
    for part, read in readers.items():
        try:
            outcomes[part] = read()
        except (kvobs.TransferRejected, TypeError, ValueError) as exc:
            outcomes[part] = type(exc)
    return outcomes


@pytest.mark.parametrize("ids", [s[1] for s in SEQUENCES] + [range(4, 1, -2), array.array("q", [4, 1, 3])],
                         ids=[s[0] for s in SEQUENCES] + ["range", "array.array"])
def test_every_part_of_kvobs_accepts_the_same_id_forms(ids):
    expected = [int(i) for i in ids]
    assert _read_by_every_part(ids) == {"lifecycle": expected, "integrity": sorted(set(expected)),
                                        "integrations": expected}


@pytest.mark.parametrize("ids", [[1.5], [True], [None], ["3"], np.array([0.5]), np.array([True]),
                                 torch.tensor([1.0]), torch.tensor([1, 2], device="meta")],
                         ids=["float", "bool", "None", "str", "float array", "bool array", "float tensor", "meta tensor"])
def test_every_part_of_kvobs_refuses_the_same_ids_with_its_own_error(ids):
    assert _read_by_every_part(ids) == {
        "lifecycle": kvobs.TransferRejected,
        "integrity": ValueError if isinstance(ids, torch.Tensor) and ids.is_meta else TypeError,
        "integrations": TypeError,
    }


def test_a_range_comes_back_as_a_list(obs):
    blocks = obs.transfer("prefetch", block_ids=range(2, 5)).blocks
    assert type(blocks.ids) is list
    assert blocks.ids == [2, 3, 4]


def test_a_list_is_not_copied_and_a_tuple_is(obs):
    ids = [5, 6]
    assert resolve_blocks("prefetch", ids, capacity=None).ids is ids  # nothing to convert: no copy
    assert resolve_blocks("prefetch", (5, 6), capacity=None).ids == [5, 6]


def test_token_slot_ids_come_back_as_a_list_with_their_pages():
    blocks = resolve_blocks("prefetch", (0, 1, 9), capacity=8, page_size=4)
    assert type(blocks.ids) is list
    assert blocks.ids == [0, 1, 9]
    assert blocks.distinct == (0, 2)
    assert blocks.count == 2


@pytest.mark.parametrize("sizes", [[2, 1], [2, 3], [4, -1, 1], [-2, 6]])
def test_group_sizes_must_be_non_negative_and_add_up_to_the_ids(sizes):
    with pytest.raises(kvobs.TransferRejected, match=r"must be non-negative and add up to the 4 block ids"):
        resolve_blocks("prefetch", [9, 10, 9, 10], capacity=64, group_sizes=sizes)


def test_group_sizes_that_add_up_are_accepted():
    blocks = resolve_blocks("prefetch", [9, 10, 9, 10], capacity=64, group_sizes=[2, 0, 2])
    assert blocks.distinct == (9, 10)
    assert blocks.count == 4


def test_token_slots_end_at_the_last_slot_of_the_last_page():
    last = 8 * 4 - 1  # 8 pages of 4 slots
    assert resolve_blocks("prefetch", [0, last], capacity=8, page_size=4).distinct == (0, 7)
    with pytest.raises(kvobs.TransferRejected, match="token slot 32 is out of range for a cache of 8 pages of 4"):
        resolve_blocks("prefetch", [0, last + 1], capacity=8, page_size=4)
    assert resolve_blocks("prefetch", [1000], capacity=None, page_size=4).distinct == (250,)


def test_block_ids_end_at_the_last_block():
    assert resolve_blocks("prefetch", [0, 63], capacity=64).distinct == (0, 63)
    with pytest.raises(kvobs.TransferRejected, match="block id 64 is out of range for a cache of 64 blocks"):
        resolve_blocks("prefetch", [64], capacity=64)


def test_no_token_slots_is_an_empty_transfer_not_an_error(registry):
    paged = kvobs.KVObserver("paged", registry=registry, integrity=None, capacity=16, page_size=4)
    with paged.transfer("prefetch", block_ids=[]) as t:
        assert t.blocks.distinct == ()


def test_a_standard_library_array_of_ids_is_a_sequence_not_an_ndarray(obs):
    with obs.transfer("prefetch", block_ids=array.array("i", [4, 2])) as t:
        assert t.blocks.ids == [4, 2] and t.blocks.distinct == (2, 4)


# -- sync, nbytes, storage keys and transfer keys ------------------------------------------------------------


def test_an_asynchronous_call_is_accepted_where_the_guard_completes_later(registry):
    """`is_sync=False` on a sync-only path is refused only when the lock would end before the copy."""
    obs = kvobs.KVObserver("later", registry=registry, integrity=None, capacity=64)

    @obs.prefetch(block_ids="ids", sync="is_sync", complete_later="job")
    def load(ids, job, is_sync=True):
        return "submitted"

    assert load([1], job="j1", is_sync=False) == "submitted"
    assert obs.complete("prefetch", "j1", "loaded") == "loaded"

    @obs.prefetch(block_ids="ids", sync="is_sync")
    def load_now(ids, is_sync=True):
        return "loaded"

    with pytest.raises(kvobs.TransferRejected, match="asynchronous transfers"):
        load_now([1], is_sync=False)


@pytest.mark.parametrize("nbytes", [0, 1, 4096])
def test_nbytes_may_be_zero(obs, nbytes):
    assert obs.transfer("prefetch", block_ids=[1], nbytes=nbytes).nbytes == nbytes


@pytest.mark.parametrize("nbytes", [-1, 1.0, True, "8"])
def test_nbytes_must_be_a_non_negative_int(obs, nbytes):
    with pytest.raises(kvobs.TransferRejected, match="nbytes must be a non-negative int"):
        obs.transfer("prefetch", block_ids=[1], nbytes=nbytes)


@pytest.mark.parametrize("n_keys, accepted", [(3, False), (4, True), (5, True), (6, False)])
def test_storage_keys_pair_with_block_ids_except_the_last_partial_block(obs, n_keys, accepted):
    keys = [f"k{i}" for i in range(n_keys)]
    if accepted:
        with obs.transfer("prefetch", block_ids=[1, 2, 3, 4, 5], keys=keys):
            pass
    else:
        with pytest.raises(kvobs.TransferRejected, match=f"{n_keys} storage keys but 5 block ids"):
            obs.transfer("prefetch", block_ids=[1, 2, 3, 4, 5], keys=keys)


def test_storage_keys_are_not_paired_with_token_slots_or_kv_groups_or_missing_ids(registry):
    paged = kvobs.KVObserver("paged", registry=registry, integrity=None, capacity=16, page_size=4)
    with paged.transfer("prefetch", block_ids=[0, 1, 2, 3, 4], keys=["page0", "page1"]):
        pass  # keys name pages, not the 5 token slots
    plain = kvobs.KVObserver("plain", registry=registry, integrity=None, capacity=16)
    with plain.transfer("prefetch", block_ids=[1, 2, 1, 2], group_sizes=[2, 2], keys=["a", "b"]):
        pass  # one key per block of all KV groups together
    with plain.transfer("prefetch", keys=["a", "b", "c"]):
        pass  # no block ids: nothing to pair with


@pytest.mark.parametrize("keys", [{"k0", "k1"}, 5, iter(["k0", "k1"])])
def test_storage_keys_that_are_not_a_sequence_are_refused_by_type(obs, keys):
    with pytest.raises(kvobs.TransferRejected, match=f"keys must be a sequence of storage keys, got {type(keys).__name__}"):
        obs.transfer("prefetch", block_ids=[1, 2], keys=keys)


def test_a_transfer_key_is_free_again_once_its_transfer_ended(obs):
    first = obs.begin("prefetch", block_ids=[1], key="req-1")
    with pytest.raises(kvobs.TransferRejected, match="already open under key 'req-1'"):
        obs.begin("prefetch", block_ids=[2], key="req-1")
    first.complete()
    obs.begin("prefetch", block_ids=[2], key="req-1").complete()


def test_a_key_without_a_table_of_open_transfers_is_only_checked_for_hashability():
    validate_key("forward", ("layer", 3), None)
    with pytest.raises(kvobs.TransferRejected, match=r"key \['layer', 3\] is not hashable"):
        validate_key("forward", ["layer", 3], None)


def test_moved_blocks_past_the_cache_are_refused_by_name_and_the_transfer_ends(registry):
    """Completion's `moved=` names blocks the cache must hold: one past its end is a TransferRejected naming it
    (not an IndexError from inside the check), the lock is released and the transfer recorded as an error."""
    cache = torch.zeros(8, 16)
    obs = kvobs.KVObserver("moved-past", registry=registry, integrity="raise")
    t = obs.begin("prefetch", block_ids=[1, 2], cache=cache, key="k")
    with pytest.raises(kvobs.TransferRejected, match="block id 9 is out of range for a cache of 8 blocks"):
        t.complete(moved=[2, 9])
    assert t.state == "failed" and not t.holds()
    assert obs.open_transfer("prefetch", "k") is None
    assert lock_is_free(obs.lock)
    errors = registry.get_sample_value("kvobs_transfers_total", {"engine": "moved-past", "path": "prefetch",
                                                                 "outcome": "error"})
    assert errors == 1
