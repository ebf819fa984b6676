"""FastDeploy's own GPU-cache lock file, taken by kvobs.

FastDeploy's GPU worker (with `FD_USE_KVCACHE_LOCK`) takes an `fcntl.flock` on
`/dev/shm/fd_lock_gpu_cache_lock.<local_engine_worker_queue_port>` (`/tmp` without `/dev/shm`) around each
`execute_model`, on tensor-parallel rank 0, blocking and without a timeout. A kvobs lock on a file of its
own would not exclude that flock. `FastDeployLock` locks that very file, so a kvobs-guarded process and an
unmodified FastDeploy process exclude each other, and kvobs's side is timed, interrupt-safe and observed.

The file is FastDeploy's (its engine creates it, mode 0600), so it is adopted, never created
(`ProcessLock(file=...)`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from kvobs import ProcessLock

LOCK_NAME = "gpu_cache_lock"


def gpu_cache_lock_path(port: int | str, directory: str | os.PathLike[str] | None = None) -> str:
    """Where FastDeploy keeps the GPU-cache lock of the engine whose worker queue listens on `port`."""
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(os.fspath(directory), f"fd_lock_{LOCK_NAME}.{port}")


class FastDeployLock(ProcessLock):
    """A `ProcessLock` on FastDeploy's GPU-cache lock file (for `KVObserver(lock=...)`).

    port: the engine's `local_engine_worker_queue_port` (the file's suffix).
    directory: where the file is; default as FastDeploy decides (`/dev/shm`, else `/tmp`).
    timeout: how long `acquire()`, `with lock:` and an observer without `lock_timeout` wait for it.
    A missing file is a FileNotFoundError (FastDeploy's engine creates it at start-up); a symlink, a file that
    is not regular or one owned by another user is refused (`kvobs.errors.UnsafeLockFile`).
    """

    def __init__(self, port: int | str, *, directory: str | os.PathLike[str] | None = None,
                 timeout: float | None = None) -> None:
        self.port = port
        # a metric label: the port stays out of it
        super().__init__(f"fastdeploy_{LOCK_NAME}", file=gpu_cache_lock_path(port, directory), timeout=timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned process opens the same file again (never creates it).
        return functools.partial(FastDeployLock, directory=self.directory, timeout=self.timeout), (self.port,)

    def __repr__(self) -> str:
        return f"FastDeployLock(port={self.port!r}, path={self.path!r})"
