"""Real SGLang 0.5.23 parts on CPU for the SGLang integration tests (no tests here).

What is SGLang's own code, from the wheel: `HiCacheController`, `HybridCacheController` (with a real
`HostPoolGroup`), `L2TransferEngine`, `MHATokenToKVPool` (device pool), `PagedTokenToKVPoolAllocator`,
`MHATokenToKVPoolHost` (host pool), the ack consumers `UnifiedRadixCache.loading_check` / `writing_check`,
`CommonKVSender`, `CommonKVReceiver`, and `CommonKVManager`'s status path (`conclude_transfer`,
`conclude_failure`, `update_status`, `send_kv_status_message`, `_encode_kv_status_message`,
`parse_kv_status_message`, `apply_prefill_status`).

What stands in, and why:
- `transfer_kv_direct`: SGLang takes it from the compiled `sgl_kernel` (CUDA/ROCm/XPU only); on CPU the name is
  not bound, so the host pool gets a torch index copy with the same signature.
- `RadixStandIn`: the radix tree around the real `loading_check` / `writing_check` (bound to it): node
  bookkeeping only (which loads and write-throughs are in flight), one rank (all-reduce is the identity).
- `cpu_kv_manager`: a `CommonKVManager` subclass playing a transfer backend (as Mooncake's is): its
  `add_transfer_request` copies pages on a thread and concludes the room through SGLang's own
  `conclude_transfer`; `_send_multipart_locked` (a ZMQ socket upstream) hands the frames to a callable.
"""

from __future__ import annotations

import math
import threading
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import upstream

HICACHE_MODULES = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.allocator.paged",
)
EXTRA_STUBS = (
    upstream.Stub("openai", "OpenAI protocol types, imported by the radix cache's session code; not used"),
    upstream.Stub("partial_json_parser", "tool-call parsing, imported with the OpenAI protocol; not used"),
)
PAGE = 4
SLOTS = 64  # device token slots (16 pages; the allocator keeps page 0 as padding)
LAYERS = 2

_loaded: dict[str, Any] = {}


