"""kvobs on SGLang 0.5.23's HiCache, against the real controllers, pools and ack consumers (see the support
module for the few stand-ins): loads and write-backs are transfers completed when SGLang takes their
acknowledgement, checked when the data is there."""

# ruff: noqa: F811  (the `engine` fixture imported from the support module is a parameter of the tests)

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch
from sglang_harness import (  # noqa: F401
    PAGE,
    HiCacheRig,
    engine,
    radix_stand_in,
)
from support import wait_until

import kvobs
from kvobs import semconv as sc
from kvobs.errors import CorruptKVError
from kvobs.integrations import sglang as kvobs_sglang
from kvobs.integrations.sglang._pages import page_views
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import ThreadLock
from kvobs.telemetry._recorder import TransferRecord
from kvobs.testing import capture

KINDS = ("plain", "hybrid")


@pytest.fixture
def records() -> list[TransferRecord]:
    return []


@pytest.fixture
def cap(records: list[TransferRecord]) -> Any:
    with capture(engine="sglang", lock=None, page_size=PAGE, integrity="raise", deadline=30,
                 hooks=[records.append]) as captured:
        yield captured


def _observed(engine: Any, cap: Any, kind: str) -> tuple[HiCacheRig, Any, Any]:
    rig = HiCacheRig(engine, kind)
    undo = kvobs_sglang.instrument_hicache(cap.observer, rig.controller)
    return rig, radix_stand_in(engine, rig.controller), undo


def _backed_up(rig: HiCacheRig, radix: Any, node: int, pages: int, value: float) -> torch.Tensor:
    """Device slots with `value`, written through to host and acknowledged: host slots holding it."""
    slots = rig.allocator.alloc(pages * PAGE)
    rig.fill(slots, value)
    host = rig.write(slots, node)
    radix.expect_write(node)
    radix.writing_check(write_back=True)
    return host


def _ended(records: list[TransferRecord], path: str) -> list[TransferRecord]:
    return [r for r in records if r.path == path]


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_is_checked_when_its_data_is_there_not_when_it_is_queued(engine: Any, cap: Any, records: list,
                                                                         kind: str) -> None:
    rig, radix, undo = _observed(engine, cap, kind)
    host = _backed_up(rig, radix, node=1, pages=2, value=1.5)
    rig.fill(torch.arange(PAGE, 64), math.nan)  # every free device page is NaN until something lands there
    destination = rig.controller.load(host, node_id=2)
    radix.expect_load(2)
    assert all(math.isnan(v) for v in rig.values(destination))  # queued, nothing copied: no check, no alarm
    assert cap.observer.open.count(sc.PATH_PREFETCH) == 1 and not _ended(records, sc.PATH_PREFETCH)
    rig.controller.start_loading()  # the copy
    assert cap.observer.open.count(sc.PATH_PREFETCH) == 1  # copied, not yet acknowledged
    radix.loading_check()  # SGLang takes the ack: the copy is done
    (load,) = _ended(records, sc.PATH_PREFETCH)
    assert (load.outcome, load.blocks, load.request_id) == (sc.OUTCOME_OK, 2, 2)
    assert radix.loaded == [2] and rig.values(destination) == [1.5] * len(rig.values(destination))
    assert cap.value("kvobs_nan_checks_total", path=sc.PATH_PREFETCH, result="clean") == 1
    (write,) = _ended(records, sc.PATH_WRITE_BACK)
    assert (write.outcome, write.request_id) == (sc.OUTCOME_OK, 1)
    undo()


