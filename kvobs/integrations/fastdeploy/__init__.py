"""Put kvobs on FastDeploy: each function takes one of FastDeploy's objects and an observer of that process,
and returns an undo handle (call it, or `.undo()`, to restore the object exactly).

    from kvobs.integrations import fastdeploy as kvfd

    # engine process (PrefixCacheManager): storage tasks from issue to done signal
    undo = kvfd.instrument_prefix_cache_manager(prefix_cache_manager, obs)
    # each cache transfer process (CacheTransferManager): the storage copies, checked on its GPU tensors
    kvfd.instrument_cache_transfer_manager(cache_transfer_manager, obs)
    # each GPU worker (PaddleDisWorkerProc): FastDeploy's own GPU-cache lock, timed, around execute_model
    obs = kvobs.KVObserver("fastdeploy-worker", lock=kvfd.FastDeployLock(port))
    kvfd.instrument_worker_process(worker_proc, obs)
    # prefill cache messager (CacheMessagerV1): early layer0 signals kept; IPC sends checked
    kvfd.bridge_cache_messager(messager, obs.signal_buffer())
    kvfd.instrument_ipc_comm_manager(messager.messager["ipc"], obs)
    # one trace per request across prefill and decode
    kvfd.instrument_prefill_connector(prefill_connector, obs)
    kvfd.instrument_decode_connector(decode_connector, obs)

Nothing here imports FastDeploy or Paddle: the objects passed in are FastDeploy's.
"""

from kvobs.integrations.fastdeploy.engine import instrument_prefix_cache_manager
from kvobs.integrations.fastdeploy.lock import FastDeployLock, gpu_cache_lock_path
from kvobs.integrations.fastdeploy.messager import bridge_cache_messager
from kvobs.integrations.fastdeploy.patching import Patches
from kvobs.integrations.fastdeploy.pd import (
    TRACE_KEY,
    DecodeReceives,
    SendFailed,
    instrument_decode_connector,
    instrument_prefill_connector,
)
from kvobs.integrations.fastdeploy.send import (
    WRITE_ERROR,
    LaunchFailed,
    instrument_ipc_comm_manager,
)
from kvobs.integrations.fastdeploy.transfer import instrument_cache_transfer_manager
from kvobs.integrations.fastdeploy.worker import instrument_worker_process

__all__ = [
    "TRACE_KEY",
    "WRITE_ERROR",
    "DecodeReceives",
    "FastDeployLock",
    "LaunchFailed",
    "Patches",
    "SendFailed",
    "bridge_cache_messager",
    "gpu_cache_lock_path",
    "instrument_cache_transfer_manager",
    "instrument_decode_connector",
    "instrument_ipc_comm_manager",
    "instrument_prefill_connector",
    "instrument_prefix_cache_manager",
    "instrument_worker_process",
]
