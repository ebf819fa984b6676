"""The prefill node's sends: `IPCCommManager.write_cache` per layer, completed by `write_block_by_sync`.

`write_cache(ip, remote_gpu_id, local_block_ids, remote_block_ids, layer_idx)` launches the copy of one
layer's blocks to the decode GPU on a stream and returns 0 at once; `write_block_by_sync(remote_gpu_id)`
waits for that stream. So each `write_cache` begins a send transfer whose sources (that layer's blocks,
now computed) are checked before the copy is launched, and the transfers to one decode GPU complete when
its stream is synced (or fail, if the sync raises or the launch returned an error code). Corrupt sources
are never sent: `write_cache` returns an error code instead, which the messager reports as the request's
"write cache error", so the decode node never waits for cache that will not come.

What is checked when:
- at `write_cache`, the layer's source blocks, before the copy is launched;
- at `write_block_by_sync`, once the stream is done, the same source blocks again. The copy ran on the stream
  at some moment in between, so a NaN written into a source after the launch check and before the copy
  (nothing excludes the forward pass with lock=None) reached decode; it is still in the source at the sync,
  and this check finds it: the send ends in error (CorruptKVError) and, given the `messager`, the request's
  task is marked "write cache error" before FastDeploy reports it, its own failure path (the decode node
  drops the request). A source changed after its copy ran is reported too (the copy itself was clean); one
  changed and restored before the sync is not seen. The destination is not read: on the decode GPU it is
  reached through CUDA IPC pointers, not tensors kvobs can check.

The lock: each layer's send holds its claim only while its copy is launched, then releases it and stays
open until the sync. A claim held to the sync would span every layer: with a BlockLock, a forward pass
writing the next layer of the same blocks queues behind it, and the next layer's send behind that forward
pass, which waits for a sync that only comes after the last layer (a stall until the lock timeout). A
BlockLock claim covers blocks, not layers, so it cannot tell "layer L is being sent" from "layer L+1 is
being computed"; the second check above is what covers the window the released claim leaves open.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from kvobs import Instrumentation, KVObserver
from kvobs import semconv as sc
from kvobs.errors import CorruptKVError, LaunchFailed
from kvobs.integrations._common import require_sharing_lock
from kvobs.integrations.fastdeploy._kvcache import per_layer

_SEQUENCE = itertools.count()  # send keys unique in the process, whatever observer and manager they are for
WRITE_ERROR = 1  # a non-zero `write_cache` return code: the messager marks the request "write cache error"
WRITE_CACHE_ERROR = "write cache error"  # the task status FastDeploy's messager reports for a failed write


def instrument_ipc_comm_manager(comm: Any, obs: KVObserver, *, messager: Any = None) -> Instrumentation:
    """Send transfers for `comm`'s `write_cache` calls, completed by `write_block_by_sync`. Returns the undo.

    messager: the `CacheMessagerV1` owning `comm`; with it, a send found corrupt at the sync marks its
    request's task "write cache error" before the messager reports the request (see the module docstring).

    Many sends are open at once (every layer until the sync), so the observer's lock must let them share
    (lock=None, or a BlockLock: sends read their blocks); a global lock is refused here, as the second
    layer's send would wait for the first one's sync, which comes after it (`SharingLockRequired`). Each send
    holds its claim only while its layer is launched (see the module docstring). A manager already
    instrumented for another observer is refused (`AlreadyInstrumented`).
    """
    require_sharing_lock(obs, "instrument_ipc_comm_manager",
                         "every layer's send stays open until write_block_by_sync, after the last layer")
    patches = Instrumentation(owner=obs)
    if not patches.claims(comm, "write_cache", "write_block_by_sync"):
        return patches  # instrumented for this observer already
    sends = OpenSends(obs, messager)
    layer_cache = per_layer(lambda: comm.local_key_cache_tensor_list, lambda: comm.local_value_cache_tensor_list)
    guard = obs.send(block_ids="local_block_ids", complete_later=sends.next_key,
                     cache=lambda ip, remote_gpu_id, local, remote, layer_idx: layer_cache(layer_idx),
                     on_corrupt=lambda t, bad_ids: WRITE_ERROR)
    patches.replace(comm, "write_cache", lambda write: sends.launching(guard(write)))
    patches.replace(comm, "write_block_by_sync", sends.syncing)
    return patches


class OpenSends:
    """The send transfers launched to each decode GPU and not yet synced."""

    def __init__(self, obs: KVObserver, messager: Any = None) -> None:
        self._obs = obs
        self._messager = messager
        self._local = threading.local()  # the key the current write_cache call opened
        self._open: dict[Any, list[Any]] = {}  # remote GPU id -> keys
        self._lock = threading.Lock()

    def next_key(self, ip: Any, remote_gpu_id: Any, *rest: Any) -> tuple[Any, int]:
        """A `complete_later` spec: a fresh key per call, remembered for this call's thread."""
        key = self._local.key = (remote_gpu_id, next(_SEQUENCE))
        return key

    def launching(self, write: Callable[..., int]) -> Callable[..., int]:
        def write_cache(ip: Any, remote_gpu_id: Any, local_block_ids: Any, remote_block_ids: Any,
                        layer_idx: int) -> int:
            self._local.key = None
            code = write(ip, remote_gpu_id, local_block_ids, remote_block_ids, layer_idx)
            key = self._local.key
            t = None if key is None else self._obs.open_transfer(sc.PATH_SEND, key)
            if t is not None:
                if code == 0:
                    t.release_lock()  # launched: the claim is per layer (see the module docstring)
                    with self._lock:
                        self._open.setdefault(remote_gpu_id, []).append(key)
                else:
                    t.fail(LaunchFailed(remote_gpu_id, layer_idx, code))
            return code

        return write_cache

    def syncing(self, sync: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def write_block_by_sync(remote_gpu_id: Any) -> Any:
            with self._lock:
                keys = self._open.pop(remote_gpu_id, [])
            try:
                result = sync(remote_gpu_id)
            except BaseException as exc:
                for key in keys:
                    self._obs.fail(sc.PATH_SEND, key, exc)
                raise
            bad: set[int] = set()
            for key in keys:
                t = self._obs.open_transfer(sc.PATH_SEND, key)
                found = None if t is None else t.check_copied()
                if found is None:
                    self._obs.complete(sc.PATH_SEND, key)
                else:
                    t.fail(CorruptKVError(sc.PATH_SEND, found))
                    bad.update(found.bad_block_ids)
            if bad and self._messager is not None:
                self._mark_failed(remote_gpu_id, bad)
            return result

        return write_block_by_sync

    def _mark_failed(self, remote_gpu_id: Any, bad: set[int]) -> None:
        """Mark the tasks that sent `bad` blocks to `remote_gpu_id` as FastDeploy marks a failed write. Runs
        inside the messager's report loop, which holds its task lock and reads each status after the sync."""
        m = self._messager
        try:
            for task in list(m.idx_cache_task_dict.values()):
                if int(task["device_ids"][m.rank]) == int(remote_gpu_id) and bad & set(task["src_block_ids"]):
                    if "error" not in task["status"]:
                        task["status"] = WRITE_CACHE_ERROR
        except Exception as exc:  # noqa: BLE001 - the messager's send thread must go on
            self._obs.logger.error("kvobs.fastdeploy.mark_failed", error=repr(exc))
