"""The compiled kernel itself; imported (with numba) only by `kvobs.integrity._kernel`, which falls back to
the torch path when this import fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

# Before a run is read, one prefetch per page of the next run (its first AHEAD_BYTES): the address
# translations and first lines of a scattered block are then on their way while the current one is read,
# instead of each page of it stalling the stream in turn. Past AHEAD_BYTES a run is one stream the
# hardware prefetcher follows.
PAGE_BYTES = 4096
AHEAD_BYTES = 128 << 10

_OPTIONS = {"nogil": True, "boundscheck": False, "error_model": "numpy"}


def _jit(fn: Callable[..., Any]) -> Any:
    """Compiled and cached on disk; compiled in memory only when numba finds no writable cache directory."""
    try:
        return numba.njit(cache=True, **_OPTIONS)(fn)
    except RuntimeError:
        return numba.njit(cache=False, **_OPTIONS)(fn)


@intrinsic
def _prefetch(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint that array[index] will be read soon (LLVM's prefetch: never faults, a no-op where unsupported)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        hint = ir.FunctionType(ir.VoidType(), [byte, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=hint)
        read, keep, data_cache = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), byte), read, keep, data_cache])
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


@intrinsic
def _claim(typingctx: Any, counter: Any) -> Any:
    """counter[0] += 1, atomically, returning the value before: threads sharing a check take chunks in turn."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return numba.types.int64(counter), codegen


@intrinsic
def _raise_flag(typingctx: Any, flags: Any, index: Any, value: Any) -> Any:
    """flags[index] = max(flags[index], value), atomically: threads reading different tensors of one cache
    raise the same flags."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        flag = context.cast(builder, args[2], signature.args[2], signature.args[0].dtype)
        builder.atomic_rmw("umax", builder.gep(data, [args[1]]), flag, "monotonic")
        return context.get_dummy_value()

    return numba.types.void(flags, index, value), codegen


@intrinsic
def _words_at(typingctx: Any, address: Any, like: Any) -> Any:
    """A pointer to words of `like`'s dtype at `address` (the memory of a tensor the caller holds)."""
    pointer = numba.types.CPointer(like.dtype)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


@_jit
def _max_key(part, mask, flip, key):  # type: ignore[no-untyped-def]
    """max(key, largest (w & mask) ^ flip over part): the exact verdict, run only on pieces found bad."""
    for i in range(part.shape[0]):
        key = max(key, (part[i] & mask) ^ flip)
    return key


@_jit
def _lane_test(wide, test, acc):  # type: ignore[no-untyped-def]
    """acc | the lane test of every 64-bit word of `wide` (see `kvobs.integrity._bits.LaneTest`).

    The common formats (no XOR, sign ignored) take the 3-operation loop."""
    xor = test[0]
    ones = test[1]
    low = test[2]
    keep = test[3]
    top = test[4]
    if xor == 0 and keep == top:
        for i in range(wide.shape[0]):
            acc |= (wide[i] & ones) + low
    else:
        for i in range(wide.shape[0]):
            y = wide[i] ^ xor
            acc |= ((y & ones) + low) & (y | keep)
    return acc


@_jit
def _run_is_bad(words, start, size, rule, top, acc):  # type: ignore[no-untyped-def]
    """Whether the run words[start : start + size] holds anything non-finite, given the lane-test result
    `acc` of its whole 64-bit words: the values after the last whole word are tested here."""
    if acc & top:
        return True
    whole = size // (8 // words.itemsize) * (8 // words.itemsize)
    mask = rule[0]
    flip = rule[1]
    bad_min = rule[2]
    return whole < size and _max_key(words[start + whole : start + size], mask, flip, mask ^ mask) >= bad_min


@_jit
def _verdicts(words, ids, block_stride, segments, length, first, count, rule, flags):  # type: ignore[no-untyped-def]
    """Read each piece of a bad run value by value: flags[block] = max(itself, 2 for NaN, 1 for Inf)."""
    mask = rule[0]
    flip = rule[1]
    bad_min = rule[2]
    nan_min = rule[3]
    for piece in range(first, first + count):
        segment, j = divmod(piece, ids.shape[0])
        start = segments[segment] + ids[j] * block_stride
        key = _max_key(words[start : start + length], mask, flip, mask ^ mask)
        _raise_flag(flags, j, 2 if key >= nan_min else (1 if key >= bad_min else 0))


