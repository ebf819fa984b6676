"""The prefill node's sends: `IPCCommManager.write_cache` per layer, completed by `write_block_by_sync`.

`write_cache(ip, remote_gpu_id, local_block_ids, remote_block_ids, layer_idx)` launches the copy of one
layer's blocks to the decode GPU on a stream and returns 0 at once; `write_block_by_sync(remote_gpu_id)`
waits for that stream. So each `write_cache` begins a send transfer whose sources (that layer's blocks,
now computed) are checked before the copy is launched, and the transfers to one decode GPU complete when
its stream is synced (or fail, if the sync raises or the launch returned an error code). Corrupt sources
are never sent: `write_cache` returns an error code instead, which the messager reports as the request's
"write cache error", so the decode node never waits for cache that will not come.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from kvobs import Instrumentation, KVObserver
from kvobs import semconv as sc
from kvobs.errors import LaunchFailed
from kvobs.integrations._common import require_sharing_lock
from kvobs.integrations.fastdeploy.kvcache import per_layer

_SEQUENCE = itertools.count()  # send keys unique in the process, whatever observer and manager they are for
WRITE_ERROR = 1  # a non-zero `write_cache` return code: the messager marks the request "write cache error"


def instrument_ipc_comm_manager(comm: Any, obs: KVObserver) -> Instrumentation:
    """Send transfers for `comm`'s `write_cache` calls, completed by `write_block_by_sync`. Returns the undo.

    Many sends are open at once (every layer until the sync), so the observer's lock must let them share
    (lock=None, or a BlockLock: sends read their blocks); a global lock is refused here, as the second
    layer's send would wait for the first one's sync, which comes after it (`SharingLockRequired`). A manager
    already instrumented for another observer is refused (`AlreadyInstrumented`).
    """
    require_sharing_lock(obs, "instrument_ipc_comm_manager",
                         "every layer's send stays open until write_block_by_sync, after the last layer")
    patches = Instrumentation(owner=obs)
    if not patches.claims(comm, "write_cache", "write_block_by_sync"):
        return patches  # instrumented for this observer already
    sends = OpenSends(obs)
    layer_cache = per_layer(lambda: comm.local_key_cache_tensor_list, lambda: comm.local_value_cache_tensor_list)
    guard = obs.send(block_ids="local_block_ids", complete_later=sends.next_key,
                     cache=lambda ip, remote_gpu_id, local, remote, layer_idx: layer_cache(layer_idx),
                     on_corrupt=lambda t, bad_ids: WRITE_ERROR)
    patches.replace(comm, "write_cache", lambda write: sends.launching(guard(write)))
    patches.replace(comm, "write_block_by_sync", sends.syncing)
    return patches


class OpenSends:
    """The send transfers launched to each decode GPU and not yet synced."""

    def __init__(self, obs: KVObserver) -> None:
        self._obs = obs
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
            if key is not None and self._obs.open_transfer(sc.PATH_SEND, key) is not None:
                if code == 0:
                    with self._lock:
                        self._open.setdefault(remote_gpu_id, []).append(key)
                else:
                    self._obs.fail(sc.PATH_SEND, key, LaunchFailed(remote_gpu_id, layer_idx, code))
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
            for key in keys:
                self._obs.complete(sc.PATH_SEND, key)
            return result

        return write_block_by_sync
