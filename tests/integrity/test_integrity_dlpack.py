"""Checks of caches that are not torch tensors: NumPy arrays and PaddlePaddle tensors (FastDeploy's KV caches),
read in place through DLPack, never copied, never modified; block ids as NumPy or Paddle int arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from integrity_support import METHODS, check, expect

from kvobs.integrity import check_blocks, validate_cache

NUM_BLOCKS = 16
BLOCK = (4, 2, 8)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_numpy_arrays_layers_and_pairs(method, dtype):
    layers = [(np.ones((NUM_BLOCKS, *BLOCK), dtype), np.ones((NUM_BLOCKS, *BLOCK), dtype)) for _ in range(3)]
    layers[2][1][9, 3, 1, 7] = np.nan
    layers[0][0][4, 0, 0, 0] = -np.inf
    before = [a.copy() for pair in layers for a in pair]
    expect(check(layers, np.array([4, 9, 10]), method), nan={9}, inf={4}, checked=3)
    expect(check(layers[1][0], np.arange(NUM_BLOCKS, dtype=np.int32), method), checked=NUM_BLOCKS)
    after = [a for pair in layers for a in pair]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(after, before))


@pytest.mark.parametrize("method", METHODS)
def test_numpy_read_only_strided_and_layers_first(method):
    base = np.ones((NUM_BLOCKS, 4, 2, 16), np.float16)
    base[7, 1, 1, 2] = np.inf
    view = base[..., ::2]  # not contiguous
    view.flags.writeable = False
    expect(check(view, [6, 7], method), inf={7})
    layers_first = np.ascontiguousarray(np.moveaxis(base, 0, 1))  # [4, blocks, 2, 16]
    expect(check(layers_first, [7, 8], method, block_dim=1), inf={7})


def test_numpy_is_read_in_place_not_copied():
    array = np.ones((NUM_BLOCKS, *BLOCK), np.float32)
    validated = validate_cache(array)
    assert validated.tensors[0].data_ptr() == array.ctypes.data
    assert check_blocks(validated, [5]).clean
    array[5, 1, 1, 1] = np.nan  # written after validation: a copy would not see it
    expect(check_blocks(validated, [5]), nan={5})


def test_numpy_without_a_float_format_is_refused():
    with pytest.raises(TypeError, match="int16 tensor"):
        validate_cache(np.zeros((4, 2), np.int16))
    with pytest.raises(TypeError, match="cannot read this ndarray through DLPack"):
        validate_cache(np.array([["a"]], dtype=object))


# --- PaddlePaddle -------------------------------------------------------------------------------------------

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed (pip install paddlepaddle)")


def paddle_cache(dtype: str):
    return paddle.ones([NUM_BLOCKS, *BLOCK], dtype="float32").astype(dtype)


def poison(cache, index: tuple[int, ...], value: float) -> None:
    """Write one value with Paddle's own ops, as the engine would."""
    cache[index] = paddle.to_tensor(value, dtype="float32").astype(cache.dtype)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_paddle_layers_of_key_value_pairs(method, dtype):
    layers = [(paddle_cache(dtype), paddle_cache(dtype)) for _ in range(2)]
    poison(layers[1][0], (12, 3, 1, 7), float("nan"))
    poison(layers[0][1], (3, 0, 0, 0), float("-inf"))
    ids = paddle.to_tensor([3, 12, 13], dtype="int64")
    before = [t.astype("float32").numpy() for pair in layers for t in pair]
    expect(check(layers, ids, method), nan={12}, inf={3}, checked=3)
    after = [t.astype("float32").numpy() for pair in layers for t in pair]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(after, before))


def test_paddle_is_read_in_place_not_copied():
    cache = paddle_cache("bfloat16")
    validated = validate_cache([cache])
    assert validated.tensors[0].data_ptr() == cache.data_ptr()
    assert validated.dtypes == ("bfloat16",) and validated.tensors[0].dtype == torch.bfloat16
    assert check_blocks(validated, [8]).clean
    poison(cache, (8, 0, 1, 2), float("inf"))  # after validation: seen only if the memory is shared
    expect(check_blocks(validated, paddle.to_tensor([8], dtype="int32")), inf={8})


def test_paddle_fp8_and_float_ids_refused():
    bits = np.full((NUM_BLOCKS, 8), 0x38, np.uint8)  # 1.0 in e4m3fn; Paddle casts saturate NaN, so set bits
    bits[2, 5] = 0x7F  # NaN
    cache = paddle.to_tensor(bits).view("float8_e4m3fn")
    expect(check_blocks(cache, [1, 2]), nan={2})
    expect(check_blocks(cache, [1, 2], method="torch"), nan={2})
    with pytest.raises(TypeError, match="integers"):
        check_blocks(cache, paddle.to_tensor([1.0]))
