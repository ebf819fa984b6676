"""The simulated engine: a forward pass, storage prefetch and write-back, a model runner and a cache messager,
each on its own thread, sharing one paged KV cache the way a real serving engine's processes share GPU memory.

What the threads do (the same code runs unguarded and guarded; only the KVObserver's configuration differs):

- forward (scheduler + execute_model): each step admits new requests into free batch slots (allocating
  blocks, which hold "uninitialised" memory, modelled as NaN), looks up their prefix in the storage cache and
  issues a prefetch for a hit, then computes the next chunk of every running prefill. Computing a block reads
  every earlier block of the sequence (attention), so NaN anywhere in the context spreads into it. A guarded
  engine holds the observer's cache lock for the whole step, like the GPU worker around `execute_model`.
  When a prefill is complete the request is handed to the model runner and, after its registration delay,
  to the cache messager. When its send is done (or declared hung) the request finishes: a write-back of its
  new blocks is issued and its blocks are freed at once (the write-back runs later, on its own thread).
- prefetch: copies the hit blocks from storage into the request's new blocks, block by block with a short
  sleep per block (a wide race window, on purpose). The forward pass waits until the copy has *started*
  (the engine believes an issued, synchronous copy is as good as done) and then computes: unguarded it
  reads blocks the copy has not reached yet; guarded the copy holds the cache lock, so the step waits.
- write-back: copies a finished request's blocks to storage, block by block with a sleep per block. By then
  the blocks may already belong to a new request whose allocation filled them with NaN: unguarded the NaN
  is stored under the old request's keys, and later prefix hits prefetch it. Guarded, the lock keeps the
  forward pass out during the copy and the NaN check before the copy refuses blocks that hold NaN.
- model runner: emits each layer's "ready" signal for the request's batch slot as soon as its prefill is
  done, layer 0 first.
- cache messager: registers the slot's transfer task after the request's registration delay, starts the
  send on the layer0 signal, sends layer by layer (a send worker thread), and finishes the task. Unguarded,
  a signal for an unregistered slot is dropped, the send never starts and the request hangs (detected here
  by a deadline, then aborted so the run goes on). Guarded, the observer's EarlySignalBuffer keeps it until
  the task registers.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import random
import threading
import time
import types
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import kvobs
from kvobs.sim.allocator import BlockAllocator, OutOfBlocks
from kvobs.sim.cache import PagedKVCache, key_values, nan_blocks
from kvobs.sim.storage import StorageCache
from kvobs.sim.workload import Request, Workload

PHANTOM_SLOT = 100_000  # the `--fault stale-signal` slot: no task ever registers for it
FAULTS = ("stale-signal", "nan")


@dataclass
class SimConfig:
    """Everything a run depends on. The defaults make both incidents appear reliably in a few seconds."""

    guarded: bool = True
    seed: int = 0
    engine: str = ""  # the `engine` label; default demo-guarded / demo-unguarded
    faults: frozenset[str] = frozenset()
    # the paged cache: [num_blocks, block_size, heads, head_dim] fp16
    num_blocks: int = 256
    block_size: int = 16
    heads: int = 4
    head_dim: int = 32
    # the workload
    num_slots: int = 8
    num_layers: int = 4
    families: int = 12
    family_blocks: int = 8
    max_suffix_blocks: int = 3
    storage_capacity: int = 96
    early_fraction: float = 0.5
    register_delay_s: tuple[float, float] = (0.005, 0.04)
    # timing: the race windows are deliberately wide
    chunk_blocks: int = 2  # prefill blocks computed per step per request
    step_s: float = 0.002  # "GPU time" of one forward step
    step_gap_s: float = 0.0005  # scheduler gap between steps
    prefetch_block_s: float = 0.002  # storage read per block
    write_back_block_s: float = 0.002  # storage write per block
    send_layer_s: float = 0.0005
    layer_gap_s: float = 0.0005  # model runner: time between layer signals
    send_deadline_s: float = 0.25  # a registered task whose send has not started by then is hung
    write_back_queue_max: int = 32  # a busy engine skips write-backs beyond this backlog
    # kvobs
    lock_timeout_s: float = 5.0
    signal_ttl_s: float = 30.0
    poison_interval_s: float = 0.5

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
        self.faults = frozenset(self.faults)
        if not self.engine:
            self.engine = "demo-guarded" if self.guarded else "demo-unguarded"


@dataclass
class RunStats:
    """What one run did, counted by the simulation itself (ground truth, not read back from kvobs)."""

    mode: str = ""
    elapsed_s: float = 0.0
    requests_admitted: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    prefix_hits: int = 0
    prefix_hit_blocks: int = 0
    nan_blocks_written_to_storage: int = 0
    nan_blocks_served_to_prefix_hits: int = 0
    stale_blocks_written_to_storage: int = 0
    lost_layer0_signals: int = 0
    hung_sends: int = 0
    prefetch_done: int = 0
    write_back_done: int = 0
    send_done: int = 0
    prefetch_corrupt: int = 0  # prefetches refused by the NaN check: recomputed as a miss
    write_back_rejected: int = 0  # write-backs refused by the NaN check (skip policy)
    write_back_skipped_busy: int = 0
    send_rejected: int = 0
    transfer_errors: int = 0
    lock_timeouts: int = 0
    signals_recovered: int = 0
    stale_signals_injected: int = 0
    poisoned_storage_entries: int = 0
    forward_steps: int = 0
    forward_lock_waits: deque = field(default_factory=lambda: deque(maxlen=20000), repr=False)

    @property
    def transfers_done(self) -> int:
        return self.prefetch_done + self.write_back_done + self.send_done

    def counters(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "forward_lock_waits"}
        out["transfers_done"] = self.transfers_done
        return out


@dataclass
class PrefetchTask:
    """FastDeploy-shaped storage task: `task_id`, `keys`, `gpu_block_ids`."""

    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]
    sources: list[Any]
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    nan_sources: int = 0


@dataclass
class WriteBackTask:
    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]


class _NullLogger:
    """The demo keeps kvobs's structured logs off stdout (the table and JSON go there)."""

    def _drop(self, *args: Any, **kwargs: Any) -> None:
        pass

    debug = info = warning = error = critical = exception = _drop


