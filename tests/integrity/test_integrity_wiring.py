"""NaN/Inf checks wired into the guards: what each path checks, when, and what each policy does."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

import kvobs
from kvobs import semconv as sc
from kvobs.integrity import CorruptKVError
from kvobs.policy import IntegrityPolicy
from kvobs.testing import capture
from support import lock_is_free, lock_is_free_from_other_thread


def kv_cache(blocks=16):
    return torch.ones(blocks, 4, 2, 8, dtype=torch.float16)


def observer(policy, **options):
    return capture(engine="nan", integrity=policy, lock_timeout=2.0, **options)


def test_write_back_raise_stops_before_storage_is_poisoned():
    cache = kv_cache()
    cache[5, 1, 0, 3] = float("nan")
    storage = {}
    with observer("raise") as cap:
        @cap.observer.write_back(keys="keys", block_ids="ids", cache=lambda keys, ids: cache)
        def write_back(keys, ids):
            storage.update(zip(keys, ids))

        with pytest.raises(CorruptKVError) as info:
            write_back(["a", "b", "c"], [4, 5, 6])
        assert storage == {}
        assert info.value.bad_block_ids == (5,)
        assert "write_back" in str(info.value)
        assert lock_is_free(cap.observer.lock)
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="write_back", result="nan") == 1
        assert cap.value(sc.NAN_BLOCKS_TOTAL, path="write_back") == 1
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="error") == 1
        (span,) = cap.spans
        (event,) = [e for e in span.events if e.name == sc.EVENT_INTEGRITY_BAD_BLOCKS]
        assert tuple(event.attributes[sc.ATTR_BAD_BLOCK_IDS]) == (5,)
        assert any(log["event"] == "kvobs.integrity.bad_blocks" and log["bad_block_ids"] == [5] for log in cap.logs)


def test_write_back_skip_leaves_the_task_out():
    cache = kv_cache()
    cache[2, 0, 0, 0] = float("inf")
    written = []
    with observer("skip") as cap:
        @cap.observer.write_back(block_ids="ids", cache=lambda ids: cache)
        def write_back(ids):
            written.append(ids)
            return "stored"

        assert write_back([1, 2]) is None
        assert write_back([3, 4]) == "stored"
        assert written == [[3, 4]]
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="write_back", result="inf") == 1
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="write_back", result="clean") == 1
        assert lock_is_free(cap.observer.lock)


def test_count_only_observes():
    cache = kv_cache()
    cache[0] = float("nan")
    with observer("count") as cap:
        @cap.observer.send(block_ids="ids", cache=lambda ids: cache)
        def send(ids):
            return "sent"

        assert send([0, 1]) == "sent"
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="send", result="nan") == 1
        assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 1


def test_prefetch_checks_the_destination_after_the_load():
    cache = kv_cache()
    poisoned_storage = {"k1": torch.full((4, 2, 8), float("nan"), dtype=torch.float16)}
    with observer("raise") as cap:
        @cap.observer.prefetch(keys="keys", block_ids="ids", cache=lambda keys, ids: cache)
        def prefetch(keys, ids):
            for key, block in zip(keys, ids):
                cache[block] = poisoned_storage[key]
            return "loaded"

        with pytest.raises(CorruptKVError) as info:
            prefetch(["k1"], [7])
        assert info.value.bad_block_ids == (7,)
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 1
        assert lock_is_free(cap.observer.lock)


def test_prefetch_skip_returns_the_policy_result_instead_of_raising():
    """A pool thread that must still send the engine's done signal: "nothing loaded, recompute"."""
    cache = kv_cache()
    with observer(IntegrityPolicy("skip", skip_result=[])) as cap:
        @cap.observer.prefetch(block_ids="ids", cache=cache, result=lambda loaded: loaded)
        def prefetch(ids, poisoned=False):
            if poisoned:
                cache[ids[0]] = float("nan")
            return list(ids)

        assert prefetch([7, 8], poisoned=True) == []
        assert prefetch([9]) == [9]
        assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="rejected") == 1
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 1
        assert lock_is_free(cap.observer.lock)


