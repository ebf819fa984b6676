"""`check_blocks`: NaN/Inf in exactly the KV blocks a transfer touched, without modifying the cache.

Each tensor is read by the compiled kernel where it can (CPU tensors, numba installed: memory speed on
scattered blocks, see `kvobs.integrity._kernel`), else by the pure-torch path (GPU tensors, no numba; see
`kvobs.integrity._torch_path`), or by NumPy where torch is not installed (`kvobs.integrity._numpy_path`). All
are exact: a block is NaN if any of its values in any tensor is NaN, else Inf if any is infinite (NaN wins,
so the two lists are disjoint).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvobs.integrity._result import CheckResult

if TYPE_CHECKING:
    import numpy as np

    from kvobs.integrity._layout import ValidatedCache

METHODS = ("auto", "kernel", "torch")


def check_blocks(
    cache: Any, block_ids: Iterable[int] | Any, *, block_dim: int | None = None, method: str = "auto"
) -> CheckResult:
    """Check the given blocks of a paged KV cache for NaN and Inf, without modifying it.

    cache: a `ValidatedCache` (from `validate_cache`: no per-call validation), or anything `validate_cache`
    accepts (a torch or DLPack tensor, lists of them per layer, (key, value) pairs per layer), validated on
    every call. block_dim: the block dimension of a raw cache (default 0); for a validated cache it must be
    None or the one it was validated with. block_ids: any iterable of ints, or an int array (NumPy, torch,
    Paddle); duplicates are checked once; empty -> clean result with 0 blocks. method: "auto" (the kernel
    where it applies, torch elsewhere, NumPy where torch is not installed), "kernel" (ValueError if some
    tensor cannot use it, naming the extra to install where that is why) or "torch" (ValueError without
    torch).
    """
    from kvobs.integrity._layout import validate_cache

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    validated = validate_cache(cache, block_dim=block_dim)
    ids = validated.block_ids(block_ids)
    if not ids.shape[0]:
        return CheckResult(0, (), ())
    nan, bad = _bad_blocks(validated, ids, method)
    return CheckResult(ids.shape[0], tuple(sorted(nan)), tuple(sorted(bad - nan)))


def check_sorted(validated: ValidatedCache, ids: tuple[int, ...]) -> CheckResult | None:
    """The check as the lifecycle runs it, on a validated cache: `ids` are a transfer's validated blocks (Python
    ints, sorted, distinct, non-negative: `Blocks.distinct`), so nothing is converted, sorted or deduplicated
    again, and a small check of a cache the kernel reads whole is one compiled call on this thread. None when
    clean: a result is built only when something was found. IndexError for an id past the cache."""
    joint = validated.joint
    if joint is None or not 0 < len(ids) <= joint.most_ids or ids[-1] >= validated.num_blocks:
        result = check_blocks(validated, ids)
        return None if result.clean else result
    work, found = joint.mark(ids)
    if not found:
        return None
    n = len(ids)
    flags = work[n : 2 * n]
    checked = work[:n]
    return CheckResult(n, tuple(checked[flags == 2].tolist()), tuple(checked[flags == 1].tolist()))


def _bad_blocks(validated: ValidatedCache, ids: np.ndarray, method: str) -> tuple[set[int], set[int]]:
    """(NaN ids, non-finite ids) over all tensors, each read by the method chosen for it."""
    import numpy as np

    import kvobs.integrity._threads as threads

    by_kernel, by_library = validated.split(method)
    nan: set[int] = set()
    bad: set[int] = set()
    if by_kernel:
        flags, found = threads.mark(by_kernel, ids)  # flags: 2 NaN, 1 Inf, 0 clean
        if found:
            nan.update(ids[flags == 2].tolist())
            bad.update(ids[flags != 0].tolist())
    by_numpy = [t for t in by_library if isinstance(t, np.ndarray)]
    by_torch = [t for t in by_library if not isinstance(t, np.ndarray)]
    if by_numpy:
        import kvobs.integrity._numpy_path as numpy_path

        numpy_nan, numpy_bad = numpy_path.bad_blocks(by_numpy, ids.tolist(), validated.block_dim)
        nan |= numpy_nan
        bad |= numpy_bad
    if by_torch:
        import kvobs.integrity._torch_path as torch_path  # imports torch: only for torch tensors

        torch_nan, torch_bad = torch_path.bad_blocks(by_torch, ids.tolist(), validated.block_dim)
        nan |= torch_nan
        bad |= torch_bad
    return nan, bad
