"""The fast CPU path: plans that let one compiled pass read the checked blocks in place.

Why: torch has no reduction over a list of scattered slices, so the pure-torch path pays one reduction
per run of adjacent blocks. The kernel (`kvobs.integrity._kernel_numba`) walks the blocks itself and keeps,
per block, the largest key `(bits & mask) ^ flip` (see `kvobs.integrity._bits`): exact for every format,
NaN and Inf told apart in the same pass, no temporary, no float arithmetic, so it runs at memory speed
whether the blocks are adjacent or scattered. A `CachePlan` puts the plans of every tensor of a cache in tables
one compiled call reads: a small check (a transfer's few blocks) is then one call, not one per tensor.

The kernel needs numba (the `fast` extra). Without it, or when compiling fails, `plan()` returns None
and the caller uses the pure-torch path (the NumPy one where torch is not installed);
`unavailable_reason()` says why. Compiled code is cached on disk where numba finds a writable cache
directory (NUMBA_CACHE_DIR, else next to the module, else the user's cache directory); where none is
writable it is compiled in memory, once per process. The compiled function releases the GIL and holds no
state: concurrent checks from many threads are safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvobs.integrity._bits import NonFiniteBits, lane_test, non_finite_bits

_log = logging.getLogger(__name__)

# A block whose contiguous pieces are shorter than this many bytes would spend more time on bookkeeping
# than on reading; more pieces per block than MAX_PIECES_PER_BLOCK would make the piece list itself large.
MIN_PIECE_BYTES = 64
MAX_PIECES_PER_BLOCK = 4096
# Threads sharing a check take its blocks this many bytes at a time: small enough that a thread slowed by
# a busy core leaves little for the others to wait on, large enough that claiming costs nothing.
CHUNK_BYTES = 512 << 10

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

_build_lock = threading.Lock()
_compiled: Any = None
_unavailable: str | None = None


@dataclass(frozen=True, eq=False)
class KernelPlan:
    """How the kernel reads one tensor's blocks: piece s of block b starts at `b * block_stride +
    segments[s]` in `words` and is `length` words long."""

    words: np.ndarray  # read-only 1-D view of the tensor's memory span as unsigned ints (no copy)
    block_stride: int
    segments: np.ndarray  # int64 offsets of the contiguous pieces of one block, relative to its start
    length: int
    bits: NonFiniteBits
    rule: np.ndarray  # mask, flip, bad_min, nan_min as words (read-only)
    test: np.ndarray  # the lane test over 64-bit words (`bits.lane_test`, read-only)
    block_bytes: int  # bytes read per checked block
    entry: Callable[..., int]  # the compiled kernel for these words (`kernel_numba.ready`)

    def mark(self, ids: np.ndarray, flags: np.ndarray, counter: np.ndarray) -> int:
        """Raise flags[j] to 2 where block ids[j] holds a NaN, else to 1 where it holds an Inf, for the chunks
        of ids this call claims from `counter`; returns how many runs held either (0: flags untouched).

        ids: int64, distinct, in range; flags: uint8, one per id, shared by all the tensors of a cache and
        every thread; counter: one int64, 0 at first, shared by every thread that checks these ids of this
        tensor. All three must be C-contiguous and writable: the entry point trusts its argument types.
        """
        chunk = max(1, CHUNK_BYTES // self.block_bytes)
        layout = (self.block_stride, self.segments, self.length)
        return self.entry(self.words, ids, *layout, self.rule, self.test, flags, chunk, counter)


@dataclass(frozen=True, eq=False)
class CachePlan:
    """The plans of every tensor of a cache, in the tables one compiled call reads them all from
    (`kernel_numba.cache_flags`): a small check is one call, however many tensors the cache has.

    Holds the plans, whose word views hold the tensors' memory: the addresses stay valid while it lives."""

    plans: tuple[KernelPlan, ...]
    addresses: np.ndarray
    spans: np.ndarray
    block_strides: np.ndarray
    first_segments: np.ndarray
    segments: np.ndarray
    lengths: np.ndarray
    rules: np.ndarray
    tests: np.ndarray
    chunks: np.ndarray
    block_bytes: int  # bytes read per checked block, over every tensor
    most_ids: int  # the most ids one thread checks (more: the check is shared by threads, see `_threads`)
    entry: Callable[..., int]  # `kernel_numba.ready_cache` for the tensors' words

    def mark(self, ids: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """(work, found) for sorted distinct in-range ids: work[n : 2n] are the flags of the n ids (2 NaN, 1 Inf,
        0 clean) in every tensor, read on this thread; `found` is 0 when every flag is 0."""
        n = len(ids)
        # One array, built in one call, for everything the kernel writes: per-call NumPy calls are what a check
        # costs most when the CPU caches are cold.
        work = np.array(ids + (0,) * (n + len(self.plans)), dtype=np.int64)
        found = self.entry(self.addresses, self.spans, self.block_strides, self.first_segments, self.segments,
                           self.lengths, self.rules, self.tests, self.chunks, work, n)
        return work, found


def cache_plan(plans: list[KernelPlan], most_bytes: int) -> CachePlan | None:
    """One table for the plans of a cache's tensors, for checks of fewer than `most_bytes`; None where they read
    different word widths (the plans are then called one by one)."""
    if not plans or len({plan.words.dtype for plan in plans}) != 1:
        return None
    word = plans[0].words.dtype.type
    first_segments = np.cumsum([0] + [plan.segments.shape[0] for plan in plans], dtype=np.int64)
    return CachePlan(
        plans=tuple(plans),
        addresses=np.array([plan.words.ctypes.data for plan in plans], dtype=np.int64),
        spans=np.array([plan.words.shape[0] for plan in plans], dtype=np.int64),
        block_strides=np.array([plan.block_stride for plan in plans], dtype=np.int64),
        first_segments=first_segments,
        segments=np.concatenate([plan.segments for plan in plans]),
        lengths=np.array([plan.length for plan in plans], dtype=np.int64),
        rules=np.stack([plan.rule for plan in plans]),
        tests=np.stack([plan.test for plan in plans]),
        chunks=np.array([max(1, CHUNK_BYTES // plan.block_bytes) for plan in plans], dtype=np.int64),
        block_bytes=sum(plan.block_bytes for plan in plans),
        most_ids=(most_bytes - 1) // sum(plan.block_bytes for plan in plans),
        entry=_load().ready_cache(word),
    )


def distinct_sorted(ids: np.ndarray) -> np.ndarray:
    """The distinct values of a writable int64 array, sorted: in place by the kernel when it is loaded."""
    if _compiled is None:
        return np.unique(ids)
    return ids[: _compiled.distinct_sorted()(ids)]


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used in this process (None when it can); loads it on first call."""
    _load()
    return _unavailable


def plan(tensor: Any, block_dim: int) -> KernelPlan | None:
    """A plan for a CPU tensor the kernel can read efficiently; None sends the tensor to the torch path."""
    bits = non_finite_bits(tensor.dtype)
    on_numpy = isinstance(tensor, np.ndarray)
    if (not on_numpy and tensor.device.type != "cpu") or bits is None or _load() is None:
        return None
    strides = _element_strides(tensor) if on_numpy else tensor.stride()
    if strides is None or (tensor.size if on_numpy else tensor.numel()) == 0:
        return None
    shape = tensor.shape
    dims = [k for k in range(tensor.ndim) if k != block_dim and shape[k] != 1]
    length = 1
    while dims and strides[dims[-1]] == length:  # the contiguous tail of a block: one piece
        length *= shape[dims.pop()]
    segments = np.zeros(1, dtype=np.int64)
    for k in dims:  # every other dim multiplies the pieces
        segments = (segments[:, None] + np.arange(shape[k], dtype=np.int64) * strides[k]).reshape(-1)
        if segments.shape[0] > MAX_PIECES_PER_BLOCK:
            return None
    if segments.shape[0] > 1 and length * bits.width < MIN_PIECE_BYTES:
        return None
    segments.flags.writeable = False
    words = _words(tensor, bits.width)
    if words is None:
        return None
    entry = _load().ready(words.dtype.type)
    # and the one-call kernel of small checks (`cache_plan`) for these words: compiled (or loaded from disk)
    # where caches are validated, at an engine's start-up, not in its first transfer
    _load().ready_cache(words.dtype.type)
    rule = np.array((bits.mask, bits.flip, bits.bad_min, bits.nan_min), dtype=words.dtype)
    test = np.array(lane_test(bits), dtype=np.uint64)
    rule.flags.writeable = test.flags.writeable = False
    block_bytes = segments.shape[0] * length * bits.width
    return KernelPlan(words, strides[block_dim], segments, length, bits, rule, test, block_bytes, entry)


def _element_strides(array: np.ndarray) -> tuple[int, ...] | None:
    """A NumPy array's strides in elements, as torch gives them; None where the kernel cannot walk them
    (negative, or not a whole number of elements)."""
    if any(stride < 0 or stride % array.itemsize for stride in array.strides):
        return None
    return tuple(stride // array.itemsize for stride in array.strides)


def _words(tensor: Any, width: int) -> np.ndarray | None:
    """The tensor's memory span, first element to last, as read-only unsigned words (None: not viewable)."""
    if isinstance(tensor, np.ndarray):
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, _element_strides(tensor)))
        as_words = tensor.view(_WORDS[width])  # same item size: a view of the same memory, any strides
        # Non-negative strides: the first element is the lowest address, so the span starts there.
        return np.lib.stride_tricks.as_strided(as_words, (span,), (width,), writeable=False)
    import torch

    try:
        as_ints = tensor.detach().view(getattr(torch, _TORCH_WORDS[width]))
        span = 1 + sum((size - 1) * stride for size, stride in zip(as_ints.shape, as_ints.stride()))
        words = torch.as_strided(as_ints, (span,), (1,), as_ints.storage_offset()).numpy().view(_WORDS[width])
    except (RuntimeError, TypeError, ValueError):  # a tensor numpy cannot see (e.g. a tensor subclass)
        return None
    words.flags.writeable = False  # the kernel is compiled for read-only input: it cannot write the cache
    return words


def _load() -> Any:
    """The kernel module (`kvobs.integrity._kernel_numba`), or None (with the reason kept) when numba is
    missing or fails."""
    global _compiled, _unavailable
    if _compiled is not None or _unavailable is not None:
        return _compiled
    with _build_lock:
        if _compiled is None and _unavailable is None:
            try:
                _compiled = _compile()
            except ModuleNotFoundError as exc:
                if exc.name != "numba":
                    raise
                _unavailable = "numba is not installed: pip install 'kvobs[fast]'"
                _log.info("kvobs integrity kernel unavailable, reading caches without it: %s", _unavailable)
            except Exception as exc:  # noqa: BLE001 - any numba failure means: use the torch path
                _unavailable = f"{type(exc).__name__}: {exc}"
                _log.info("kvobs integrity kernel unavailable, using the torch path: %s", _unavailable)
    return _compiled


def _compile() -> Any:
    import kvobs.integrity._kernel_numba as kernel_numba

    kernel_numba.ready(np.uint16)  # compiles the kernel once: a failure shows here, not inside a check
    kernel_numba.distinct_sorted()
    return kernel_numba
