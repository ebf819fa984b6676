"""FastDeploy's GPU KV cache as kvobs checks it: Paddle tensors, one per layer for keys and one for values.

Why a stable object: kvobs validates a cache once and reuses that while the same object comes back, so
every call must hand over the same object, not a new list of the same tensors. The engine can replace its
tensors (RL weight updates clear and re-create them), so the object is rebuilt when the tensors change.
A cache kvobs cannot check (a uint8 block-wise-fp8 cache, or none while cleared) is left out (None):
the transfer is still locked, counted and traced, never refused for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvobs.integrations._common import checkable

Tensors = Callable[[], Sequence[Sequence[Any]]]


class LayerCaches:
    """The cache to check: every tensor the getter lists, as one tuple, rebuilt only when they change."""

    def __init__(self, tensors: Tensors) -> None:
        self._tensors = tensors
        self._lock = threading.Lock()
        self._ids: tuple[int, ...] = ()
        self._cache: tuple[Any, ...] | None = None

    def __call__(self, *_call: Any, **_kwargs: Any) -> tuple[Any, ...] | None:
        """The cache (usable as a guard's `cache=` spec: the call's arguments are ignored)."""
        flat = tuple(t for group in self._tensors() for t in group)
        ids = tuple(map(id, flat))
        with self._lock:
            if ids != self._ids:
                self._ids, self._cache = ids, _checkable(flat)
            return self._cache


def _checkable(tensors: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if not tensors:
        return None
    cache, _ = checkable(list(tensors))  # integer (fp8-as-uint8) caches hold no NaN/Inf to find
    return None if cache is None else tensors


def per_layer(keys: Callable[[], Sequence[Any]], values: Callable[[], Sequence[Any]]) -> Callable[[int], Any]:
    """`layer -> cache of that layer` (its key and value tensors), one stable object per layer."""
    layers: dict[int, LayerCaches] = {}

    def layer_cache(layer: int) -> Any:
        caches = layers.get(layer)
        if caches is None:
            caches = layers.setdefault(layer, LayerCaches(lambda: _layer(keys(), values(), layer)))
        return caches()

    return layer_cache


def _layer(keys: Sequence[Any], values: Sequence[Any], layer: int) -> tuple[tuple[Any, ...]]:
    return ((keys[layer],) + ((values[layer],) if layer < len(values) else ()),)
