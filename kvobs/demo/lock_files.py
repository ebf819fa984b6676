"""Where a run's block lock keeps its lock file: a temporary directory of the run's own, removed with the file
when the run stops (or when the process exits, if an engine thread outlived the stop). Runs never share a
lock file, and a demo leaves nothing behind in /dev/shm or the temp directory."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

from kvobs.demo.runs import RunSpec


class LockFiles:
    """The directory (None: the run's lock needs no file) and the locks to close before removing it."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._locks: list[Any] = []
        self._finalizer = weakref.finalize(self, _close_and_remove, self._locks, directory)

    @classmethod
    def of(cls, run: RunSpec) -> LockFiles:
        return cls(tempfile.mkdtemp(prefix="kvobs-demo-lock-") if run.claims_blocks else None)

    def owns(self, lock: Any) -> None:
        """`lock` lives in the directory: closed before it is removed."""
        if hasattr(lock, "close"):
            self._locks.append(lock)

    def remove(self) -> None:
        """Close the locks and remove the directory; once (later calls do nothing)."""
        self._finalizer()

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive


def _close_and_remove(locks: list[Any], directory: str | None) -> None:
    for lock in locks:
        lock.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
