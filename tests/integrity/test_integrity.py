"""kvobs.integrity: NaN/Inf checks over selected KV blocks, on both paths (compiled kernel and pure torch).

Every correctness test runs once per method: "kernel" (forced onto the compiled kernel for every layout, and
an error if it cannot be used) and "torch" (the pure-torch fallback). Both must agree with a naive
per-block reference.
"""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integrity_support import FLOATS, FP8, METHODS, check, expect, naive, raw

from kvobs.integrity import POLICIES, CheckResult, CorruptKVError, IntegrityPolicy, check_blocks
from kvobs.integrity import _torch_path as torch_path
from kvobs.integrity._ids import runs
from kvobs.semconv import CHECK_CLEAN, CHECK_INF, CHECK_NAN

WITH_INF = set(FLOATS) | {torch.float8_e5m2}
NAN = float("nan")
INF = float("inf")
NUM_BLOCKS = 16
BLOCK = (4, 2, 8)  # tokens, heads, head dim


def bad_values(dtype) -> list[float]:
    return [NAN, INF, -INF] if dtype in WITH_INF else [NAN]


def ones(shape, dtype) -> torch.Tensor:
    return torch.ones(shape).to(dtype)


def finding(value: float, block: int) -> tuple[set[int], set[int]]:
    return ({block}, set()) if math.isnan(value) else (set(), {block})


