"""KVObsConnector around the REAL vLLM 0.33 OffloadingConnector, whose jobs a real OffloadingWorker copies on
threads (see vllm_harness): each load job is a prefetch checked when the worker reports it
done, each store job a write-back checked before it is submitted.
"""

# ruff: noqa: F811  (pytest fixtures imported from upstream are parameters of the tests)
from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import upstream
from upstream import vllm  # noqa: F401  (the fixture)
from vllm_harness import (
    Rig,
    as_bytes,
    default_engine_observer,  # noqa: F401  (autouse fixture)
    load_job,
    offloading_metadata,
    store_job,
    wait_until,
)

from kvobs import semconv as sc
from kvobs.errors import CorruptKVError

NAN = math.nan


@pytest.fixture
def rig(vllm: upstream.Upstream, request: pytest.FixtureRequest) -> Iterator[Rig]:
    options = getattr(request, "param", {})
    made = Rig(vllm, **options)
    yield made
    made.close()


def blocks_equal(caches: dict[str, torch.Tensor], block: int, value: float) -> bool:
    return all(bool((cache[block] == value).all()) for cache in caches.values())


def test_a_load_is_checked_when_its_copy_has_landed_not_at_submit(rig: Rig, vllm: upstream.Upstream) -> None:
    """The destination holds NaN (stale) while the copy is on its way: no alarm; checked once it landed."""
    rig.caches["layer.0"][5] = NAN
    worker = rig.register()
    for host in worker.host:
        host[4] = as_bytes(7.0)
    worker.gate.clear()  # the copy waits
    rig.step(load_jobs={11: load_job(vllm, "req-1", host=[4], device=[5])})
    assert worker.submitted == [("load", 11)]
    assert rig.obs.open_transfer(sc.PATH_PREFETCH, 11).request_id == "req-1"
    assert rig.connector.get_transfer_results(set()).finished_recving == set()  # nothing landed yet
    assert rig.outcomes(sc.PATH_PREFETCH) == []
    worker.gate.set()
    seen = rig.results_until(request_id="req-1")
    assert rig.outcomes(sc.PATH_PREFETCH) == [(11, sc.OUTCOME_OK)]
    assert seen["invalid"] == set() and seen["failed_recving"] == set()
    assert seen["completed_jobs"] == {11: 1}
    assert blocks_equal(rig.caches, 5, 7.0)


def test_a_partial_hit_is_checked_only_where_data_arrived(rig: Rig, vllm: upstream.Upstream) -> None:
    """Storage had one of the request's two blocks: the other (still NaN, to be computed) is not checked."""
    rig.caches["layer.1"][6] = NAN
    worker = rig.register()
    for host in worker.host:
        host[2] = as_bytes(1.5)
    rig.step(load_jobs={12: load_job(vllm, "req-2", host=[2], device=[5])})
    seen = rig.results_until(request_id="req-2")
    assert rig.outcomes(sc.PATH_PREFETCH) == [(12, sc.OUTCOME_OK)]
    assert seen["invalid"] == set()
    (record,) = rig.records
    assert record.blocks == 1 and record.request_id == "req-2"


def test_a_nan_load_is_reported_to_vllm_as_a_load_failure(rig: Rig, vllm: upstream.Upstream) -> None:
    worker = rig.register()
    for host in worker.host:
        host[3] = as_bytes(NAN)
        host[4] = as_bytes(2.0)
    rig.step(load_jobs={13: load_job(vllm, "req-3", host=[3, 4], device=[1, 2])})
    seen = rig.results_until(request_id="req-3")
    assert seen["invalid"] == {1}  # vLLM recomputes from block 1 (kv_load_failure_policy=recompute)
    assert rig.outcomes(sc.PATH_PREFETCH) == [(13, sc.OUTCOME_REJECTED)]
    assert rig.records[0].bad_block_ids == (1,)
    assert seen["completed_jobs"] == {13: 1}  # the connector's own bookkeeping is untouched


@pytest.mark.parametrize("rig", [{"integrity": "raise"}], indirect=True)
def test_a_nan_load_raises_after_the_connectors_bookkeeping_under_raise(rig: Rig, vllm: upstream.Upstream) -> None:
    worker = rig.register()
    for host in worker.host:
        host[3] = as_bytes(math.inf)
    rig.step(load_jobs={14: load_job(vllm, "req-4", host=[3], device=[2])})
    wait_until(lambda: bool(worker._finished))
    with pytest.raises(CorruptKVError, match="prefetch"):
        rig.connector.get_transfer_results(set())
    assert rig.connector.build_connector_worker_meta().completed_jobs == {14: 1}
    assert rig.outcomes(sc.PATH_PREFETCH) == [(14, sc.OUTCOME_ERROR)]


