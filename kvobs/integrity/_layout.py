"""Validate a KV cache once, up front, into the description every later check of it reuses.

Why once: a misconfigured cache (integer dtype, meta or sparse tensors, a wrong block_dim, layers that
disagree) should fail when a guard is set up, before any lock or transfer, not on every call. The
description also carries what the compiled kernel needs per tensor (word views, piece offsets), so a check
of a validated cache does no per-tensor set-up.

Any array that speaks DLPack (PaddlePaddle, NumPy, CuPy, JAX) is taken as a torch tensor over the same
memory, without a copy; where torch is not installed, as a NumPy array (CPU memory only; see
`kvobs.integrity._arrays`).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import kvobs.integrity._kernel as kernel
from kvobs.integrity._arrays import TORCH_EXTRA, device, elements, from_dlpack, installed_torch, is_torch_tensor
from kvobs.integrity._bits import NO_NON_FINITE, non_finite_bits
from kvobs.integrity._ids import id_array

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class ValidatedCache:
    """A cache that passed `validate_cache`: its tensors (as torch views of the caller's memory, in order, or
    NumPy views where torch is not installed), the block dimension and block count they agree on, and per
    tensor how checks read it.

    Holds the tensors (not copies): a cache whose list of layers changes later must be validated again.
    """

    tensors: tuple[torch.Tensor | np.ndarray, ...]
    block_dim: int
    num_blocks: int
    plans: tuple[kernel.KernelPlan | None, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(device(t) for t in self.tensors))

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in self.tensors))

    @property
    def methods(self) -> tuple[str, ...]:
        """Per tensor, how `check_blocks(method="auto")` reads it: "kernel" (compiled, CPU), else "torch", or
        "numpy" where torch is not installed."""
        return tuple(
            "kernel" if p is not None else "numpy" if isinstance(t, np.ndarray) else "torch"
            for t, p in zip(self.tensors, self.plans)
        )

    def split(self, method: str) -> tuple[list[kernel.KernelPlan], list[torch.Tensor | np.ndarray]]:
        """(plans the kernel reads, tensors the torch or NumPy path reads) for a check method; empty tensors
        are in neither. ValueError for method="kernel" where some tensor cannot use it, and for
        method="torch" where torch is not installed."""
        if method == "torch":
            if any(isinstance(t, np.ndarray) for t in self.tensors):
                raise ValueError(f"method='torch' needs torch, which is not installed: {TORCH_EXTRA}")
            return [], [t for t in self.tensors if t.numel()]
        by_kernel, by_library = self._auto_split
        if by_library and method == "kernel":
            reason = kernel.unavailable_reason() or "a GPU tensor, or a layout or dtype the kernel does not read"
            raise ValueError(f"method='kernel' cannot check {len(by_library)} of the cache's tensors: {reason}")
        return by_kernel, by_library

    @functools.cached_property
    def _auto_split(self) -> tuple[list[kernel.KernelPlan], list[torch.Tensor | np.ndarray]]:
        """`split("auto")`, worked out on the first check rather than on every one."""
        pairs = [(t, plan) for t, plan in zip(self.tensors, self.plans) if elements(t)]
        return [plan for _, plan in pairs if plan is not None], [t for t, plan in pairs if plan is None]

    @functools.cached_property
    def joint(self) -> kernel.CachePlan | None:
        """The kernel's table of every tensor, read in one call by small checks (`_check.check_sorted`); None
        where some tensor is read by torch or NumPy, or the tensors' word widths differ."""
        import kvobs.integrity._threads as threads

        by_kernel, by_library = self._auto_split
        if by_library:
            return None
        return kernel.cache_plan(by_kernel, most_bytes=2 * threads.MIN_BYTES_PER_THREAD)

    def block_ids(self, block_ids: Any) -> np.ndarray:
        """The ids, sorted and distinct (int64); TypeError for non-integers, IndexError for ids beyond the
        cache."""
        return id_array(block_ids, self.num_blocks)

    def __repr__(self) -> str:
        return (
            f"ValidatedCache({len(self.tensors)} tensors, num_blocks={self.num_blocks}, "
            f"block_dim={self.block_dim}, devices={self.devices}, dtypes={self.dtypes}, "
            f"methods={tuple(dict.fromkeys(self.methods))})"
        )