# --- correctness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", FLOATS + FP8)
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_single_tensor_finds_bad_value(method, dtype, where):
    selected = [2, 3, 4, 9, 11]
    size = BLOCK[0] * BLOCK[1] * BLOCK[2]
    block, flat = {"first": (2, 0), "last": (11, size - 1), "middle": (9, size // 2 + 3)}[where]
    for value in bad_values(dtype):
        cache = ones((NUM_BLOCKS, *BLOCK), dtype)
        cache[block].view(-1)[flat] = value
        before = raw(cache).clone()
        result = check(cache, selected, method)
        expect(result, *finding(value, block), checked=len(selected))
        assert result.result == (CHECK_NAN if math.isnan(value) else CHECK_INF)
        assert not result.clean and result.bad_block_ids == (block,)
        assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_per_layer_key_value_pairs(method, dtype, where):
    layer, kv, block, flat = {
        "first": (0, 0, 0, 0),
        "last": (2, 1, 15, BLOCK[0] * BLOCK[1] * BLOCK[2] - 1),
        "middle": (1, 1, 6, 17),
    }[where]
    for value in bad_values(dtype):
        layers = [(ones((NUM_BLOCKS, *BLOCK), dtype), ones((NUM_BLOCKS, *BLOCK), dtype)) for _ in range(3)]
        layers[layer][kv][block].view(-1)[flat] = value
        expect(check(layers, [0, 5, 6, 7, 15], method), *finding(value, block), checked=5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_blocks_outside_selection_never_reported(method, dtype):
    cache = torch.ones(NUM_BLOCKS, *BLOCK, dtype=dtype)
    for b in (0, 1, 7, 15):
        cache[b, 1, 1, 1] = NAN
    cache[8, 0, 0, 0] = -INF
    expect(check(cache, [2, 3, 4, 5, 6, 9, 10, 14], method), checked=8)
    expect(check(cache, [6, 7, 8, 9], method), nan={7}, inf={8})


@pytest.mark.parametrize("method", METHODS)
def test_nan_wins_over_inf_in_one_block_and_across_tensors(method):
    k = torch.ones(NUM_BLOCKS, *BLOCK)
    v = torch.ones(NUM_BLOCKS, *BLOCK)
    k[3, 0, 0, 0] = INF
    k[3, 3, 1, 7] = NAN
    k[5, 0, 0, 0] = -INF
    v[5, 0, 0, 0] = NAN
    k[6, 2, 0, 0] = INF
    v[6, 1, 0, 0] = -INF
    result = check([(k, v)], range(NUM_BLOCKS), method)
    expect(result, nan={3, 5}, inf={6})
    assert result.bad_block_ids == (3, 5, 6)
    assert result.result == CHECK_NAN


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_block_dim_one_layers_first_layout(method, dtype):
    cache = torch.zeros(3, NUM_BLOCKS, *BLOCK, dtype=dtype)  # [layers, blocks, ...]
    cache[2, 10, -1, -1, -1] = NAN
    cache[0, 4, 0, 0, 0] = INF
    before = raw(cache).clone()
    expect(check(cache, [4, 10, 11], method, block_dim=1), nan={10}, inf={4})
    expect(check(cache, [4, 10, 11], method, block_dim=-4), nan={10}, inf={4})
    expect(check(cache, [5, 9, 11], method, block_dim=1))
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_contiguous_views(method, dtype):
    base = torch.zeros(NUM_BLOCKS, 2 * BLOCK[0], BLOCK[2], BLOCK[1], dtype=dtype)
    view = base[:, ::2].transpose(2, 3)  # strided and transposed: [blocks, 4, 2, 8], not contiguous
    assert not view.is_contiguous()
    base[7, 1, 0, 0] = NAN  # hidden by the stride: not part of the view
    base[9, 6, 5, 1] = -INF  # visible: view[9, 3, 1, 5]
    expect(check(view, range(NUM_BLOCKS), method), inf={9})
    cache = torch.zeros(NUM_BLOCKS, *BLOCK, dtype=dtype)
    cache[12, 3, 1, 7] = NAN
    expect(check(cache.transpose(0, 1), [11, 12, 13], method, block_dim=1), nan={12})
    expect(check(cache[:, :, :, 1:], [11, 12, 13], method), nan={12})  # pieces at an odd element offset
    expect(check(cache[:, :, :, :7], [11, 12, 13], method))  # the NaN sits just past the view


@pytest.mark.parametrize("method", METHODS)
def test_expanded_and_offset_views(method):
    block = torch.ones(1, *BLOCK)
    block[0, 1, 1, 1] = INF
    expanded = block.expand(NUM_BLOCKS, *BLOCK)  # block stride 0: every block is the same memory
    expect(check(expanded, [0, 9], method), inf={0, 9})
    storage = torch.ones(3 * NUM_BLOCKS, *BLOCK)
    storage[NUM_BLOCKS + 4, 0, 0, 0] = NAN
    expect(check(storage[NUM_BLOCKS : 2 * NUM_BLOCKS], [3, 4, 5], method), nan={4})


@pytest.mark.parametrize("method", METHODS)
def test_large_runs_stay_exact(method):
    cache = torch.ones(64, 64, 8, 128, dtype=torch.bfloat16)  # 8 MiB
    cache[63, -1, -1, -1] = INF
    cache[0, 0, 0, 0] = NAN
    cache[31, 17, 3, 3] = -INF
    expect(check(cache, range(64), method), nan={0}, inf={31, 63})
    expect(check(cache, range(1, 63), method), inf={31})
    expect(check(cache, [31, 62, 63], method), inf={31, 63})


@pytest.mark.parametrize("method", METHODS)
def test_duplicates_and_id_types(method):
    cache = torch.ones(NUM_BLOCKS, *BLOCK)
    cache[4, 0, 0, 0] = NAN
    id_forms = (
        [4, 4, 1, 4],
        (1, 4),
        np.array([4, 1, 1]),
        np.array([[1], [4]], dtype=np.uint8),
        torch.tensor([1, 4, 4], dtype=torch.int32),
        iter([1, 4]),
        range(1, 5, 3),
        [np.int64(4), np.int16(1)],
    )
    for ids in id_forms:
        expect(check(cache, ids, method), nan={4}, checked=2)
    expect(check(cache, [], method), checked=0)
    assert check(cache, np.array([], dtype=np.int64), method).clean


@pytest.mark.parametrize("method", METHODS)
def test_extreme_finite_values_are_no_false_alarm(method):
    for dtype in FLOATS + FP8:
        info = torch.finfo(dtype)
        cache = torch.full((NUM_BLOCKS, *BLOCK), info.max, dtype=torch.float64).to(dtype)
        if dtype != torch.float8_e8m0fnu:  # e8m0 has no sign
            cache[::2] = -info.max
        cache[3] = info.tiny
        cache[5] = 0
        assert check(cache, range(NUM_BLOCKS), method).result == CHECK_CLEAN, dtype


@pytest.mark.timeout(120)
def test_512_mib_fp16_no_false_alarm():
    cache = torch.ones(4096, 64, 8, 128, dtype=torch.float16)  # 512 MiB; sum() of it is inf
    assert torch.isinf(cache[:1024].sum())
    for method in METHODS:
        assert check(cache, range(4096), method).clean
    cache[2048:] = torch.finfo(torch.float16).max
    cache[4000:] = -torch.finfo(torch.float16).max
    for method in METHODS:
        result = check(cache, range(4096), method)
        assert result.clean and result.checked_blocks == 4096
    cache[4095, 63, 7, 127] = NAN
    cache[0, 0, 0, 0] = -INF
    for method in METHODS:
        expect(check(cache, range(4096), method), nan={4095}, inf={0})


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_every_variant(method, dtype):
    cache = ones((NUM_BLOCKS, *BLOCK), dtype)
    cache[2, 0, 0, 0] = NAN
    if dtype in WITH_INF:
        cache[5, 1, 1, 1] = -INF
    else:
        cache[5, 1, 1, 1] = torch.finfo(dtype).max  # the largest finite value, not a finding
    before = raw(cache).clone()
    expect(check(cache, range(NUM_BLOCKS), method), nan={2}, inf={5} if dtype in WITH_INF else ())
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_fp8_torch_chunks_find_bad_values_at_every_chunk_edge(monkeypatch, dtype):
    """The torch path upcasts fp8 in chunks of whole blocks: a finding in the first block of a chunk, its
    last block, or a run starting mid-chunk must never fall between two chunks."""
    per_block = BLOCK[0] * BLOCK[1] * BLOCK[2]
    monkeypatch.setattr(torch_path, "FP8_CHUNK_ELEMENTS", 3 * per_block)  # 3 blocks per chunk
    num_blocks = 20
    for ids in (range(num_blocks), range(1, num_blocks), [0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 19]):
        chunks = torch_path._chunks(ones((num_blocks, *BLOCK), dtype), runs(sorted(ids)), per_block)
        firsts = {start for start, _ in chunks}
        lasts = {start + length - 1 for start, length in chunks}
        assert len(chunks) > 2 and all(length <= 3 for _, length in chunks)
        for block in sorted(firsts | lasts):
            for value in bad_values(dtype):
                cache = ones((num_blocks, *BLOCK), dtype)
                cache[block, 0, 0, 0] = value
                expect(check_blocks(cache, ids, method="torch"), *finding(value, block))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    method=st.sampled_from(METHODS),
    dtype=st.sampled_from(FLOATS + FP8),
    block_dim=st.sampled_from([0, 1, -1]),
    layers=st.integers(1, 3),
    strided=st.booleans(),
)
def test_random_selections_match_naive_reference(data, method, dtype, block_dim, layers, strided):
    """Contiguous tensors and strided, non-contiguous ones; any block dim; both paths."""
    num_blocks = data.draw(st.integers(1, 24))
    shape = {0: (num_blocks, 3, 5), 1: (2, num_blocks, 7), -1: (3, 4, num_blocks)}[block_dim]
    if strided:
        tensors = [ones((*shape[:-1], 2 * shape[-1]), dtype)[..., ::2] for _ in range(2 * layers)]
    else:
        tensors = [ones(shape, dtype) for _ in range(2 * layers)]
    for _ in range(data.draw(st.integers(0, 6))):
        t = tensors[data.draw(st.integers(0, len(tensors) - 1))]
        where = np.unravel_index(data.draw(st.integers(0, t.numel() - 1)), shape)
        t[tuple(int(i) for i in where)] = data.draw(st.sampled_from(bad_values(dtype)))
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=2 * num_blocks))
    befores = [raw(t).clone() for t in tensors]
    cache = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(layers)]
    result = check(cache, ids, method, block_dim=block_dim)
    nan, inf = naive(tensors, ids, block_dim)
    expect(result, nan, inf, checked=len(set(ids)))
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, befores))