def load() -> upstream.Upstream:
    """SGLang with the radix cache and the hybrid controller too (one load per process)."""
    if "sglang" not in _loaded:
        try:
            _loaded["sglang"] = upstream.load(
                "sglang", upstream.SGLANG_VERSION, packages=("sglang",),
                modules=upstream.SGLANG_MODULES + HICACHE_MODULES, stubs=upstream.SGLANG_STUBS + EXTRA_STUBS,
                requirements=upstream.SGLANG_REQUIREMENTS, bare=("sglang",),
                data_prefixes=("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/"))
        except upstream.UpstreamUnavailable as exc:
            _loaded["sglang"] = exc
    outcome = _loaded["sglang"]
    if isinstance(outcome, upstream.UpstreamUnavailable):
        if upstream._in_ci():
            pytest.fail(f"CI=true and the upstream sglang code is unavailable: {outcome}")
        pytest.skip(f"upstream sglang unavailable: {outcome}")
    return outcome


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[upstream.Upstream]:
    """SGLang's modules active for one test, with the CPU copy kernel in place."""
    with load().active() as sglang:
        mha = sglang.module("sglang.srt.mem_cache.pool_host.mha")
        monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
        yield sglang


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor,
                       dst_indices: torch.Tensor, page_size: int) -> None:
    """`sgl_kernel.kvcacheio.transfer_kv_direct` on CPU: copy the rows of every layer."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


# ----------------------------------------------------------------------------------------------------------
# HiCache
# ----------------------------------------------------------------------------------------------------------


class HiCacheRig:
    """A real device pool, allocator, host pool and controller (plain or hybrid) on CPU."""

    def __init__(self, engine: upstream.Upstream, kind: str) -> None:
        memory_pool = engine.module("sglang.srt.mem_cache.memory_pool")
        self.pool = memory_pool.MHATokenToKVPool(SLOTS, PAGE, torch.float32, 2, 4, LAYERS, "cpu", False)
        paged = engine.module("sglang.srt.mem_cache.allocator.paged")
        self.allocator = paged.PagedTokenToKVPoolAllocator(SLOTS, PAGE, torch.float32, "cpu", self.pool,
                                                           need_sort=False)
        mha = engine.module("sglang.srt.mem_cache.pool_host.mha")
        self.host = mha.MHATokenToKVPoolHost(
            self.pool.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "layer_first", pin_memory=False,
            device_capacity_tokens=self.pool.size, start_layer=self.pool.start_layer,
            end_layer=self.pool.end_layer)
        self.controller = self._controller(engine, kind)

    def _controller(self, engine: upstream.Upstream, kind: str) -> Any:
        if kind == "plain":
            plain = engine.attr("sglang.srt.managers.cache_controller:HiCacheController")
            return plain(self.allocator, self.host, PAGE, None, threading.Event(), io_backend="direct")
        assembler = engine.module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
        entry = assembler.build_pool_entry(name=assembler.PoolName.KV, host_pool=self.host, device_pool=self.pool,
                                           layer_mapping={i: i for i in range(LAYERS)},
                                           transfer_layer_id_max=LAYERS, is_anchor=True)
        group = engine.attr("sglang.srt.mem_cache.pool_host:HostPoolGroup")([entry])
        hybrid = engine.attr("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController")
        return hybrid(self.allocator, group, PAGE, None, threading.Event(), io_backend="direct",
                      transfer_layer_id_max=LAYERS)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.pool.k_buffer, *self.pool.v_buffer]

    def fill(self, slots: Any, value: float) -> None:
        for tensor in self.tensors:
            tensor[slots] = value

    def poison_host(self, host_slots: Any) -> None:
        for tensor in [*self.host.k_buffer, *self.host.v_buffer]:
            tensor[host_slots] = math.nan

    def values(self, slots: Any) -> list[float]:
        return [float(x) for tensor in self.tensors for x in tensor[slots].reshape(len(slots), -1)[:, 0]]

    def write(self, slots: Any, node: int) -> Any:
        """A write-back as the radix cache issues it (a hybrid controller defers it: `flush=False`)."""
        if "Hybrid" in type(self.controller).__name__:
            return self.controller.write(slots, node_id=node, flush=False)
        return self.controller.write(slots, node_id=node)


def radix_stand_in(engine: upstream.Upstream, controller: Any) -> Any:
    """The radix cache's real `loading_check` / `writing_check`, on a tree that only tracks nodes in flight."""
    radix = engine.attr("sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache")

    class RadixStandIn:
        loading_check = radix.loading_check
        writing_check = radix.writing_check
        _count_ready_acks = radix._count_ready_acks
        _log_write_ack_metrics = radix._log_write_ack_metrics

        def __init__(self) -> None:
            self.cache_controller = controller
            self.pp_rank = 0
            self.metrics_collector = None
            self.buffer_pipeline = None
            self.loaded: list[int] = []
            self.written: list[int] = []
            self.tree_core = types.SimpleNamespace(write_back_duplicate_reclaim_digest=0,
                                                   finish_load_back=self.loaded.append)
            self.ongoing_load_back: dict[int, tuple[int, None, None]] = {}
            self.ongoing_write_through: dict[int, int] = {}

        def expect_load(self, node: int) -> None:
            self.ongoing_load_back[node] = (node, None, None)

        def expect_write(self, node: int) -> None:
            self.ongoing_write_through[node] = node

        def _all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
            """One rank: the minimum over ranks is this rank's count."""

        def dec_lock_ref(self, node: Any, params: Any) -> None:
            """Lock references are the tree's business, not the copy's."""

        def dec_host_lock_ref(self, node: Any, params: Any) -> None:
            """As dec_lock_ref."""

        def _finish_write_through_ack(self, node: int) -> None:
            self.written.append(self.ongoing_write_through.pop(node))

    return RadixStandIn()


# ----------------------------------------------------------------------------------------------------------
# PD
# ----------------------------------------------------------------------------------------------------------

ROOM = 0x5EED
DECODE_ENDPOINT = ("127.0.0.1", 17001)


def device_pool(engine: upstream.Upstream, value: float = 0.0) -> Any:
    pool = engine.module("sglang.srt.mem_cache.memory_pool").MHATokenToKVPool(SLOTS, PAGE, torch.float32, 2, 4,
                                                                            LAYERS, "cpu", False)
    for tensor in [*pool.k_buffer, *pool.v_buffer]:
        tensor.fill_(value)
    return pool


def page_rows(pages: Any) -> torch.Tensor:
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])


def copy_pages(source: Any, src_pages: Any, destination: Any, dst_pages: Any) -> None:
    for src, dst in zip([*source.k_buffer, *source.v_buffer], [*destination.k_buffer, *destination.v_buffer],
                        strict=True):
        dst[page_rows(dst_pages)] = src[page_rows(src_pages)]