def test_a_nan_store_is_not_submitted_completes_and_its_destination_is_never_served(
        rig: Rig, vllm: upstream.Upstream) -> None:
    rig.caches["layer.0"][3, 0, 0, 0, 0] = NAN
    worker = rig.register()
    # step 1: the forward pass wrote block 3; wait_for_save queues its store for the next step
    rig.step(store_jobs={21: store_job(vllm, "req-5", device=[3], host=[9])}, save=True)
    rig.connector.clear_connector_metadata()
    # step 2: start_load_kv submits the queued store: its source is checked first
    rig.step()
    seen = rig.results_until(job_id=21)
    assert worker.submitted == []  # never copied
    assert seen["completed_jobs"] == {21: 1}  # ...yet reported done: nothing in vLLM waits for it
    (record,) = rig.records
    assert (record.path, record.outcome, record.request_id, record.bad_block_ids) == (
        sc.PATH_WRITE_BACK, sc.OUTCOME_ERROR, "req-5", (3,))
    assert isinstance(record.error, CorruptKVError)
    # later, a load from where the store should have written: finite but stale, reported as a load failure
    rig.step(load_jobs={22: load_job(vllm, "req-6", host=[9], device=[4])})
    seen = rig.results_until(request_id="req-6")
    assert seen["invalid"] == {4}
    assert rig.outcomes(sc.PATH_PREFETCH) == [(22, sc.OUTCOME_ERROR)]
    assert "a corrupt store was left out" in str(rig.records[-1].error)
    # a clean store to the same place makes it loadable again
    rig.caches["layer.0"][3] = 1.0
    rig.step(store_jobs={23: store_job(vllm, "req-5", device=[3], host=[9])}, save=True)
    rig.connector.clear_connector_metadata()
    rig.step()
    rig.results_until(job_id=23)
    rig.step(load_jobs={24: load_job(vllm, "req-6", host=[9], device=[5])})
    assert rig.results_until(request_id="req-6")["invalid"] == set()
    assert rig.outcomes(sc.PATH_PREFETCH)[-1] == (24, sc.OUTCOME_OK)


@pytest.mark.parametrize("rig", [{"integrity": "raise"}], indirect=True)
def test_a_nan_store_raises_before_its_copy_is_submitted_under_raise(rig: Rig, vllm: upstream.Upstream) -> None:
    rig.caches["layer.1"][2] = NAN
    worker = rig.register()
    rig.step(store_jobs={23: store_job(vllm, "req-7", device=[2], host=[1])}, save=True)
    rig.connector.clear_connector_metadata()
    with pytest.raises(CorruptKVError, match="write_back"):
        rig.step()  # start_load_kv submits the queued store
    assert worker.submitted == []


def test_a_clean_store_is_a_write_back_from_submit_to_completion(rig: Rig, vllm: upstream.Upstream) -> None:
    rig.caches["layer.0"][6] = 3.0
    worker = rig.register()
    rig.step(store_jobs={24: store_job(vllm, "req-8", device=[6], host=[5])}, save=True)
    rig.connector.clear_connector_metadata()
    worker.gate.clear()
    rig.step()
    assert worker.submitted == [("store", 24)]
    assert rig.obs.open_transfer(sc.PATH_WRITE_BACK, 24).request_id == "req-8"
    worker.gate.set()
    rig.results_until(job_id=24)
    assert rig.outcomes(sc.PATH_WRITE_BACK) == [(24, sc.OUTCOME_OK)]
    assert bool((worker.host[0][5].view(torch.float32) == 3.0).all())


@pytest.mark.parametrize("rig", [{"deadline": 0.3}], indirect=True)
def test_a_load_whose_completion_is_lost_is_abandoned_at_its_deadline(rig: Rig, vllm: upstream.Upstream) -> None:
    worker = rig.register()
    worker.lose.add(15)
    rig.step(load_jobs={15: load_job(vllm, "req-9", host=[0], device=[7])})
    wait_until(lambda: rig.outcomes(sc.PATH_PREFETCH) == [(15, sc.OUTCOME_ABANDONED)])
    assert rig.obs.open_transfer(sc.PATH_PREFETCH, 15) is None
    assert rig.connector.get_transfer_results(set()).finished_recving == set()  # vLLM's view: still loading


def test_a_sync_load_completes_in_the_step_that_submits_it(rig: Rig, vllm: upstream.Upstream) -> None:
    worker = rig.register()
    for host in worker.host:
        host[1] = as_bytes(NAN)
    rig.step(load_jobs={16: load_job(vllm, "req-10", host=[1], device=[3], sync=True)})
    assert worker.waited == [{16}]  # the real connector waited for it before the forward pass
    results = rig.connector.get_transfer_results(set())
    assert results.finished_recving == set()  # sync loads are not reported as received...
    assert rig.connector.get_block_ids_with_load_errors() == {3}  # ...their corrupt blocks are, this step


