"""The methods KVObsConnector adds observation to; every other one is passed to the wrapped connector as is.

Each method calls the wrapped connector with the same arguments and returns what it returned, raising what
it raised; observation runs around the call. Observation never breaks vLLM: an unexpected error in it is
logged and the wrapped connector's result returned. The only deliberate changes are the integrity mode's
(a corrupt load reported as a load failure; a corrupt store left out; CorruptKVError under `raise`), the
trace context added to `kv_transfer_params`, and the step's metadata travelling inside
`KVObsConnectorMetadata` from the scheduler to the workers (unwrapped before the wrapped connector sees it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvobs.integrations.vllm._children as children
from kvobs.errors import CorruptKVError, LockTimeout
from kvobs.integrations._common import HookFailures
from kvobs.integrations.vllm._observers import observer_for
from kvobs.integrations.vllm._scheduler import SchedulerSide, load_failure_policy
from kvobs.integrations.vllm._transfers import Transfers
from kvobs.integrations.vllm._worker import WorkerSide

_DELIBERATE = (CorruptKVError, LockTimeout)  # what the integrity mode or a configured lock raises on purpose


class WrapperMethods:
    """Mixed into the connector classes built in `kvobs.integrations.vllm._classes`, before vLLM's base."""

    __kvobs_wrapper__ = True
    _kvobs_metadata_type: type  # KVObsConnectorMetadata, set on the built classes

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

        base.KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        child_cls, child_config, options = children.child_of(vllm_config)
        children.check_hma(type(self), child_config.kv_transfer_config)
        self._kvobs_wrapped = wrapped = child_cls(child_config, role, kv_cache_config)
        # Called once per layer per step: the wrapped connector's own bound methods, with no frame of ours.
        self.wait_for_layer_load = wrapped.wait_for_layer_load
        self.save_kv_layer = wrapped.save_kv_layer
        obs = observer_for(options)
        self._kvobs_transfers = transfers = Transfers(obs, options.integrity, options.check_every)
        self._kvobs_worker: WorkerSide | None = None
        self._kvobs_scheduler: SchedulerSide | None = None
        if role == base.KVConnectorRole.WORKER:
            self._kvobs_worker = WorkerSide(
                transfers, num_blocks=kv_cache_config.num_blocks,
                group_layers=[list(group.layer_names) for group in kv_cache_config.kv_cache_groups],
                block_size=vllm_config.cache_config.block_size, offloading_worker=OffloadingWorker,
                transfer_result=TransferResult)
        else:
            load_failure_policy(vllm_config.kv_transfer_config, options.integrity, options.recompute, obs.logger)
            self._kvobs_scheduler = SchedulerSide(transfers, block_size=_block_size(kv_cache_config))

    @property
    def kvobs_wrapped(self) -> Any:
        """The wrapped connector."""
        return self._kvobs_wrapped

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped connector's own (e.g. `connector_worker`, `sub_connectors`)."""
        wrapped = self.__dict__.get("_kvobs_wrapped")
        if wrapped is None or name.startswith("_kvobs"):
            raise AttributeError(name)
        return getattr(wrapped, name)

    def _kvobs_safely(self, fallback: Any, observe: Callable[..., Any], *args: Any) -> Any:
        try:
            return observe(*args)
        except _DELIBERATE:
            raise
        except Exception as exc:  # noqa: BLE001 - observing never changes what vLLM sees
            HookFailures(self._kvobs_transfers.obs)(getattr(observe, "__name__", "observe"), exc)
            return fallback

    # -- worker side ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> Any:
        result = self._kvobs_wrapped.register_kv_caches(kv_caches)
        if self._kvobs_worker is not None:
            self._kvobs_safely(None, self._kvobs_worker.registered, self._kvobs_wrapped, kv_caches)
        return result

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        wrapped_metadata, trace_contexts = self._kvobs_unwrap(connector_metadata)
        self._kvobs_wrapped.bind_connector_metadata(wrapped_metadata)
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]
        if self._kvobs_worker is not None:
            self._kvobs_safely(None, self._kvobs_worker.bound, self._kvobs_wrapped, wrapped_metadata, trace_contexts)

    def clear_connector_metadata(self) -> None:
        self._kvobs_wrapped.clear_connector_metadata()
        super().clear_connector_metadata()  # type: ignore[misc]
        if self._kvobs_worker is not None:
            self._kvobs_worker.cleared()

    def handle_preemptions(self, kv_connector_metadata: Any) -> Any:
        wrapped_metadata, _ = self._kvobs_unwrap(kv_connector_metadata)
        if self._kvobs_worker is not None:
            self._kvobs_safely(None, self._kvobs_worker.preempting, self._kvobs_wrapped, wrapped_metadata)
        return self._kvobs_wrapped.handle_preemptions(wrapped_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Per-step checks of the worker's own flags, here: a call of kvobs's per engine step costs microseconds
        # (its code is cold after each forward pass), so the steps that need nothing of kvobs make none.
        if self._kvobs_worker is not None and self._kvobs_worker.loads_in_step:
            self._kvobs_safely(None, self._kvobs_worker.loading)
        return self._kvobs_wrapped.start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> Any:
        if self._kvobs_worker is not None:
            self._kvobs_safely(None, self._kvobs_worker.saving)
        result = self._kvobs_wrapped.wait_for_save()
        if self._kvobs_worker is not None and self._kvobs_worker.sync.stores_open:
            self._kvobs_safely(None, self._kvobs_worker.saved)
        return result

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        finished = self._kvobs_wrapped.get_finished(finished_req_ids)
        if self._kvobs_worker is None:
            return finished
        return self._kvobs_safely(finished, self._kvobs_worker.finished, finished)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self._kvobs_wrapped.get_transfer_results(finished_req_ids)
        if self._kvobs_worker is None:
            return results
        return self._kvobs_safely(results, self._kvobs_worker.results, results)

    def get_block_ids_with_load_errors(self) -> set[int]:
        reported = self._kvobs_wrapped.get_block_ids_with_load_errors()
        if self._kvobs_worker is None or not self._kvobs_worker.load_errors_found:
            return reported
        return self._kvobs_safely(reported, self._kvobs_worker.load_errors, reported)

    def build_connector_worker_meta(self) -> Any:
        meta = self._kvobs_wrapped.build_connector_worker_meta()
        if self._kvobs_worker is not None:
            self._kvobs_safely(None, self._kvobs_worker.worker_meta, self._kvobs_wrapped, meta)
        return meta

    def shutdown(self) -> Any:
        try:
            return self._kvobs_wrapped.shutdown()
        finally:
            if self._kvobs_worker is not None:
                self._kvobs_safely(None, self._kvobs_worker.shutdown)

    def _kvobs_unwrap(self, metadata: Any) -> tuple[Any, dict[str, Any]]:
        if isinstance(metadata, self._kvobs_metadata_type):
            return metadata.wrapped, metadata.trace_contexts
        return metadata, {}

    # -- scheduler side ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        wrapped = self._kvobs_wrapped.build_connector_meta(scheduler_output)
        contexts = {} if self._kvobs_scheduler is None else self._kvobs_scheduler.take_trace_contexts()
        return self._kvobs_metadata_type(wrapped=wrapped, trace_contexts=contexts)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Any, bool]:
        result = self._kvobs_wrapped.get_num_new_matched_tokens(request, num_computed_tokens)
        if self._kvobs_scheduler is None:
            return result
        return self._kvobs_safely(result, self._kvobs_scheduler.matched, request, num_computed_tokens, result)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        result = self._kvobs_wrapped.update_state_after_alloc(request, blocks, num_external_tokens)
        if self._kvobs_scheduler is not None:
            self._kvobs_safely(None, self._kvobs_scheduler.allocated, request, blocks, num_external_tokens)
        return result

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return self._kvobs_finished(request, block_ids, self._kvobs_wrapped.request_finished(request, block_ids))

    def update_connector_output(self, connector_output: Any) -> Any:
        result = self._kvobs_wrapped.update_connector_output(connector_output)
        if self._kvobs_scheduler is not None:
            self._kvobs_safely(None, self._kvobs_scheduler.output, connector_output)
        return result

    def _kvobs_finished(self, request: Any, block_ids: Any, result: tuple[bool, Any]) -> tuple[bool, Any]:
        if self._kvobs_scheduler is None:
            return result
        return self._kvobs_safely(result, self._kvobs_scheduler.finished, request, block_ids, result)

    # -- class-level questions vLLM asks the configured class: answered by the wrapped connector's class ---

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        child_cls, child_config, _ = children.child_of(vllm_config)
        return child_cls.get_required_kvcache_layout(child_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from vllm.config.kv_transfer import KVTransferConfig

        from kvobs.integrations.vllm._options import read_options

        connector = read_options(extra_config).connector
        child_cls = children.child_class(KVTransferConfig(**{"kv_role": "kv_both", **connector}))
        return child_cls.requires_piecewise_for_cudagraph(connector.get("kv_connector_extra_config", {}))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        child_cls, child_config = children.child_of_transfer_config(kv_transfer_config)
        return child_cls.supports_sleep_mode(child_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        child_cls = children.last_seen_child()
        return None if child_cls is None else child_cls.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        child_cls, child_config, _ = children.child_of(vllm_config)
        return child_cls.build_prom_metrics(child_config, metric_types, labelnames, per_engine_labelvalues)


def _block_size(kv_cache_config: Any) -> int:
    """Tokens per KV block of the first KV group (the one whose prefix hashes vLLM keeps per block)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return int(groups[0].kv_cache_spec.block_size) if groups else 1


class HMAMethods:
    """The HMA entry point, for children that support the hybrid KV cache manager."""

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        result = self._kvobs_wrapped.request_finished_all_groups(request, block_ids)  # type: ignore[attr-defined]
        return self._kvobs_finished(request, block_ids, result)  # type: ignore[attr-defined]