class CpuBackend:
    """The transfer-backend half of a KV manager (Mooncake's role): moves pages on a thread, concludes the room
    through SGLang's `conclude_transfer`, and hands status frames to `deliver` instead of a ZMQ socket."""

    poll: Any  # SGLang's KVPoll, set by `cpu_kv_manager`

    def __init__(self, pool: Any, deliver: Callable[[list[bytes]], None] = lambda frames: None) -> None:
        self.pool, self.deliver = pool, deliver
        self.request_status: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self.failure_lock = threading.Lock()
        self.transfer_infos: dict[int, Any] = {}
        self._staging_outstanding: dict[int, int] = {}
        self._deferred_ack_targets: dict[int, Any] = {}
        self._deferred_ack_poisoned_rooms: set[int] = set()
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.prefill_response_tracker: dict[int, set[int]] = {}
        self.required_prefill_response_num_table: dict[int, int] = {}
        self.addr_to_rooms_tracker: defaultdict[str, set[int]] = defaultdict(set)
        self.enable_staging, self._staging_handler = False, None
        self.is_dummy_cp_rank = self.enable_all_cp_ranks_for_transfer = False
        self.bootstrap_timeout = self.waiting_timeout = 300
        self.attn_tp_rank = self.pp_rank = self.attn_cp_rank = 0
        self.pp_size = self.attn_cp_size = 1
        self.kv_args = types.SimpleNamespace(page_size=PAGE)
        self.requests: list[tuple[Any, ...]] = []
        self.destination: dict[int, tuple[Any, list[int]]] = {}  # room -> (decode pool, decode pages)
        self.outcome: Callable[[int, bool], None] | None = None  # override: how a room's transfer ends
        self.threads: list[threading.Thread] = []

    def expect(self, room: int, decode_pool: Any, pages: list[int]) -> None:
        """What the decode node's metadata tells the prefill: where to write, whom to tell."""
        self.destination[room] = (decode_pool, pages)
        endpoint, port = DECODE_ENDPOINT
        self.transfer_infos[room] = {"decode-0": types.SimpleNamespace(endpoint=endpoint, dst_port=port,
                                                                       is_dummy=False)}

    def register_to_bootstrap(self) -> None:
        """No bootstrap server on CPU."""

    def add_transfer_request(self, room: int, kv_indices: Any, index_slice: slice, is_last: bool,
                             **kwargs: Any) -> None:
        self.requests.append((room, [int(p) for p in kv_indices], index_slice, is_last))
        earlier = list(self.threads)
        thread = threading.Thread(target=self._transfer,
                                  args=(room, list(kv_indices), index_slice, is_last, earlier))
        self.threads.append(thread)
        thread.start()

    def _transfer(self, room: int, pages: list[int], index_slice: slice, is_last: bool,
                  earlier: list[threading.Thread]) -> None:
        target = self.destination.get(room)
        if target is not None:
            copy_pages(self.pool, pages, target[0], target[1][index_slice])
        if not is_last:
            return
        for thread in earlier:  # a backend concludes a room once all its chunks landed, as Mooncake does
            thread.join()
        if self.outcome is not None:
            self.outcome(room, is_last)
        else:
            self.conclude_transfer(bootstrap_room=room, status=self.poll.Success)

    def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False) -> None:
        self.deliver(list(parts))

    def listen(self, frames: list[bytes]) -> None:
        """The decode listener thread's body: parse a prefill status message and apply it."""
        parsed = self.parse_kv_status_message(frames)
        if parsed is not None:
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)


def cpu_kv_manager(engine: upstream.Upstream) -> type:
    """A CommonKVManager subclass whose backend is `CpuBackend`."""
    common = engine.attr("sglang.srt.disaggregation.common.conn:CommonKVManager")
    poll = engine.attr("sglang.srt.disaggregation.base.conn:KVPoll")
    return type("CpuKVManager", (CpuBackend, common), {"poll": poll})


def sender(engine: upstream.Upstream, manager: Any, room: int = ROOM, pages: int = 0) -> Any:
    sender_type = engine.attr("sglang.srt.disaggregation.common.conn:CommonKVSender")
    get_parallel = engine.attr("sglang.srt.runtime_context:get_parallel")
    with get_parallel().override(num_dp_ranks=1):
        made = sender_type(manager, "127.0.0.1:8998", bootstrap_room=room)
    made.init(num_kv_indices=pages)
    return made


def receiver(engine: upstream.Upstream, manager: Any, room: int = ROOM) -> Any:
    """A decode receiver past `init()` (which asks the bootstrap server over HTTP): one prefill rank."""
    receiver_type = engine.attr("sglang.srt.disaggregation.common.conn:CommonKVReceiver")
    made = receiver_type(manager, "127.0.0.1:8998", bootstrap_room=room)
    made.bootstrap_infos, made.required_dst_info_num = [], 1
    manager.required_prefill_response_num_table[room] = 1
    return made
