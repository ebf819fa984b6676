"""NaN/Inf checks over exactly the KV blocks a transfer touched, at memory speed.

Why this shape: `isfinite(t).all()` materialises a bool per element and runs at ~2% of memory speed, and
`t.sum()` is no check at all (a large finite fp16 tensor sums to inf). Min and max are: NaN propagates through
them and an Inf shows up as an extreme, so a slab of blocks is finite iff its min and max are.

Algorithm of `check_blocks`:

1. Sort and de-duplicate the block ids and coalesce them into runs of consecutive ids. Each run is read in
   place, never gathered: as slices of one flat view where the blocks are contiguous in memory, else as a
   `narrow` view along the block dimension (any strides).
2. Fast path, one pass: `aminmax` over each view, all results stacked into one small tensor and read back
   with ONE host synchronisation per device. A clean check ends here.
3. Only when some run is not finite: a second pass over the bad runs alone reduces each block to its min and
   max (`amin`/`amax` over the non-block dims) and reads them back with one more synchronisation, to name the
   bad blocks. Corruption is rare; clean checks never pay for localisation.

Pass block ids on the host (a list, or a CPU tensor): ids on a GPU cost a synchronisation of their own.

Choices:
- A block with both NaN and Inf (in one tensor, or NaN in the keys and Inf in the values) is reported as NaN:
  NaN wins, so `nan_block_ids` and `inf_block_ids` are disjoint.
- Duplicate block ids are checked once; `checked_blocks` counts distinct ids.
- fp16, bf16, fp32 and fp64 are reduced natively. fp8 (e4m3fn, e5m2 and their fnuz variants) has no min/max
  kernels in torch, so each run is upcast to fp16 (exact for every fp8 value, NaN and Inf included) in chunks
  of at most `_FP8_CHUNK_ELEMENTS` elements to bound the temporary memory; fp8 checks are therefore slower.
- Integer, bool and complex tensors have nothing to check (or no order): TypeError.
- The cache is never modified; only reductions (and, for fp8, upcast copies) read it.
- torch's global thread settings are left alone.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvobs.errors import CorruptKVError
from kvobs.policy import POLICIES, IntegrityPolicy, Sampler
from kvobs.semconv import CHECK_CLEAN, CHECK_INF, CHECK_NAN

if TYPE_CHECKING:
    import torch

__all__ = [
    "POLICIES",
    "CheckResult",
    "CorruptKVError",
    "IntegrityPolicy",
    "Sampler",
    "check_blocks",
]

_FP8_CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements: a 32 MiB fp16 temporary per chunk


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: how many distinct blocks were checked and which were bad (NaN wins over Inf)."""

    checked_blocks: int
    nan_block_ids: tuple[int, ...]
    inf_block_ids: tuple[int, ...]

    @property
    def clean(self) -> bool:
        return not self.nan_block_ids and not self.inf_block_ids

    @property
    def bad_block_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.nan_block_ids + self.inf_block_ids))

    @property
    def result(self) -> str:
        if self.nan_block_ids:
            return CHECK_NAN
        return CHECK_INF if self.inf_block_ids else CHECK_CLEAN


def check_blocks(cache: Any, block_ids: Iterable[int], *, block_dim: int = 0) -> CheckResult:
    """Check the given blocks of a paged KV cache for NaN and Inf, without modifying it.

    cache: a torch.Tensor, or a sequence of tensors (e.g. one per layer), or a sequence of (key, value) pairs
    per layer. Every tensor must have the same number of blocks along `block_dim`. block_ids: any iterable of
    ints (list, tuple, numpy array, 1-D int tensor). Duplicates allowed (checked once). Empty -> clean result
    with 0 blocks.
    """
    import torch

    block_dim = operator.index(block_dim)
    tensors = _flatten(cache)
    num_blocks = _validate_tensors(tensors, block_dim)
    ids = _normalize_ids(block_ids, num_blocks)
    if not ids:
        return CheckResult(0, (), ())
    runs = _coalesce(ids)

    # Fast path: aminmax over views covering each (tensor, chunk of a run); one readback per device.
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
        return CheckResult(len(ids), (), ())
    return _localize(bad_chunks, block_dim, len(ids))


def _localize(bad_chunks: list[tuple[Any, int, int]], block_dim: int, checked: int) -> CheckResult:
    """Second pass over the bad chunks only: per-block min/max names the bad blocks, NaN winning over Inf."""
    import torch

    flags: dict[Any, tuple[list[torch.Tensor], list[tuple[int, int]]]] = {}
    for t, start, length in bad_chunks:
        slab = _readable(t.narrow(block_dim, start, length)).movedim(block_dim, 0).unsqueeze(-1)
        dims = tuple(range(1, slab.dim()))
        lo, hi = slab.amin(dim=dims), slab.amax(dim=dims)
        nan = lo.isnan() | hi.isnan()
        bad = ~(lo.isfinite() & hi.isfinite())
        parts, spans = flags.setdefault(t.device, ([], []))
        parts.append(torch.stack((nan, bad)))
        spans.append((start, length))
    nan_ids: set[int] = set()
    inf_ids: set[int] = set()
    for parts, spans in flags.values():
        nan_rows, bad_rows = torch.cat(parts, dim=1).tolist()
        offsets = (start + i for start, length in spans for i in range(length))
        for block, is_nan, is_bad in zip(offsets, nan_rows, bad_rows):
            if is_bad:
                (nan_ids if is_nan else inf_ids).add(block)
    inf_ids -= nan_ids
    return CheckResult(checked, tuple(sorted(nan_ids)), tuple(sorted(inf_ids)))


