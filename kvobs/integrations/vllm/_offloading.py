"""vLLM's offloading worker, observed: each load job a prefetch, each store job a write-back, from the
moment the copy is submitted to the moment the worker reports it done.

`OffloadingConnectorWorker` submits its jobs to an `OffloadingWorker` (`submit_load` in `start_load_kv`,
`submit_store` in the `start_load_kv` after the `wait_for_save` that queued it) and learns of completions
from the worker's `get_finished()`. Those methods (and `wait`) are wrapped on that one worker instance, so a
transfer begins right before its copy is submitted and completes when the worker says the copy is done.
Job ids map to requests through the metadata bound for the step: a load's while it is submitted, a store's
when `wait_for_save`/`handle_preemptions` queue it.

A store whose sources hold NaN/Inf (mode `report`) is not submitted. vLLM 0.33 has no failed store (a failed
TransferResult trips an assertion), so the worker's completion list reports it done and nothing waits for
it; its destination keeps what it held before, so every later load from there is reported to vLLM as a load
failure, until a clean store overwrites it. A store whose destination kvobs cannot name is submitted as is
(its NaN is then caught when loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kvobs import Instrumentation
from kvobs import semconv as sc
from kvobs.errors import EngineReportedFailure, StaleSource
from kvobs.integrations._common import int_list
from kvobs.integrations.vllm._transfers import Transfers


class LoadFailure(NamedTuple):
    """A load vLLM must hear about: the GPU blocks that hold bad data, the request, whether it was sync."""

    request_id: Any
    block_ids: tuple[int, ...]
    sync: bool


class _Load(NamedTuple):
    request_id: Any
    destination: tuple[int, ...]
    sync: bool
    stale_source: bool  # read from where a store was skipped


def block_ids(spec: Any) -> list[int]:
    return int_list(spec.block_ids)


def group_sizes(spec: Any) -> list[int] | None:
    sizes = getattr(spec, "group_sizes", None)
    return None if sizes is None else int_list(sizes)


def _medium_ids(spec: Any) -> set[tuple[str, int]] | None:
    """Where a store writes, named by the medium's spec type and its block (chunk) ids; None if unknown."""
    ids = getattr(spec, "block_ids", None)
    return None if ids is None else {(type(spec).__name__, b) for b in int_list(ids)}


class OffloadingWatch:
    """Observes one OffloadingWorker instance; `undo()` puts its methods back."""

    def __init__(self, worker: Any, transfers: Transfers, result_type: type, failures: list[LoadFailure]) -> None:
        """failures: where the loads vLLM must hear about are added, for the worker side to report."""
        self.worker = worker
        self.transfers = transfers
        self.result_type = result_type  # vLLM's TransferResult, for the stores left out
        self.metadata: Any = None  # this connector's metadata for the step
        self.failures = failures
        self._store_requests: dict[int, Any] = {}
        self._loads: dict[int, _Load] = {}
        self._skipped: list[int] = []
        self._skipped_ids: set[int] = set()
        self._stale: set[tuple[str, int]] = set()
        self._patches = Instrumentation(owner=transfers.obs)
        for name, make in (("submit_load", self._submit_load), ("submit_store", self._submit_store),
                           ("get_finished", self._get_finished), ("wait", self._wait)):
            self._patches.replace(worker, name, make)  # on this worker instance only

    def undo(self) -> None:
        self._patches.undo()

    def note_stores(self, metadata: Any) -> None:
        """The store jobs `metadata` queues: their requests, kept until they are submitted."""
        for job_id, job in (getattr(metadata, "store_jobs", None) or {}).items():
            self._store_requests[job_id] = job.req_id

    def forget(self, job_ids: Iterable[int]) -> None:
        """Jobs vLLM counted done without this worker (a rank that does not write stores)."""
        for job_id in job_ids:
            self._store_requests.pop(job_id, None)

    # -- the worker's methods ------------------------------------------------------------------------------

    def _submit_load(self, original: Callable[..., bool]) -> Callable[..., bool]:
        def submit_load(job_id: int, src_spec: Any, dst_spec: Any, *args: Any, **kwargs: Any) -> bool:
            job = (getattr(self.metadata, "load_jobs", None) or {}).get(job_id)
            request_id = None if job is None else job.req_id
            destination = block_ids(dst_spec)
            stale = bool(self._stale) and not self._stale.isdisjoint(_medium_ids(src_spec) or ())
            self._loads[job_id] = _Load(request_id, tuple(destination), bool(getattr(job, "sync", False)), stale)
            self.transfers.begin(sc.PATH_PREFETCH, job_id, request_id=request_id, block_ids=destination,
                                 group_sizes=group_sizes(dst_spec))
            return self._submit(sc.PATH_PREFETCH, job_id, original, (job_id, src_spec, dst_spec, *args), kwargs)

        return submit_load

    def _submit_store(self, original: Callable[..., bool]) -> Callable[..., bool]:
        def submit_store(job_id: int, src_spec: Any, dst_spec: Any, *args: Any, **kwargs: Any) -> bool:
            request_id = self._store_requests.pop(job_id, None)
            bad = self.transfers.begin(sc.PATH_WRITE_BACK, job_id, request_id=request_id,
                                       block_ids=block_ids(src_spec), group_sizes=group_sizes(src_spec))
            destination = _medium_ids(dst_spec) if bad or self._stale else None
            if bad and destination is not None:
                self._skipped.append(job_id)
                self._skipped_ids.add(job_id)
                self._stale |= destination
                return True
            if destination:
                self._stale -= destination
            return self._submit(sc.PATH_WRITE_BACK, job_id, original, (job_id, src_spec, dst_spec, *args), kwargs)

        return submit_store

    def _submit(self, path: str, job_id: int, original: Callable[..., bool], args: tuple, kwargs: dict) -> bool:
        try:
            accepted = original(*args, **kwargs)
        except BaseException as exc:
            self.transfers.fail(path, job_id, exc)
            raise
        if not accepted:
            self.transfers.fail(path, job_id, EngineReportedFailure(path, job_id, "the worker refused the job"))
        return accepted

    def _get_finished(self, original: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
        def get_finished() -> list[Any]:
            results = original()
            for result in results:
                self._finished(result.job_id, result.success)
            if not self._skipped:
                return results
            skipped, self._skipped = self._skipped, []
            self._skipped_ids.difference_update(skipped)
            return [*results, *(self.result_type(job_id=job_id, success=True) for job_id in skipped)]

        return get_finished

    def _finished(self, job_id: int, success: bool) -> None:
        load = self._loads.pop(job_id, None)
        path = sc.PATH_WRITE_BACK if load is None else sc.PATH_PREFETCH
        if not success:
            self.transfers.fail(path, job_id, EngineReportedFailure(path, job_id, "TransferResult.success is False"))
            return
        if load is not None and load.stale_source:
            self.transfers.fail(path, job_id, StaleSource(job_id))
            self.failures.append(LoadFailure(load.request_id, load.destination, load.sync))
            return
        bad = self.transfers.complete(path, job_id)
        if load is not None and bad:
            self.failures.append(LoadFailure(load.request_id, tuple(bad), load.sync))

    def _wait(self, original: Callable[[Any], None]) -> Callable[[Any], None]:
        def wait(job_ids: Any) -> None:
            if self._skipped_ids and not self._skipped_ids.isdisjoint(job_ids):
                job_ids = set(job_ids) - self._skipped_ids  # never submitted: nothing to wait for
            return original(job_ids)

        return wait

