"""The upstream harness loads the engines' REAL classes from their wheels, and cleans up after itself.

These tests pin the upstream facts the kvobs integrations rely on (signatures, where block ids live,
where completions come back), so an engine upgrade that moves them fails here first.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from typing import Any

import pytest
import torch
import upstream
from support import wait_until
from upstream import sglang, vllm  # noqa: F401  (fixtures)

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
OFFLOAD_COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"


def params(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


# --------------------------------------------------------------------------------------------
# The harness itself
# --------------------------------------------------------------------------------------------


def test_wheel_is_reused_from_the_cache_without_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    upstream.require("vllm")  # skips (fails under CI) when it cannot be had
    monkeypatch.setattr(upstream.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert upstream.wheel("vllm", upstream.VLLM_VERSION).name.startswith("vllm-0.33.0-")


def test_failed_download_names_the_wheel(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOBS_WHEEL_CACHE", str(tmp_path))
    failed = types.SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching distribution")
    monkeypatch.setattr(upstream.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(upstream.UpstreamUnavailable, match=r"sglang==0\.5\.23.*No matching"):
        upstream.wheel("sglang", "0.5.23")


@pytest.mark.parametrize("ci, outcome", [("", pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_unavailable_engine_skips_offline_and_fails_under_ci(
        ci: str, outcome: type[BaseException], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", ci)
    monkeypatch.setitem(upstream._loaded, "vllm", upstream.UpstreamUnavailable("no network: vllm==0.33.0"))
    with pytest.raises(outcome, match=r"vllm==0\.33\.0"):
        upstream.require("vllm")


@pytest.mark.parametrize("engine, stub", [("vllm", "transformers"), ("sglang", "triton")])
def test_loaded_modules_and_stubs_stay_out_of_sys_modules(engine: str, stub: str) -> None:
    loaded = upstream.require(engine)
    assert engine not in sys.modules and stub not in sys.modules
    with loaded.active():
        assert sys.modules[engine] is loaded.modules[engine]
        assert "kvobs test stub" in (sys.modules[stub].__doc__ or "")
    assert engine not in sys.modules and stub not in sys.modules


def test_torch_still_sees_triton_absent_after_the_sglang_load() -> None:
    upstream.require("sglang")
    from torch.utils._triton import has_triton_package

    assert has_triton_package() is False


# --------------------------------------------------------------------------------------------
# vLLM 0.33: the V1 connector API
# --------------------------------------------------------------------------------------------


def test_vllm_classes_come_from_the_wheel(vllm: upstream.Upstream) -> None:
    base = vllm.attr(f"{BASE}:KVConnectorBase_V1")
    assert str(vllm.root) in inspect.getfile(base)
    assert vllm.attr(f"{BASE}:KVConnectorRole").WORKER.value == 1


def test_vllm_connector_api_signatures(vllm: upstream.Upstream) -> None:
    base = vllm.attr(f"{BASE}:KVConnectorBase_V1")
    assert base.__abstractmethods__ == {
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"}
    assert params(base.__init__) == ["self", "vllm_config", "role", "kv_cache_config"]
    assert params(base.start_load_kv) == ["self", "forward_context", "kwargs"]
    assert params(base.save_kv_layer) == ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"]
    assert params(base.get_finished) == ["self", "finished_req_ids"]
    # The model runner calls get_transfer_results; a wrapper must forward it, not just get_finished.
    assert params(base.get_transfer_results) == ["self", "finished_req_ids"]
    assert params(base.update_state_after_alloc) == ["self", "request", "blocks", "num_external_tokens"]
    assert params(base.request_finished) == ["self", "request", "block_ids"]
    assert params(vllm.attr(f"{BASE}:SupportsHMA.request_finished_all_groups")) == [
        "self", "request", "block_ids"]


def _vllm_config(vllm: upstream.Upstream, **transfer: Any) -> Any:
    """A real VllmConfig; the model part is duck-typed (a real ModelConfig reads a HF model)."""
    config = vllm.attr("vllm.config:VllmConfig")(
        kv_transfer_config=vllm.attr("vllm.config.kv_transfer:KVTransferConfig")(
            kv_role="kv_both", **transfer))
    config.model_config = types.SimpleNamespace(
        use_mla=False, get_total_num_kv_heads=lambda: 2, dtype=torch.float32, model="tiny",
        max_model_len=256)
    return config


def _kv_cache_config(vllm: upstream.Upstream, num_blocks: int = 8) -> Any:
    iface = vllm.module("vllm.v1.kv_cache_interface")
    spec = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    return iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[iface.KVCacheGroupSpec(["layer.0", "layer.1"], spec)])


def _connector_module(vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch, hma: bool) -> str:
    """An external connector module, loaded the way users plug theirs in: by module path."""
    name = f"kvobs_test_external_connector_{'hma' if hma else 'plain'}"
    base = vllm.attr(f"{BASE}:KVConnectorBase_V1")
    bases = (base, vllm.attr(f"{BASE}:SupportsHMA")) if hma else (base,)
    members = {name: (lambda self, *a, **k: None) for name in base.__abstractmethods__}
    members["request_finished_all_groups"] = lambda self, request, block_ids: (False, None)
    module = types.ModuleType(name)
    module.External = type("External", bases, members)
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_vllm_factory_loads_a_connector_by_module_path(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _connector_module(vllm, monkeypatch, hma=True)
    config = _vllm_config(vllm, kv_connector="External", kv_connector_module_path=module)
    role = vllm.attr(f"{BASE}:KVConnectorRole")
    connector = vllm.attr(f"{FACTORY}:KVConnectorFactory").create_connector(
        config, role.WORKER, _kv_cache_config(vllm))
    assert type(connector) is sys.modules[module].External and connector.role is role.WORKER


@pytest.mark.parametrize("hma", [True, False])
def test_vllm_config_turns_hma_off_for_a_connector_without_it(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch, hma: bool) -> None:
    module = _connector_module(vllm, monkeypatch, hma=hma)
    config = _vllm_config(vllm, kv_connector="External", kv_connector_module_path=module)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is (not hma)


def test_vllm_factory_refuses_a_connector_without_hma_when_hma_is_forced_on(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _connector_module(vllm, monkeypatch, hma=False)
    config = _vllm_config(vllm, kv_connector="External", kv_connector_module_path=module)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    role = vllm.attr(f"{BASE}:KVConnectorRole")
    with pytest.raises(ValueError, match="does not support HMA"):
        vllm.attr(f"{FACTORY}:KVConnectorFactory").create_connector(
            config, role.SCHEDULER, _kv_cache_config(vllm))


def test_vllm_multiconnector_builds_children_from_extra_config_and_binds_their_metadata(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _connector_module(vllm, monkeypatch, hma=True)
    child = {"kv_connector": "External", "kv_connector_module_path": module, "kv_role": "kv_both"}
    config = _vllm_config(vllm, kv_connector="MultiConnector",
                          kv_connector_extra_config={"connectors": [child, child]})
    role = vllm.attr(f"{BASE}:KVConnectorRole")
    multi = vllm.attr(f"{FACTORY}:KVConnectorFactory").create_connector(
        config, role.WORKER, _kv_cache_config(vllm))
    children = multi.sub_connectors
    assert [type(c).__name__ for c in children] == ["External", "External"]
    assert all(c._kv_transfer_config.engine_id == config.kv_transfer_config.engine_id for c in children)
    metadata_type = vllm.attr(f"{BASE}:KVConnectorMetadata")
    first, second = metadata_type(), metadata_type()
    multi.bind_connector_metadata(vllm.attr(
        "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiKVConnectorMetadata")(
        metadata=(first, second)))
    assert [c._get_connector_metadata() for c in children] == [first, second]
    multi.clear_connector_metadata()
    assert not any(c.has_connector_metadata() for c in children)


def test_vllm_offloading_spec_and_worker_signatures(vllm: upstream.Upstream) -> None:
    worker = vllm.attr("vllm.v1.kv_offload.base:OffloadingWorker")
    assert params(worker.submit_load) == ["self", "job_id", "src_spec", "dst_spec", "expedited"]
    assert params(worker.submit_store) == ["self", "job_id", "src_spec", "dst_spec"]
    assert params(worker.get_finished) == ["self"] and params(worker.wait) == ["self", "job_ids"]
    gpu_spec = vllm.attr("vllm.v1.kv_offload.base:GPULoadStoreSpec")
    hybrid = gpu_spec([9, 10, 9, 10], group_sizes=[2, 2], block_indices=[0, 0])
    assert hybrid.block_ids.tolist() == [9, 10, 9, 10] and list(hybrid.group_sizes) == [2, 2]
    job = vllm.attr(f"{OFFLOAD_COMMON}:TransferJob")
    assert [f for f in job.__dataclass_fields__] == ["req_id", "src_spec", "dst_spec", "sync"]


def test_vllm_offloading_connector_builds_both_halves_on_cpu(vllm: upstream.Upstream) -> None:
    config = _vllm_config(vllm, kv_connector="OffloadingConnector",
                          kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20})
    factory = vllm.attr(f"{FACTORY}:KVConnectorFactory")
    role = vllm.attr(f"{BASE}:KVConnectorRole")
    scheduler = factory.create_connector(config, role.SCHEDULER, _kv_cache_config(vllm))
    worker = factory.create_connector(config, role.WORKER, _kv_cache_config(vllm))
    assert type(scheduler.connector_scheduler).__name__ == "OffloadingConnectorScheduler"
    assert type(worker.connector_worker).__name__ == "OffloadingConnectorWorker"


def test_vllm_offloading_load_is_submitted_at_start_load_and_reported_by_get_finished(
        vllm: upstream.Upstream) -> None:
    config = _vllm_config(vllm, kv_connector="OffloadingConnector", kv_connector_extra_config={
        "cpu_bytes_to_use": 1 << 20, "spec_name": "ThreadOffloadingSpec",
        # copies on a real thread, as the CUDA backend copies on a stream
        "spec_module_path": "vllm_harness"})
    num_blocks = 8
    connector = vllm.attr(f"{FACTORY}:KVConnectorFactory").create_connector(
        config, vllm.attr(f"{BASE}:KVConnectorRole").WORKER, _kv_cache_config(vllm, num_blocks))
    caches = {name: torch.zeros(num_blocks, 2, 16, 2, 8) for name in ("layer.0", "layer.1")}
    connector.register_kv_caches(caches)
    worker = connector.connector_worker.worker
    for host in worker.host:
        host[4] = 7  # what storage holds for the request, as raw bytes

    common = vllm.module(OFFLOAD_COMMON)
    job = common.TransferJob(
        req_id="req-1",
        src_spec=vllm.attr("vllm.v1.kv_offload.cpu.common:CPULoadStoreSpec")([4]),
        dst_spec=vllm.attr("vllm.v1.kv_offload.base:GPULoadStoreSpec")([5], group_sizes=[1],
                                                                          block_indices=[0]))
    connector.bind_connector_metadata(common.OffloadingConnectorMetadata(load_jobs={11: job},
                                                                         store_jobs={}))
    connector.start_load_kv(forward_context=None)
    assert worker.submitted == [("load", 11)]
    finished: set[str] = set()

    def reported() -> bool:
        finished.update(connector.get_transfer_results(set()).finished_recving)
        return "req-1" in finished

    wait_until(reported)
    connector.clear_connector_metadata()
    assert all(bool((cache[5].view(torch.int8) == 7).all()) for cache in caches.values())
    assert not any(bool(cache[4].any()) for cache in caches.values())
    assert connector.build_connector_worker_meta().completed_jobs == {11: 1}


def test_vllm_nixl_metadata_keeps_block_ids_per_kv_group(vllm: upstream.Upstream) -> None:
    metadata = vllm.attr(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlConnectorMetadata")()
    metadata.add_new_req_to_recv("req-1", ([3, 4], [9]), {
        "remote_block_ids": [[1, 2], [8]], "remote_engine_id": "p0", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 5600})
    assert metadata.reqs_to_recv["req-1"].local_block_ids == ([3, 4], [9])


# --------------------------------------------------------------------------------------------
# SGLang 0.5.23: HiCache and the PD sender
# --------------------------------------------------------------------------------------------


class _DevicePool:
    device = "cpu"
    layer_num = 2

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _DeviceAllocator:
    """Token-slot allocator: hands out slot indices, as SGLang's allocators do."""

    def __init__(self, slots: int = 64) -> None:
        self.pool = _DevicePool()
        self.free = list(range(slots))

    def get_kvcache(self) -> _DevicePool:
        return self.pool

    def alloc(self, need: int) -> torch.Tensor:
        taken, self.free = self.free[:need], self.free[need:]
        return torch.tensor(taken, dtype=torch.int64)

    def set_hicache_transfer_done_event(self, key: Any, event: Any) -> None:
        self.done_event = event


