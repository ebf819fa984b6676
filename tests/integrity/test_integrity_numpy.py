"""NaN/Inf checks where torch is not installed: NumPy reads CPU caches (the kernel too, with numba), exactly
as the torch path does, and what only torch could read fails naming the extra to install.

The NumPy path itself is compared with the torch path in this process; the checks as a user without torch
makes them run in a child process in which `import torch` fails (and, for the NumPy path, `import numba`).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvobs.integrity import _numpy_path as numpy_path
from kvobs.integrity import _torch_path as torch_path

DTYPES = [np.float16, np.float32, np.float64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    block_dim=st.integers(0, 3),
    bad=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from([np.nan, np.inf, -np.inf])), max_size=6),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=8),
    transpose=st.booleans(),
    chunk=st.sampled_from([1, 7, 1 << 22]),
)
def test_numpy_path_agrees_with_the_torch_path(dtype, shape, block_dim, bad, picks, transpose, chunk):
    block_dim %= len(shape)
    array = np.ones(shape, dtype=dtype)
    flat = array.reshape(-1)
    for position, value in bad:
        flat[position % flat.size] = value
    if transpose:  # a strided view: the NumPy path copies a chunk, never the cache
        array = array.T
        block_dim = array.ndim - 1 - block_dim
    before = array.copy()
    ids = sorted({p % array.shape[block_dim] for p in picks})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numpy_path, "CHUNK_ELEMENTS", chunk)
        found = numpy_path.bad_blocks([array], ids, block_dim)
    assert found == torch_path.bad_blocks([torch.from_numpy(array)], ids, block_dim)
    np.testing.assert_array_equal(array, before)  # never written (NaN compares equal here)


WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` fails, as on a plain install
    if "--no-numba" in sys.argv:
        sys.modules["numba"] = None
    import numpy as np
    import kvobs
    from kvobs.integrity import validate_cache

    cache = np.ones((16, 4, 2, 8), dtype=np.float32)
    cache[3, 1, 0, 5] = np.nan
    cache[7, 0, 1, 0] = -np.inf
    cache[12, 3, 1, 7] = np.inf
    views = {
        "contiguous": (cache, 0),
        "blocks second": (np.ascontiguousarray(cache.transpose(1, 0, 2, 3)), 1),
        "strided": (cache.transpose(1, 0, 2, 3), 1),
        "reversed": (cache[::-1], 0),
        "layers": ([(cache, cache.copy()), (cache.copy(), cache.copy())], 0),
    }
    for name, (view, block_dim) in views.items():
        ids = [15 - i for i in (2, 3, 7, 12)] if name == "reversed" else [2, 3, 7, 12, 13]
        result = kvobs.check_blocks(view, ids, block_dim=block_dim)
        print(name, result.nan_block_ids, result.inf_block_ids, validate_cache(view, block_dim=block_dim).methods)
    for method in ("kernel", "torch"):
        try:
            kvobs.check_blocks(cache, [1], method=method)
            print(method, "ok")
        except ValueError as exc:
            print(method, "refused:", exc)
    print("torch imported:", sys.modules["torch"] is not None)
    """
)


def run_without_torch(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_without_torch_the_kernel_reads_numpy_caches():
    pytest.importorskip("numba")
    out = run_without_torch()
    assert "contiguous (3,) (7, 12) ('kernel',)\n" in out
    assert "blocks second (3,) (7, 12) ('kernel',)\n" in out
    assert "strided (3,) (7, 12) ('kernel',)\n" in out
    assert "reversed (12,) (3, 8) ('numpy',)\n" in out  # negative strides: the kernel declines
    assert "layers (3,) (7, 12) ('kernel', 'kernel', 'kernel', 'kernel')\n" in out
    assert "kernel ok\n" in out
    assert "torch refused: method='torch' needs torch, which is not installed: pip install 'kvobs[torch]'" in out
    assert "torch imported: False" in out


def test_without_torch_or_numba_numpy_reads_them_and_the_kernel_names_its_extra():
    out = run_without_torch("--no-numba")
    assert "contiguous (3,) (7, 12) ('numpy',)\n" in out
    assert "strided (3,) (7, 12) ('numpy',)\n" in out
    assert "reversed (12,) (3, 8) ('numpy',)\n" in out
    assert "layers (3,) (7, 12) ('numpy', 'numpy', 'numpy', 'numpy')\n" in out
    assert ("kernel refused: method='kernel' cannot check 1 of the cache's tensors: numba is not installed: "
            "pip install 'kvobs[fast]'") in out


def test_without_torch_a_paddle_tensor_is_read_through_dlpack_or_names_the_extra():
    pytest.importorskip("paddle")
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        import paddle
        import kvobs
        cache = paddle.ones([8, 4, 16], dtype="float16")
        cache[2, 1, 3] = float("nan")
        print(kvobs.check_blocks(cache, paddle.to_tensor([1, 2, 5])).nan_block_ids)
        try:
            kvobs.check_blocks(paddle.ones([8, 4, 16], dtype="bfloat16"), [1])
        except TypeError as exc:
            print("bf16:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(2,)\n" in proc.stdout
    assert "bf16: cache: NumPy cannot read this Tensor through DLPack" in proc.stdout
    assert "but it is not installed: pip install 'kvobs[torch]'" in proc.stdout
