"""The worker half of KVObsConnector: what it observes around each call it passes to the wrapped connector.

Transfers begin before the wrapped call that submits their copy and complete after the wrapped call that
reports them done (see `offloading` and `receive`). A load found corrupt (mode `report`) is told to vLLM
the way connectors report failed loads, in the same step vLLM learns it finished: its block ids through
`get_block_ids_with_load_errors()` when the model has one KV group (vLLM then recomputes from the first bad
block, or fails the request, as its `kv_load_failure_policy` says), else the request in `failed_recving`
(vLLM refuses block-level reports for several KV groups). Everything else vLLM sees is the wrapped
connector's, unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvobs.integrations.vllm._caches import checkable_caches
from kvobs.integrations.vllm._offloading import LoadFailure, OffloadingWatch
from kvobs.integrations.vllm._receive import ReceiveWatch
from kvobs.integrations.vllm._sync import SyncWatch, slot_requests
from kvobs.integrations.vllm._transfers import Transfers
from kvobs.integrations.vllm._tree import leaves


class WorkerSide:
    """Observation for one worker-side KVObsConnector."""

    def __init__(self, transfers: Transfers, *, num_blocks: int, group_layers: list[list[str]], block_size: int,
                 offloading_worker: type, transfer_result: type) -> None:
        self.transfers = transfers
        self.num_blocks = num_blocks
        self.group_layers = group_layers
        self.num_groups = len(group_layers)
        self._offloading_worker = offloading_worker
        self._transfer_result = transfer_result
        self.watches: list[tuple[Any, OffloadingWatch]] = []
        self._only_watch: OffloadingWatch | None = None  # the wrapped connector is one offloading connector
        self.receives = ReceiveWatch(transfers)
        self.sync = SyncWatch(transfers, block_size)
        self.failures: list[LoadFailure] = []  # corrupt loads found since vLLM last asked for results
        self._receiving: list[Any] = []  # this step's metadata parts that name receives
        self._syncing: list[Any] = []  # ... and those of connectors that copy during the pass
        self.loads_in_step = False  # whether `loading` has anything to begin this step
        self._trace_contexts: Mapping[str, Any] = {}
        self._load_errors: set[int] = set()

    def registered(self, wrapped: Any, kv_caches: Mapping[str, Any]) -> None:
        """After the wrapped `register_kv_caches`: the caches to check, and the offloading workers it made."""
        self.transfers.cache, left_out = checkable_caches(kv_caches, self.num_blocks)
        if self.transfers.cache is not None and self.num_groups == 1 and not left_out:
            self.transfers.block_bytes = sum(view[0].nbytes for view in self.transfers.cache)
        if self.num_groups > 1:
            self._register_groups(kv_caches)
        if left_out:
            self.transfers.obs.logger.warning("kvobs.vllm: KV caches left out of the NaN/Inf checks",
                                              layers=left_out[:8], count=len(left_out))
        for leaf, _ in leaves(wrapped):
            worker = getattr(getattr(leaf, "connector_worker", None), "worker", None)
            if isinstance(worker, self._offloading_worker) and self._watch(leaf) is None:
                self.watches.append((leaf, OffloadingWatch(worker, self.transfers, self._transfer_result,
                                                           self.failures)))
        if len(self.watches) == 1 and self.watches[0][0] is wrapped:
            self._only_watch = self.watches[0][1]

    def _register_groups(self, kv_caches: Mapping[str, Any]) -> None:
        """Each KV group's own caches, so a block id is checked where that group keeps it."""
        group_caches = []
        group_bytes: list[int | None] = []
        for layers in self.group_layers:
            views, left_out = checkable_caches({n: kv_caches[n] for n in layers if n in kv_caches}, self.num_blocks)
            group_caches.append(views)
            group_bytes.append(None if views is None or left_out else sum(view[0].nbytes for view in views))
        self.transfers.group_caches = group_caches
        self.transfers.group_block_bytes = group_bytes

    def bound(self, wrapped: Any, metadata: Any, trace_contexts: Mapping[str, Any]) -> None:
        """After the wrapped `bind_connector_metadata`: each connector's part of the step's metadata, sorted
        once per step to the watches that can use it. An offloading connector's part goes to its watch only,
        so a step that moves nothing costs the offloading path no more than handing it over."""
        self._trace_contexts = trace_contexts
        if self._only_watch is not None:  # the metadata is all its own, every step
            self._only_watch.metadata = metadata
            return
        receiving = []
        syncing = []
        for leaf, part in leaves(wrapped, metadata):
            watch = self._watch(leaf)
            if watch is not None:
                watch.metadata = part
                continue
            if isinstance(getattr(part, "reqs_to_recv", None), Mapping):
                receiving.append(part)
            if slot_requests(part):
                syncing.append(part)
        self._receiving = receiving
        self._syncing = syncing
        self.loads_in_step = bool(receiving or syncing)

    def cleared(self) -> None:
        """After the wrapped `clear_connector_metadata` (cannot fail: no observation to guard)."""
        self._receiving = []
        self._syncing = []
        self.loads_in_step = False
        self._trace_contexts = {}
        for _, watch in self.watches:
            watch.metadata = None

    def preempting(self, wrapped: Any, metadata: Any) -> None:
        """Before the wrapped `handle_preemptions`, which takes the stores it flushes out of `store_jobs`."""
        for leaf, part in leaves(wrapped, metadata):
            watch = self._watch(leaf)
            if watch is not None:
                watch.note_stores(part)

    def loading(self) -> None:
        """Before the wrapped `start_load_kv`, when `loads_in_step`: the receives this step hands over begin,
        and the loads of connectors that copy in `start_load_kv` itself."""
        for part in self._receiving:
            self.receives.start(part, self._trace_contexts)
        if self._syncing:
            self.sync.loading(self._syncing)

    def saving(self) -> None:
        """Before the wrapped `wait_for_save`, which queues this step's stores for the next step (offloading)
        or ends the ones written during the pass (synchronous connectors, whose loads end here too)."""
        for _, watch in self.watches:
            if watch.metadata is not None:
                watch.note_stores(watch.metadata)
        if self._syncing or self.sync.loads_open:
            self.failures.extend(self.sync.saving(self._syncing))

    def saved(self) -> None:
        """After the wrapped `wait_for_save`, when `sync.stores_open`."""
        self.sync.saved()

    def results(self, results: Any) -> Any:
        """After the wrapped `get_transfer_results`: end what it reports; corrupt loads told to vLLM."""
        if not (results.finished_recving or results.failed_recving or self.failures or self.transfers.pending):
            return results  # most steps: nothing ended, nothing to tell
        requests = self._report(self._finished(results.finished_recving, results.failed_recving))
        if requests:
            results = dataclasses.replace(results, finished_recving=set(results.finished_recving) | requests,
                                          failed_recving=set(results.failed_recving) | requests)
        self.transfers.raise_pending()
        return results

    def finished(self, finished: tuple[Any, Any]) -> tuple[Any, Any]:
        """After the wrapped `get_finished` (the older API: no failed receives, so none can be added)."""
        for request_id in self._report(self._finished(finished[1], ())):
            self._cannot_report(LoadFailure(request_id, (), False), "get_finished cannot report failed receives")
        self.transfers.raise_pending()
        return finished

    @property
    def load_errors_found(self) -> bool:
        return bool(self._load_errors)

    def load_errors(self, reported: set[int]) -> set[int]:
        """The wrapped connector's load errors, and the corrupt blocks found this step."""
        errors, self._load_errors = self._load_errors, set()
        return set(reported) | errors

    def worker_meta(self, wrapped: Any, meta: Any) -> None:
        """After the wrapped `build_connector_worker_meta`: jobs counted done without being submitted here."""
        if self._only_watch is not None:
            if isinstance(getattr(meta, "completed_jobs", None), Mapping):
                self._only_watch.forget(meta.completed_jobs)
            return
        for leaf, part in leaves(wrapped, meta):
            watch = self._watch(leaf)
            if watch is not None and isinstance(getattr(part, "completed_jobs", None), Mapping):
                watch.forget(part.completed_jobs)

    def shutdown(self) -> None:
        for _, watch in self.watches:
            watch.undo()
        self.watches = []
        self._only_watch = None

    def _watch(self, leaf: Any) -> OffloadingWatch | None:
        for known, watch in self.watches:
            if known is leaf:
                return watch
        return None

    def _finished(self, finished: Any, failed: Any) -> list[LoadFailure]:
        failures = self.receives.finish(finished, failed)
        failures.extend(self.failures)
        self.failures.clear()  # the list the watches add to: cleared, never replaced
        return failures

    def _report(self, failures: list[LoadFailure]) -> set[Any]:
        """Corrupt loads as vLLM takes them: block ids (one KV group), else requests (async loads only)."""
        requests = set()
        for failure in failures:
            if self.num_groups == 1:
                self._load_errors.update(failure.block_ids)
            elif failure.request_id is not None and not failure.sync:
                requests.add(failure.request_id)
            else:
                self._cannot_report(failure, "vLLM takes no block-level load errors with several KV groups")
        return requests

    def _cannot_report(self, failure: LoadFailure, why: str) -> None:
        self.transfers.obs.logger.error("kvobs.vllm: corrupt KV loaded and not reported to vLLM", reason=why,
                                        request_id=failure.request_id, block_ids=list(failure.block_ids[:8]))
