"""The compiled integrity kernel: exact on every bit pattern, taken where it should be, safe across threads
and forks, and still there when numba has nowhere to cache."""

from __future__ import annotations

import dataclasses
import multiprocessing
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from integrity_support import FLOATS, FP8, expect, naive, raw

from kvobs.integrity import _kernel as kernel
from kvobs.integrity import _threads as threads
from kvobs.integrity import _torch_path as torch_path
from kvobs.integrity import check_blocks, validate_cache
from kvobs.integrity._bits import non_finite_bits
from kvobs.integrity._check import check_sorted

pytest.importorskip("numba")

EVERY_FORMAT = FLOATS + FP8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def kernel_loaded():
    """numba is installed, so the kernel must load: a silent fallback to torch fails every test here."""
    assert kernel.unavailable_reason() is None, kernel.unavailable_reason()


def patterns(dtype) -> torch.Tensor:
    """Every bit pattern of an 8/16-bit format; for fp32/fp64 the special ones plus 50,000 random ones."""
    width = torch.empty((), dtype=dtype).element_size()
    if width <= 2:
        everything = torch.arange(1 << (8 * width), dtype=torch.int64)
        return everything.to(torch.uint8 if width == 1 else torch.int16).view(dtype)
    exponent_bits = 8 if width == 4 else 11
    mantissa_bits = 8 * width - 1 - exponent_bits
    ints = torch.int32 if width == 4 else torch.int64
    top = (1 << exponent_bits) - 1
    special = [(e << mantissa_bits) | m for e in (0, 1, top - 1, top) for m in (0, 1, (1 << mantissa_bits) - 1)]
    special += [s | (1 << (8 * width - 1)) for s in special]
    signed = [s - (1 << (8 * width)) if s >= 1 << (8 * width - 1) else s for s in special]
    random_bits = torch.randint(torch.iinfo(ints).min, torch.iinfo(ints).max, (50_000,), dtype=ints,
                                generator=torch.Generator().manual_seed(1))
    return torch.cat([torch.tensor(signed, dtype=ints), random_bits]).view(dtype)


@pytest.mark.parametrize("dtype", EVERY_FORMAT, ids=str)
def test_every_bit_pattern_is_classified_exactly(dtype):
    """One element per block, so each pattern gets its own verdict; both paths against torch's own isnan."""
    values = patterns(dtype)
    wide = values.float() if values.element_size() == 1 else values.double()
    nan = set(torch.nonzero(wide.isnan()).view(-1).tolist())
    inf = set(torch.nonzero(wide.isinf()).view(-1).tolist())
    assert nan  # every format kvobs checks has a NaN
    cache = values.view(-1, 1)
    for method in ("kernel", "torch"):
        expect(check_blocks(cache, range(cache.shape[0]), method=method), nan, inf)