@pytest.mark.parametrize("kind", KINDS)
def test_a_partial_hit_checks_only_the_pages_that_were_loaded(engine: Any, cap: Any, records: list,
                                                              kind: str) -> None:
    rig, radix, undo = _observed(engine, cap, kind)
    host = _backed_up(rig, radix, node=1, pages=3, value=2.0)
    rig.fill(torch.arange(PAGE, 64), math.nan)  # the pages the request computes itself stay NaN
    destination = rig.controller.load(host[: 2 * PAGE], node_id=2)  # the host holds part of the prefix
    radix.expect_load(2)
    rig.controller.start_loading()
    radix.loading_check()
    (load,) = _ended(records, sc.PATH_PREFETCH)
    assert (load.outcome, load.blocks, load.bad_block_ids) == (sc.OUTCOME_OK, 2, ())
    assert len(destination) == 2 * PAGE
    undo()


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_load_is_caught_and_sglang_still_takes_its_ack(engine: Any, cap: Any, records: list,
                                                             kind: str) -> None:
    rig, radix, undo = _observed(engine, cap, kind)
    host = _backed_up(rig, radix, node=1, pages=2, value=1.0)
    rig.poison_host(host[PAGE:])  # the second page went bad in host memory
    destination = rig.controller.load(host, node_id=2)
    radix.expect_load(2)
    rig.controller.start_loading()
    radix.loading_check()  # does not raise: SGLang's loop goes on
    (load,) = _ended(records, sc.PATH_PREFETCH)
    assert load.outcome == sc.OUTCOME_ERROR and isinstance(load.error, CorruptKVError)
    assert load.bad_block_ids == (int(destination[PAGE]) // PAGE,)
    assert radix.loaded == [2] and rig.controller.ack_load_queue == [] and radix.ongoing_load_back == {}
    undo()


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_store_is_not_copied_and_nothing_waits_for_it(engine: Any, cap: Any, records: list,
                                                            kind: str) -> None:
    rig, radix, undo = _observed(engine, cap, kind)
    slots = rig.allocator.alloc(2 * PAGE)
    rig.fill(slots, 3.0)
    rig.fill(slots[PAGE:PAGE + 1], math.nan)
    host_free = rig.host.available_size()
    assert rig.write(slots, 7) is None  # SGLang's "no host memory" answer: the node stays on the device
    assert rig.host.available_size() == host_free
    assert rig.controller.write_queue == [] and rig.controller.ack_write_queue == []
    radix.writing_check()  # nothing to wait for
    radix.writing_check(write_back=True)
    (write,) = _ended(records, sc.PATH_WRITE_BACK)
    assert write.outcome == sc.OUTCOME_ERROR and isinstance(write.error, CorruptKVError)
    assert write.bad_block_ids == (int(slots[PAGE]) // PAGE,)
    clean = _backed_up(rig, radix, node=8, pages=1, value=4.0)  # the next write-back goes through
    assert clean is not None and radix.written == [8]
    undo()


def test_a_nan_written_between_the_write_and_its_copy_is_caught_on_the_host_at_the_ack(engine: Any, cap: Any,
                                                                                      records: list) -> None:
    rig, radix, undo = _observed(engine, cap, "hybrid")  # the radix cache defers the copy (flush=False)
    slots = rig.allocator.alloc(2 * PAGE)
    rig.fill(slots, 3.0)
    host = rig.write(slots, 5)  # sources checked now: clean
    rig.fill(slots[PAGE:PAGE + 1], math.nan)  # the forward pass writes a queued page (lock=None excludes nobody)
    radix.expect_write(5)
    rig.controller.start_writing()  # the copy carries the NaN to host memory
    radix.writing_check()  # SGLang takes the ack: the host pages are checked now
    (write,) = _ended(records, sc.PATH_WRITE_BACK)
    assert write.outcome == sc.OUTCOME_ERROR and isinstance(write.error, CorruptKVError)
    assert write.bad_block_ids == (int(host[PAGE]) // PAGE,)  # the host page holding the bad copy
    (span,) = [s for s in cap.spans if s.name == "kvobs.write_back"]
    assert list(span.attributes[sc.ATTR_BAD_BLOCK_IDS]) == [int(host[PAGE]) // PAGE]
    assert cap.value("kvobs_nan_checks_total", path=sc.PATH_WRITE_BACK, result="nan") == 1
    assert radix.written == [5] and rig.controller.ack_write_queue == []  # SGLang's loop went on
    undo()


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_never_acknowledged_is_abandoned_at_the_deadline(engine: Any, records: list, kind: str) -> None:
    with capture(engine="sglang", lock=None, page_size=PAGE, deadline=0.2, hooks=[records.append]) as cap:
        rig, radix, undo = _observed(engine, cap, kind)
        host = _backed_up(rig, radix, node=1, pages=1, value=1.0)
        rig.controller.load(host, node_id=2)
        radix.expect_load(2)
        rig.controller.start_loading()  # the ack is never taken (a check that never runs)
        wait_until(lambda: _ended(records, sc.PATH_PREFETCH), "the load to be abandoned")
        (load,) = _ended(records, sc.PATH_PREFETCH)
        assert load.outcome == sc.OUTCOME_ABANDONED
        radix.loading_check()  # a late acknowledgement changes nothing
        assert len(_ended(records, sc.PATH_PREFETCH)) == 1 and radix.loaded == [2]
        undo()


def test_several_loads_open_at_once_without_a_global_lock(engine: Any, records: list, tmp_path: Any) -> None:
    pages = HiCacheRig(engine, "plain").pool.k_buffer[0].shape[0] // PAGE
    with capture(engine="sglang", lock=BlockLock("sglang", pages, directory=tmp_path), page_size=PAGE,
                 lock_timeout=2, hooks=[records.append]) as cap:
        rig, radix, undo = _observed(engine, cap, "plain")
        first = _backed_up(rig, radix, node=1, pages=1, value=1.0)
        second = _backed_up(rig, radix, node=2, pages=1, value=2.0)
        rig.controller.load(first, node_id=3)
        rig.controller.load(second, node_id=4)  # both open, each on its own pages
        radix.expect_load(3)
        radix.expect_load(4)
        assert cap.observer.open.count(sc.PATH_PREFETCH) == 2
        rig.controller.start_loading()  # one merged copy, one ack for both
        radix.loading_check()
        loads = _ended(records, sc.PATH_PREFETCH)
        assert sorted(r.request_id for r in loads) == [3, 4] and {r.outcome for r in loads} == {sc.OUTCOME_OK}
        undo()


def test_a_global_lock_is_refused_when_instrumenting(engine: Any) -> None:
    with capture(engine="sglang", lock=ThreadLock(), page_size=PAGE) as cap:
        rig = HiCacheRig(engine, "plain")
        with pytest.raises(ValueError, match="lock=None.*BlockLock"):
            kvobs_sglang.instrument_hicache(cap.observer, rig.controller)
        assert not kvobs_sglang.is_instrumented(rig.controller.write)


def test_a_page_size_that_is_not_sglangs_is_refused(engine: Any) -> None:
    with capture(engine="sglang", lock=None, page_size=2 * PAGE) as cap:
        rig = HiCacheRig(engine, "plain")
        with pytest.raises(ValueError, match=f"page_size={2 * PAGE} is not SGLang's page size {PAGE}"):
            kvobs_sglang.instrument_hicache(cap.observer, rig.controller)
        assert not kvobs_sglang.is_instrumented(rig.controller.write)
        assert type(rig.controller.ack_load_queue) is list


def test_a_class_instrumented_with_the_wrong_page_size_goes_on_unobserved(engine: Any) -> None:
    with capture(engine="sglang", lock=None, page_size=2 * PAGE) as cap:
        rig = HiCacheRig(engine, "plain")
        undo = kvobs_sglang.instrument_hicache(cap.observer, type(rig.controller))  # before the server starts
        slots = rig.allocator.alloc(PAGE)
        assert rig.controller.write(slots, node_id=1) is not None  # SGLang's copy, unobserved
        assert rig.controller.write(slots, node_id=2) is not None
        undo()
    (error,) = [e for e in cap.logs if e["event"] == "kvobs.telemetry.failed"]  # logged once per interval
    assert (error["stage"], error["where"]) == ("hook", "attach")
    assert f"page_size={2 * PAGE} is not SGLang's page size {PAGE}" in str(error["exc_info"])
    assert cap.value("kvobs_telemetry_errors_total", stage="hook") == 2  # each failure counted
    assert cap.value("kvobs_transfers_total", path=sc.PATH_WRITE_BACK, outcome="ok") == 0


def _session(rig: HiCacheRig, radix: Any) -> list[Any]:
    """Write-backs, a load-back, a partial load and the acks, as the radix cache drives them; every return
    value, queue and KV byte recorded."""
    seen: list[Any] = []
    slots = rig.allocator.alloc(3 * PAGE)
    rig.fill(slots, 5.0)
    host = rig.write(slots, 1)
    seen.append(("write", host.tolist(), _acks(rig.controller.ack_write_queue)))
    radix.expect_write(1)
    radix.writing_check()
    radix.writing_check(write_back=True)
    seen.append(("written", radix.written, _acks(rig.controller.ack_write_queue)))
    for node, part in ((2, host), (3, host[:PAGE])):
        seen.append(("load", rig.controller.load(part, node_id=node).tolist()))
        radix.expect_load(node)
    seen.append(("queued", [(op.host_indices.tolist(), op.device_indices.tolist(), op.node_ids)
                            for op in rig.controller.load_queue]))
    seen.append(("start_loading", rig.controller.start_loading(), _acks(rig.controller.ack_load_queue)))
    radix.loading_check()
    seen.append(("loaded", radix.loaded, _acks(rig.controller.ack_load_queue)))
    seen.append(("kv", [t.clone() for t in rig.tensors], [t.clone() for t in rig.host.k_buffer]))
    return seen


def _acks(acks: list[Any]) -> list[tuple[Any, ...]]:
    return [(a.node_ids, a.num_tokens, a.num_bytes) for a in acks]


@pytest.mark.parametrize("kind", KINDS)
def test_sglang_behaves_the_same_with_and_without_kvobs(engine: Any, cap: Any, kind: str) -> None:
    plain_rig = HiCacheRig(engine, kind)
    expected = _session(plain_rig, radix_stand_in(engine, plain_rig.controller))
    controller_type = type(plain_rig.controller)
    originals = {name: controller_type.__dict__[name] for name in ("write", "load")}
    undo = kvobs_sglang.instrument_hicache(cap.observer, controller_type)  # the class, as a server would
    rig = HiCacheRig(engine, kind)
    got = _session(rig, radix_stand_in(engine, rig.controller))
    assert kvobs_sglang.instrument_hicache(cap.observer, controller_type).methods == ()  # idempotent
    undo()
    assert {name: controller_type.__dict__[name] for name in originals} == originals
    assert type(rig.controller.ack_load_queue) is list and type(rig.controller.ack_write_queue) is list
    assert got[:-1] == expected[:-1]
    for got_tensor, expected_tensor in zip(got[-1][1] + got[-1][2], expected[-1][1] + expected[-1][2], strict=True):
        assert torch.equal(got_tensor.nan_to_num(-1.0), expected_tensor.nan_to_num(-1.0))


def test_pools_kvobs_cannot_view_as_pages_are_left_unchecked_with_the_reason() -> None:
    nhd = types.SimpleNamespace(kv_cache_layout="nhd", k_buffer=[torch.zeros(8, 2, 3)], v_buffer=[torch.zeros(8, 2, 3)])
    views, _ = page_views(nhd, PAGE)
    assert [tuple(v.shape) for v in views] == [(2, PAGE, 2, 3)] * 2
    hnd = types.SimpleNamespace(kv_cache_layout="hnd", k_buffer=[torch.zeros(8, 2, 3)])
    assert page_views(hnd, PAGE) == (None, "the 'hnd' KV layout is not indexed by token slot (only 'nhd' is)")
    ragged = types.SimpleNamespace(k_buffer=[torch.zeros(6, 2)])
    assert page_views(ragged, PAGE)[0] is None
    assert page_views(object(), PAGE) == (None, "object has no k_buffer/v_buffer/kv_buffer tensors")


@pytest.mark.parametrize("on_class", [False, True], ids=["controller", "class"])
def test_a_second_observer_is_refused_and_the_same_one_changes_nothing(engine: Any, cap: Any, on_class: bool) -> None:
    rig = HiCacheRig(engine, "plain")
    target = type(rig.controller) if on_class else rig.controller
    undo = kvobs_sglang.instrument_hicache(cap.observer, target)
    try:
        assert kvobs_sglang.instrument_hicache(cap.observer, target).methods == ()
        with capture(engine="sglang-2", lock=None, page_size=PAGE) as other:
            with pytest.raises(kvobs.AlreadyInstrumented, match="write is already instrumented by kvobs for "
                                                                "observer 'sglang'"):
                kvobs_sglang.instrument_hicache(other.observer, target)
        slots = rig.allocator.alloc(PAGE)
        assert rig.controller.write(slots, node_id=1) is not None
        assert cap.observer.open.count(sc.PATH_WRITE_BACK) == 1  # still the first observer's
    finally:
        undo()
    assert not kvobs_sglang.is_instrumented(rig.controller.write)