@pytest.mark.parametrize("method", METHODS)
def test_empty_blocks_are_clean(method):
    expect(check(torch.ones(4, 0), [1, 2], method), checked=2)


# --- results and errors -------------------------------------------------------------------------------------


def test_check_result_properties():
    result = CheckResult(10, nan_block_ids=(7,), inf_block_ids=(2, 9))
    assert result.bad_block_ids == (2, 7, 9) and not result.clean and result.result == CHECK_NAN
    assert CheckResult(3, (), (1,)).result == CHECK_INF
    assert CheckResult(0, (), ()).clean and CheckResult(0, (), ()).result == CHECK_CLEAN


def test_corrupt_kv_error_message_and_pickle():
    result = CheckResult(40, nan_block_ids=(3,), inf_block_ids=tuple(range(10, 20)))
    err = CorruptKVError("prefetch", result)
    assert isinstance(err, RuntimeError)
    assert err.path == "prefetch" and err.result is result
    assert err.bad_block_ids == (3, *range(10, 20))
    message = str(err)
    for part in ("'prefetch'", "11 of 40", "1 NaN", "10 Inf", "3, 10, 11", "..."):
        assert part in message
    clone = pickle.loads(pickle.dumps(err))
    assert clone.path == "prefetch" and clone.result == result and str(clone) == message


