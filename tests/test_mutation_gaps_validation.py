"""Input checks that a sampled mutation run of kvobs.validation and kvobs.policy showed no test pinned down.

Each test here fails on a mutant that the other tests let through (an operator swapped, a condition or a
statement removed); tools/mutate.py reruns them.
"""

from __future__ import annotations

import array
import dataclasses

import numpy as np
import pytest
import torch

import kvobs
from kvobs.policy import IntegrityPolicy
from kvobs.validation import resolve_blocks, validate_key


@pytest.fixture
def obs(registry):
    return kvobs.KVObserver("gaps", registry=registry, integrity=None, capacity=64, lock_timeout=2.0)


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


@pytest.mark.parametrize("fraction", [True, False, "0.5", [0.5], 0.5j, b"1"])
def test_a_fraction_that_is_not_a_number_is_rejected(fraction):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        IntegrityPolicy(fraction=fraction)


@pytest.mark.parametrize("fraction", [1, 0.5, 1e-9])
def test_numbers_in_range_are_accepted_as_fractions(fraction):
    assert IntegrityPolicy(fraction=fraction).fraction == fraction


@pytest.mark.parametrize("fraction", [0, -0.5, 1.0000001, float("nan")])
def test_a_fraction_out_of_range_is_rejected(fraction):
    with pytest.raises(ValueError, match="fraction must be in"):
        IntegrityPolicy(fraction=fraction)


@pytest.mark.parametrize("every", [True, "2", 2.0, 0, -1])
def test_every_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        IntegrityPolicy(every=every)


def test_every_with_a_fraction_is_refused_but_every_1_is_the_default():
    with pytest.raises(ValueError, match="not both"):
        IntegrityPolicy(every=2, fraction=0.5)
    assert IntegrityPolicy(every=1, fraction=0.5).fraction == 0.5


def test_a_policy_cannot_be_changed_after_its_checks_ran():
    policy = IntegrityPolicy("count", every=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.mode = "explode"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.every = 0  # type: ignore[misc]
    assert (policy.mode, policy.every) == ("count", 2)


def test_a_skip_result_takes_no_part_in_equality_and_may_be_unhashable():
    """`skip_result=[]` is the documented way to say "nothing loaded"; the policy must still hash."""
    a, b = IntegrityPolicy("skip", skip_result=[]), IntegrityPolicy("skip", skip_result={"loaded": 0})
    assert a == b
    assert hash(a) == hash(b)
    assert a != IntegrityPolicy("raise")


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


def test_a_batch_of_token_slots_claims_the_union_of_its_pages(registry):
    paged = kvobs.KVObserver("paged", registry=registry, integrity=None, capacity=16, page_size=4)
    t = paged.begin("prefetch", requests={"a": [0, 1, 5], "b": [5, 9], "c": []})
    assert t.blocks.distinct == (0, 1, 2)  # slots 0, 1 -> page 0; 5 -> page 1 (shared); 9 -> page 2
    assert t.requests == {"a": 2, "b": 2, "c": 0}  # pages per request
    t.complete()


def test_no_token_slots_is_an_empty_transfer_not_an_error(registry):
    paged = kvobs.KVObserver("paged", registry=registry, integrity=None, capacity=16, page_size=4)
    with paged.transfer("prefetch", block_ids=[]) as t:
        assert t.blocks.distinct == ()


def test_a_standard_library_array_of_ids_is_a_sequence_not_an_ndarray(obs):
    with obs.transfer("prefetch", block_ids=array.array("i", [4, 2])) as t:
        assert t.blocks.ids == [4, 2] and t.blocks.distinct == (2, 4)


@pytest.mark.parametrize("keys", [{"k0", "k1"}, 5, iter(["k0", "k1"])])
def test_storage_keys_that_are_not_a_sequence_are_refused_by_type(obs, keys):
    with pytest.raises(kvobs.TransferRejected, match=f"keys must be a sequence of storage keys, got {type(keys).__name__}"):
        obs.transfer("prefetch", block_ids=[1, 2], keys=keys)
