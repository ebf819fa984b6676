"""The simulated engine: one run, its threads wired together around one paged KV cache, the way a real serving
engine's processes share GPU memory. Each thread is its own component:

- forward.py: the scheduler and the forward pass (`execute_model`);
- prefetcher.py: storage -> newly allocated blocks, for prefix hits;
- write_back.py: a finished request's blocks -> storage;
- model_runner.py: per-layer "ready" signals per batch slot;
- messager.py and send_worker.py: the cache messager (registrations, layer0 starts the send, hang deadlines)
  and its send worker;
- faults.py: injected faults.

The same code runs in every run of the demo; a run (runs.py) decides the KVObserver's configuration and whether
the engine frees a finished request's blocks only once their write-back completed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

import kvobs
from kvobs.demo.allocator import BlockAllocator
from kvobs.demo.cache import PagedKVCache
from kvobs.demo.config import SimConfig
from kvobs.demo.faults import StoragePoisoner, inject_stale_signal
from kvobs.demo.forward import ForwardPass
from kvobs.demo.lock_files import LockFiles
from kvobs.demo.messager import BufferedSignals, CacheMessager, DroppingSignals, SignalRoute
from kvobs.demo.messages import SendEnded
from kvobs.demo.model_runner import LayerProgress, ModelRunner
from kvobs.demo.prefetcher import Prefetcher
from kvobs.demo.prefix_probe import PrefixProbe
from kvobs.demo.send_worker import SendWorker
from kvobs.demo.stats import RunStats
from kvobs.demo.storage import StorageCache
from kvobs.demo.workload import Request, Workload
from kvobs.demo.write_back import WriteBack


class SimulationFailed(RuntimeError):
    """An engine thread crashed: the run stopped, and its numbers mean nothing."""


class Component(Protocol):
    """What the engine runs on a thread of its own."""

    def run(self) -> None: ...


class _NullLogger:
    """The demo keeps kvobs's structured logs off stdout (the table and JSON go there)."""

    def _drop(self, *args: Any, **kwargs: Any) -> None:
        pass

    debug = info = warning = error = critical = exception = _drop


class SimEngine:
    """One run of the simulated engine. `start()`, then `stop()`; `stats` and `registry` hold the results."""

    def __init__(self, config: SimConfig, *, registry: CollectorRegistry | None = None,
                 tracer_provider: Any = None, logger: Any = None) -> None:
        self.config = c = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.stats = RunStats(mode=c.run.name)
        self.cache = PagedKVCache(c.num_blocks, c.block_size, c.heads, c.head_dim)
        self.lock_files = LockFiles.of(c.run)
        self.lock = c.run.make_lock(c.num_blocks, self.lock_files.directory)
        self.lock_files.owns(self.lock)
        self.observer = kvobs.KVObserver(
            c.engine, lock=self.lock, lock_timeout=c.lock_timeout_s, registry=self.registry,
            tracer_provider=tracer_provider, logger=logger if logger is not None else _NullLogger(),
            capacity=c.num_blocks, block_bytes=self.cache.block_bytes, block_dim=0, integrity=c.run.integrity,
        )
        # Warm up: the first NaN check in a process may compile its kernel (a second or more). Paid here, before
        # the run's clock starts, it cannot stall the first transfers of a short run (as a real engine's warm-up).
        kvobs.check_blocks(self.cache.data, [0], block_dim=0)
        self.storage = StorageCache(c.storage_capacity)
        self.signals = self._signal_route()
        self.thread_error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0
        self.components = self._build_components()

    def _signal_route(self) -> SignalRoute:
        c = self.config
        if not c.run.buffer_signals:
            return DroppingSignals(self.stats)
        buffer = self.observer.signal_buffer(ttl_s=c.signal_ttl_s, max_pending=4 * c.num_slots + 16)
        return BufferedSignals(buffer, self.stats)

    def _build_components(self) -> dict[str, Component]:
        """Every thread's component by thread name, wired: who hands what to whom."""
        c = self.config
        stop = self._stop
        stats = self.stats
        storage = self.storage
        allocator = BlockAllocator(c.num_blocks)
        progress = LayerProgress()
        ended: queue.Queue[SendEnded] = queue.Queue()
        guarded = dict(stop=stop, observer=self.observer, gpu_cache=self.cache.data, stats=stats)
        self.prefetcher = Prefetcher(**guarded, storage=storage, block_s=c.prefetch_block_s)
        self.write_back = WriteBack(**guarded, storage=storage, allocator=allocator, block_s=c.write_back_block_s,
                                    max_backlog=c.write_back_queue_max,
                                    free_after_write_back=c.run.free_after_write_back)
        self.messager = CacheMessager(stop=stop, signals=self.signals, stats=stats, start_send=self._start_send,
                                      ended=ended.put, send_deadline_s=c.send_deadline_s)
        self.send_worker = SendWorker(**guarded, progress=progress, ended=self.messager.put,
                                      num_layers=c.num_layers, layer_s=c.send_layer_s)
        self.model_runner = ModelRunner(stop=stop, progress=progress, signal=self.messager.put,
                                        num_layers=c.num_layers, layer_gap_s=c.layer_gap_s)
        self.forward = ForwardPass(
            stop=stop, observer=self.observer, config=c, cache=self.cache, allocator=allocator, storage=storage,
            workload=Workload.of(c), stats=stats, progress=progress, ended=ended, prefetcher=self.prefetcher,
            write_back=self.write_back, model_runner=self.model_runner, messager=self.messager,
            prefix_probe=PrefixProbe(self.lock) if isinstance(self.lock, kvobs.BlockLock) else None,
        )
        components: dict[str, Component] = {
            "forward": self.forward, "prefetch": self.prefetcher, "write-back": self.write_back,
            "model-runner": self.model_runner, "cache-messager": self.messager, "send-worker": self.send_worker,
        }
        if "nan" in c.faults:
            components["fault-nan"] = StoragePoisoner(stop=stop, storage=storage, stats=stats, families=c.families,
                                                      interval_s=c.poison_interval_s, seed=c.seed)
        return components

    def _start_send(self, req: Request) -> None:
        """The messager starts a send; the send worker is built after it (it reports back to the messager)."""
        self.send_worker.put(req)

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = time.monotonic()
        if "stale-signal" in self.config.faults:
            inject_stale_signal(self.messager.put, self.stats, self.config.block_size)
        for name, component in self.components.items():
            thread = threading.Thread(target=self._loud(component.run), name=f"sim-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 5.0) -> RunStats:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.stats.elapsed_s = time.monotonic() - self._t0
        if not any(thread.is_alive() for thread in self._threads):
            self.lock_files.remove()  # a thread still running may hold a claim: removed at exit instead
        return self.stats

    @property
    def elapsed(self) -> float:
        """Seconds since start, frozen at stop."""
        if not self._t0:
            return 0.0
        return self.stats.elapsed_s if self._stop.is_set() and self.stats.elapsed_s else time.monotonic() - self._t0

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    def raise_if_failed(self) -> None:
        if self.thread_error is not None:
            raise SimulationFailed(f"the {self.config.run.name} simulation failed: {self.thread_error!r}") from (
                self.thread_error)

    def pending_signals(self) -> int:
        return self.signals.pending()

    def _loud(self, target: Callable[[], None]) -> Callable[[], None]:
        """A crashed engine thread stops the run and is re-raised by the demo, never a silent hang."""
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self.thread_error = exc
                self._stop.set()
                raise

        return run
