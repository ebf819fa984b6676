"""Helpers for the vLLM PD tests (no tests here): the real NIXL scheduler halves driven as vLLM's scheduler
drives them, and the decode worker NIXL would be.

`SimulatedNixlWorker` (served by this module's PEP 562 `__getattr__`, loaded by vLLM's factory through
`kv_connector_module_path`) stands in for NIXL's worker half, which needs RDMA hardware: it reads the blocks
the real NIXL scheduler put in its real `NixlConnectorMetadata.reqs_to_recv` from the prefill node's memory
(`REMOTE_BLOCKS`, filled by the test from what the prefill node holds), on a thread, into the registered
caches, and reports them as NIXL's worker does: in finished_recving, and in failed_recving too for a block
it cannot read.
"""

from __future__ import annotations

import math
import pickle
import threading
import types
from typing import Any

import torch
import upstream
from support import wait_until
from vllm_harness import BASE

NIXL_META = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata"
# What the prefill node's GPU blocks hold, readable by the decode node: (remote engine id, block id) -> value.
REMOTE_BLOCKS: dict[tuple[str, int], float] = {}
_served: dict[int, type] = {}


def __getattr__(name: str) -> Any:
    if name != "SimulatedNixlWorker":
        raise AttributeError(name)
    engine = upstream.require("vllm")
    if id(engine) not in _served:
        base = engine.module(BASE)
        _served[id(engine)] = type("SimulatedNixlWorker", (_SimulatedNixlMethods, base.KVConnectorBase_V1,
                                                           base.SupportsHMA), {
            "results_type": base.KVConnectorTransferResults, "__module__": __name__,
            "metadata_type": engine.attr(f"{NIXL_META}:NixlConnectorMetadata")})
    return _served[id(engine)]


class _SimulatedNixlMethods:
    results_type: type
    metadata_type: type

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self.caches: dict[str, torch.Tensor] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.lose: set[str] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()  # type: ignore[attr-defined]
        assert isinstance(metadata, self.metadata_type)
        for request_id, request in metadata.reqs_to_recv.items():
            threading.Thread(target=self._read, args=(request_id, request), daemon=True).start()

    def _read(self, request_id: str, request: Any) -> None:
        assert self.gate.wait(30)
        read = True
        for local_group, remote_group in zip(request.local_block_ids, request.remote.block_ids):
            for local, remote in zip(local_group, remote_group):
                value = REMOTE_BLOCKS.get((request.remote.engine_id, remote))
                read = read and value is not None
                for cache in self.caches.values():
                    cache[local] = math.nan if value is None else value
        if request_id not in self.lose:
            with self._lock:
                (self._done if read else self._failed).add(request_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        with self._lock:
            done, failed, self._done, self._failed = self._done, self._failed, set(), set()
        return self.results_type(finished_recving=done | failed, failed_recving=failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.metadata_type()

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        return False, None


def nixl_child(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def simulated_worker_child() -> dict[str, Any]:
    return {"kv_connector": "SimulatedNixlWorker", "kv_connector_module_path": __name__, "kv_role": "kv_consumer"}


def finished_prefill(vllm: upstream.Upstream, request_id: str, num_tokens: int = 32) -> Any:
    """A request as the prefill node's scheduler hands it to request_finished (duck-typed vLLM Request)."""
    status = vllm.attr("vllm.v1.request:RequestStatus").FINISHED_LENGTH_CAPPED
    return types.SimpleNamespace(request_id=request_id, kv_transfer_params={"do_remote_decode": True},
                                 status=status, num_computed_tokens=num_tokens,
                                 prompt_token_ids=list(range(num_tokens)), num_prompt_tokens=num_tokens)


def decode_request(request_id: str, kv_transfer_params: dict[str, Any], num_tokens: int = 32) -> Any:
    return types.SimpleNamespace(request_id=request_id, kv_transfer_params=dict(kv_transfer_params),
                                 prompt_token_ids=list(range(num_tokens)), num_prompt_tokens=num_tokens)


def decode_schedule(vllm: upstream.Upstream, scheduler: Any, request: Any, local_blocks: list[int]) -> Any:
    """The decode node's scheduler on a request from the prefill node: match, allocate, build the step's
    connector metadata, pickled and unpickled as vLLM ships it to the workers."""
    count, load_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert load_async and count > 0
    blocks = vllm.attr("vllm.v1.core.kv_cache_manager:KVCacheBlocks")(
        blocks=([vllm.attr("vllm.v1.core.kv_cache_utils:KVCacheBlock")(b) for b in local_blocks],))
    scheduler.update_state_after_alloc(request, blocks, count)
    metadata = scheduler.build_connector_meta(vllm.attr("vllm.v1.core.sched.output:SchedulerOutput").make_empty())
    return pickle.loads(pickle.dumps(metadata))


def receive_until(worker: Any, request_id: str) -> dict[str, set[Any]]:
    seen: dict[str, set[Any]] = {"finished": set(), "failed": set(), "invalid": set()}

    def done() -> bool:
        results = worker.get_transfer_results(set())
        seen["finished"] |= results.finished_recving
        seen["failed"] |= results.failed_recving
        seen["invalid"] |= worker.get_block_ids_with_load_errors()
        return request_id in seen["finished"]

    wait_until(done)
    return seen