def _views(t: Any, runs: list[tuple[int, int]], block_dim: int) -> list[tuple[int, int, Sequence[Any]]]:
    """(start, length, views covering those blocks) per run (or fp8 chunk of a run); no copy except fp8 upcasts.

    A contiguous tensor is seen as [outer, blocks, inner]: a run is then `outer` contiguous segments of one
    flat view, all cut in a single `tensor_split` call (one C++ loop instead of a Python slice per run); each
    segment is one reduction, which torch parallelises over its intra-op threads. Other tensors, and fp8
    chunks, get one `narrow` view per run. (On an oversubscribed CPU torch's parallel regions can stall
    waiting for a descheduled thread: a check then slows down, it never goes wrong.)
    """
    num_blocks = t.shape[block_dim]
    inner = math.prod(t.shape[block_dim + 1 :])
    if t.dtype in _fp8_dtypes() or not t.is_contiguous():
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


def _chunks(t: Any, runs: list[tuple[int, int]], per_block: int) -> list[tuple[int, int]]:
    """The runs, split for fp8 so that each upcast temporary stays bounded."""
    if t.dtype not in _fp8_dtypes():
        return runs
    cap = max(1, _FP8_CHUNK_ELEMENTS // per_block)
    return [(s + i, min(cap, n - i)) for s, n in runs for i in range(0, n, cap)]


def _readable(view: Any) -> Any:
    """The view itself, or its fp16 upcast for fp8 (torch has no fp8 min/max; fp16 holds every fp8 value)."""
    import torch

    return view.to(torch.float16) if view.dtype in _fp8_dtypes() else view


def _coalesce(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids -> (start, length) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    start = prev = ids[0]
    for i in ids[1:]:
        if i != prev + 1:
            runs.append((start, prev - start + 1))
            start = i
        prev = i
    runs.append((start, prev - start + 1))
    return runs


def _flatten(cache: Any) -> list[Any]:
    """A tensor, or arbitrarily nested lists/tuples of tensors (layers, (key, value) pairs) -> flat list."""
    import torch

    if isinstance(cache, torch.Tensor):
        return [cache]
    if not isinstance(cache, (list, tuple)):
        raise TypeError(
            f"cache must be a torch.Tensor or a list/tuple of tensors or (key, value) pairs, "
            f"got {type(cache).__name__}"
        )
    tensors = [t for item in cache for t in _flatten(item)]
    if not tensors:
        raise ValueError("cache holds no tensors")
    return tensors


@functools.cache
def _fp8_dtypes() -> frozenset[Any]:
    import torch

    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


def _validate_tensors(tensors: list[Any], block_dim: int) -> int:
    """Check dtypes, block_dim and equal block counts; return the block count."""
    counts = set()
    for t in tensors:
        if not (t.is_floating_point() or t.dtype in _fp8_dtypes()):
            raise TypeError(
                f"cannot check a {t.dtype} tensor for NaN/Inf: only floating-point KV caches "
                f"(fp16, bf16, fp32, fp64, fp8) can hold non-finite values"
            )
        if not -t.dim() <= block_dim < t.dim():
            raise ValueError(f"block_dim {block_dim} out of range for a tensor of shape {tuple(t.shape)}")
        counts.add(t.shape[block_dim])
    if len(counts) > 1:
        raise ValueError(f"tensors disagree on the number of blocks along dim {block_dim}: {sorted(counts)}")
    return counts.pop()


def _normalize_ids(block_ids: Iterable[int], num_blocks: int) -> list[int]:
    """Any iterable of ints (list, numpy array, int tensor) -> sorted distinct ids, validated."""
    import torch

    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise TypeError(f"block ids must be integers, got a {block_ids.dtype} tensor")
        raw: Iterable[Any] = block_ids.reshape(-1).tolist()
    elif hasattr(block_ids, "dtype") and hasattr(block_ids, "tolist"):  # numpy array
        if block_ids.dtype.kind not in "iu":
            raise TypeError(f"block ids must be integers, got a {block_ids.dtype} array")
        raw = block_ids.reshape(-1).tolist()
    else:
        raw = block_ids
    ids = set()
    for i in raw:
        if isinstance(i, bool):
            raise TypeError(f"block ids must be integers, got {i!r}")
        try:
            ids.add(operator.index(i))
        except TypeError:
            raise TypeError(f"block ids must be integers, got {i!r} ({type(i).__name__})") from None
    ordered = sorted(ids)
    for i in ordered[:1] + ordered[-1:]:
        if not 0 <= i < num_blocks:
            raise IndexError(f"block id {i} out of range: the cache has {num_blocks} blocks")
    return ordered
