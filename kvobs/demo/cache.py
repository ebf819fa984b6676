"""The paged KV cache: one torch CPU tensor of blocks, [num_blocks, block_size, heads, head_dim].

Layers are not a tensor dimension here: one block stands for the KV of all layers of its tokens, which keeps
each run small and fast. Block contents are written by the forward pass (real values derived from the
block's storage key), by prefetches (copies from the storage cache) and, on allocation, by the
"uninitialised" fill: a real engine hands out `torch.empty`-like memory holding whatever was there; the
simulation makes that explicit and visible by filling NaN.
"""

from __future__ import annotations

import hashlib

import torch


class PagedKVCache:
    """Blocks of KV values; `data[block_id]` is one block. No locking: the engine decides who may touch what."""

    def __init__(
        self,
        num_blocks: int = 256,
        block_size: int = 16,
        heads: int = 4,
        head_dim: int = 32,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        self.block_shape = (block_size, heads, head_dim)
        self.dtype = dtype
        self.data = torch.zeros((num_blocks, *self.block_shape), dtype=dtype)
        self.block_bytes = self.data[0].numel() * self.data.element_size()

    def mark_uninitialised(self, block_ids: list[int]) -> None:
        """What a fresh allocation holds, modelled explicitly as NaN (a real engine's memory is just garbage)."""
        if block_ids:
            self.data[block_ids] = float("nan")

    def compute_block(self, block_id: int, key: str, context_ids: list[int]) -> None:
        """The forward pass writes one block: values derived from its key, attending over `context_ids`.

        Attention reads every earlier block of the sequence; a NaN anywhere in that context makes the
        output NaN, exactly as a real softmax over a NaN score would. The values themselves only depend on
        the key (the context enters multiplied by zero), so a clean recompute reproduces them bit for bit.
        """
        values = key_values(key, self.block_shape, self.dtype)
        if context_ids:
            ctx = self.data[context_ids].float().mean()
            values = values + (ctx * 0.0).to(self.dtype)
        self.data[block_id].copy_(values)


_VALUES_CACHE: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def key_values(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The deterministic KV values of the block a storage key names (memoised: keys repeat a lot)."""
    cached = _VALUES_CACHE.get((key, shape))
    if cached is None:
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)
        gen = torch.Generator().manual_seed(seed)
        cached = torch.randn(shape, generator=gen).to(dtype)
        if len(_VALUES_CACHE) >= 4096:  # suffix keys are unique: bound the memo (4 KiB each)
            _VALUES_CACHE.clear()
        _VALUES_CACHE[(key, shape)] = cached
    return cached


def nan_blocks(tensor: torch.Tensor) -> int:
    """How many blocks along dim 0 hold a NaN or Inf: the simulation's own ground truth, independent of kvobs."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return 0
    flat = tensor.reshape(tensor.shape[0], -1)
    return int((~torch.isfinite(flat)).any(dim=1).sum())
