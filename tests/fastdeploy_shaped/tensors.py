"""The KV cache tensors of the shaped engine: Paddle on CPU when installed, else NumPy (both speak DLPack).

Copies go through NumPy views of the same memory (`np.from_dlpack`), standing in for FastDeploy's CUDA
copy kernels: what lands is visible in the Paddle tensors kvobs checks.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

try:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")  # paddle's C++-extension notice
        import paddle

    paddle.device.set_device("cpu")
except ImportError:  # the tests then say they ran on NumPy
    paddle = None

BACKEND = "paddle" if paddle is not None else "numpy"


def zeros(shape: list[int], dtype: str = "float16") -> Any:
    if paddle is not None:
        return paddle.zeros(shape, dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def full(shape: list[int], value: int, dtype: str) -> Any:
    if paddle is not None:
        return paddle.full(shape, value, dtype=dtype)
    return np.full(shape, value, dtype=dtype)


def ids(values: list[int]) -> Any:
    """Block ids as FastDeploy's messager passes them: an int32 CPU tensor."""
    if paddle is not None:
        return paddle.to_tensor(values, dtype="int32", place="cpu")
    return np.asarray(values, dtype=np.int32)


def view(tensor: Any) -> np.ndarray:
    """A NumPy view of the tensor's memory (no copy): writes land in the tensor."""
    return tensor if isinstance(tensor, np.ndarray) else np.from_dlpack(tensor)
