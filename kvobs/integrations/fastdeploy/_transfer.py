"""The cache transfer process: `CacheTransferManager.read_storage_task` / `write_back_storage_task`.

Each runs in a one-thread pool fed by `do_data_transfer`, one such process per tensor-parallel rank. The
data moves in `_run_read_storage` / `_run_write_back_storage`, between the storage backend and this rank's
`gpu_cache_k_tensors` / `gpu_cache_v_tensors`. Then every rank meets at a barrier, and the done signal
goes to the engine (`cache_task_queue.put_transfer_done_signal`).

So a transfer here covers exactly the copy: the lock is held and the checks run while and where the data
moves (the read's destinations once they landed, on the blocks `_run_read_storage` returns: a partial
storage hit checks only what loaded; the write-back's sources before they leave), and it ends before the
barrier. A lock held up to the done signal would be held across the barrier: with one lock file shared by
the ranks (FastDeploy's `gpu_cache_lock`), rank 0 would wait at the barrier holding it while rank 1 waits
for it.

Corrupt blocks never keep the done signal from going out (the engine would wait for ever). A corrupt read is
a failed read: `_run_read_storage` raises `CorruptLoad`, FastDeploy's own failure path for a read
(`read_storage_task` logs it and reports nothing loaded), the rank's transfer ends in error, and the done
signal's empty block list is a `CorruptBlocks`, which tells the engine's observer (`engine.DoneSignals`) that
the load was corrupt, not a storage miss: it ends in error there too, with the same bad blocks. A corrupt
write-back is not performed (counted `rejected`) and its done signal says nothing was written. Bad blocks are
in each transfer's `bad_block_ids` and on its span.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvobs import Instrumentation, KVObserver, Transfer
from kvobs.errors import CorruptLoad
from kvobs.integrations._common import HookFailures
from kvobs.integrations.fastdeploy._engine import READ_DONE, WRITE_DONE, CorruptBlocks
from kvobs.integrations.fastdeploy._kvcache import LayerCaches

_COPY_SPECS = {"keys": "k_cache_keys", "block_ids": "gpu_block_ids", "request_id": "task_id"}
NOTHING_WRITTEN = 0  # what `_run_write_back_storage` returns when it wrote no block


def instrument_cache_transfer_manager(manager: Any, obs: KVObserver) -> Instrumentation:
    """Guard `manager`'s storage copies and carry kvobs's verdicts in its done signals. Returns the undo. A
    manager already instrumented for another observer is refused (`AlreadyInstrumented`)."""
    patches = Instrumentation(owner=obs)
    if not (patches.claims(manager, "_run_read_storage", "_run_write_back_storage")
            and patches.claims(manager.cache_task_queue, "put_transfer_done_signal")):
        return patches  # instrumented for this observer already
    caches = LayerCaches(lambda: (manager.gpu_cache_k_tensors, manager.gpu_cache_v_tensors))
    verdicts = Verdicts(HookFailures(obs))
    read = obs.prefetch(cache=caches, result=list, on_corrupt=verdicts.corrupt_load, **_COPY_SPECS)
    write = obs.write_back(cache=caches, on_corrupt=verdicts.nothing_written, **_COPY_SPECS)
    patches.replace(manager, "_run_read_storage", read)  # the manager's bound copy keeps its `self`
    patches.replace(manager, "_run_write_back_storage", write)
    patches.replace(manager.cache_task_queue, "put_transfer_done_signal", verdicts.applied)
    return patches


class Verdicts:
    """Tasks whose copy kvobs left out because of corrupt blocks, until their done signal goes out."""

    def __init__(self, failed: HookFailures) -> None:
        self._left_out: dict[tuple[str, Any], tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._failed = failed

    def corrupt_load(self, t: Transfer, bad_ids: tuple[int, ...]) -> list[int]:
        """Fail the read the way FastDeploy fails one: `_run_read_storage` raises, nothing counts as loaded."""
        self._record(READ_DONE, t.request_id, bad_ids)
        raise CorruptLoad(t.request_id, tuple(bad_ids))

    def nothing_written(self, t: Transfer, bad_ids: tuple[int, ...]) -> int:
        self._record(WRITE_DONE, t.request_id, bad_ids)
        return NOTHING_WRITTEN

    def _record(self, kind: str, task_id: Any, bad_ids: tuple[int, ...]) -> None:
        with self._lock:
            self._left_out[(kind, task_id)] = tuple(bad_ids)

    def applied(self, put_done_signal: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Wrap `put_transfer_done_signal`: a task kvobs left out is reported with no blocks; always sent."""

        def put_transfer_done_signal(result: Any) -> Any:
            try:
                result = self._verdict(result)
            except Exception as exc:  # noqa: BLE001 - the done signal must go out whatever happens here
                self._failed("done_signal_verdict", exc)
            return put_done_signal(result)

        return put_transfer_done_signal

    def _verdict(self, result: Any) -> Any:
        kind = getattr(result[0], "name", None)
        if kind not in (READ_DONE, WRITE_DONE):
            return result
        with self._lock:
            bad_ids = self._left_out.pop((kind, result[1]), None)
        if bad_ids is None:
            return result
        return (*result[:-1], CorruptBlocks(bad_ids) if kind == READ_DONE else [])

