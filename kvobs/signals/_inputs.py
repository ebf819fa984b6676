"""Argument checks for the signal buffers: every value is a Python int before any lock is taken.

Engines hand over Python ints, numpy integers or one-element tensors; a float, bool or string slot is a bug
upstream and gets an error naming the argument, never a silent conversion.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from kvobs._runtime import ids


def as_int(value: Any, name: str, minimum: int = 0) -> int:
    """A Python int >= `minimum` from an int, numpy integer or one-element integer tensor; else a clear error."""
    if type(value) is int:
        result = value
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    else:
        try:
            result = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def int_list(values: Any, name: str) -> list[int]:
    """Sequences, NumPy arrays and tensors as a list of Python ints >= 0, read as everywhere in kvobs
    (`kvobs._runtime.ids`: one `.tolist()`, no per-item device sync); the signals' errors naming `name`."""
    try:
        ints = ids.int_list(values, name)
    except ids.BadIds as exc:
        if exc.problem in ids.ONE_ID:
            as_int(exc.value, name)  # raises the error every signal argument gets for that value
        raise TypeError(str(exc)) from None
    if ints and min(ints) < 0:
        as_int(min(ints), name)  # raises: below the minimum
    return ints


def step_batch(layer: Any, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
               count: Any) -> tuple[int, list[int], list[int]]:
    """One model-runner step's (layer, slots, tokens), cut to the first `count` (all when None; -1 or 0: none).

    Everything is checked before the caller takes its lock, so a bad batch changes nothing.
    """
    if count is not None:
        count = as_int(count, "count", minimum=-1)
        if count <= 0:
            return 0, [], []
    layer = as_int(layer, "layer")
    slot_list = int_list(slots, "slot")
    token_list = int_list(tokens, "tokens")
    if len(slot_list) != len(token_list):
        raise ValueError(f"{len(slot_list)} slots but {len(token_list)} token counts")
    if count is not None:
        if count > len(slot_list):
            raise ValueError(f"count {count} exceeds the {len(slot_list)} slots given")
        slot_list = slot_list[:count]
        token_list = token_list[:count]
    return layer, slot_list, token_list
