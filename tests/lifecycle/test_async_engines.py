"""Transfers that complete after the issuing call returns, in the three shapes real engines have.

- FastDeploy: the issuing call hands the task to a thread pool and (when is_sync) waits for a done signal;
  the pool thread copies and sends the done signal with the block ids that actually loaded.
- vLLM: the connector submits loads on one step; the worker reports them finished through get_finished()
  on a later step.
- SGLang: load() returns the destination token slots and queues the copy; start_loading() runs it and an
  acknowledgement queue reports it done.

In each: the lock is held while the data moves (the forward pass cannot run over it), checks run when the
data is there, a partial hit raises no false alarm, a poisoned load is caught without hanging the engine,
and a completion that never comes is abandoned at the deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
from support import lock_is_free

import kvobs
from kvobs import semconv as sc
from kvobs.locks._block_lock import BlockLock
from kvobs.testing import capture

NUM_BLOCKS = 32
NAN = float("nan")


def gpu_cache() -> torch.Tensor:
    """Uninitialised GPU memory, modelled as NaN: a check at submit time would always cry wolf."""
    return torch.full((NUM_BLOCKS, 4, 8), NAN)


@dataclass
class ReadStorageTask:
    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    loaded: list[int] | None = None


class FastDeployShaped:
    """The engine side issues, a pool thread (the transfer process) copies and sends the done signal."""

    def __init__(self, obs: kvobs.KVObserver, storage: dict[str, torch.Tensor], copy_delay: float = 0.05):
        self.obs = obs
        self.gpu_cache = gpu_cache()
        self.storage = storage
        self.copy_delay = copy_delay
        self.pool = ThreadPoolExecutor(2)
        self.issue = obs.prefetch(
            keys="task.keys", block_ids="task.gpu_block_ids", request_id="task.task_id", sync="is_sync",
            cache=self.gpu_cache, complete_later="task.task_id", result=lambda loaded: loaded,
        )(self._issue)

    def _issue(self, task: ReadStorageTask, is_sync: bool = True) -> None:
        self.pool.submit(self._read_storage_task, task)
        if is_sync:
            task.done.wait(5)

    def _read_storage_task(self, task: ReadStorageTask) -> None:
        loaded = []
        for key, block in zip(task.keys, task.gpu_block_ids):
            if key not in self.storage:
                break  # a partial storage hit loads a prefix of the blocks
            time.sleep(self.copy_delay / len(task.keys))
            self.gpu_cache[block] = self.storage[key]
            loaded.append(block)
        self._send_done(task, loaded)

    def _send_done(self, task: ReadStorageTask, loaded: list[int]) -> None:
        # the done signal carries what kvobs lets through: a corrupt load becomes "nothing loaded"
        task.loaded = self.obs.complete("prefetch", task.task_id, loaded)
        task.done.set()


def _observer(cap, **options) -> kvobs.KVObserver:
    options.setdefault("integrity", kvobs.IntegrityPolicy("skip", skip_result=[]))
    return kvobs.KVObserver("engine", registry=cap.registry, logger=cap.observer.logger, lock_timeout=5,
                            capacity=NUM_BLOCKS, **options)


def test_fastdeploy_shaped_pool_holds_the_lock_until_the_done_signal(cap):
    obs = _observer(cap)
    storage = {f"k{i}": torch.full((4, 8), float(i)) for i in range(4)}
    engine = FastDeployShaped(obs, storage, copy_delay=0.2)
    forward_ran_at = []

    @obs.locked("forward")
    def execute_model():
        forward_ran_at.append(time.monotonic())

    task = ReadStorageTask("t1", ["k0", "k1", "k2", "k3"], [3, 4, 5, 6])
    engine.issue(task, is_sync=False)  # returns at once; the copy goes on in the pool
    issued_at = time.monotonic()
    execute_model()  # waits for the copy: the transfer holds the lock until its done signal
    assert task.done.wait(5)
    assert forward_ran_at[0] - issued_at >= 0.15
    assert task.loaded == [3, 4, 5, 6]
    assert torch.equal(engine.gpu_cache[6], storage["k3"])
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="clean") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, engine="engine", path="prefetch", outcome="ok") == 1
    assert lock_is_free(obs.lock)


def test_fastdeploy_shaped_partial_hit_is_no_false_alarm(cap):
    obs = _observer(cap)
    engine = FastDeployShaped(obs, {"k0": torch.ones(4, 8), "k1": torch.ones(4, 8)})
    task = ReadStorageTask("t2", ["k0", "k1", "k2"], [7, 8, 9])  # k2 missed: block 9 stays uninitialised
    engine.issue(task, is_sync=True)
    assert task.loaded == [7, 8]
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="clean") == 1
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, engine="engine", path="prefetch") == 2


def test_fastdeploy_shaped_poisoned_load_is_caught_and_the_done_signal_still_comes(cap):
    obs = _observer(cap)
    engine = FastDeployShaped(obs, {"k0": torch.ones(4, 8), "k1": torch.full((4, 8), NAN)})
    task = ReadStorageTask("t3", ["k0", "k1"], [1, 2])
    engine.issue(task, is_sync=True)
    assert task.done.is_set()
    assert task.loaded == []  # "nothing loaded, recompute"
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="nan") == 1
    assert cap.value(sc.NAN_BLOCKS_TOTAL, engine="engine", path="prefetch") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, engine="engine", path="prefetch", outcome="rejected") == 1
    assert lock_is_free(obs.lock)


def test_fastdeploy_shaped_lost_done_signal_is_abandoned_at_the_deadline(cap):
    obs = _observer(cap, deadline=0.3)
    engine = FastDeployShaped(obs, {})
    engine._read_storage_task = lambda task: None  # the pool thread dies before sending the done signal
    task = ReadStorageTask("t4", ["k0"], [1])
    engine.issue(task, is_sync=False)
    assert obs.open_transfer("prefetch", "t4") is not None
    deadline = time.monotonic() + 5
    while obs.open_transfer("prefetch", "t4") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, engine="engine", path="prefetch", outcome="abandoned") == 1
    assert any(e["event"] == "kvobs._lifecycle.transfer" and e["outcome"] == "abandoned" and e["log_level"] == "warning"
               for e in cap.logs)
    # a late done signal changes nothing and releases nothing twice
    assert obs.complete("prefetch", "t4", [1]) == [1]
    assert cap.value(sc.TRANSFERS_TOTAL, engine="engine", path="prefetch", outcome="ok") == 0


class VllmShaped:
    """Loads are submitted per request on one step; a worker thread copies; get_finished() on a later step
    reports the requests whose loads are done."""

    def __init__(self, obs: kvobs.KVObserver):
        self.obs = obs
        self.gpu_cache = gpu_cache()
        self.jobs: queue.Queue = queue.Queue()
        self.finished: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def start_load_kv(self, reqs_to_load: dict[str, tuple[list[int], torch.Tensor]]) -> None:
        for req_id, (block_ids, data) in reqs_to_load.items():
            self.obs.begin("prefetch", key=req_id, request_id=req_id, block_ids=block_ids, cache=self.gpu_cache)
            self.jobs.put((req_id, block_ids, data))

    def get_finished(self) -> set[str]:
        done = set()
        while not self.finished.empty():
            req_id = self.finished.get()
            self.obs.complete("prefetch", req_id)
            done.add(req_id)
        return done

    def _work(self) -> None:
        while True:
            req_id, block_ids, data = self.jobs.get()
            for block in block_ids:
                self.gpu_cache[block] = data
            self.finished.put(req_id)


def test_vllm_shaped_completions_arrive_through_get_finished_on_the_next_step(cap):
    obs = _observer(cap, integrity="raise", lock=None)  # several loads open at once: no global lock
    connector = VllmShaped(obs)
    connector.start_load_kv({"r1": ([1, 2], torch.ones(4, 8)), "r2": ([3], torch.ones(4, 8))})
    assert {t.key for table in obs.open.by_path.values() for t in table.values()} == {"r1", "r2"}
    time.sleep(0.1)  # the worker copies between steps
    assert connector.get_finished() == {"r1", "r2"}
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="clean") == 2
    assert obs.open.count("prefetch") == 0


def test_vllm_shaped_nan_load_is_caught_at_completion(cap):
    obs = _observer(cap, integrity="raise", lock=None)
    connector = VllmShaped(obs)
    connector.start_load_kv({"r3": ([5], torch.full((4, 8), NAN))})
    time.sleep(0.1)
    with pytest.raises(kvobs.CorruptKVError, match="1 of 1 checked blocks"):
        connector.get_finished()
    assert cap.value(sc.TRANSFERS_TOTAL, engine="engine", path="prefetch", outcome="error") == 1
    assert lock_is_free(obs.lock)


def test_nan_store_is_stopped_at_its_own_begin_not_blamed_on_a_later_load(cap):
    obs = _observer(cap, integrity="raise")
    cache = torch.ones(NUM_BLOCKS, 4, 8)
    cache[4] = NAN
    with pytest.raises(kvobs.CorruptKVError):
        obs.begin("write_back", key="store-1", block_ids=[4], cache=cache)
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="write_back", result="nan") == 1
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="nan") == 0
    assert lock_is_free(obs.lock)


class SglangShaped:
    """load() picks destination token slots and queues the copy; start_loading() copies; the ack queue says
    which operation finished."""

    PAGE = 4

    def __init__(self, obs: kvobs.KVObserver):
        self.obs = obs
        self.cache = gpu_cache()  # NUM_BLOCKS pages
        self.pending: list[tuple[int, list[int], torch.Tensor]] = []
        self.ack: queue.Queue = queue.Queue()
        self.next_free_slot = 0
        self.load = obs.prefetch(complete_later="node_id", cache=self.cache, result=lambda slots: slots)(self._load)

    def _load(self, host_data: torch.Tensor, node_id: int) -> list[int]:
        slots = list(range(self.next_free_slot, self.next_free_slot + 2 * self.PAGE))
        self.next_free_slot += 2 * self.PAGE
        self.pending.append((node_id, slots, host_data))
        return slots

    def start_loading(self) -> None:
        for node_id, slots, data in self.pending:
            for page in sorted({s // self.PAGE for s in slots}):
                self.cache[page] = data
            self.ack.put((node_id, slots))
        self.pending.clear()

    def loading_check(self) -> None:
        while not self.ack.empty():
            node_id, slots = self.ack.get()
            self.obs.complete("prefetch", node_id, slots)


def test_sglang_shaped_ack_queue_completes_token_slot_loads(cap):
    obs = _observer(cap, integrity="raise", page_size=SglangShaped.PAGE, lock=None)
    hicache = SglangShaped(obs)
    assert hicache.load(torch.ones(4, 8), node_id=11) == list(range(8))
    assert hicache.load(torch.ones(4, 8), node_id=12) == list(range(8, 16))
    assert obs.open.count("prefetch") == 2
    hicache.start_loading()
    hicache.loading_check()
    assert obs.open.count("prefetch") == 0
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="engine", path="prefetch", result="clean") == 2
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, engine="engine", path="prefetch") == 4  # 2 pages each


def test_sglang_shaped_poisoned_page_is_caught_on_the_ack(cap):
    obs = _observer(cap, integrity="raise", page_size=SglangShaped.PAGE, lock=None)
    hicache = SglangShaped(obs)
    hicache.load(torch.full((4, 8), NAN), node_id=13)
    hicache.start_loading()
    with pytest.raises(kvobs.CorruptKVError):
        hicache.loading_check()
    assert lock_is_free(obs.lock)


def test_per_layer_caches_are_validated_once_each(cap, monkeypatch):
    """Sends go layer by layer, each with its own layer's cache: each is validated once, not once per call."""
    from kvobs import integrity

    calls = []
    real = integrity.validate_cache
    monkeypatch.setattr(integrity, "validate_cache", lambda cache, **kw: calls.append(id(cache)) or real(cache, **kw))
    obs = _observer(cap, integrity="raise")
    layers = [torch.ones(NUM_BLOCKS, 4, 8) for _ in range(3)]
    for _ in range(4):
        for layer in layers:
            obs.begin("send", block_ids=[1, 2], cache=layer).complete()
    assert sorted(calls) == sorted(id(layer) for layer in layers)


