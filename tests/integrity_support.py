"""What the integrity tests share: the dtypes and methods they run on, a check forced onto one path, and a
naive per-block reference to compare with."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvobs.integrity import CheckResult, check_blocks
from kvobs.integrity import _kernel as kernel

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]
METHODS = ["kernel", "torch"]


@contextlib.contextmanager
def forced(method: str):
    """The check runs on exactly this path: the kernel takes every layout (even tiny pieces), torch all."""
    if method != "kernel":
        yield method
        return
    pytest.importorskip("numba")
    assert kernel.unavailable_reason() is None, kernel.unavailable_reason()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "MIN_PIECE_BYTES", 0)
        yield method


def check(cache, ids, method: str, **options) -> CheckResult:
    with forced(method):
        return check_blocks(cache, ids, method=method, **options)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, comparable with torch.equal even when it holds NaN."""
    return t.contiguous().view(torch.uint8)


def naive(tensors: list[torch.Tensor], ids, block_dim: int = 0) -> tuple[set[int], set[int]]:
    """Reference: per block, NaN anywhere -> nan; else any non-finite -> inf."""
    nan, inf = set(), set()
    for b in {int(i) for i in ids}:
        blocks = [t.select(block_dim, b).float() if t.element_size() == 1 else t.select(block_dim, b) for t in tensors]
        if any(x.isnan().any() for x in blocks):
            nan.add(b)
        elif any(not torch.isfinite(x).all() for x in blocks):
            inf.add(b)
    return nan, inf


def expect(result: CheckResult, nan=(), inf=(), checked=None) -> None:
    assert result.nan_block_ids == tuple(sorted(nan))
    assert result.inf_block_ids == tuple(sorted(inf))
    if checked is not None:
        assert result.checked_blocks == checked
