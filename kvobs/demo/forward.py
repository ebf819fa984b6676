"""The forward-pass thread: the scheduler and `execute_model`, one step at a time.

Each iteration admits new requests into free batch slots (allocating blocks, which hold "uninitialised"
memory, modelled as NaN), looks up their prefix in the storage cache and prepares a prefetch for a hit, then
runs one forward step over the batch: the next chunk of every running prefill the scheduler considers ready.
Computing a block reads every earlier block of the sequence (attention), so NaN anywhere in the context
spreads into it. The step holds the observer's cache lock over the blocks it reads and writes, like the GPU
worker around `execute_model` (a global lock takes the whole cache whatever the claim; a run without a lock
takes kvobs's no-op lock). A complete prefill goes to the model runner and, after its registration delay, to
the cache messager; when the messager hands the request back (sent, or aborted as hung) the scheduler frees
its slot and retires it through the write-back.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import kvobs
from kvobs import semconv as sc
from kvobs.demo.allocator import BlockAllocator, OutOfBlocks
from kvobs.demo.cache import PagedKVCache
from kvobs.demo.config import SimConfig
from kvobs.demo.messager import CacheMessager
from kvobs.demo.messages import PrefetchTask, Registration, SendEnded
from kvobs.demo.model_runner import LayerProgress, ModelRunner
from kvobs.demo.prefetcher import Prefetcher
from kvobs.demo.prefix_probe import PrefixProbe
from kvobs.demo.stats import RunStats
from kvobs.demo.storage import StorageCache
from kvobs.demo.worker import drain
from kvobs.demo.workload import Request, Workload
from kvobs.demo.write_back import WriteBack


@dataclass(eq=False, kw_only=True)
class ForwardPass:
    """The scheduler and the model's forward steps; the only thread that touches `running` and the slots."""

    stop: threading.Event
    observer: kvobs.KVObserver
    config: SimConfig
    cache: PagedKVCache
    allocator: BlockAllocator
    storage: StorageCache
    workload: Workload
    stats: RunStats
    progress: LayerProgress
    ended: queue.Queue[SendEnded]  # requests the messager hands back, sent or aborted
    prefetcher: Prefetcher
    write_back: WriteBack
    model_runner: ModelRunner
    messager: CacheMessager
    prefix_probe: PrefixProbe | None = None  # a block lock's: skip prefills whose prefix is still claimed
    running: list[Request] = field(default_factory=list, init=False)
    _next_request: Request | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.config.num_slots - 1, -1, -1))

    def run(self) -> None:
        while not self.stop.is_set():
            for ended in drain(self.ended):
                self._retire(ended)
            issued = self._admit()
            self._step()
            for task in issued:
                self.prefetcher.put(task)
            self._advance()
            time.sleep(self.config.step_gap_s)

    def _step(self) -> None:
        """One forward step over the ready prefills, holding the cache lock on the blocks it touches. Its wait
        shows as kvobs_lock_wait_seconds{path="forward"}."""
        batch = self._ready()
        if not batch:  # nothing to compute: the GPU idles a step, no lock taken
            time.sleep(self.config.step_s)
            return
        blocks = _touched_blocks(batch, self.config.chunk_blocks)
        called_at = time.perf_counter()
        try:
            with self.observer.hold(sc.HOLDER_FORWARD, block_ids=blocks):
                self.stats.forward_waited(time.perf_counter() - called_at)
                self._compute(batch)
                time.sleep(self.config.step_s)
        except kvobs.LockTimeout:
            self.stats.add(lock_timeouts=1)
            return
        self.stats.add(forward_steps=1)

    def _admit(self) -> list[PrefetchTask]:
        """Fill free slots: allocate blocks ("uninitialised": NaN), find a prefix hit, prepare its prefetch."""
        issued = []
        while self.free_slots:
            req = self._peek_request()
            try:
                ids = self.allocator.allocate(req.num_blocks)
            except OutOfBlocks:
                break
            self._next_request = None
            req.slot = self.free_slots.pop()
            req.gpu_block_ids = ids
            self.cache.mark_uninitialised(ids)
            self.stats.add(requests_admitted=1)
            sources = self.storage.longest_prefix(req.keys[: req.prefix_blocks])
            if sources:
                hit = len(sources)
                req.prefetch = PrefetchTask(req.task_id, req.keys[:hit], ids[:hit], sources)
                req.computed = hit
                issued.append(req.prefetch)
            self.running.append(req)
        return issued

    def _peek_request(self) -> Request:
        if self._next_request is None:
            self._next_request = self.workload.next_request()
        return self._next_request

    def _ready(self) -> list[Request]:
        """The prefills this step computes a chunk of: every one whose prefix (if any) the engine considers
        loaded and that has blocks left (a refused prefix is noticed even when nothing else is left)."""
        return [req for req in self.running if self._prefix_ready(req) and req.computed < req.num_blocks]

    def _prefix_ready(self, req: Request) -> bool:
        """A prefetch that has started counts as loaded (the engine's belief); with a prefix probe, only once
        its blocks are no longer claimed. A refused prefetch is recomputed as a miss."""
        task = req.prefetch
        if task is None:
            return True
        if task.failed:
            req.prefetch = None
            req.computed = 0
            return True
        if req.prefix_free:
            return True
        if not task.started.is_set():
            return False
        probe = self.prefix_probe
        if probe is not None and not self._probe(probe, task.gpu_block_ids):
            return False
        req.prefix_free = True
        return True

    def _probe(self, probe: PrefixProbe, block_ids: list[int]) -> bool:
        """Ask the block lock whether the prefix is free; timed apart from the step's own lock wait."""
        started = time.perf_counter()
        free = probe.free(block_ids)
        self.stats.probed(time.perf_counter() - started, free)
        return free

    def _compute(self, batch: list[Request]) -> None:
        """One chunk of every prefill in the batch."""
        for req in batch:
            end = min(req.computed + self.config.chunk_blocks, req.num_blocks)
            for j in range(req.computed, end):
                self.cache.compute_block(req.gpu_block_ids[j], req.keys[j], req.gpu_block_ids[:j])
            req.computed = end

    def _advance(self) -> None:
        """Completed prefills go to the model runner and, after their registration delay, the messager."""
        still = []
        for req in self.running:
            if not _prefill_complete(req):
                still.append(req)
                continue
            self.messager.put(Registration(req, due=time.monotonic() + req.register_delay_s))
            self.model_runner.put(req)
        self.running = still

    def _retire(self, ended: SendEnded) -> None:
        """A request whose send is over: free its slot, write back its new blocks, free them."""
        req = ended.request
        if ended.sent:
            self.stats.add(requests_completed=1)
        else:
            self.stats.add(requests_aborted=1)
        self.progress.clear(req.slot)
        self.free_slots.append(req.slot)
        self.write_back.retire(req)


def _touched_blocks(batch: list[Request], chunk_blocks: int) -> list[int]:
    """The blocks a step reads (the context) and writes (the next chunk): each prefill's blocks up to the end
    of its chunk. One exclusive claim covers both, as a holder's claim has one mode."""
    return sorted(b for req in batch for b in req.gpu_block_ids[: min(req.computed + chunk_blocks, req.num_blocks)])


def _prefill_complete(req: Request) -> bool:
    """Every block computed, and a prefetch (if any) done and not refused (a refused one is recomputed)."""
    task = req.prefetch
    if req.computed < req.num_blocks:
        return False
    return task is None or (task.done.is_set() and not task.failed)