def test_on_corrupt_decides_what_the_call_returns():
    cache = kv_cache()
    cache[2] = float("nan")
    seen = []
    with observer("raise") as cap:
        def report(transfer, bad_ids):
            seen.append((transfer.path, bad_ids))
            return "reported"

        @cap.observer.write_back(block_ids="ids", cache=cache, on_corrupt=report)
        def write_back(ids):
            raise AssertionError("a corrupt write-back must not run")

        assert write_back([1, 2]) == "reported"
        assert seen == [("write_back", (2,))]
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1


def test_checks_cover_per_layer_key_value_lists_and_block_dim():
    layers = [(torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)) for _ in range(3)]
    layers[2][1][1, 9, 4] = float("nan")
    with observer("raise", block_dim=1) as cap:
        @cap.observer.send(block_ids="ids", cache=lambda ids: layers)
        def send(ids):
            return "sent"

        assert send([1, 2, 3]) == "sent"
        with pytest.raises(CorruptKVError) as info:
            send([8, 9])
        assert info.value.bad_block_ids == (9,)


def test_sampling_every_nth_call():
    cache = kv_cache()
    with observer(IntegrityPolicy("raise", every=3)) as cap:
        @cap.observer.send(block_ids="ids", cache=lambda ids: cache)
        def send(ids):
            return "sent"

        for _ in range(7):
            send([1])
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="send", result="clean") == 3


def test_per_path_policy_and_per_guard_override():
    cache = kv_cache()
    cache[3] = float("nan")
    with observer({"write_back": "raise", "send": "count"}) as cap:
        @cap.observer.send(block_ids="ids", cache=lambda ids: cache)
        def send(ids):
            return "sent"

        @cap.observer.write_back(block_ids="ids", cache=lambda ids: cache, check=False)
        def unchecked_write(ids):
            return "written"

        @cap.observer.prefetch(block_ids="ids", cache=lambda ids: cache)
        def prefetch(ids):
            return "loaded"

        assert send([3]) == "sent"
        assert unchecked_write([3]) == "written"
        with pytest.raises(CorruptKVError):  # left out of the mapping: prefetch keeps the default, "raise"
            prefetch([3])
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="write_back", result="nan") == 0
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 1


def test_a_cache_that_cannot_be_checked_is_rejected_before_the_lock():
    with observer("raise") as cap:
        ran = []

        @cap.observer.write_back(block_ids="ids", cache=lambda ids: "not a tensor")
        def write_back(ids):
            ran.append(ids)

        with pytest.raises(kvobs.TransferRejected, match="cache cannot be checked"):
            write_back([1])
        assert ran == []
        assert lock_is_free(cap.observer.lock)
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1


def test_context_manager_skip_raises_because_a_body_cannot_be_skipped():
    cache = kv_cache()
    cache[1] = float("nan")
    with observer("skip") as cap:
        with pytest.raises(CorruptKVError):
            with cap.observer.transfer("write_back", block_ids=[1], cache=cache):
                raise AssertionError("the body must not run")
        assert lock_is_free(cap.observer.lock)


def test_checks_run_in_disabled_mode_without_telemetry(registry):
    cache = kv_cache()
    cache[0] = float("nan")
    obs = kvobs.KVObserver("quiet", registry=registry, enabled=False, integrity="raise")

    @obs.write_back(block_ids="ids", cache=lambda ids: cache)
    def write_back(ids):
        return "written"

    with pytest.raises(CorruptKVError):
        write_back([0])
    assert write_back([1]) == "written"
    assert registry.get_sample_value(sc.NAN_CHECKS_TOTAL, {"engine": "quiet", "path": "write_back", "result": "nan"}) is None


def test_a_sampling_policy_given_per_call_samples_across_calls():
    cache = kv_cache()
    every_other = IntegrityPolicy("raise", every=2)
    with observer(None) as cap:
        for _ in range(4):
            cap.observer.begin("send", block_ids=[1], cache=cache, check=every_other).complete()
        assert cap.value(sc.NAN_CHECKS_TOTAL, path="send", result="clean") == 2


