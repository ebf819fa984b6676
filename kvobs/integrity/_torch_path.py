"""The pure-torch path: any device, any layout; used where the compiled kernel is unavailable or declines.

Why min and max: `isfinite(t).all()` materialises a bool per element and `t.sum()` is no check at all (a
large finite fp16 tensor sums to inf). NaN propagates through min and max and an Inf shows up as an
extreme, so a slab of blocks is finite iff its min and max are.

1. The sorted distinct ids are coalesced into runs of consecutive ids, each read in place, never gathered:
   as slices of one flat view where the blocks are contiguous in memory, else as a `narrow` view along the
   block dimension (any strides).
2. One pass: `aminmax` over each view, all results stacked into one small tensor and read back with ONE
   host synchronisation per device. A clean check ends here.
3. Only when some run is not finite: a second pass over the bad runs alone reduces each block to its min
   and max, to name the bad blocks. Corruption is rare; clean checks never pay for localisation.

fp8 formats have no min/max kernels in torch, so each run is upcast (fp16 holds every value of the fp8
formats with a sign, fp32 every value of the exponent-only e8m0) in chunks of at most
`FP8_CHUNK_ELEMENTS` elements, to bound the temporary memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvobs.integrity._ids import runs as coalesce

FP8_CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements: a 32 MiB fp16 temporary per chunk

_UPCAST = {
    getattr(torch, name): wide
    for name, wide in (
        ("float8_e4m3fn", torch.float16),
        ("float8_e5m2", torch.float16),
        ("float8_e4m3fnuz", torch.float16),
        ("float8_e5m2fnuz", torch.float16),
        ("float8_e8m0fnu", torch.float32),
    )
    if hasattr(torch, name)
}


def bad_blocks(tensors: Sequence[torch.Tensor], ids: list[int], block_dim: int) -> tuple[set[int], set[int]]:
    """(NaN block ids, non-finite block ids) among `ids` (sorted, distinct, in range) of these tensors."""
    runs = coalesce(ids)
    by_device: dict[Any, tuple[list[torch.Tensor], list[int], list[tuple[torch.Tensor, int, int]]]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        stats, owner, chunks = by_device.setdefault(t.device, ([], [], []))
        for start, length, views in _views(t, runs, block_dim % t.dim()):
            for view in views:
                stats.extend(view.aminmax())
            owner.extend([len(chunks)] * len(views))
            chunks.append((t, start, length))
    bad_chunks: list[tuple[torch.Tensor, int, int]] = []
    for stats, owner, chunks in by_device.values():
        finite = torch.stack(stats).isfinite().view(-1, 2).all(1).tolist()
        bad = sorted({owner[i] for i, ok in enumerate(finite) if not ok})
        bad_chunks.extend(chunks[i] for i in bad)
    if not bad_chunks:
        return set(), set()
    return _localize(bad_chunks, block_dim)


def _localize(bad_chunks: list[tuple[torch.Tensor, int, int]], block_dim: int) -> tuple[set[int], set[int]]:
    """Second pass over the bad chunks only: per-block min/max names the bad blocks."""
    flags: dict[Any, tuple[list[torch.Tensor], list[tuple[int, int]]]] = {}
    for t, start, length in bad_chunks:
        slab = _readable(t.narrow(block_dim % t.dim(), start, length)).movedim(block_dim % t.dim(), 0)
        slab = slab.unsqueeze(-1)
        dims = tuple(range(1, slab.dim()))
        lo = slab.amin(dim=dims)
        hi = slab.amax(dim=dims)
        nan = lo.isnan() | hi.isnan()
        bad = ~(lo.isfinite() & hi.isfinite())
        parts, spans = flags.setdefault(t.device, ([], []))
        parts.append(torch.stack((nan, bad)))
        spans.append((start, length))
    nan_ids: set[int] = set()
    bad_ids: set[int] = set()
    for parts, spans in flags.values():
        nan_rows, bad_rows = torch.cat(parts, dim=1).tolist()
        offsets = (start + i for start, length in spans for i in range(length))
        for block, is_nan, is_bad in zip(offsets, nan_rows, bad_rows):
            if is_nan:
                nan_ids.add(block)
            if is_bad:
                bad_ids.add(block)
    return nan_ids, bad_ids


def _views(t: torch.Tensor, runs: list[tuple[int, int]], block_dim: int) -> list[tuple[int, int, Sequence[Any]]]:
    """(start, length, views covering those blocks) per run (or fp8 chunk of a run); no copy but fp8 upcasts.

    A contiguous tensor is seen as [outer, blocks, inner]: a run is then `outer` contiguous segments of one
    flat view, all cut in a single `tensor_split` call (one C++ loop instead of a Python slice per run); each
    segment is one reduction, which torch parallelises over its intra-op threads. Other tensors, and fp8
    chunks, get one `narrow` view per run.
    """
    num_blocks = t.shape[block_dim]
    inner = math.prod(t.shape[block_dim + 1 :])
    if t.dtype in _UPCAST or not t.is_contiguous():
        return [
            (start, length, [_readable(t.narrow(block_dim, start, length))])
            for start, length in _chunks(t, runs, t.numel() // num_blocks)
        ]
    flat = t.view(-1)
    bounds: list[int] = []
    for base in range(0, flat.numel(), num_blocks * inner):
        for start, length in runs:
            bounds += (base + start * inner, base + (start + length) * inner)
    pieces = flat.tensor_split(bounds)[1::2]
    return [(start, length, pieces[r :: len(runs)]) for r, (start, length) in enumerate(runs)]


def _chunks(t: torch.Tensor, runs: list[tuple[int, int]], per_block: int) -> list[tuple[int, int]]:
    """The runs, split for fp8 so that each upcast temporary stays bounded."""
    if t.dtype not in _UPCAST:
        return runs
    cap = max(1, FP8_CHUNK_ELEMENTS // per_block)
    return [(s + i, min(cap, n - i)) for s, n in runs for i in range(0, n, cap)]


def _readable(view: torch.Tensor) -> torch.Tensor:
    """The view itself, or its exact upcast for fp8 (torch has no fp8 min/max)."""
    wide = _UPCAST.get(view.dtype)
    return view if wide is None else view.to(wide)