def validate_cache(cache: Any, *, block_dim: int | None = None) -> ValidatedCache:
    """Validate a KV cache for NaN/Inf checks, once; pass the result to `check_blocks` instead of the cache.

    cache: a tensor (torch, or any DLPack array: Paddle, NumPy, CuPy), or nested lists/tuples of them (one
    per layer, or (key, value) pairs per layer). Every tensor must be a strided floating-point tensor with
    data (not meta, not sparse) and the same number of blocks along `block_dim` (default 0). Without torch
    installed, only CPU memory in dtypes NumPy knows can be read (TypeError naming the extra otherwise).
    Raises TypeError or ValueError naming the problem. Also compiles the fast kernel if it is not yet.
    A `ValidatedCache` is returned as it is (block_dim, if given, must be the one it was validated with).
    """
    if isinstance(cache, ValidatedCache):
        if block_dim is not None and operator.index(block_dim) != cache.block_dim:
            raise ValueError(f"cache was validated with block_dim={cache.block_dim}, not {block_dim}")
        return cache
    block_dim = 0 if block_dim is None else operator.index(block_dim)
    tensors = tuple(_flatten(cache, "cache", installed_torch() is not None))
    if not tensors:
        raise ValueError("cache holds no tensors: nothing to check")
    counts: dict[int, str] = {}
    for where, t in tensors:
        _validate_tensor(t, where, block_dim)
        counts.setdefault(t.shape[block_dim], where)
    if len(counts) > 1:
        shown = ", ".join(f"{n} in {where}" for n, where in counts.items())
        raise ValueError(f"tensors disagree on the number of blocks along dim {block_dim}: {shown}")
    plans = tuple(kernel.plan(t, block_dim % t.ndim) for _, t in tensors)
    return ValidatedCache(tuple(t for _, t in tensors), block_dim, next(iter(counts)), plans)


def _flatten(cache: Any, where: str, with_torch: bool) -> list[tuple[str, Any]]:
    """(where, tensor) for every tensor in nested lists/tuples; DLPack arrays become torch views, or NumPy
    views where torch is not installed (a NumPy array is then kept as it is)."""
    if is_torch_tensor(cache) or (not with_torch and isinstance(cache, np.ndarray)):
        return [(where, cache)]
    if isinstance(cache, (list, tuple)):
        return [pair for i, item in enumerate(cache) for pair in _flatten(item, f"{where}[{i}]", with_torch)]
    if hasattr(cache, "__dlpack__"):
        return [(where, from_dlpack(cache, where))]
    raise TypeError(
        f"{where} must be a tensor (torch, or any DLPack array such as Paddle, NumPy or CuPy) or a list/tuple "
        f"of them or of (key, value) pairs, got {type(cache).__name__}"
    )


def _validate_tensor(t: Any, where: str, block_dim: int) -> None:
    if is_torch_tensor(t):
        torch = installed_torch()
        if t.layout != torch.strided:
            raise TypeError(f"{where} is a {t.layout} tensor: only dense (strided) KV caches can be checked")
        if t.device.type == "meta":
            raise ValueError(f"{where} is on the meta device: it holds no data to check")
    name = str(t.dtype).removeprefix("torch.")
    if name in NO_NON_FINITE:
        raise TypeError(
            f"{where} is {name}, which cannot encode NaN or Inf: there is nothing to check "
            "(turn the integrity check off for this cache)"
        )
    if non_finite_bits(t.dtype) is None:
        raise TypeError(
            f"cannot check a {name} tensor ({where}) for NaN/Inf: only floating-point KV caches "
            "(fp16, bf16, fp32, fp64, fp8) can hold non-finite values"
        )
    if not -t.ndim <= block_dim < t.ndim:
        raise ValueError(f"block_dim {block_dim} out of range for {where} of shape {tuple(t.shape)}")
