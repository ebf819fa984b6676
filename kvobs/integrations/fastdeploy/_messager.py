"""The prefill node's cache messager (FastDeploy's `CacheMessagerV1`): early layer0 signals are kept, not lost.

The model runner reports, per layer, which batch slots hold how many prompt tokens; `consume_signals` reads
that array (`get_output_kv_signal`) in an endless loop and, on layer 0, queues the slots whose send may
start. A signal read before the slot's transfer task registers (`_add_cache_task_thread`) was lost: the
loop skipped the whole read while no task was registered (`if not self.cache_info: continue`), and a
queued slot with no task failed the send thread's assertion. The request then hung on the decode node.

The bridge puts kvobs's signal buffer between the two threads without editing either loop:
- after each read of the signal array it records the layer progress of every slot (as the loop does), and
  takes out of the array the layer0 signals of slots with no task yet (the buffer keeps them);
- when a task registers (`engine_worker_queue.put_finished_add_cache_task_req`), the buffer hands back its
  kept signal exactly once and the bridge queues the send, as the loop would have;
- when a task ends (`engine_worker_queue.put_finished_req`), its slot is finished in the buffer.

Install the bridge right after the messager is built: a read already in progress at that moment completes
without it. With tensor parallelism every rank runs its own messager, and the ranks' send barriers need the same
batches in the same order: give each rank a `StepAlignedSignalBuffer`; the bridge then decides once per
model-runner step (at each layer0 read), in the buffer's canonical order.
"""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from kvobs import Instrumentation
from kvobs.integrations._common import HookFailures, default_logger
from kvobs.signals import EarlySignalBuffer, StepAlignedSignalBuffer

SIGNAL_READER = "get_output_kv_signal"  # the module function `consume_signals` reads the array with
NO_SIGNAL = -1


def bridge_cache_messager(messager: Any, buffer: EarlySignalBuffer | StepAlignedSignalBuffer, *,
                          module: ModuleType | None = None, logger: Any = None) -> Instrumentation:
    """Bridge `buffer` into `messager` (a `CacheMessagerV1` on a prefill node). Returns the undo handle.

    module: where `consume_signals` finds `get_output_kv_signal` (default: the messager class's module).
    logger: a structlog-style logger for the bridge's own errors (default kvobs's), which never reach the
    messager's threads.
    """
    if not isinstance(buffer, (EarlySignalBuffer, StepAlignedSignalBuffer)):
        raise TypeError(f"buffer must be an EarlySignalBuffer or StepAlignedSignalBuffer, got {buffer!r}")
    bridge = SignalBridge(messager, buffer, logger if logger is not None else default_logger())
    patches = Instrumentation()  # no observer: bridging again with any buffer changes nothing
    queue = messager.engine_worker_queue
    if not patches.claims(queue, "put_finished_add_cache_task_req", "put_finished_req"):
        return patches  # bridged already
    patches.replace(queue, "put_finished_add_cache_task_req", bridge.registering)
    patches.replace(queue, "put_finished_req", bridge.finishing)
    detach = READERS.attach(module or sys.modules[type(messager).__module__], messager.rank_id, bridge)
    if detach is not None:
        patches.add(detach)
    return patches


