"""Helpers for the vLLM integration tests (no tests here): real vLLM configs, and an offloading backend
plugged in through vLLM's own out-of-tree spec mechanism whose copies run on real threads.

`ThreadOffloadingSpec` (served by this module's PEP 562 `__getattr__`, named in `kv_connector_extra_config`
as `spec_name` / `spec_module_path`) gives the real `OffloadingConnector` a worker that copies bytes between
the registered GPU caches and host memory on a thread per job, as the CUDA worker copies on a stream, and
reports completions through `get_finished()`. Tests hold copies back (`gate`), lose completions (`lose`),
and read what moved (`submitted`, `host`).
"""

from __future__ import annotations

import itertools
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import upstream
from support import wait_until

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
MODULE = "kvobs.integrations.vllm"
NUM_BLOCKS = 8
HOST_BLOCKS = 16
BLOCK_SHAPE = (2, 16, 2, 8)  # one layer's block: (K/V, tokens, heads, head size), float32: 2048 bytes
_labels = itertools.count()


@pytest.fixture(autouse=True)
def default_engine_observer() -> Iterator[Any]:
    """Connectors configured without an engine label use "vllm": give them an observer on a registry of their
    own, so no test leaves an observer on prometheus_client's global registry."""
    from prometheus_client import CollectorRegistry

    import kvobs
    from kvobs.integrations.vllm import use_observer

    obs = kvobs.KVObserver("vllm", lock=None, registry=CollectorRegistry())
    undo = use_observer(obs)
    yield obs
    undo()


def engine_label() -> str:
    return f"vllm-test-{next(_labels)}"


def vllm_config(vllm: upstream.Upstream, **transfer: Any) -> Any:
    """A real VllmConfig; the model part is duck-typed (a real ModelConfig reads a HF model)."""
    config = vllm.attr("vllm.config:VllmConfig")(
        kv_transfer_config=vllm.attr("vllm.config.kv_transfer:KVTransferConfig")(**{"kv_role": "kv_both", **transfer}))
    config.model_config = types.SimpleNamespace(
        use_mla=False, get_total_num_kv_heads=lambda: 2, dtype=torch.float32, model="tiny", max_model_len=256)
    return config


def kv_cache_config(vllm: upstream.Upstream, num_blocks: int = NUM_BLOCKS) -> Any:
    iface = vllm.module("vllm.v1.kv_cache_interface")
    spec = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    return iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[iface.KVCacheGroupSpec(["layer.0", "layer.1"], spec)])


def offloading_child() -> dict[str, Any]:
    """The kv_transfer_config of a real OffloadingConnector with the thread-copying backend."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 20, "spec_name": "ThreadOffloadingSpec", "spec_module_path": __name__}}


def wrapper_config(vllm: upstream.Upstream, child: dict[str, Any], name: str = "KVObsConnector",
                   **options: Any) -> Any:
    return vllm_config(vllm, kv_connector=name, kv_connector_module_path=MODULE,
                       kv_connector_extra_config={"connector": child, **options})


def create(vllm: upstream.Upstream, config: Any, role: str = "WORKER", num_blocks: int = NUM_BLOCKS) -> Any:
    """A connector built by vLLM's own factory, as the engine builds it."""
    factory = vllm.attr(f"{FACTORY}:KVConnectorFactory")
    return factory.create_connector(config, getattr(vllm.attr(f"{BASE}:KVConnectorRole"), role),
                                    kv_cache_config(vllm, num_blocks))


def layer_caches(num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(num_blocks, *BLOCK_SHAPE) for name in ("layer.0", "layer.1")}


def as_bytes(value: float) -> torch.Tensor:
    """One host block whose float32 values are all `value`, as the worker's raw bytes."""
    return torch.full(BLOCK_SHAPE, value).view(-1).view(torch.int8)


def load_job(vllm: upstream.Upstream, request_id: str, host: list[int], device: list[int], sync: bool = False) -> Any:
    return vllm.module(COMMON).TransferJob(
        req_id=request_id, src_spec=vllm.attr("vllm.v1.kv_offload.cpu.common:CPULoadStoreSpec")(host),
        dst_spec=gpu_spec(vllm, device), sync=sync)


def store_job(vllm: upstream.Upstream, request_id: str, device: list[int], host: list[int]) -> Any:
    return vllm.module(COMMON).TransferJob(
        req_id=request_id, src_spec=gpu_spec(vllm, device),
        dst_spec=vllm.attr("vllm.v1.kv_offload.cpu.common:CPULoadStoreSpec")(host))


def gpu_spec(vllm: upstream.Upstream, blocks: list[int]) -> Any:
    return vllm.attr("vllm.v1.kv_offload.base:GPULoadStoreSpec")(blocks, group_sizes=[len(blocks)],
                                                                  block_indices=[0])


def offloading_metadata(vllm: upstream.Upstream, load_jobs: dict | None = None,
                        store_jobs: dict | None = None) -> Any:
    return vllm.module(COMMON).OffloadingConnectorMetadata(load_jobs=load_jobs or {}, store_jobs=store_jobs or {})


def backend(connector: Any) -> Any:
    """The thread-copying OffloadingWorker under a (possibly wrapped) OffloadingConnector."""
    return connector.connector_worker.worker


# vLLM imports specs and connectors by module path and name; served here per loaded vLLM.
_served: dict[tuple[int, str], type] = {}