def test_sglang_hicache_controller_builds_on_cpu_and_queues_a_load(sglang: upstream.Upstream) -> None:
    controller_type = sglang.attr("sglang.srt.managers.cache_controller:HiCacheController")
    assert params(controller_type.write) == ["self", "device_indices", "priority", "node_id", "extra_pools"]
    assert params(controller_type.load) == ["self", "host_indices", "priority", "node_id"]
    assert params(controller_type.start_loading) == params(controller_type.start_writing) == ["self"]
    assert params(controller_type.prefetch) == [
        "self", "request_id", "new_input_tokens", "last_hash", "prefix_keys"]
    host_pool = types.SimpleNamespace(layout="layer_first", size_per_token=4, page_size=4)
    controller = controller_type(_DeviceAllocator(), host_pool, 4, None, threading.Event(),
                                 io_backend="direct")
    device_indices = controller.load(torch.arange(8, 16), node_id=3)
    assert device_indices.tolist() == list(range(8))  # token slots, not pages
    (operation,) = controller.load_queue
    assert operation.node_ids == [3] and operation.host_indices.tolist() == list(range(8, 16))
    assert controller.ack_load_queue == [] and controller.ack_write_queue == []
    ack_fields = sglang.attr("sglang.srt.managers.cache_controller:HiCacheAck")._fields
    assert ack_fields[:3] == ("start_event", "finish_event", "node_ids")


