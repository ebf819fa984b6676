"""Ids as an engine hands them over (a list, a NumPy array, a torch or Paddle tensor) as Python ints."""

from __future__ import annotations

import operator
from typing import Any


def int_list(ids: Any) -> list[int]:
    """`ids` as a list of Python ints: one `.tolist()` for an array or tensor (no per-item device sync);
    TypeError for a value that is not an integer."""
    values = ids.tolist() if hasattr(ids, "tolist") else ids
    return [operator.index(i) for i in values]
