"""kvobs on vLLM (0.33): wrap the KV connector you already use in KVObsConnector; nothing else changes.

In a server, only the connector configuration changes (printed below for CPU offloading and for a
prefill/decode pair):

    vllm serve <model> --kv-transfer-config '{"kv_connector": "KVObsConnector",
        "kv_connector_module_path": "kvobs.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"connector": {"kv_connector": "OffloadingConnector", ...}}}'

Every offloading load job then is a `prefetch` transfer checked for NaN/Inf once its copy has landed, every
store job a `write_back` checked before it is submitted; a corrupt load is reported to vLLM as a load
failure (vLLM recomputes it), a corrupt store is left out.

This script runs it on vLLM's real OffloadingConnector, on CPU; it needs vLLM 0.33 installed beside kvobs
(without it, it says so and exits). On CPU vLLM has no offloading worker (its copies run on CUDA streams), so
this script plugs one in through vLLM's own out-of-tree spec option (`spec_name` / `spec_module_path`) that
copies with torch indexing.
"""

from __future__ import annotations

import json
import math
import sys
import types
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.integrations.vllm import use_observer

BLOCKS, HOST_BLOCKS, BLOCK = 8, 16, (2, 16, 2, 8)  # a layer's block: K/V, 16 tokens, 2 heads of 8, float32


def kvobs_transfer_config(connector: dict[str, Any], kv_role: str, engine: str = "vllm") -> dict[str, Any]:
    """vLLM's kv_transfer_config with `connector` wrapped by kvobs."""
    return {
        "kv_connector": "KVObsConnector",  # KVObsConnectorNoHMA for a connector without HMA support
        "kv_connector_module_path": "kvobs.integrations.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"connector": connector, "engine": engine, "integrity": "report"},
    }


OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}
SETUPS = {
    "CPU offloading": kvobs_transfer_config(OFFLOADING, "kv_both"),
    "prefill node": kvobs_transfer_config({"kv_connector": "NixlConnector"}, "kv_producer", "vllm-prefill"),
    "decode node": kvobs_transfer_config({"kv_connector": "NixlConnector"}, "kv_consumer", "vllm-decode"),
}


def vllm_or_exit() -> None:
    """Exit 0 saying what is missing when vLLM (which brings torch) is not installed."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector  # noqa: F401
    except ImportError as exc:
        print(f"skipped: needs vLLM 0.33 installed beside kvobs (pip install vllm==0.33.0): {exc}")
        sys.exit(0)


def __getattr__(name: str) -> Any:
    """vLLM loads the offloading spec by module path and name: this script's, built once vLLM is there."""
    if name != "TorchCopyOffloadingSpec":
        raise AttributeError(name)
    import torch
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class TorchCopyWorker(OffloadingWorker):
        """Copies at submission; reports the job done at the next get_finished(), as a stream would."""

        def __init__(self, kv_caches: Any) -> None:
            self.device = [t.tensor for t in kv_caches.tensors]  # vLLM's byte views of the layer caches
            self.host = [torch.zeros(HOST_BLOCKS, t.shape[1], dtype=torch.int8) for t in self.device]
            self.done: list[Any] = []

        def _copy(self, job_id: int, sources: list[Any], targets: list[Any], src: Any, dst: Any) -> bool:
            for source, target in zip(sources, targets):
                target[torch.from_numpy(dst.block_ids).long()] = source[torch.from_numpy(src.block_ids).long()]
            self.done.append(TransferResult(job_id=job_id, success=True))
            return True

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            return self._copy(job_id, self.device, self.host, src_spec, dst_spec)

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
            return self._copy(job_id, self.host, self.device, src_spec, dst_spec)

        def get_finished(self) -> list[Any]:
            done, self.done = self.done, []
            return done

        def wait(self, job_ids: set[int]) -> None:
            return None  # every copy is done at submission

    class TorchCopyOffloadingSpec(CPUOffloadingSpec):
        def get_worker(self, kv_caches: Any) -> Any:
            if self._worker is None:
                self._worker = TorchCopyWorker(kv_caches)
            return self._worker

    return TorchCopyOffloadingSpec


def offloading_worker_connector() -> Any:
    """The worker-side connector vLLM builds from the CPU-offloading configuration, through its own factory."""
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    on_cpu = {"cpu_bytes_to_use": 1 << 20, "spec_name": "TorchCopyOffloadingSpec", "spec_module_path": __name__}
    child = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": on_cpu}
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**kvobs_transfer_config(child, "kv_both",
                                                                                    "vllm-example")))
    # A real ModelConfig reads a Hugging Face model; the offloading connector reads only these fields.
    config.model_config = types.SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2,
                                                dtype=torch.float32, model="tiny", max_model_len=256)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)])
    return KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)


def step(connector: Any, load_jobs: dict | None = None, store_jobs: dict | None = None) -> set[int]:
    """One engine step as vLLM's model runner drives the connector; returns the blocks reported bad."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    connector.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs=load_jobs or {},
                                                                  store_jobs=store_jobs or {}))
    connector.start_load_kv(None)
    connector.wait_for_save()  # queues this step's stores: the next step's start_load_kv submits them
    connector.get_transfer_results(set())
    bad = connector.get_block_ids_with_load_errors()
    connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return bad


def job(request_id: str, source: list[int], destination: list[int], load: bool) -> Any:
    """What vLLM's scheduler puts in the step's metadata: a job moving blocks between GPU and CPU."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    def gpu(ids: list[int]) -> Any:
        return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])

    if load:
        return TransferJob(req_id=request_id, src_spec=CPULoadStoreSpec(source), dst_spec=gpu(destination))
    return TransferJob(req_id=request_id, src_spec=gpu(source), dst_spec=CPULoadStoreSpec(destination))


def main() -> None:
    vllm_or_exit()
    import torch

    for name, config in SETUPS.items():
        print(f"# {name}\nvllm serve <model> --kv-transfer-config '{json.dumps(config)}'")
    registry = CollectorRegistry()
    undo = use_observer(kvobs.KVObserver("vllm-example", lock=None, registry=registry))
    connector = offloading_worker_connector()
    caches = {layer: torch.zeros(BLOCKS, *BLOCK) for layer in ("layer.0", "layer.1")}
    connector.register_kv_caches(caches)
    caches["layer.0"][2] = 1.0
    step(connector, store_jobs={1: job("req-1", [2], [5], load=False)})  # stored on the next step
    print(f"load of a clean block, bad blocks: {step(connector, load_jobs={2: job('req-2', [5], [3], True)})}")
    caches["layer.1"][4, 0, 0, 0, 0] = math.nan
    step(connector, store_jobs={3: job("req-3", [4], [6], load=False)})
    step(connector)  # the NaN store is left out, and reported done
    print(f"load from where the NaN store was left out, bad blocks: "
          f"{step(connector, load_jobs={4: job('req-4', [6], [7], True)})}")
    connector.shutdown()
    undo()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(("kvobs_transfers_total", "kvobs_nan_checks_total")) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