class _KVManager:
    """The slice of a CommonKVManager subclass (Mooncake, NIXL...) that CommonKVSender uses."""

    sender_trace_module = None
    deferred_bootstrap = None
    is_dummy_cp_rank = False
    kv_shard_size = 1
    enable_all_cp_ranks_for_transfer = False
    defer_decode_allocation = False
    reports_transfer_latency = False
    bootstrap_timeout = 300
    kv_item_lens_sum = 0
    state_item_lens_sum = 0

    def __init__(self) -> None:
        self.request_status: dict[int, int] = {}
        self._staging_outstanding: dict[int, int] = {}
        self.requests: list[tuple[Any, ...]] = []

    def update_status(self, room: int, status: int) -> None:
        self.request_status[room] = status

    def check_status(self, room: int) -> int:
        return self.request_status[room]

    def prepare_send_state_indices(self, state_indices: Any) -> Any:
        return state_indices

    def add_transfer_request(self, room: int, kv_indices: Any, index_slice: slice,
                             is_last: bool, **kwargs: Any) -> None:
        self.requests.append((room, list(kv_indices), index_slice, is_last))


def test_sglang_sender_queues_on_send_and_reports_through_poll(sglang: upstream.Upstream) -> None:
    sender_type = sglang.attr("sglang.srt.disaggregation.common.conn:CommonKVSender")
    poll = sglang.attr("sglang.srt.disaggregation.base.conn:KVPoll")
    assert params(sender_type.send) == ["self", "kv_indices", "state_indices", "num_kv_tokens",
                                        "indices_event"]
    get_parallel = sglang.attr("sglang.srt.runtime_context:get_parallel")
    manager = _KVManager()
    with get_parallel().override(num_dp_ranks=1):
        sender = sender_type(manager, "127.0.0.1:8998", bootstrap_room=77)
    assert sender.poll() == poll.Bootstrapping
    sender.init(num_kv_indices=3)
    sender.send([5, 6, 7])
    assert manager.requests == [(77, [5, 6, 7], slice(0, 3), True)]
    assert sender.poll() == poll.Bootstrapping  # queued: the transfer thread has not run
    manager.update_status(77, poll.Success)
    assert sender.poll() == poll.Success