class SignalBridge:
    """One messager's signal reads, registrations and finishes, through one buffer."""

    def __init__(self, messager: Any, buffer: EarlySignalBuffer | StepAlignedSignalBuffer, logger: Any) -> None:
        self.messager = messager
        self.buffer = buffer
        self.logger = logger
        self.step_aligned = isinstance(buffer, StepAlignedSignalBuffer)
        self._failed = HookFailures(logger=logger)

    # -- the signal array, after each read ---------------------------------------------------------------

    def read(self, kv_signal_data: Any) -> None:
        """Record the read's progress; keep out of the array the layer0 signals the loop must not see yet."""
        array = _writable_view(kv_signal_data)
        count = int(array[0])
        if count <= 0:
            return
        layer = int(array[1])
        triples = array[2 : 2 + 3 * count].reshape(count, 3).tolist()  # (slot, chunk offset, chunk length)
        slots, tokens = [s for s, _, _ in triples], [o + n for _, o, n in triples]
        self._record_progress(layer, slots, tokens)
        if layer != 0:
            self.buffer.signal_batch(layer, slots, tokens)
            return
        kept, recovered = self._decide_layer0(slots, tokens)
        if len(kept) < count:
            _rewrite(array, [triples[i] for i in kept])
        self._queue_sends(recovered)

    def _decide_layer0(self, slots: list[int], tokens: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Indexes of the read's signals whose send may start now, and signals recovered from earlier steps."""
        ready = self.buffer.signal_batch(0, slots, tokens)
        if self.step_aligned:
            ready = self.buffer.end_step()
        wanted = {(s.slot, s.tokens) for s in ready}
        kept = [i for i, pair in enumerate(zip(slots, tokens)) if pair in wanted]
        in_read = {(slots[i], tokens[i]) for i in kept}
        return kept, [(s.slot, s.tokens) for s in ready if (s.slot, s.tokens) not in in_read]

    def _record_progress(self, layer: int, slots: list[int], tokens: list[int]) -> None:
        """What the loop records for every signal, also for those it would skip or not see."""
        m = self.messager
        with m.engine_cache_task_thread_lock:
            for slot, slot_tokens in zip(slots, tokens):
                task = m.engine_cache_tasks[slot]
                task["prefilled_layer_idx"] = layer
                task["prefilled_token_num"] = slot_tokens

    def _queue_sends(self, batch: list[tuple[int, int]]) -> None:
        """Queue (slot, tokens) sends for the send thread, as the loop queues a layer0 batch."""
        if batch:
            m = self.messager
            with m.engine_cache_task_thread_lock:
                m.cache_prefilled_engine_ids_queue.put(batch)

    # -- task registration and end ---------------------------------------------------------------------

    def registering(self, put: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def put_finished_add_cache_task_req(req_ids: Any) -> Any:
            self._guarded(self.registered, req_ids)
            return put(req_ids)

        return put_finished_add_cache_task_req

    def finishing(self, put: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def put_finished_req(send_cache_result: Any) -> Any:
            self._guarded(self.finished, [request_id for request_id, *_ in send_cache_result])
            return put(send_cache_result)

        return put_finished_req

    def registered(self, request_ids: list[Any]) -> None:
        """Tasks just registered: hand back their kept signals (an EarlySignalBuffer does it now)."""
        recovered = []
        for request_id in request_ids:
            info = self.messager.cache_info.get(request_id) or {}
            try:
                slot = info["current_id"]
                tokens = self.buffer.register(slot, info["need_prefill_tokens"])
            except (KeyError, TypeError, ValueError) as exc:  # no slot known, or still live: never finished here
                self.logger.error("kvobs.fastdeploy.register_failed", error=repr(exc), request_id=str(request_id))
                continue
            if tokens is not None:  # an EarlySignalBuffer recovered the slot's kept signal
                recovered.append((operator.index(slot), tokens))
        self._queue_sends(recovered)

    def finished(self, request_ids: list[Any]) -> None:
        for request_id in request_ids:
            info = self.messager.cache_info.get(request_id)
            if info is not None and "current_id" in info:
                self.buffer.finish(info["current_id"])

    def _guarded(self, step: Callable[[Any], None], arg: Any) -> None:
        try:
            step(arg)
        except Exception as exc:  # noqa: BLE001 - the messager's own thread must go on
            self._failed(step.__name__, exc)


def _writable_view(data: Any) -> np.ndarray:
    """The signal array itself (a CPU Paddle tensor, or NumPy), not a copy: rewrites must reach the loop."""
    return data if isinstance(data, np.ndarray) else np.from_dlpack(data)


def _rewrite(array: np.ndarray, triples: list[list[int]]) -> None:
    array[0] = len(triples) if triples else NO_SIGNAL
    if triples:
        array[2 : 2 + 3 * len(triples)] = np.asarray(triples, dtype=array.dtype).reshape(-1)


class _Readers:
    """`get_output_kv_signal` of each messager module, wrapped once, dispatching to the bridge of each rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modules: dict[ModuleType, tuple[Instrumentation, dict[Any, SignalBridge]]] = {}

    def attach(self, module: ModuleType, rank_id: Any, bridge: SignalBridge) -> Callable[[], None] | None:
        """Dispatch `rank_id`'s reads to `bridge`; the undo, or None when that rank is bridged already."""
        with self._lock:
            if module not in self._modules:
                bridges: dict[Any, SignalBridge] = {}
                patches = Instrumentation()
                patches.replace(module, SIGNAL_READER, lambda read: _dispatching(read, bridges))
                self._modules[module] = (patches, bridges)
            bridges = self._modules[module][1]
            if rank_id in bridges:
                return None
            bridges[rank_id] = bridge
        return lambda: self._detach(module, rank_id, bridge)

    def _detach(self, module: ModuleType, rank_id: Any, bridge: SignalBridge) -> None:
        with self._lock:
            patches, bridges = self._modules.get(module, (None, {}))
            if bridges.get(rank_id) is bridge:
                del bridges[rank_id]
            if patches is not None and not bridges:
                patches.undo()
                del self._modules[module]


def _dispatching(read: Callable[..., Any], bridges: dict[Any, SignalBridge]) -> Callable[..., Any]:
    def get_output_kv_signal(kv_signal_data: Any, rank_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = read(kv_signal_data, rank_id, *args, **kwargs)
        bridge = bridges.get(rank_id)
        if bridge is not None:
            bridge._guarded(bridge.read, kv_signal_data)
        return result

    return get_output_kv_signal


READERS = _Readers()