def __getattr__(name: str) -> Any:
    makers = {"ThreadOffloadingSpec": _make_spec, "PlainConnector": _make_plain_connector}
    if name not in makers:
        raise AttributeError(name)
    engine = upstream.require("vllm")
    if (id(engine), name) not in _served:
        _served[(id(engine), name)] = makers[name](engine)
    return _served[(id(engine), name)]


class _PlainConnectorMethods:
    """A connector without HMA support, with its own classmethod answers and its own errors."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unexpected load options {sorted(kwargs)}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return max(0, 32 - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.metadata_type()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        raise LookupError(f"PlainConnector does not know request {request.request_id!r}")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str:
        return f"PLAIN-{vllm_config.kv_transfer_config.kv_connector}"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(extra_config.get("layerwise"))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return kv_transfer_config.kv_role == "kv_consumer"


def _make_plain_connector(vllm: upstream.Upstream) -> type:
    base = vllm.module(BASE)
    return type("PlainConnector", (_PlainConnectorMethods, base.KVConnectorBase_V1),
                {"metadata_type": base.KVConnectorMetadata, "__module__": __name__})


class _ThreadWorkerMethods:
    """An OffloadingWorker copying on a thread per job; `result_type` is vLLM's TransferResult."""

    result_type: type

    def __init__(self, kv_caches: Any) -> None:
        self.device = [t.tensor for t in kv_caches.tensors]
        self.host = [torch.zeros(HOST_BLOCKS, t.shape[1], dtype=torch.int8) for t in self.device]
        self.submitted: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lose: set[int] = set()
        self.waited: list[set[int]] = []
        self._finished: list[Any] = []
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()

    def _copy(self, job_id: int, sources: list[Any], targets: list[Any], src: Any, dst: Any) -> None:
        def run() -> None:
            assert self.gate.wait(30)
            for source, target in zip(sources, targets):
                target[torch.from_numpy(dst.block_ids).long()] = source[torch.from_numpy(src.block_ids).long()]
            with self._lock:
                if job_id not in self.lose:
                    self._finished.append(self.result_type(job_id=job_id, success=True))
        self._threads[job_id] = threading.Thread(target=run, daemon=True)
        self._threads[job_id].start()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.submitted.append(("store", job_id))
        self._copy(job_id, self.device, self.host, src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        self.submitted.append(("load", job_id))
        self._copy(job_id, self.host, self.device, src_spec, dst_spec)
        return True

    def get_finished(self) -> list[Any]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self.waited.append(set(job_ids))
        for job_id in job_ids:
            self._threads[job_id].join()


def _make_spec(vllm: upstream.Upstream) -> type:
    base = vllm.module("vllm.v1.kv_offload.base")
    worker_type = type("ThreadOffloadingWorker", (_ThreadWorkerMethods, base.OffloadingWorker),
                       {"result_type": base.TransferResult})

    def get_worker(self: Any, kv_caches: Any) -> Any:
        if self._worker is None:
            self._worker = worker_type(kv_caches)
        return self._worker

    return type("ThreadOffloadingSpec", (vllm.attr("vllm.v1.kv_offload.cpu.spec:CPUOffloadingSpec"),),
                {"get_worker": get_worker, "__module__": __name__})


class Rig:
    """A worker-side KVObsConnector around the real OffloadingConnector, with its own observer."""

    def __init__(self, vllm: upstream.Upstream, *, integrity: str = "report", deadline: float = 30.0,
                 check_every: int = 1, **observer_options: Any) -> None:
        from prometheus_client import CollectorRegistry

        import kvobs
        from kvobs.integrations.vllm import use_observer

        self.vllm = vllm
        self.records: list[Any] = []
        self.label = engine_label()
        observer_options.setdefault("lock", None)
        self.obs = kvobs.KVObserver(self.label, registry=CollectorRegistry(), deadline=deadline,
                                    hooks=[self.records.append], **observer_options)
        self._undo = use_observer(self.obs)
        self.connector = create(vllm, wrapper_config(vllm, offloading_child(), engine=self.label,
                                                     integrity=integrity, check_every=check_every))
        self.caches = layer_caches()

    def register(self) -> Any:
        self.connector.register_kv_caches(self.caches)
        return backend(self.connector)

    def step(self, load_jobs: dict | None = None, store_jobs: dict | None = None, save: bool = False) -> None:
        """One engine step's connector calls up to the copies' submission (and wait_for_save if `save`)."""
        self.connector.bind_connector_metadata(offloading_metadata(self.vllm, load_jobs, store_jobs))
        self.connector.start_load_kv(None)
        if save:
            self.connector.wait_for_save()

    def results_until(self, request_id: str | None = None, job_id: int | None = None) -> dict[str, Any]:
        """The step's end, repeated until `request_id` is received or `job_id` counted done."""
        seen: dict[str, Any] = {"finished_recving": set(), "failed_recving": set(), "invalid": set(),
                                "completed_jobs": {}}

        def done() -> bool:
            results = self.connector.get_transfer_results(set())
            seen["finished_recving"] |= results.finished_recving
            seen["failed_recving"] |= results.failed_recving
            seen["invalid"] |= self.connector.get_block_ids_with_load_errors()
            meta = self.connector.build_connector_worker_meta()
            seen["completed_jobs"].update(meta.completed_jobs if meta is not None else {})
            return request_id in seen["finished_recving"] or job_id in seen["completed_jobs"]

        wait_until(done)
        self.connector.clear_connector_metadata()
        return seen

    def outcomes(self, path: str) -> list[tuple[Any, str]]:
        return [(r.key, r.outcome) for r in self.records if r.path == path]

    def close(self) -> None:
        self.connector.shutdown()
        self._undo()