@_jit
def _runs(ids, block_stride, segments, length):  # type: ignore[no-untyped-def]
    """(first piece, piece count) of each run: the pieces of consecutive ids that touch in memory.

    Pieces are numbered segment by segment: piece s * len(ids) + j is segment s of block ids[j]."""
    n = ids.shape[0]
    firsts = np.empty(n * segments.shape[0], np.int64)
    counts = np.empty(n * segments.shape[0], np.int64)
    runs = 0
    for segment in range(segments.shape[0]):
        j = 0
        while j < n:
            k = j + 1
            while k < n and (ids[k] - ids[k - 1]) * block_stride == length:
                k += 1
            firsts[runs] = segment * n + j
            counts[runs] = k - j
            runs += 1
            j = k
    return firsts[:runs], counts[:runs]


@_jit
def _prefetch_run(words, start, size):  # type: ignore[no-untyped-def]
    """One prefetch per page of the first AHEAD_BYTES of words[start : start + size]."""
    step = PAGE_BYTES // words.itemsize
    for offset in range(0, min(size, AHEAD_BYTES // words.itemsize), step):
        _prefetch(words, start + offset)


@_jit
def _check_chunk(words, ids, block_stride, segments, length, rule, test, flags, after):  # type: ignore[no-untyped-def]
    """block_flags over one chunk of ids, returning how many runs held something non-finite; `after` is
    where the next chunk starts (-1: none), prefetched while the chunk's last run is read."""
    per_word = 8 // words.itemsize
    top = test[4]
    n = ids.shape[0]
    firsts, counts = _runs(ids, block_stride, segments, length)
    runs = firsts.shape[0]
    bad = 0
    for r in range(runs):
        if r + 1 < runs:
            _prefetch_run(words, segments[firsts[r + 1] // n] + ids[firsts[r + 1] % n] * block_stride,
                          counts[r + 1] * length)
        elif after >= 0:
            _prefetch_run(words, after, length)
        start = segments[firsts[r] // n] + ids[firsts[r] % n] * block_stride
        size = counts[r] * length
        wide = words[start : start + size // per_word * per_word].view(np.uint64)
        if _run_is_bad(words, start, size, rule, top, _lane_test(wide, test, top ^ top)):
            _verdicts(words, ids, block_stride, segments, length, firsts[r], counts[r], rule, flags)
            bad += 1
    return bad


@_jit
def block_flags(words, ids, block_stride, segments, length, rule, test, flags, chunk, counter):  # type: ignore[no-untyped-def]
    """flags[j] = max(itself, 2 if block ids[j] holds a NaN, else 1 if it holds an Inf); returns how many
    runs this call found non-finite values in (0: nothing to look at in flags).

    rule: (mask, flip, bad_min, nan_min) of the format, as words; test: its lane test (`bits.lane_test`).

    Segment s of block b is words[b * block_stride + segments[s] :][:length]. Pieces that touch in memory
    form a run, read as one stream. A lane test over 64-bit words finds whether a run holds anything
    non-finite; only the pieces of such a run are read again, value by value, for the exact verdict.

    The ids are taken `chunk` at a time from the shared `counter` (counter[0], claimed atomically), so
    that threads calling this with the same counter share the work however fast each of them runs: a
    thread that gets no core only leaves more chunks to the others. Each chunk is claimed one ahead, so
    the next chunk's first block is prefetched like any next run. Threads share `flags` too: each raises
    them atomically.
    """
    n = ids.shape[0]
    bad = 0
    lo = _claim(counter) * chunk
    while lo < n:
        hi = min(n, lo + chunk)
        after = _claim(counter) * chunk
        start = segments[0] + ids[after] * block_stride if after < n else -1
        bad += _check_chunk(words, ids[lo:hi], block_stride, segments, length, rule, test, flags[lo:hi], start)
        lo = after
    return bad


@_jit
def cache_flags(addresses, spans, block_strides, first_segments, segments, lengths, rules, tests, chunks, work, n):  # type: ignore[no-untyped-def]
    """block_flags over every tensor of a cache in one call, on one thread; returns how many runs held something
    non-finite (0: nothing to look at in the flags).

    Per tensor p: its words (`spans[p]` of them) start at `addresses[p]`; its segments are
    segments[first_segments[p] : first_segments[p + 1]]; rules[p], tests[p], chunks[p] as in block_flags.
    work: the ids (n, sorted, distinct, in range), then their flags (n, zero), then one counter per tensor (zero).
    """
    ids = work[:n]
    flags = work[n : 2 * n]
    bad = 0
    for p in range(addresses.shape[0]):
        words = numba.carray(_words_at(addresses[p], rules), (spans[p],))
        bad += block_flags(words, ids, block_strides[p], segments[first_segments[p] : first_segments[p + 1]],
                           lengths[p], rules[p], tests[p], flags, chunks[p], work[2 * n + p : 2 * n + p + 1])
    return bad


@_jit
def _distinct_sorted(ids):  # type: ignore[no-untyped-def]
    """Sort ids in place, move the distinct ones to the front and return how many there are."""
    ids.sort()
    count = 0
    for i in range(ids.shape[0]):
        if count == 0 or ids[i] != ids[count - 1]:
            ids[count] = ids[i]
            count += 1
    return count


def ready(word: type) -> Callable[..., int]:
    """block_flags for one word width, compiled (or loaded from the disk cache) once: at validation, not
    inside the first check. Thread-safe (numba compiles under its own lock; a repeat is a no-op).

    Returned is the compiled entry point itself, which skips numba's per-call type dispatch (a large part of a
    small check's time, see docs/benchmarks.md). It trusts its arguments: call it only with arrays of exactly
    the compiled types (`kernel.plan` builds them), never with a caller's own arrays.
    """
    entry = _entries.get(word)
    if entry is not None:
        return entry

    def array(dtype: Any, readonly: bool = True) -> Any:
        return numba.types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C", readonly=readonly)

    count = numba.types.int64
    ints = array(np.int64, readonly=False)  # ints: ids and counter
    flags = array(np.uint8, readonly=False)
    entry = block_flags.compile(
        (array(word), ints, count, array(np.int64), count, array(word), array(np.uint64), flags, count, ints)
    )
    # A first call pages the compiled code in: keep that out of the first check too.
    sample = np.zeros(1, word)
    segments = np.zeros(1, np.int64)
    rule = np.ones(4, word)
    test = np.zeros(5, np.uint64)
    one_id = np.zeros(1, np.int64)
    one_flag = np.zeros(1, np.uint8)
    counter = np.zeros(1, np.int64)
    entry(sample, one_id, 1, segments, 1, rule, test, one_flag, 1, counter)
    _entries[word] = entry
    return entry


def ready_cache(word: type) -> Callable[..., int]:
    """cache_flags for one word width, as a compiled entry point (see `ready`: it trusts its argument types)."""
    entry = _cache_entries.get(word)
    if entry is not None:
        return entry
    ints = numba.types.Array(numba.types.int64, 1, "C")
    table = numba.types.Array(numba.from_dtype(np.dtype(word)), 2, "C")
    tests = numba.types.Array(numba.types.uint64, 2, "C")
    count = numba.types.int64
    entry = cache_flags.compile((ints, ints, ints, ints, ints, ints, table, tests, ints, ints, count))
    one = np.zeros(1, np.int64)
    sample = np.zeros(8, word)  # a first call pages the compiled code in (see `ready`)
    address = np.array([sample.ctypes.data], np.int64)
    rules = np.ones((1, 4), word)
    entry(address, one + 1, one, np.array([0, 1], np.int64), one, one + 1, rules, np.zeros((1, 5), np.uint64),
          one + 1, np.zeros(3, np.int64), 1)
    _cache_entries[word] = entry
    return entry


def distinct_sorted() -> Callable[[np.ndarray], int]:
    """`_distinct_sorted` for a writable int64 array, as a compiled entry point (see `ready`)."""
    global _distinct_entry
    if _distinct_entry is None:
        _distinct_entry = _distinct_sorted.compile((numba.types.Array(numba.types.int64, 1, "C"),))
        _distinct_entry(np.zeros(1, np.int64))
    return _distinct_entry


_entries: dict[type, Callable[..., int]] = {}
_cache_entries: dict[type, Callable[..., int]] = {}
_distinct_entry: Callable[[np.ndarray], int] | None = None
