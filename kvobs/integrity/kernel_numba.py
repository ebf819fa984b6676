"""The compiled kernel itself; imported (with numba) only by `kvobs.integrity.kernel`, which falls back to
the torch path when this import fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

CHUNK = 2048  # 64-bit words per step of the two interleaved streams

_OPTIONS = {"nogil": True, "boundscheck": False, "error_model": "numpy"}


def _jit(fn: Callable[..., Any]) -> Any:
    """Compiled and cached on disk; compiled in memory only when numba finds no writable cache directory."""
    try:
        return numba.njit(cache=True, **_OPTIONS)(fn)
    except RuntimeError:
        return numba.njit(cache=False, **_OPTIONS)(fn)


@_jit
def _max_key(part, mask, flip, key):  # type: ignore[no-untyped-def]
    """max(key, largest (w & mask) ^ flip over part): the exact verdict, run only on pieces found bad."""
    for i in range(part.shape[0]):
        key = max(key, (part[i] & mask) ^ flip)
    return key


@_jit
def _lane_test(wide, test, acc):  # type: ignore[no-untyped-def]
    """acc | the lane test of every 64-bit word of `wide` (see `kvobs.integrity.bits.LaneTest`).

    The common formats (no XOR, sign ignored) take the 3-operation loop."""
    xor, ones, low, keep, top = test[0], test[1], test[2], test[3], test[4]
    if xor == 0 and keep == top:
        for i in range(wide.shape[0]):
            acc |= (wide[i] & ones) + low
    else:
        for i in range(wide.shape[0]):
            y = wide[i] ^ xor
            acc |= ((y & ones) + low) & (y | keep)
    return acc


@_jit
def _tail_is_bad(words, start, length, whole, mask, flip, test):  # type: ignore[no-untyped-def]
    """Whether the values of a piece after its last whole 64-bit word hold anything non-finite."""
    return _max_key(words[start + whole : start + length], mask, flip, mask ^ mask) >= test[5]


@_jit
def block_flags(words, starts, owners, length, mask, flip, bad_min, nan_min, test, flags):  # type: ignore[no-untyped-def]
    """flags[owners[p]] = max(itself, 2 if piece p holds a NaN, else 1 if it holds an Inf).

    Piece p is words[starts[p] : starts[p] + length]. A lane test over 64-bit words finds whether a piece
    holds anything non-finite; only such a piece is read again, value by value, for the exact verdict.
    Pieces go two at a time, interleaved chunk by chunk: two memory streams in flight hide the cost of
    starting a new stream at every scattered block.
    """
    per_word = 8 // words.itemsize
    whole = length // per_word * per_word  # values in whole 64-bit words
    top = test[4]
    n = starts.shape[0]
    for p in range(0, n, 2):
        q = min(p + 1, n - 1)  # an odd last piece is paired with itself and read once
        wide_p = words[starts[p] : starts[p] + whole].view(np.uint64)
        wide_q = words[starts[q] : starts[q] + whole].view(np.uint64)
        acc_p = top ^ top
        acc_q = acc_p
        for begin in range(0, wide_p.shape[0], CHUNK):
            end = min(wide_p.shape[0], begin + CHUNK)
            acc_p = _lane_test(wide_p[begin:end], test, acc_p)
            if q != p:
                acc_q = _lane_test(wide_q[begin:end], test, acc_q)
        for piece, acc in ((p, acc_p), (q, acc_q)):
            if acc & top or (whole < length and _tail_is_bad(words, starts[piece], length, whole, mask, flip, test)):
                key = _max_key(words[starts[piece] : starts[piece] + length], mask, flip, mask ^ mask)
                flag = 2 if key >= nan_min else (1 if key >= bad_min else 0)
                if flag > flags[owners[piece]]:
                    flags[owners[piece]] = flag


def ready(word: type) -> None:
    """Compile (or load from the disk cache) the kernel for one word width, once: at validation, not inside
    the first check. Thread-safe (numba compiles under its own lock; a repeat is a no-op)."""
    if word in _ready:
        return
    index = numba.types.Array(numba.types.int64, 1, "C")
    scalar = numba.from_dtype(np.dtype(word))
    words = numba.types.Array(scalar, 1, "C", readonly=True)
    flags = numba.types.Array(numba.types.uint8, 1, "C")
    test = numba.types.Array(numba.types.uint64, 1, "C", readonly=True)
    block_flags.compile((words, index, index, numba.types.int64, scalar, scalar, scalar, scalar, test, flags))
    sample = np.zeros(1, dtype=word)
    sample.flags.writeable = False  # the first call also resolves the argument types: keep it out of checks
    zero, one = word(0), word(1)
    lanes = np.zeros(6, np.uint64)
    lanes.flags.writeable = False
    block_flags(sample, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, zero, zero, one, one, lanes, np.zeros(1, np.uint8))
    _ready.add(word)


_ready: set[type] = set()
