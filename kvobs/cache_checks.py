"""The integrity checks as the lifecycle uses them: a cache validated once, before any lock, then checked.

A misconfigured cache (an integer or meta tensor, a wrong `block_dim`, ids past its end) must fail at the
first call that names it, as a TransferRejected before the lock is taken, not under the lock on every call
after a prefetch already ran. The last cache seen is remembered, so the common case (the same cache object
on every call) validates once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvobs.errors import TransferRejected


class Layout(NamedTuple):
    cache: Any
    num_blocks: int


class CacheCheck:
    """Validates caches for one observer and runs the NaN/Inf check on validated ones."""

    def __init__(self, block_dim: int) -> None:
        self.block_dim = block_dim
        self._last: tuple[Any, Any] | None = None

    def inspect(self, path: str, cache: Any) -> Any:
        """The layout of `cache` (with `num_blocks`); TransferRejected naming the problem."""
        last = self._last
        if last is not None and last[0] is cache:
            return last[1]
        from kvobs.integrity import _flatten, _validate_tensors

        try:
            import torch

            tensors = _flatten(cache)
            for t in tensors:
                if t.is_meta or t.layout != torch.strided:
                    raise TypeError(f"a {'meta' if t.is_meta else 'sparse'} tensor holds no data to check")
            layout = Layout(cache, _validate_tensors(tensors, self.block_dim))
        except (TypeError, ValueError) as exc:
            raise TransferRejected(path, f"cache cannot be checked: {exc}") from None
        self._last = (cache, layout)
        return layout

    def check(self, layout: Any, block_ids: tuple[int, ...]) -> Any:
        from kvobs.integrity import check_blocks

        return check_blocks(layout.cache, block_ids, block_dim=self.block_dim)
