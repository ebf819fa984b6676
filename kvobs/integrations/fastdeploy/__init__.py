"""Put kvobs on FastDeploy: each function takes one of FastDeploy's objects and an observer of that process,
and returns an undo handle (call it, or `.undo()`, to restore the object exactly).

    from kvobs.integrations import fastdeploy as kvfd

    # engine process (PrefixCacheManager): storage tasks from issue to done signal; no KV tensors there
    engine_obs = kvobs.KVObserver("fd-engine", lock=None)
    undo = kvfd.instrument_prefix_cache_manager(prefix_cache_manager, engine_obs)
    # each cache transfer process and GPU worker: FastDeploy's own GPU-cache lock file, so kvobs and
    # FastDeploy exclude each other; the storage copies are checked on the process's GPU tensors
    obs = kvobs.KVObserver("fd-rank0", lock=kvfd.FastDeployLock(local_engine_worker_queue_port))
    kvfd.instrument_cache_transfer_manager(cache_transfer_manager, obs)
    kvfd.instrument_worker_process(worker_proc, obs)  # execute_model, on tensor-parallel rank 0
    # prefill cache messager (CacheMessagerV1): early layer0 signals kept; IPC sends checked before launch
    msg_obs = kvobs.KVObserver("fd-messager", lock=None)  # sends stay open until their stream sync
    kvfd.bridge_cache_messager(messager, msg_obs.signal_buffer())  # StepAlignedSignalBuffer() per TP rank
    kvfd.instrument_ipc_comm_manager(messager.messager["ipc"], msg_obs, messager=messager)  # checked at sync too
    # one trace per request across prefill and decode (engine processes)
    kvfd.instrument_prefill_connector(prefill_splitwise_connector, engine_obs)
    receives = kvfd.instrument_decode_connector(decode_splitwise_connector, decode_engine_obs)

Nothing here imports FastDeploy or Paddle: the objects passed in are FastDeploy's.
"""

from kvobs import Instrumentation as Patches
from kvobs.errors import CorruptLoad, LaunchFailed, SendFailed
from kvobs.integrations.fastdeploy._engine import instrument_prefix_cache_manager
from kvobs.integrations.fastdeploy._lock import FastDeployLock, gpu_cache_lock_path
from kvobs.integrations.fastdeploy._messager import bridge_cache_messager
from kvobs.integrations.fastdeploy._pd import (
    TRACE_KEY,
    DecodeReceives,
    instrument_decode_connector,
    instrument_prefill_connector,
)
from kvobs.integrations.fastdeploy._send import WRITE_ERROR, instrument_ipc_comm_manager
from kvobs.integrations.fastdeploy._transfer import instrument_cache_transfer_manager
from kvobs.integrations.fastdeploy._worker import instrument_worker_process

__all__ = [
    "TRACE_KEY",
    "WRITE_ERROR",
    "CorruptLoad",
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
