"""Which library reads a cache's memory: torch when it is installed, else NumPy.

Why both: torch is an optional extra (`kvobs[torch]`). An engine built on torch has it and gets every device
and layout; an engine without it (FastDeploy runs Paddle) still gets exact checks of CPU memory through
NumPy, which reads any DLPack array on the CPU without a copy. What only torch can read (GPU memory, dtypes
NumPy lacks) fails with an error naming the extra to install.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

TORCH_EXTRA = "pip install 'kvobs[torch]'"


@functools.cache
def installed_torch() -> Any:
    """The torch module, or None when it is not installed (asked once: a failed import is slow to repeat)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def is_torch_tensor(value: Any) -> bool:
    torch = installed_torch()
    return torch is not None and isinstance(value, torch.Tensor)


def elements(array: Any) -> int:
    """The number of elements of a torch tensor or a NumPy array."""
    return array.size if isinstance(array, np.ndarray) else array.numel()


def device(array: Any) -> str:
    return "cpu" if isinstance(array, np.ndarray) else str(array.device)


def from_dlpack(value: Any, what: str) -> Any:
    """A torch tensor (torch installed) or a NumPy array over the same memory as a DLPack array, no copy.

    TypeError naming `what` when it cannot be read; without torch, the message names the extra that would."""
    torch = installed_torch()
    try:
        return np.from_dlpack(value) if torch is None else torch.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        if torch is None:
            raise TypeError(
                f"{what}: NumPy cannot read this {type(value).__name__} through DLPack ({exc}); torch reads GPU "
                f"memory and dtypes NumPy lacks, but it is not installed: {TORCH_EXTRA}"
            ) from exc
        name = type(value).__name__
        raise TypeError(f"{what}: cannot read this {name} through DLPack without a copy: {exc}") from exc
