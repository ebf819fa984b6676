"""The registered KV caches as kvobs checks them: one view per distinct memory, vLLM's blocks along dim 0.

vLLM 0.33 registers one tensor per attention layer, indexed by the block manager's block ids along dim 0, or
by kernel blocks when a manager block is split into several (dim 0 is then a multiple of the block count;
vLLM's own offloading worker views it the same way). Layers of different KV groups may alias one tensor
(hybrid models), so aliases are checked once. Tensors kvobs cannot check (integer storage, e.g. fp8 kept as
uint8) are left out, so a transfer is never refused because of the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvobs.integrations._common import checkable


def checkable_caches(kv_caches: Mapping[str, Any], num_blocks: int) -> tuple[list[Any] | None, list[str]]:
    """(the views kvobs checks, or None when none; the layers left out, with the reason)."""
    views: list[Any] = []
    left_out: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for layer, tensor in kv_caches.items():
        view, reason = _block_view(tensor, num_blocks)
        if view is None:
            left_out.append(f"{layer}: {reason}")
            continue
        alias = (view.data_ptr(), tuple(view.shape), tuple(view.stride()), view.dtype)
        if alias not in seen:
            seen.add(alias)
            views.append(view)
    return (views or None), left_out


def _block_view(tensor: Any, num_blocks: int) -> tuple[Any, str]:
    shape = getattr(tensor, "shape", None)
    if not shape:
        return None, f"not a tensor ({type(tensor).__name__})"
    if shape[0] % num_blocks:
        return None, f"dim 0 ({shape[0]}) is not a multiple of the {num_blocks} KV blocks"
    view = tensor if shape[0] == num_blocks else tensor.unflatten(0, (num_blocks, -1))
    return checkable(view)
