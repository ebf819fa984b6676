"""kvobs.integrity: NaN/Inf checks over exactly the KV blocks a transfer touched, at memory speed.

`validate_cache` once (a clear error for a cache that cannot be checked), then `check_blocks` per transfer.
Importing this package does not import torch, NumPy or numba; the first check does (torch only where it
is installed: without it, NumPy reads CPU caches).
"""

from kvobs.errors import CorruptKVError
from kvobs.integrity._check import check_blocks
from kvobs.integrity._result import CheckResult
from kvobs.policy import POLICIES, IntegrityPolicy, Sampler

__all__ = [
    "POLICIES",
    "CheckResult",
    "CorruptKVError",
    "IntegrityPolicy",
    "Sampler",
    "ValidatedCache",
    "check_blocks",
    "validate_cache",
]


def __getattr__(name: str) -> object:
    """`validate_cache` and `ValidatedCache` import NumPy (and torch where installed): imported on first use."""
    if name in ("validate_cache", "ValidatedCache"):
        from kvobs.integrity import _layout as layout

        return getattr(layout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