def _corrupt_error() -> type[BaseException]:
    try:
        from kvobs.integrity import CorruptKVError
    except ImportError:  # integrity module absent: nothing can raise it
        class CorruptKVError(Exception):  # type: ignore[no-redef]
            pass
    return CorruptKVError


class SimCacheManager:
    """A FastDeploy-shaped PrefixCacheManager whose two storage paths are guarded by the observer.

    Decorated per instance (each run has its own observer), with the same specs a user writes at class level:
    `@obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")`.
    """

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.gpu_cache = engine.cache.data
        self.storage = engine.storage
        obs = engine.observer
        specs = dict(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")
        self.issue_prefetch_storage_task = types.MethodType(
            obs.prefetch(**specs)(type(self)._prefetch), self
        )
        self.issue_write_back_storage_task = types.MethodType(
            obs.write_back(**specs)(type(self)._write_back), self
        )

    def _prefetch(self, task: PrefetchTask, is_sync: bool = True) -> int:
        """storage -> GPU blocks, one block at a time (a slow host buffer: the race window)."""
        task.started.set()
        delay = self.engine.config.prefetch_block_s
        for block_id, src in zip(task.gpu_block_ids, task.sources):
            time.sleep(delay)
            self.gpu_cache[block_id].copy_(src)
        return len(task.gpu_block_ids)

    def _write_back(self, task: WriteBackTask, is_sync: bool = True) -> int:
        """GPU blocks -> storage, one block at a time; each block is read when its turn comes."""
        delay = self.engine.config.write_back_block_s
        written = 0
        for key, block_id in zip(task.keys, task.gpu_block_ids):
            time.sleep(delay)
            block = self.gpu_cache[block_id].clone()
            self.storage.put(key, block)
            written += 1
            if not bool(block.isfinite().all()):
                self.engine._count("nan_blocks_written_to_storage")
            elif not torch.equal(block, key_values(key, block.shape, block.dtype)):
                # Finite, but another request's KV: the block was reused before its write-back ran.
                self.engine._count("stale_blocks_written_to_storage")
        return written


class SimCacheMessager:
    """The prefill node's cache messager: registers transfer tasks, starts sends on layer0, finishes them."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.gpu_cache = engine.cache.data
        obs = engine.observer
        self.send_layer = types.MethodType(
            obs.send(block_ids="req.gpu_block_ids", cache="self.gpu_cache")(type(self)._send_layer), self
        )
        self.decode_side: dict[int, Any] = {}

    def _send_layer(self, req: Request, layer: int) -> int:
        """Copy one layer's KV of the request to the decode node (here: a dict)."""
        time.sleep(self.engine.config.send_layer_s)
        self.decode_side[req.slot] = self.gpu_cache[req.gpu_block_ids].clone()
        return len(req.gpu_block_ids)


class SimEngine:
    """One run of the simulated engine. `start()`, then `stop()`; `stats` and `registry` hold the results."""

    def __init__(
        self,
        config: SimConfig,
        *,
        registry: CollectorRegistry | None = None,
        tracer_provider: Any = None,
        logger: Any = None,
    ) -> None:
        self.config = c = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.stats = RunStats(mode="guarded" if c.guarded else "unguarded")
        self.cache = PagedKVCache(c.num_blocks, c.block_size, c.heads, c.head_dim)
        self.allocator = BlockAllocator(c.num_blocks)
        self.storage = StorageCache(c.storage_capacity)
        self.workload = Workload(
            c.seed, families=c.families, family_blocks=c.family_blocks, max_suffix_blocks=c.max_suffix_blocks,
            block_size=c.block_size, early_fraction=c.early_fraction, register_delay_s=c.register_delay_s,
        )
        self.rng = random.Random(c.seed ^ 0x5EED)
        if c.guarded:
            lock: Any = kvobs.ThreadLock("kv_cache")
            integrity: Any = {"prefetch": "raise", "write_back": "skip", "send": "skip"}
        else:
            lock, integrity = None, "count"
        self.observer = kvobs.KVObserver(
            c.engine, lock=lock, lock_timeout=c.lock_timeout_s, registry=self.registry,
            tracer_provider=tracer_provider, logger=logger if logger is not None else _NullLogger(),
            capacity=c.num_blocks, block_bytes=self.cache.block_bytes, block_dim=0, integrity=integrity,
        )
        self.signals = (
            self.observer.signal_buffer(ttl_s=c.signal_ttl_s, max_pending=4 * c.num_slots + 16)
            if c.guarded else None
        )
        self.corrupt_error = _corrupt_error()
        self.manager = SimCacheManager(self)
        self.messager = SimCacheMessager(self)

        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._prefetch_q: queue.Queue[PrefetchTask] = queue.Queue()
        self._write_back_q: queue.Queue[WriteBackTask] = queue.Queue()
        self._runner_q: queue.Queue[Request] = queue.Queue()
        self._messager_q: queue.Queue[tuple] = queue.Queue()
        self._send_q: queue.Queue[Request] = queue.Queue()
        self._finished_q: queue.Queue[tuple[str, Request]] = queue.Queue()
        self._progress: dict[int, tuple[int, int]] = {}  # slot -> (req_id, last layer ready)
        self._free_slots = list(range(c.num_slots - 1, -1, -1))
        self._running: list[Request] = []
        self._t0 = 0.0

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = time.monotonic()
        targets = [
            ("forward", self._forward_loop),
            ("prefetch", self._prefetch_loop),
            ("write-back", self._write_back_loop),
            ("model-runner", self._runner_loop),
            ("cache-messager", self._messager_loop),
            ("send-worker", self._send_loop),
        ]
        if "nan" in self.config.faults:
            targets.append(("fault-nan", self._poison_loop))
        for name, target in targets:
            t = threading.Thread(target=self._guard_thread(target), name=f"sim-{name}", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self, timeout: float = 5.0) -> RunStats:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.stats.elapsed_s = time.monotonic() - self._t0
        return self.stats

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0 if self._t0 else 0.0

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    def _guard_thread(self, target: Any) -> Any:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # a crashed simulation thread must be loud, not a silent hang
                self.thread_error = exc
                self._stop.set()
                raise

        return run

    thread_error: BaseException | None = None

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def pending_signals(self) -> int:
        return self.signals.pending_count if self.signals is not None else 0

    # -- forward pass + scheduler -----------------------------------------------------------------------------

    def _forward_loop(self) -> None:
        c = self.config
        execute_model = self.observer.locked("forward")  # its wait shows as kvobs_lock_wait_seconds{path="forward"}
        stats = self.stats
        while not self._stop.is_set():
            self._drain_finished()
            t0 = time.perf_counter()
            try:
                with execute_model:
                    stats.forward_lock_waits.append(time.perf_counter() - t0)
                    issued = self._admit()
                    self._compute_step()
                    time.sleep(c.step_s)  # the rest of the step's GPU time, lock held (like execute_model)
            except kvobs.LockTimeout:
                self._count("lock_timeouts")
                continue
            stats.forward_steps += 1
            for task in issued:
                self._prefetch_q.put(task)
            self._advance()
            time.sleep(c.step_gap_s)

    def _admit(self) -> list[PrefetchTask]:
        """Fill free slots: allocate blocks ("uninitialised": NaN), find a prefix hit, prepare its prefetch."""
        issued = []
        while self._free_slots:
            req = self._peek_request()
            try:
                ids = self.allocator.allocate(req.num_blocks)
            except OutOfBlocks:
                break
            self._next_req = None
            req.slot = self._free_slots.pop()
            req.gpu_block_ids = ids
            self.cache.mark_uninitialised(ids)
            self._count("requests_admitted")
            sources = self.storage.longest_prefix(req.keys[: req.prefix_blocks])
            if sources:
                hit = len(sources)
                req.prefetch = PrefetchTask(req.task_id, req.keys[:hit], ids[:hit], sources)
                req.computed = hit
                issued.append(req.prefetch)
            self._running.append(req)
        return issued

    _next_req: Request | None = None

    def _peek_request(self) -> Request:
        if self._next_req is None:
            self._next_req = self.workload.next_request()
        return self._next_req

    def _compute_step(self) -> None:
        """One chunk of every running prefill whose prefetch (if any) has been issued."""
        c = self.config
        for req in self._running:
            task = req.prefetch
            if task is not None:
                if task.failed:  # the NaN check refused the prefix: recompute it as a miss
                    req.prefetch = None
                    req.computed = 0
                    req.recomputes += 1
                elif not task.started.is_set():
                    continue
            end = min(req.computed + c.chunk_blocks, req.num_blocks)
            for j in range(req.computed, end):
                self.cache.compute_block(req.gpu_block_ids[j], req.keys[j], req.gpu_block_ids[:j])
            req.computed = end

    def _advance(self) -> None:
        """Completed prefills go to the model runner and the messager."""
        still = []
        for req in self._running:
            task = req.prefetch
            if req.computed < req.num_blocks or (task is not None and not task.done.is_set()):
                still.append(req)
                continue
            if task is not None and task.failed:
                still.append(req)  # recomputed on the next step
                continue
            due = time.monotonic() + req.register_delay_s
            self._messager_q.put(("register", req, due))
            self._runner_q.put(req)
        self._running = still

    def _drain_finished(self) -> None:
        """Requests whose send finished or hung: issue the write-back of their new blocks, free everything."""
        c = self.config
        while True:
            try:
                how, req = self._finished_q.get_nowait()
            except queue.Empty:
                return
            self._count("requests_completed" if how == "done" else "requests_aborted")
            missing = self.storage.missing(req.keys)
            if missing:
                if self._write_back_q.qsize() >= c.write_back_queue_max:
                    self._count("write_back_skipped_busy")
                else:
                    self._write_back_q.put(WriteBackTask(
                        req.task_id, [req.keys[i] for i in missing], [req.gpu_block_ids[i] for i in missing]
                    ))
            # Freed now, while the write-back may still be queued or copying: the race of incident 1.
            self.allocator.free(req.gpu_block_ids)
            self._progress.pop(req.slot, None)
            self._free_slots.append(req.slot)

    # -- storage transfer threads -----------------------------------------------------------------------------

    def _prefetch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                task = self._prefetch_q.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                self.manager.issue_prefetch_storage_task(task, is_sync=True)
            except self.corrupt_error:
                task.failed = True
                self._count("prefetch_corrupt")
                self.storage.evict(task.keys)  # quarantine: the next request recomputes and stores clean data
            except Exception:  # noqa: BLE001 - lock timeout, rejection: the request recomputes
                task.failed = True
                self._count("transfer_errors")
            else:
                # Ground truth: how many of the blocks this hit loaded held NaN/Inf in storage.
                served = sum(nan_blocks(src.unsqueeze(0)) for src in task.sources)
                self._count("prefetch_done")
                self._count("prefix_hits")
                self._count("prefix_hit_blocks", len(task.gpu_block_ids))
                if served:
                    self._count("nan_blocks_served_to_prefix_hits", served)
            finally:
                task.started.set()
                task.done.set()

    def _write_back_loop(self) -> None:
        while not self._stop.is_set():
            try:
                task = self._write_back_q.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                result = self.manager.issue_write_back_storage_task(task, is_sync=True)
            except Exception:  # noqa: BLE001
                self._count("transfer_errors")
                continue
            if result is None:  # skip policy: the NaN check refused it, nothing was stored
                self._count("write_back_rejected")
            else:
                self._count("write_back_done")

    # -- model runner and cache messager ------------------------------------------------------------------------

    def _runner_loop(self) -> None:
        c = self.config
        if "stale-signal" in c.faults:
            self._count("stale_signals_injected")
            self._messager_q.put(("signal", PHANTOM_SLOT, 0, c.block_size))
        while not self._stop.is_set():
            try:
                req = self._runner_q.get(timeout=0.05)
            except queue.Empty:
                continue
            for layer in range(c.num_layers):
                self._progress[req.slot] = (req.req_id, layer)
                self._messager_q.put(("signal", req.slot, layer, req.tokens))
                time.sleep(c.layer_gap_s)

    def _messager_loop(self) -> None:
        """Registrations (after each request's delay), layer signals, send completions, hang deadlines.

        Every queued item is handled before deadlines are checked, so a signal already emitted is never
        mistaken for a lost one just because this thread was slow.
        """
        c = self.config
        buf = self.signals
        regs: list[tuple[float, int, Request]] = []  # (due, order, request): registrations not yet due
        order = itertools.count()
        registered: dict[int, Request] = {}
        deadline: dict[int, float] = {}
        started: set[int] = set()
        next_expire = 0.0

        def start_send(req: Request) -> None:
            started.add(req.slot)
            self._send_q.put(req)

        def register_due(now: float) -> None:
            while regs and regs[0][0] <= now:
                _, _, req = heapq.heappop(regs)
                registered[req.slot] = req
                deadline[req.slot] = now + c.send_deadline_s
                if buf is not None:
                    ready = buf.register(req.slot, req.tokens)
                    if ready is not None:
                        self._count("signals_recovered")
                        start_send(req)

        def handle(item: tuple, now: float) -> None:
            kind = item[0]
            if kind == "register":
                _, req, due = item
                heapq.heappush(regs, (due, next(order), req))
                register_due(now)  # a zero delay registers before any signal queued after it
            elif kind == "signal":
                _, slot, layer, tokens = item
                if buf is not None:
                    ready = buf.signal(slot, layer, tokens)
                    if ready is not None and slot in registered and slot not in started:
                        start_send(registered[slot])
                elif slot in registered:
                    if layer == 0 and slot not in started:
                        start_send(registered[slot])
                elif layer == 0 and slot != PHANTOM_SLOT:
                    self._count("lost_layer0_signals")  # no task for the slot: dropped, the send never starts
            elif kind == "send_done":
                _, req, ok = item
                if buf is not None:
                    buf.finish(req.slot)
                registered.pop(req.slot, None)
                deadline.pop(req.slot, None)
                started.discard(req.slot)
                self._finished_q.put(("done" if ok else "aborted", req))

        while not self._stop.is_set():
            now = time.monotonic()
            wait = 0.005 if not regs else min(0.005, max(0.0, regs[0][0] - now))
            try:
                item: tuple | None = self._messager_q.get(timeout=wait)
            except queue.Empty:
                item = None
            while item is not None:
                now = time.monotonic()
                register_due(now)
                handle(item, now)
                try:
                    item = self._messager_q.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            register_due(now)
            for slot in [s for s, d in deadline.items() if s not in started and d <= now]:
                req = registered.pop(slot)
                del deadline[slot]
                self._count("hung_sends")
                if buf is not None:
                    self._count("lost_layer0_signals")  # buffered or never seen: it never reached the send
                    buf.finish(slot)
                self._finished_q.put(("aborted", req))
            if buf is not None and now >= next_expire:
                buf.expire()
                next_expire = now + 0.5

    def _send_loop(self) -> None:
        c = self.config
        while not self._stop.is_set():
            try:
                req = self._send_q.get(timeout=0.05)
            except queue.Empty:
                continue
            ok = True
            for layer in range(c.num_layers):
                if not self._wait_layer(req, layer):
                    ok = False
                    break
                try:
                    result = self.messager.send_layer(req, layer)
                except Exception:  # noqa: BLE001
                    self._count("transfer_errors")
                    ok = False
                    break
                if result is None:
                    self._count("send_rejected")
                    ok = False
                    break
                self._count("send_done")
            self._messager_q.put(("send_done", req, ok))

    def _wait_layer(self, req: Request, layer: int) -> bool:
        """Poll the model runner's per-slot progress (an IPC flag in a real engine) until `layer` is ready."""
        end = time.monotonic() + 2.0
        while not self._stop.is_set() and time.monotonic() < end:
            rid, ready = self._progress.get(req.slot, (-1, -1))
            if rid == req.req_id and ready >= layer:
                return True
            time.sleep(0.0002)
        return False

    # -- faults ------------------------------------------------------------------------------------------------

    def _poison_loop(self) -> None:
        """`--fault nan`: every poison_interval_s, replace a stored prefix block with NaN."""
        c = self.config
        while not self._stop.wait(c.poison_interval_s):
            candidates = [
                Workload.family_key(f, j) for f in range(c.families) for j in range(2)
                if Workload.family_key(f, j) in self.storage
            ]
            if candidates and self.storage.poison(self.rng.choice(candidates)):
                self._count("poisoned_storage_entries")


