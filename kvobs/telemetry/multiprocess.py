"""Multiprocess mode: prometheus_client writes every worker's values to files in PROMETHEUS_MULTIPROC_DIR.

prometheus_client decides the mode once, when it is imported, from the environment; a directory that is
missing or read-only only shows up later as a raw OSError from deep inside it. kvobs checks the directory
when its metrics are created and says which variable to fix.
"""

from __future__ import annotations

import os
import tempfile

from prometheus_client import values as prometheus_values

from kvobs import semconv as sc
from kvobs.errors import MultiprocessDirError

_LEGACY_VARIABLE = "prometheus_multiproc_dir"  # still honoured by prometheus_client


def multiprocess_dir() -> str | None:
    """The directory multiprocess mode writes to, or None in single-process mode."""
    return os.environ.get(sc.ENV_MULTIPROC_DIR) or os.environ.get(_LEGACY_VARIABLE) or None


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes values to per-process mmap files."""
    return multiprocess_dir() is not None


def check_multiprocess_dir(*, writable: bool = True) -> None:
    """Raise MultiprocessDirError unless the directory exists and this process can use it.

    `writable=False` checks only that it can be read (the scraping process). Writing is checked by creating
    a file there, since permission bits alone say nothing for root or on a read-only mount; and a process
    that records must have had the variable when prometheus_client was imported.
    """
    path = multiprocess_dir()
    if path is None:
        return
    variable = sc.ENV_MULTIPROC_DIR if os.environ.get(sc.ENV_MULTIPROC_DIR) else _LEGACY_VARIABLE
    if not os.path.exists(path):
        raise MultiprocessDirError(variable, path, "does not exist")
    if not os.path.isdir(path):
        raise MultiprocessDirError(variable, path, "is not a directory")
    try:
        os.listdir(path)
    except OSError as exc:
        raise MultiprocessDirError(variable, path, f"cannot be read ({exc.strerror})") from exc
    if writable:
        try:
            with tempfile.TemporaryFile(dir=path, prefix=".kvobs-check-"):
                pass
        except OSError as exc:
            raise MultiprocessDirError(variable, path, f"is not writable ({exc.strerror})") from exc
        if prometheus_values.ValueClass is prometheus_values.MutexValue:
            raise MultiprocessDirError(
                variable, path, "was set after prometheus_client was imported (it chooses the mode at import, "
                "so this process would keep its values to itself); set it before the process starts")
