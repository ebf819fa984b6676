"""The engine process: `PrefixCacheManager.issue_prefetch_storage_task` / `issue_write_back_storage_task`.

The engine holds no KV tensors; it issues a storage task to the cache transfer processes (one per
tensor-parallel rank) and learns the outcome from their done signals, read by its `recv_data_transfer_result`
thread through `cache_task_queue.get_transfer_done_signal()`. So each issue begins a transfer (lock, counts,
span) that stays open under the task id until its done signal is read here, in both modes: `is_sync=True`
waits for that signal inside the call, `is_sync=False` returns at once. A read completes once every rank
answered, with the shortest list of loaded blocks, as FastDeploy itself decides; a write-back on its first
signal. A signal that never comes leaves the transfer to the observer's deadline (abandoned, lock released).
A rank whose kvobs found the load corrupt answers with a `CorruptBlocks` list (empty, as FastDeploy reads it,
naming the bad blocks): the engine's prefetch then ends in error with those blocks, not as a storage miss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvobs import Instrumentation, KVObserver
from kvobs import semconv as sc
from kvobs.errors import CorruptLoad
from kvobs.integrations._common import HookFailures

READ_DONE, WRITE_DONE = "STORAGE2GPU", "GPU2STORAGE"  # CacheStatus member names in a done signal


class CorruptBlocks(list):
    """The block list of a read's done signal when the rank found the loaded blocks corrupt: empty (nothing
    loaded, as FastDeploy reads it), with the bad block ids for the engine's observer. Pickled with the done
    signal between processes: both run kvobs."""

    def __init__(self, bad_block_ids: Any = ()) -> None:
        super().__init__()
        self.bad_block_ids = tuple(bad_block_ids)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.bad_block_ids,)


_TASK_SPECS = {"keys": "task.keys", "block_ids": "task.gpu_block_ids", "request_id": "task.task_id",
               "complete_later": "task.task_id", "sync": "is_sync"}


def instrument_prefix_cache_manager(manager: Any, obs: KVObserver) -> Instrumentation:
    """Guard `manager`'s two storage issue methods and complete their transfers from its done signals.

    Returns the undo handle. Calls made while the manager has no storage backend pass straight through
    (FastDeploy returns at once and no done signal will ever come). A manager already instrumented for another
    observer is refused (`AlreadyInstrumented`).
    """
    patches = Instrumentation(owner=obs)
    if not (patches.claims(manager, "issue_prefetch_storage_task", "issue_write_back_storage_task")
            and patches.claims(manager.cache_task_queue, "get_transfer_done_signal")):
        return patches  # instrumented for this observer already
    for name, path in (("issue_prefetch_storage_task", sc.PATH_PREFETCH),
                       ("issue_write_back_storage_task", sc.PATH_WRITE_BACK)):
        patches.replace(manager, name, lambda issue, path=path: _issuing(manager, issue, obs.guard(path, **_TASK_SPECS)))
    signals = DoneSignals(obs, lambda: getattr(manager, "tensor_parallel_size", 1))
    patches.replace(manager.cache_task_queue, "get_transfer_done_signal", signals.reading)
    return patches


def _issuing(manager: Any, issue: Callable[..., Any], guard: Any) -> Callable[..., Any]:
    guarded = guard(issue)

    def issue_storage_task(task: Any, is_sync: bool = True) -> Any:
        if getattr(manager, "kvcache_storage_backend", None) is None:
            return issue(task, is_sync)
        return guarded(task, is_sync)

    issue_storage_task.__wrapped__ = issue
    return issue_storage_task


class DoneSignals:
    """Completes the engine's open storage transfers from the done signals its receiver thread reads."""

    def __init__(self, obs: KVObserver, ranks: Callable[[], int]) -> None:
        self._obs = obs
        self._ranks = ranks
        self._reads: dict[Any, list[list[int]]] = {}  # task id -> block lists answered so far, one per rank
        self._lock = threading.Lock()
        self._failed = HookFailures(obs)

    def reading(self, get_done_signal: Callable[[], Any]) -> Callable[[], Any]:
        """Wrap `get_transfer_done_signal`: what it returns is returned unchanged, whatever kvobs does."""

        def get_transfer_done_signal() -> Any:
            data = get_done_signal()
            if data is not None:
                try:
                    self.seen(data)
                except Exception as exc:  # noqa: BLE001 - the engine's receiver thread must get its signal
                    self._failed("done_signal", exc)
            return data

        return get_transfer_done_signal

    def seen(self, data: Any) -> None:
        """One done signal: `(status, task_id, keys, block_ids)` for storage tasks; others are not ours."""
        kind = getattr(data[0], "name", None)
        if kind == WRITE_DONE:
            _, task_id, _, block_ids = data
            self._obs.complete(sc.PATH_WRITE_BACK, task_id, moved=list(block_ids))
        elif kind == READ_DONE:
            _, task_id, _, block_ids = data
            answers = self._all_ranks_answered(task_id, block_ids)
            if answers is None:
                return
            bad = sorted({i for answer in answers for i in getattr(answer, "bad_block_ids", ())})
            if bad:
                self._corrupt(task_id, tuple(bad))
            else:
                self._obs.complete(sc.PATH_PREFETCH, task_id, moved=list(min(answers, key=len)))

    def _all_ranks_answered(self, task_id: Any, block_ids: list[int]) -> list[list[int]] | None:
        """Every rank's answer, once all answered; None before."""
        with self._lock:
            if self._obs.open_transfer(sc.PATH_PREFETCH, task_id) is None:
                self._reads.pop(task_id, None)  # ended already (abandoned): forget its late answers
                return None
            answers = self._reads.setdefault(task_id, [])
            answers.append(block_ids)
            if len(answers) < self._ranks():
                return None
            del self._reads[task_id]
        return answers

    def _corrupt(self, task_id: Any, bad: tuple[int, ...]) -> None:
        """A rank found the load corrupt: the engine's transfer ends in error with the bad blocks."""
        t = self._obs.open_transfer(sc.PATH_PREFETCH, task_id)
        if t is None:
            return
        t.bad_block_ids = bad
        if t.span is not None:
            t.span.set_attribute(sc.ATTR_BAD_BLOCK_IDS, list(bad))
        t.fail(CorruptLoad(task_id, bad))
