"""Engine ids as Python ints: the one reader of the forms engines hand ids over in.

Engines pass block ids, token slots and page indices as lists, tuples, ranges, NumPy arrays, torch or Paddle
tensors, or lists of NumPy integers. Every part of kvobs that takes ids (the lifecycle's validation, the
integrity check, the signal buffers, the integrations) reads them here, so all accept the same forms and refuse
the same mistakes: a bool, a float or a string among ids is a bug upstream, never converted silently.

What is refused is raised as `BadIds`, whose message names the problem; each caller raises it as its own error
(a TransferRejected before the lock, the TypeError of a public function), worded for its users where theirs
differs. Range checks stay with the callers: only they know the cache's size or what a negative id means.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence, Set
from typing import Any

_INT_ONLY = {int}  # exactly int: bool (a subclass) and NumPy integers take the checked path

# BadIds.problem: what was wrong, for callers that word it their own way
NONE = "none"  # the ids are None
NOT_A_SEQUENCE = "not a sequence"  # a str, set, mapping, iterator or scalar where an ordered sequence is needed
NOT_ITERABLE = "not iterable"  # not even an iterable (with ordered=False)
NOT_ONE_DIMENSIONAL = "not one-dimensional"  # an array or tensor of another shape (with ordered=True)
META = "meta"  # a meta tensor: it has a shape but no values
NOT_INTEGER_ARRAY = "not an integer array"  # an array or tensor of floats, bools, ...
BOOL = "bool"  # one id is a bool
NOT_AN_INT = "not an int"  # one id is a float, str, None, ...
ONE_ID = (BOOL, NOT_AN_INT)  # problems whose `value` is the one id at fault


class BadIds(Exception):
    """Ids refused for `problem` (one of this module's constants); `value` is the id at fault (problems in
    ONE_ID) or the ids themselves; the message says it in a sentence."""

    def __init__(self, problem: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.problem = problem
        self.value = value


def int_list(ids: Any, what: str = "block ids", *, ordered: bool = True) -> list[int]:
    """`ids` as a list of Python ints: the list itself when it holds only ints (no copy), else a new one.

    ordered=True (ids whose order or length means something: a transfer's ids, slots paired with tokens):
    lists, tuples, ranges and one-dimensional arrays or tensors (anything with `tolist` and `ndim`: NumPy,
    torch, Paddle, CuPy); None, strings, sets, mappings and iterators are refused. ordered=False (ids read as a
    set): any iterable, and arrays of any shape, flattened. `what` names the ids in messages ("block ids").
    Raises BadIds."""
    array = False
    if type(ids) is list or isinstance(ids, (tuple, range)):  # first: what engines pass most
        values = ids
    elif hasattr(ids, "tolist") and hasattr(ids, "ndim"):  # NumPy, torch, Paddle, CuPy
        array = True
        values = _array_values(ids, what, ordered)
    elif ids is None:
        raise BadIds(NONE, ids, f"{what} resolved to None; pass a sequence of ints (empty if none)")
    elif ordered:
        if isinstance(ids, (str, bytes, Set, Mapping)) or not isinstance(ids, Sequence):
            raise BadIds(NOT_A_SEQUENCE, ids, f"{what} must be a sequence of ints, got {type(ids).__name__}")
        values = ids
    else:
        try:
            values = list(ids)
        except TypeError:
            raise BadIds(NOT_ITERABLE, ids, f"{what} must be an iterable of ints, got {ids!r}") from None
    if set(map(type, values)) <= _INT_ONLY:  # checked in C: the common case on an engine's hot path
        return values if type(values) is list else list(values)
    if array:  # tolist() of an integer array gives ints only
        kind = "array" if type(ids).__module__ == "numpy" else "tensor"
        raise BadIds(NOT_INTEGER_ARRAY, ids, f"{what} must be integers, got a {ids.dtype} {kind}")
    return [_one(value, what) for value in values]


def _array_values(ids: Any, what: str, ordered: bool) -> list[Any]:
    """The values of an array or tensor, in one `tolist()` (one device sync for a GPU tensor, not one per id)."""
    if ordered and ids.ndim != 1:
        raise BadIds(NOT_ONE_DIMENSIONAL, ids, f"{what} must be one-dimensional, got shape {tuple(ids.shape)}")
    if getattr(ids, "is_meta", False):  # torch would raise NotImplementedError from tolist()
        raise BadIds(META, ids, f"{what} are a meta tensor: it holds no values to read")
    values = ids.tolist()
    if ids.ndim == 0:
        return [values]
    for _ in range(ids.ndim - 1):
        values = [value for row in values for value in row]
    return values


def _one(value: Any, what: str) -> int:
    one = what.removesuffix("s")
    if isinstance(value, bool):
        raise BadIds(BOOL, value, f"{one} {value!r} is a bool, not an int")
    try:
        return operator.index(value)
    except TypeError:
        raise BadIds(NOT_AN_INT, value, f"{one} {value!r} is a {type(value).__name__}, not an int") from None