# -- a completion key taken by two transfers while they waited -----------------------------------------------


def _conflicts(registry) -> float:
    return sum(s.value for f in registry.collect() for s in f.samples if s.name == sc.LOCK_CONFLICTS_TOTAL)


def test_of_two_transfers_that_took_one_key_while_waiting_only_the_first_keeps_it(tmp_path):
    """Both validated while the key was free, then waited for the lock: the second to get its blocks finds
    the key taken, lets its blocks go and is rejected."""
    lock = BlockLock("race", 8, directory=tmp_path)
    with capture(engine="race", integrity=None, lock=lock, lock_timeout=5.0) as cap:
        outcomes: list[object] = []

        def begin(block):
            try:
                outcomes.append(cap.observer.begin("prefetch", block_ids=[block], key="job-1"))
            except kvobs.TransferRejected as exc:
                outcomes.append(exc)

        with lock.claim([]):  # the whole cache: both validate, then wait
            threads = [threading.Thread(target=begin, args=(block,)) for block in (1, 2)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 10
            while _conflicts(cap.registry) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _conflicts(cap.registry) == 2
        for thread in threads:
            thread.join(10)
        (kept,) = [o for o in outcomes if isinstance(o, kvobs.Transfer)]
        (refused,) = [o for o in outcomes if isinstance(o, kvobs.TransferRejected)]
        assert "already open under key 'job-1'" in str(refused)
        other_block = 3 - kept.blocks.distinct[0]
        with lock.claim([other_block], timeout=0):  # the refused transfer let its block go
            pass
        kept.complete()
    lock.close()
