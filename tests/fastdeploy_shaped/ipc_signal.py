"""`IPCLock` (upstream: inter_communicator/ipc_signal.py): a blocking `fcntl.flock` on
`<dir>/fd_lock_<name>.<suffix>`, dir `/dev/shm` (else `/tmp`); `lock_dir` is added here so tests can use a
temporary directory."""

from __future__ import annotations

import fcntl
import os


class IPCLock:
    def __init__(self, name: str, suffix: int | None = None, create: bool = True, lock_dir: str | None = None):
        if suffix is not None:
            name = f"{name}.{suffix}"
        if lock_dir is None:
            lock_dir = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.path = os.path.join(lock_dir, f"fd_lock_{name}")
        if create:
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        else:
            if not os.path.exists(self.path):
                raise RuntimeError(f"IPC lock file not found: {self.path}")
            self.fd = os.open(self.path, os.O_RDWR)

    def acquire(self, shared: bool = False) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def clear(self) -> None:
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


if __name__ == "__main__":  # a process of an unmodified FastDeploy: `python ipc_signal.py DIR PORT`
    import sys

    lock = IPCLock("gpu_cache_lock", suffix=int(sys.argv[2]), create=False, lock_dir=sys.argv[1])
    for line in sys.stdin:  # "acquire" / "release": answered once done
        getattr(lock, line.strip())()
        print(f"{line.strip()}d", flush=True)