# --- policy and sampling ------------------------------------------------------------------------------------


def test_policy_validation():
    assert POLICIES == ("raise", "skip", "count")
    assert IntegrityPolicy().mode == "raise"
    with pytest.raises(ValueError, match="raise, skip, count"):
        IntegrityPolicy(mode="quarantine")
    for bad in ({"every": 0}, {"every": 1.5}, {"fraction": 0.0}, {"fraction": 1.5}, {"every": 2, "fraction": 0.5}):
        with pytest.raises(ValueError):
            IntegrityPolicy(**bad)


def test_sampler_every_nth():
    sampler = IntegrityPolicy(every=3).sampler()
    assert [sampler.should_check() for _ in range(9)] == [True, False, False] * 3
    always = IntegrityPolicy().sampler()
    assert all(always.should_check() for _ in range(100))


class _Draws(random.Random):
    """A random source that returns the given draws in turn."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__()
        self._draws = iter(draws)

    def random(self) -> float:
        return next(self._draws)


def test_sampler_fraction_checks_exactly_the_draws_below_it():
    sampler = IntegrityPolicy(fraction=0.25).sampler(_Draws([0.0, 0.2499, 0.25, 0.9]))
    assert [sampler.should_check() for _ in range(4)] == [True, True, False, False]


def test_sampler_fraction_seeded():
    picks = [IntegrityPolicy(fraction=0.25).sampler(random.Random(7)) for _ in range(2)]
    runs = [[s.should_check() for _ in range(4000)] for s in picks]
    assert runs[0] == runs[1]
    assert 0.22 < sum(runs[0]) / 4000 < 0.28
    full = IntegrityPolicy(fraction=1.0).sampler(random.Random(1))
    assert all(full.should_check() for _ in range(100))


def test_sampler_thread_safe():
    from concurrent.futures import ThreadPoolExecutor

    sampler = IntegrityPolicy(every=4).sampler()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: sampler.should_check(), range(4000)))
    assert sum(results) == 1000
