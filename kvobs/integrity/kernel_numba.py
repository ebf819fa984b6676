"""The compiled kernel itself; imported (with numba) only by `kvobs.integrity.kernel`, which falls back to
the torch path when this import fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

CHUNK = 1024  # words per step of the two interleaved streams

_OPTIONS = {"nogil": True, "boundscheck": False, "error_model": "numpy"}


def _jit(fn: Callable[..., Any]) -> Any:
    """Compiled and cached on disk; compiled in memory only when numba finds no writable cache directory."""
    try:
        return numba.njit(cache=True, **_OPTIONS)(fn)
    except RuntimeError:
        return numba.njit(cache=False, **_OPTIONS)(fn)


@_jit
def _max_key(part, mask, flip, key):  # type: ignore[no-untyped-def]
    """max(key, largest (w & mask) ^ flip over part); the XOR-free loop for the formats that need none."""
    if flip == 0:
        for i in range(part.shape[0]):
            key = max(key, part[i] & mask)
    else:
        for i in range(part.shape[0]):
            key = max(key, (part[i] & mask) ^ flip)
    return key


@_jit
def block_flags(words, starts, owners, length, mask, flip, bad_min, nan_min, flags):  # type: ignore[no-untyped-def]
    """flags[owners[p]] = max(itself, 2 if piece p's largest key is >= nan_min, else 1 if it is >= bad_min).

    Piece p is words[starts[p] : starts[p] + length]. Pieces go two at a time, interleaved chunk by chunk:
    two memory streams in flight hide the cost of starting a new stream at every scattered block.
    """
    n = starts.shape[0]
    for p in range(0, n, 2):
        q = min(p + 1, n - 1)  # an odd last piece is paired with itself and read once
        key_p = mask ^ mask
        key_q = key_p
        for c in range(0, length, CHUNK):
            end = min(length, c + CHUNK)
            key_p = _max_key(words[starts[p] + c : starts[p] + end], mask, flip, key_p)
            if q != p:
                key_q = _max_key(words[starts[q] + c : starts[q] + end], mask, flip, key_q)
        for owner, key in ((owners[p], key_p), (owners[q], key_q)):
            flag = 2 if key >= nan_min else (1 if key >= bad_min else 0)
            if flag > flags[owner]:
                flags[owner] = flag


def ready(word: type) -> None:
    """Compile (or load from the disk cache) the kernel for one word width, once: at validation, not inside
    the first check. Thread-safe (numba compiles under its own lock; a repeat is a no-op)."""
    if word in _ready:
        return
    index = numba.types.Array(numba.types.int64, 1, "C")
    scalar = numba.from_dtype(np.dtype(word))
    words = numba.types.Array(scalar, 1, "C", readonly=True)
    flags = numba.types.Array(numba.types.uint8, 1, "C")
    block_flags.compile((words, index, index, numba.types.int64, scalar, scalar, scalar, scalar, flags))
    sample = np.zeros(1, dtype=word)
    sample.flags.writeable = False  # the first call also resolves the argument types: keep it out of checks
    zero, one = word(0), word(1)
    block_flags(sample, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, zero, zero, one, one, np.zeros(1, np.uint8))
    _ready.add(word)


_ready: set[type] = set()