@pytest.mark.parametrize("dtype", EVERY_FORMAT, ids=str)
def test_lane_test_flags_exactly_the_words_holding_a_non_finite_value(dtype):
    """The fast test alone (no exact second pass): a 64-bit word is flagged iff one of its values is NaN or
    Inf, so clean data never pays for the second pass and bad data never slips through."""
    from kvobs.integrity._bits import lane_test
    from kvobs.integrity._kernel_numba import _lane_test

    values = patterns(dtype)
    per_word = 8 // values.element_size()
    values = values[: values.numel() // per_word * per_word]
    wide = values.float() if values.element_size() == 1 else values.double()
    expected = (~wide.isfinite()).view(-1, per_word).any(1).tolist()
    words = values.view(torch.int64).numpy().view(np.uint64)
    test = np.array(lane_test(non_finite_bits(dtype)), dtype=np.uint64)
    top = np.uint64(test[4])
    flagged = [bool(_lane_test(words[i : i + 1], test, np.uint64(0)) & top) for i in range(words.shape[0])]
    assert flagged == expected


def test_bit_rules_cover_every_floating_format_torch_has():
    dtypes = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
    names = {name for name, dtype in dtypes.items() if dtype.is_floating_point}
    for name in names - {"float4_e2m1fn_x2", "half", "float", "double"}:
        assert non_finite_bits(getattr(torch, name)) is not None, name


def test_bit_rules_are_shared_and_cannot_be_changed_by_a_caller():
    rule = non_finite_bits(torch.bfloat16)
    assert non_finite_bits(torch.bfloat16) is rule  # cached: one rule object serves every check
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.nan_min = 0  # would make every later bf16 check flag finite values
    assert non_finite_bits(torch.bfloat16).nan_min == 0x7F81


def test_pieces_chunks_and_runs_have_no_blind_spot(monkeypatch):
    """Findings at every edge of what the kernel walks: the first and last value of a piece, the values after
    the last whole 64-bit word, the first and last id of a chunk (chunks of 2 blocks here, so runs of
    adjacent ids are cut by chunks and the next chunk's first block is prefetched), single ids and long runs,
    and every piece of a block split into several."""
    length = 2 * 4096 + 7  # 3 values past the last whole word
    monkeypatch.setattr(kernel, "CHUNK_BYTES", 2 * length * 2)
    offsets = [0, 1, 4095, 4096, length - 4, length - 3, length - 1]
    ids = [1, 3, 4, 5, 6, 9]  # chunks [1, 3] [4, 5] [6, 9]: runs [1] [3] [4, 5] [6] [9]
    for position in range(len(ids)):
        for offset in offsets:
            cache = torch.ones(10, length, dtype=torch.bfloat16)
            cache[ids[position], offset] = float("nan")
            expect(check_blocks(cache, ids, method="kernel"), nan={ids[position]})
    split = torch.ones(3, 8, 4097, dtype=torch.float16)  # [segments, blocks, values]: 3 pieces per block
    assert validate_cache(split, block_dim=1).plans[0].segments.shape[0] == 3
    for segment in range(3):
        for offset in (0, 4095, 4096):
            cache = split.clone()
            cache[segment, 5, offset] = -float("inf")
            expect(check_blocks(cache, [2, 5, 6, 7], block_dim=1, method="kernel"), inf={5})


def test_threads_split_large_checks_and_miss_nothing(monkeypatch):
    """Three threads take chunks of one id from the same counters and raise the same flags: every finding of
    both tensors (two widths, two block sizes) is found wherever it is, whichever thread read its block."""
    monkeypatch.setattr(threads, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(kernel, "CHUNK_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    shares = []
    real = threads._mark_share
    monkeypatch.setattr(threads, "_mark_share", lambda *args: shares.append(args) or real(*args))
    keys = torch.ones(10, 4, 64, dtype=torch.bfloat16)
    values = torch.ones(10, 4, 64, dtype=torch.float32)  # other width, other block size
    ids = [0, 1, 2, 4, 5, 7, 9]
    for position in range(len(ids)):
        for tensor in (keys, values):
            shares.clear()
            tensor[ids[position], 3, 63] = float("inf")
            expect(check_blocks([keys, values], ids, method="kernel"), inf={ids[position]})
            tensor[ids[position], 3, 63] = 1
            first = shares[0]
            assert shares and all(s[2] is first[2] and s[3] is first[3] for s in shares)  # one flags, one counters
            assert all(claimed > len(ids) for claimed in shares[0][3])  # every chunk of both tensors was claimed


def test_a_share_no_pool_thread_began_is_taken_back(monkeypatch):
    """A check whose caller read every chunk before a pool thread started does not wait for that thread."""
    monkeypatch.setattr(threads, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    jobs: list[tuple] = []
    monkeypatch.setattr(threads, "_jobs", SimpleNamespace(put=jobs.append))  # no pool thread sees the share
    cache = torch.ones(8, 64, dtype=torch.bfloat16)
    cache[6, 3] = float("nan")
    expect(check_blocks(cache, range(8), method="kernel"), nan={6})
    [(claim, *_)] = jobs
    assert claim.locked()  # taken back: a pool thread getting it now would skip it


def test_fast_path_is_taken_where_it_applies(monkeypatch):
    """'auto' must read CPU tensors with the kernel: the torch path is made to fail, the checks still work."""
    per_layer = [(torch.ones(32, 16, 2, 64, dtype=torch.bfloat16), torch.ones(32, 16, 2, 64, dtype=torch.bfloat16))
                 for _ in range(4)]
    caches = {
        "one tensor": (torch.ones(32, 16, 2, 64, dtype=torch.float16), 0),
        "layers of (k, v)": (per_layer, 0),
        "layers first": (torch.ones(4, 32, 16, 64, dtype=torch.float32), 1),
        "k and v stacked": (torch.ones(2, 32, 16, 64, dtype=torch.bfloat16), 1),
        "fp8": (torch.ones(32, 16, 64).to(torch.float8_e4m3fn), 0),
        "numpy": (np.ones((32, 16, 64), dtype=np.float16), 0),
        "strided, large pieces": (torch.ones(32, 16, 2, 128, dtype=torch.bfloat16)[:, :, :, :64], 0),
    }

    def no_torch_path(*args, **kwargs):
        raise AssertionError("the torch path ran where the kernel applies")

    monkeypatch.setattr(torch_path, "bad_blocks", no_torch_path)
    for name, (cache, block_dim) in caches.items():
        validated = validate_cache(cache, block_dim=block_dim)
        assert set(validated.methods) == {"kernel"}, name
        first = validated.tensors[0]
        first.select(block_dim, 20)[(0,) * (first.dim() - 1)] = float("nan")
        assert check_blocks(validated, [3, 20, 31]).nan_block_ids == (20,), name


def test_kernel_declines_what_it_cannot_read_fast_and_says_so():
    tiny_pieces = torch.ones(8, 64, 4, dtype=torch.float16).transpose(1, 2)  # every piece is 2 bytes
    assert validate_cache(tiny_pieces).methods == ("torch",)
    two_small_pieces = torch.ones(8, 2, 32, dtype=torch.float16)[:, :, :16]  # 2 pieces of 32 bytes per block
    assert validate_cache(two_small_pieces).methods == ("torch",)
    two_pieces = torch.ones(8, 2, 64, dtype=torch.float16)[:, :, :32]  # 2 pieces of 64 bytes: worth it
    assert validate_cache(two_pieces).methods == ("kernel",)
    for empty in (torch.ones(0, 8, dtype=torch.float16), torch.ones(8, 0, dtype=torch.float16)):
        validated = validate_cache(empty)  # no blocks, or empty ones: nothing to read, nothing to compile
        assert validated.methods == ("torch",), empty.shape
        assert check_blocks(validated, list(range(empty.shape[0]))).clean
    with pytest.raises(ValueError, match="method='kernel' cannot check 1 of the cache's tensors"):
        check_blocks(tiny_pieces, [1], method="kernel")
    mixed = [torch.ones(8, 64, dtype=torch.float16), tiny_pieces]
    assert validate_cache(mixed).methods == ("kernel", "torch")
    expect(check_blocks(mixed, [1, 2]), checked=2)


@pytest.mark.parametrize(("cpus", "workers"), [(None, 1), (1, 1), (2, 1), (8, 7)])
def test_split_checks_leave_one_core_to_the_engine(monkeypatch, cpus, workers):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpus)
    assert threads.pool_size() == workers


def test_without_numba_everything_runs_on_torch(monkeypatch):
    monkeypatch.setattr(kernel, "_compiled", None)
    monkeypatch.setattr(kernel, "_unavailable", "ModuleNotFoundError: No module named 'numba'")
    cache = torch.ones(8, 4, 16, dtype=torch.bfloat16)
    cache[6, 0, 0] = float("nan")
    assert validate_cache(cache).methods == ("torch",)
    expect(check_blocks(cache, [1, 6]), nan={6})
    with pytest.raises(ValueError, match="No module named 'numba'"):
        check_blocks(cache, [1], method="kernel")


def _lifecycle_cache(dtype) -> list[torch.Tensor]:
    """Three layers of one dtype and three layouts: contiguous blocks, blocks of 4 pieces (a transposed view),
    blocks with values after the last whole 64-bit word."""
    return [torch.ones(16, 4, 64).to(dtype), torch.ones(4, 16, 64).to(dtype).transpose(0, 1),
            torch.ones(16, 4097).to(dtype)]


@pytest.mark.parametrize("dtype", EVERY_FORMAT, ids=str)
def test_the_lifecycles_check_reads_every_tensor_in_one_call_exactly(dtype, monkeypatch):
    """`check_sorted` (how the lifecycle checks a transfer's validated blocks: one compiled call over every
    tensor of the cache) finds a NaN or Inf in any tensor, in any piece of a block, tells them apart (NaN wins
    in a block holding both), and agrees with check_blocks and the naive reference; clean is None."""
    layers = _lifecycle_cache(dtype)
    validated = validate_cache(layers)
    assert validated.joint is not None and len(validated.joint.plans) == 3
    monkeypatch.setattr(kernel.KernelPlan, "mark", lambda *args: pytest.fail("read tensor by tensor"))
    ids = (0, 1, 5, 9, 15)
    assert check_sorted(validated, ids) is None
    for layer, where in ((0, (5, 3, 63)), (1, (9, 2, 0)), (2, (15, 4096)), (2, (0, 0))):
        for value in (float("nan"), float("inf"), -float("inf")):
            other = layers[(layer + 1) % 3]
            layers[layer][where] = value
            other[(1,) + (0,) * (other.dim() - 1)] = float("inf")  # another tensor's Inf in another block
            nan, inf = naive(layers, ids)
            result = check_sorted(validated, ids)  # None: clean (a format whose Inf saturates to a finite value)
            found = ((), ()) if result is None else (result.nan_block_ids, result.inf_block_ids)
            assert found == (tuple(sorted(nan)), tuple(sorted(inf))) and (result is None) == (not nan and not inf)
            monkeypatch.undo()
            expect(check_blocks(validated, ids, method="kernel"), nan, inf, checked=len(ids))
            monkeypatch.setattr(kernel.KernelPlan, "mark", lambda *args: pytest.fail("read tensor by tensor"))
            layers[layer][where] = 1
            other[(1,) + (0,) * (other.dim() - 1)] = 1
    layers[0][(5, 0, 0)] = float("nan")
    layers[2][(5, 7)] = float("inf")
    expect(check_sorted(validated, ids), nan={5}, checked=len(ids))


def test_the_lifecycles_check_falls_back_where_one_call_cannot_read_the_cache():
    """Tensors of two widths, or one the kernel does not read (pieces too small): each tensor is read as
    check_blocks reads it. Ids past the cache (a moved-blocks report) are refused, never read."""
    mixed = [torch.ones(16, 64, dtype=torch.bfloat16), torch.ones(16, 64, dtype=torch.float32)]
    mixed[1][7, 3] = float("nan")
    tiny_pieces = [torch.ones(16, 64, 2, dtype=torch.bfloat16).transpose(1, 2)]
    tiny_pieces[0][7, 1, 3] = float("inf")
    for cache, nan, inf in ((mixed, {7}, set()), (tiny_pieces, set(), {7})):
        validated = validate_cache(cache)
        assert validated.joint is None
        expect(check_sorted(validated, (2, 7, 15)), nan, inf, checked=3)
        assert check_sorted(validated, (2, 15)) is None
    with pytest.raises(IndexError, match="block id 16 out of range"):
        check_sorted(validate_cache(_lifecycle_cache(torch.float16)), (2, 16))


def test_the_kernel_only_reads():
    cache = torch.ones(8, 4, 64, dtype=torch.bfloat16)
    cache[2, 1, 1] = float("nan")
    before = raw(cache).clone()
    plan = validate_cache(cache).plans[0]
    assert not plan.words.flags.writeable and not plan.segments.flags.writeable
    assert plan.words.ctypes.data == cache.data_ptr()  # the cache's own memory, not a copy
    expect(check_blocks(cache, range(8), method="kernel"), nan={2})
    assert torch.equal(raw(cache), before)


def test_many_threads_checking_at_once(monkeypatch):
    """Small and split (pooled) checks from 8 threads, each with its own findings."""
    monkeypatch.setattr(threads, "MIN_BYTES_PER_THREAD", 1 << 16)
    caches = []
    for n in range(8):
        cache = torch.ones(64, 16, 2, 64, dtype=torch.bfloat16)  # 256 KiB: checks of all blocks are split
        cache[n, 0, 0, 0] = float("nan")
        cache[n + 8, 3, 1, 5] = float("inf")
        caches.append(validate_cache(cache))
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            start.wait()
            for round_ in range(40):
                ids = list(range(64)) if round_ % 2 else [n, n + 8, 40]
                result = check_blocks(caches[n], ids) if round_ % 3 else check_sorted(caches[n], (n, n + 8, 40))
                assert result.nan_block_ids == (n,) and result.inf_block_ids == (n + 8,)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors and not any(w.is_alive() for w in workers)


def _check_in_child(cache, queue) -> None:
    queue.put(check_blocks(cache, range(64)).nan_block_ids)


@pytest.mark.timeout(60)
def test_split_checks_work_in_a_forked_child(monkeypatch):
    """The pool's threads do not survive fork; a child that inherited a used pool must not hang."""
    monkeypatch.setattr(threads, "MIN_BYTES_PER_THREAD", 1 << 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cache = torch.ones(64, 16, 2, 64, dtype=torch.bfloat16)
    assert check_blocks(cache, range(64)).clean and threads._started  # the parent used the pool
    cache[33, 0, 0, 0] = float("nan")  # made here: the child runs no torch op (OpenMP is not fork-safe)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_check_in_child, args=(cache, queue))
    child.start()
    try:
        assert queue.get(timeout=30) == (33,)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()


@pytest.mark.timeout(120)
def test_no_writable_cache_directory_compiles_in_memory(tmp_path):
    """Where numba finds no cache directory it can write, the kernel is compiled in memory, not lost."""
    script = textwrap.dedent(
        """
        import numba.core.caching as caching

        def refuse(self):
            raise OSError("read-only file system")

        caching._CacheLocator.ensure_cache_path = refuse
        import torch
        from kvobs.integrity import check_blocks
        from kvobs.integrity import _kernel as kernel
        from kvobs.integrity._check import check_sorted
        from kvobs.integrity import _kernel_numba as kernel_numba

        assert kernel.unavailable_reason() is None, kernel.unavailable_reason()
        assert isinstance(kernel_numba.block_flags._cache, caching.NullCache)
        cache = torch.ones(8, 64, dtype=torch.bfloat16)
        cache[5, 7] = float("inf")
        print(check_blocks(cache, [4, 5], method="kernel").inf_block_ids)
        """
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, cwd=ROOT,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(5,)"


@pytest.mark.timeout(180)
def test_the_kernel_never_reads_outside_its_arrays(tmp_path):
    """The kernel reads the cache in place with bounds checks compiled out; here numba compiles them in
    (NUMBA_BOUNDSCHECK=1), so any read past an array raises, over every kind of run: single ids, runs at
    both ends of the cache, odd tails after the last 64-bit word, one value per block."""
    script = textwrap.dedent(
        """
        import random
        import torch
        from kvobs.integrity import check_blocks, validate_cache
        from kvobs.integrity import _kernel as kernel
        from kvobs.integrity._check import check_sorted

        assert kernel.unavailable_reason() is None, kernel.unavailable_reason()
        rng = random.Random(0)
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn):
            for shape in ((33, 3), (17, 5, 3), (64, 2, 8, 16), (9, 1)):
                cache = torch.full(shape, 1.5).to(dtype)
                validated = validate_cache(cache)
                assert validated.methods == ("kernel",), (dtype, shape, validated.methods)
                n, flat = shape[0], cache.view(shape[0], -1)
                for ids in ([0], [n - 1], list(range(n)), [0, n - 1], sorted(rng.sample(range(n), n // 2)),
                            list(range(n - 3, n)), [1, 2, 3, 7, 8, n - 2, n - 1]):
                    assert check_blocks(validated, ids, method="kernel").clean, (dtype, shape, ids)
                    assert check_sorted(validated, tuple(sorted(set(ids)))) is None, (dtype, shape, ids)
                    flat[ids[-1], -1] = float("nan")
                    found = check_blocks(validated, ids, method="kernel").nan_block_ids
                    assert found == (ids[-1],), (dtype, shape, ids, found)
                    found = check_sorted(validated, tuple(sorted(set(ids)))).nan_block_ids
                    assert found == (ids[-1],), (dtype, shape, ids, found)
                    flat[ids[-1], -1] = 1.5
        print("ok")
        """
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NUMBA_BOUNDSCHECK": "1",
           "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_kvobs_integrity_loads_neither_torch_nor_numba():
    script = "import sys, kvobs.integrity; print(sorted({'torch', 'numba'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_naive_reference_agrees_on_a_realistic_cache():
    """A [blocks, tokens, heads, dim] bf16 cache with scattered findings, 64 random blocks."""
    cache = torch.randn(512, 16, 4, 64).to(torch.bfloat16)
    rng = np.random.default_rng(3)
    for value in (float("nan"), float("inf"), -float("inf")) * 10:
        cache[tuple(int(rng.integers(0, s)) for s in cache.shape)] = value
    ids = rng.choice(512, 64, replace=False).tolist()
    nan, inf = naive([cache], ids)
    for method in ("kernel", "torch"):
        expect(check_blocks(cache, ids, method=method), nan, inf, checked=64)