def test_a_flushed_nan_store_is_not_waited_for(rig: Rig, vllm: upstream.Upstream) -> None:
    """handle_preemptions submits and waits for the stores it flushes: a store left out is not waited for."""
    import vllm_harness as support

    rig.caches["layer.0"][4] = NAN
    worker = rig.register()
    metadata = support.offloading_metadata(vllm, store_jobs={25: store_job(vllm, "req-11", device=[4], host=[2]),
                                                              26: store_job(vllm, "req-11", device=[5], host=[3])})
    metadata.jobs_to_flush = {25, 26}
    rig.connector.handle_preemptions(metadata)
    assert worker.submitted == [("store", 26)] and worker.waited == [{26}]
    assert rig.connector.build_connector_worker_meta() is None  # completions are taken in get_finished
    rig.connector.bind_connector_metadata(support.offloading_metadata(vllm))
    seen = rig.results_until(job_id=25)
    assert seen["completed_jobs"] == {25: 1, 26: 1}
    assert sorted(rig.outcomes(sc.PATH_WRITE_BACK)) == [(25, sc.OUTCOME_ERROR), (26, sc.OUTCOME_OK)]


@pytest.mark.parametrize("rig", [{"check_every": 2}], indirect=True)
def test_check_every_checks_one_transfer_in_n(rig: Rig, vllm: upstream.Upstream) -> None:
    worker = rig.register()
    for host in worker.host:
        host[0] = as_bytes(NAN)
    for job_id, device in ((31, 1), (32, 2), (33, 3)):
        rig.step(load_jobs={job_id: load_job(vllm, f"req-{job_id}", host=[0], device=[device])})
        rig.results_until(request_id=f"req-{job_id}")
    assert rig.outcomes(sc.PATH_PREFETCH) == [(31, sc.OUTCOME_REJECTED), (32, sc.OUTCOME_OK), (33, sc.OUTCOME_REJECTED)]


def test_a_block_lock_holds_the_blocks_of_every_open_transfer_at_once(vllm: upstream.Upstream, tmp_path) -> None:
    """vLLM keeps many transfers open: a BlockLock lets those on disjoint blocks hold their blocks together."""
    from kvobs.locks._block_lock import BlockLock

    rig = Rig(vllm, lock=BlockLock("vllm-offloading", 8, directory=tmp_path), lock_timeout=1.0)
    try:
        worker = rig.register()
        worker.gate.clear()
        rig.step(load_jobs={41: load_job(vllm, "req-41", host=[0], device=[1]),
                            42: load_job(vllm, "req-42", host=[1], device=[2])})
        assert all(rig.obs.open_transfer(sc.PATH_PREFETCH, job).holds() for job in (41, 42))
        worker.gate.set()
        rig.results_until(request_id="req-42")
        wait_until(lambda: len(rig.records) == 2)
        assert sorted(rig.outcomes(sc.PATH_PREFETCH)) == [(41, sc.OUTCOME_OK), (42, sc.OUTCOME_OK)]
    finally:
        rig.close()


def test_a_global_lock_cannot_hold_two_open_transfers(vllm: upstream.Upstream) -> None:
    """Why the integration takes no lock by default: the second job waits for the first one's completion,
    which comes a step later, and times out inside vLLM's step."""
    import kvobs

    rig = Rig(vllm, lock=kvobs.ThreadLock(), lock_timeout=0.2)
    try:
        rig.register()
        with pytest.raises(kvobs.LockTimeout):
            rig.step(load_jobs={43: load_job(vllm, "req-43", host=[0], device=[1]),
                                44: load_job(vllm, "req-44", host=[1], device=[2])})
    finally:
        rig.close()


def test_an_offloading_connectors_steps_ask_its_metadata_nothing_but_its_jobs(rig: Rig, vllm: upstream.Upstream) -> None:
    """The wrapper's per-step work for an offloading connector is its watch's only: the receive and
    synchronous-connector watches (NIXL's `reqs_to_recv`, the shared-storage `requests`) never look at it."""
    base = type(offloading_metadata(vllm))
    asked: list[str] = []

    class Recording(base):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> object:
            if not name.startswith("__"):
                asked.append(name)
            return super().__getattribute__(name)

    worker = rig.register()
    for host in worker.host:
        host[4] = as_bytes(3.0)
    for load_jobs in ({31: load_job(vllm, "req-31", host=[4], device=[5])}, {}):
        rig.connector.bind_connector_metadata(Recording(load_jobs=load_jobs, store_jobs={}))
        rig.connector.start_load_kv(None)
        rig.connector.wait_for_save()
        rig.connector.get_transfer_results(set())
        rig.connector.get_block_ids_with_load_errors()
        rig.connector.clear_connector_metadata()
    rig.step()
    assert rig.results_until(request_id="req-31")["finished_recving"] == {"req-31"}
    assert set(asked) <= {"load_jobs", "store_jobs"}, sorted(set(asked))
