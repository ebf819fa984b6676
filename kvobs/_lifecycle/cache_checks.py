"""The integrity checks as the lifecycle uses them: a cache validated once, before any lock, then checked.

A misconfigured cache (an integer or meta tensor, a wrong `block_dim`, ids past its end) must fail at the
first call that names it, as a TransferRejected before the lock is taken, not under the lock on every call
after a prefetch already ran. The caches seen recently are remembered by identity (a few hundred: one per
layer of a model whose sends go layer by layer), so each validates once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvobs.errors import TransferRejected
from kvobs.integrity._check import check_sorted  # imports nothing heavy: NumPy and torch load with a cache


class CacheCheck:
    """Validates caches for one observer and runs the NaN/Inf check on validated ones."""

    def __init__(self, block_dim: int, remembered: int = 256) -> None:
        self.block_dim = block_dim
        self._remembered = remembered
        self._seen: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # id(cache) -> (cache, validated)

    def inspect(self, path: str, cache: Any, blocks: Any = None) -> Any:
        """The layout of `cache` (with `num_blocks`), checked to hold `blocks` (a validation.Blocks or None);
        TransferRejected naming the problem."""
        layout = self._layout(path, cache)
        if blocks is not None and blocks.distinct and blocks.distinct[-1] >= layout.num_blocks:
            raise TransferRejected(
                path, f"block id {blocks.distinct[-1]} is out of range for a cache of {layout.num_blocks} blocks"
            )
        return layout

    def _layout(self, path: str, cache: Any) -> Any:
        seen = self._seen.get(id(cache))
        if seen is not None and seen[0] is cache:  # the cache is held here, so its id cannot be reused
            return seen[1]
        from kvobs.integrity import validate_cache

        try:
            layout = validate_cache(cache, block_dim=self.block_dim)
        except (TypeError, ValueError) as exc:
            raise TransferRejected(path, f"cache cannot be checked: {exc}") from None
        layout.joint  # built (and its kernel compiled) now, before any lock, not inside the first check
        self._seen[id(cache)] = (cache, layout)
        while len(self._seen) > self._remembered:
            self._seen.popitem(last=False)
        return layout

    @staticmethod
    def check(layout: Any, distinct: tuple[int, ...]) -> Any:
        """The NaN/Inf check of a transfer's validated blocks (`Blocks.distinct`) in a cache validated by
        `inspect`: its CheckResult when something was found, None when clean."""
        return check_sorted(layout, distinct)