def test_begin_can_leave_a_corrupt_copy_out_instead_of_raising():
    cache = kv_cache()
    cache[2] = float("nan")
    with observer(IntegrityPolicy("skip", skip_result="not stored")) as cap:
        t = cap.observer.begin("write_back", block_ids=[2], cache=cache, skippable=True)
        assert t.skipped
        assert t.skip() == "not stored"
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1
        with pytest.raises(CorruptKVError):  # without skippable, the caller's code cannot be left out
            cap.observer.begin("write_back", block_ids=[2], cache=cache)
        assert lock_is_free(cap.observer.lock)


# -- `with obs.transfer("prefetch", ...)`: the destinations are checked when the block exits -----------------


def test_with_prefetch_checks_the_blocks_it_loaded_on_exit_and_raises_what_it_finds(checked):
    cache = kv_cache()
    with pytest.raises(CorruptKVError) as info, \
            checked.observer.transfer("prefetch", block_ids=[2, 5], cache=cache):
        assert not lock_is_free_from_other_thread(checked.observer.lock)
        cache[5, 1, 1, 3] = float("nan")  # the "load" brings a bad value into a destination block
    assert info.value.bad_block_ids == (5,)
    assert "prefetch" in str(info.value)
    assert lock_is_free(checked.observer.lock)
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 1
    (span,) = checked.spans
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "CorruptKVError"


def test_with_prefetch_does_not_look_at_blocks_before_they_are_loaded(checked):
    cache = kv_cache()
    cache[3] = float("inf")  # stale garbage in a destination the prefetch is about to overwrite
    with checked.observer.transfer("prefetch", block_ids=[3], cache=cache):
        cache[3] = 1.0
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="clean") == 1


def test_with_prefetch_leaves_blocks_outside_the_transfer_alone(checked):
    cache = kv_cache()
    cache[7] = float("nan")
    with checked.observer.transfer("prefetch", block_ids=[1, 2], cache=cache):
        pass
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1


def test_async_with_prefetch_checks_on_exit(checked):
    cache = kv_cache()

    async def main():
        async with checked.observer.transfer("prefetch", block_ids=[0, 1], cache=cache):
            await asyncio.sleep(0)
            cache[0, 0, 0] = float("-inf")

    with pytest.raises(CorruptKVError) as info:
        asyncio.run(main())
    assert info.value.bad_block_ids == (0,)
    assert lock_is_free(checked.observer.lock)


# -- what a check at completion reads, and the skip policy in an async guard ---------------------------------


def test_only_the_blocks_that_moved_are_checked_at_completion(checked):
    cache = kv_cache()
    cache[2] = float("nan")  # block 2 was never loaded: its stale contents are not this transfer's doing
    t = checked.observer.begin("prefetch", block_ids=[1, 2], cache=cache)
    assert t.complete("loaded 1", moved=[1]) == "loaded 1"
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="clean") == 1


def test_a_transfer_naming_no_blocks_checks_nothing_even_with_a_cache(checked):
    cache = kv_cache()
    cache[0] = float("nan")
    with checked.observer.transfer("prefetch", cache=cache):  # no block ids: nothing known to have moved
        pass
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 0


def test_an_async_write_back_of_corrupt_blocks_is_skipped_and_never_runs():
    cache = kv_cache()
    cache[3, 0, 1] = float("nan")
    written = []
    with capture(engine="askip", integrity=kvobs.IntegrityPolicy("skip", skip_result="skipped"),
                 lock_timeout=2.0) as cap:
        @cap.observer.write_back(block_ids="ids", cache=lambda ids: cache)
        async def write_back(ids):
            written.append(ids)
            return "stored"

        assert asyncio.run(write_back([2, 3])) == "skipped"
        assert asyncio.run(write_back([4])) == "stored"
        assert written == [[4]]
        assert lock_is_free(cap.observer.lock)
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 1


# -- an IntegrityPolicy is checked when it is made, and never changes ----------------------------------------


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
    a = IntegrityPolicy("skip", skip_result=[])
    b = IntegrityPolicy("skip", skip_result={"loaded": 0})
    assert a == b
    assert hash(a) == hash(b)
    assert a != IntegrityPolicy("raise")
