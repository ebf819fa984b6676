"""kvobs.integrity: NaN/Inf checks over selected KV blocks, policies and samplers."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvobs import integrity
from kvobs.integrity import (
    POLICIES,
    CheckResult,
    CorruptKVError,
    IntegrityPolicy,
    check_blocks,
)
from kvobs.semconv import CHECK_CLEAN, CHECK_INF, CHECK_NAN

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BAD_VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
NUM_BLOCKS = 16
BLOCK = (4, 2, 8)  # tokens, heads, head dim


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, comparable with torch.equal even when it holds NaN."""
    return t.contiguous().view(torch.uint8)


def naive(tensors: list[torch.Tensor], ids, block_dim: int = 0) -> tuple[set[int], set[int]]:
    """Reference: per block, NaN anywhere -> nan; else any non-finite -> inf."""
    nan, inf = set(), set()
    for b in set(ids):
        blocks = [t.select(block_dim, b) for t in tensors]
        if any(x.isnan().any() for x in blocks):
            nan.add(b)
        elif any(not torch.isfinite(x).all() for x in blocks):
            inf.add(b)
    return nan, inf


def expect(result: CheckResult, nan=(), inf=(), checked=None) -> None:
    assert result.nan_block_ids == tuple(sorted(nan))
    assert result.inf_block_ids == tuple(sorted(inf))
    if checked is not None:
        assert result.checked_blocks == checked


# --- correctness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_single_tensor_finds_bad_value(dtype, kind, where):
    cache = torch.randn(NUM_BLOCKS, *BLOCK).to(dtype)
    selected = [2, 3, 4, 9, 11]
    size = cache[0].numel()
    block, flat = {"first": (2, 0), "last": (11, size - 1), "middle": (9, size // 2 + 3)}[where]
    cache[block].view(-1)[flat] = BAD_VALUES[kind]
    before = raw(cache).clone()
    result = check_blocks(cache, selected)
    expected = ({block}, set()) if kind == "nan" else (set(), {block})
    expect(result, *expected, checked=len(selected))
    assert result.result == (CHECK_NAN if kind == "nan" else CHECK_INF)
    assert not result.clean and result.bad_block_ids == (block,)
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_per_layer_key_value_pairs(dtype, kind, where):
    layers = [(torch.randn(NUM_BLOCKS, *BLOCK).to(dtype), torch.randn(NUM_BLOCKS, *BLOCK).to(dtype)) for _ in range(3)]
    selected = [0, 5, 6, 7, 15]
    layer, kv, block, flat = {
        "first": (0, 0, 0, 0),
        "last": (2, 1, 15, layers[0][0][0].numel() - 1),
        "middle": (1, 1, 6, 17),
    }[where]
    layers[layer][kv][block].view(-1)[flat] = BAD_VALUES[kind]
    result = check_blocks(layers, selected)
    expect(result, *(({block}, set()) if kind == "nan" else (set(), {block})), checked=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_outside_selection_never_reported(dtype):
    cache = torch.ones(NUM_BLOCKS, *BLOCK, dtype=dtype)
    for b in (0, 1, 7, 15):
        cache[b, 1, 1, 1] = float("nan")
    cache[8, 0, 0, 0] = float("-inf")
    expect(check_blocks(cache, [2, 3, 4, 5, 6, 9, 10, 14]), checked=8)
    expect(check_blocks(cache, [6, 7, 8, 9]), nan={7}, inf={8})


def test_nan_wins_over_inf_in_one_block_and_across_tensors():
    k = torch.ones(NUM_BLOCKS, *BLOCK)
    v = torch.ones(NUM_BLOCKS, *BLOCK)
    k[3, 0, 0, 0], k[3, 3, 1, 7] = float("inf"), float("nan")
    k[5, 0, 0, 0], v[5, 0, 0, 0] = float("-inf"), float("nan")
    k[6, 2, 0, 0], v[6, 1, 0, 0] = float("inf"), float("-inf")
    result = check_blocks([(k, v)], range(NUM_BLOCKS))
    expect(result, nan={3, 5}, inf={6})
    assert result.bad_block_ids == (3, 5, 6)
    assert result.result == CHECK_NAN


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_dim_one_layers_first_layout(dtype):
    cache = torch.zeros(3, NUM_BLOCKS, *BLOCK, dtype=dtype)  # [layers, blocks, ...]
    cache[2, 10, -1, -1, -1] = float("nan")
    cache[0, 4, 0, 0, 0] = float("inf")
    before = raw(cache).clone()
    expect(check_blocks(cache, [4, 10, 11], block_dim=1), nan={10}, inf={4})
    expect(check_blocks(cache, [4, 10, 11], block_dim=-4), nan={10}, inf={4})
    expect(check_blocks(cache, [5, 9, 11], block_dim=1))
    assert torch.equal(raw(cache), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_views(dtype):
    base = torch.zeros(NUM_BLOCKS, 2 * BLOCK[0], BLOCK[2], BLOCK[1], dtype=dtype)
    view = base[:, ::2].transpose(2, 3)  # strided and transposed: [blocks, 4, 2, 8], not contiguous
    assert not view.is_contiguous()
    base[7, 1, 0, 0] = float("nan")  # hidden by the stride: not part of the view
    base[9, 6, 5, 1] = float("-inf")  # visible: view[9, 3, 1, 5]
    expect(check_blocks(view, range(NUM_BLOCKS)), inf={9})
    cache = torch.zeros(NUM_BLOCKS, *BLOCK, dtype=dtype)
    cache[12, 3, 1, 7] = float("nan")
    expect(check_blocks(cache.transpose(0, 1), [11, 12, 13], block_dim=1), nan={12})


def test_large_runs_use_parallel_path_and_stay_exact():
    cache = torch.ones(64, 64, 8, 128, dtype=torch.bfloat16)  # 8 MiB: one slab over all blocks
    cache[63, -1, -1, -1] = float("inf")
    cache[0, 0, 0, 0] = float("nan")
    cache[31, 17, 3, 3] = float("-inf")
    expect(check_blocks(cache, range(64)), nan={0}, inf={31, 63})
    expect(check_blocks(cache, range(1, 63)), inf={31})  # below the parallel size: serial pieces
    expect(check_blocks(cache, [31, 62, 63]), inf={31, 63})


def test_duplicates_and_id_types():
    cache = torch.ones(NUM_BLOCKS, *BLOCK)
    cache[4, 0, 0, 0] = float("nan")
    id_forms = ([4, 4, 1, 4], (1, 4), np.array([4, 1, 1]), torch.tensor([1, 4, 4], dtype=torch.int32), iter([1, 4]))
    for ids in id_forms:
        expect(check_blocks(cache, ids), nan={4}, checked=2)
    expect(check_blocks(cache, []), checked=0)
    assert check_blocks(cache, np.array([], dtype=np.int64)).clean


def test_near_max_values_are_no_false_alarm():
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        cache = torch.full((NUM_BLOCKS, *BLOCK), info.max, dtype=dtype)
        cache[::2] = -info.max
        cache[3] = info.tiny
        assert check_blocks(cache, range(NUM_BLOCKS)).result == CHECK_CLEAN


@pytest.mark.timeout(60)
def test_512_mib_fp16_no_false_alarm():
    cache = torch.ones(4096, 64, 8, 128, dtype=torch.float16)  # 512 MiB; sum() of it is inf
    assert torch.isinf(cache[:1024].sum())
    assert check_blocks(cache, range(4096)).clean
    cache[2048:] = torch.finfo(torch.float16).max
    cache[4000:] = -torch.finfo(torch.float16).max
    result = check_blocks(cache, range(4096))
    assert result.clean and result.checked_blocks == 4096
    cache[4095, 63, 7, 127] = float("nan")
    expect(check_blocks(cache, range(4096)), nan={4095})


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fp8_is_upcast_and_checked(dtype):
    cache = torch.ones(NUM_BLOCKS, *BLOCK).to(dtype)
    cache[2, 0, 0, 0] = float("nan")
    before = raw(cache).clone()
    if dtype == torch.float8_e5m2:
        cache[5, 1, 1, 1] = float("-inf")
        before = raw(cache).clone()
        expect(check_blocks(cache, range(NUM_BLOCKS)), nan={2}, inf={5})
    else:  # e4m3fn has no Inf
        expect(check_blocks(cache, range(NUM_BLOCKS)), nan={2})
    assert torch.equal(raw(cache), before)


def test_fp8_chunks_bound_the_temporary(monkeypatch):
    monkeypatch.setattr(integrity, "_FP8_CHUNK_ELEMENTS", 3 * 64)  # 3 blocks of 64 elements per chunk
    cache = torch.zeros(NUM_BLOCKS, *BLOCK).to(torch.float8_e5m2)
    cache[7, 0, 0, 0] = float("inf")
    cache[13, 0, 0, 0] = float("nan")
    expect(check_blocks(cache, range(1, NUM_BLOCKS)), nan={13}, inf={7})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    block_dim=st.sampled_from([0, 1]),
    layers=st.integers(1, 3),
    strided=st.booleans(),
)
def test_random_selections_match_naive_reference(data, dtype, block_dim, layers, strided):
    """Contiguous tensors (flat segment slices) and strided, non-contiguous ones (narrow views)."""
    num_blocks = data.draw(st.integers(1, 24))
    shape = (num_blocks, 3, 5) if block_dim == 0 else (2, num_blocks, 7)
    if strided:
        tensors = [torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2] for _ in range(2 * layers)]
    else:
        tensors = [torch.randn(shape).to(dtype) for _ in range(2 * layers)]
    for _ in range(data.draw(st.integers(0, 6))):
        t = tensors[data.draw(st.integers(0, len(tensors) - 1))]
        where = np.unravel_index(data.draw(st.integers(0, t.numel() - 1)), shape)
        t[tuple(int(i) for i in where)] = data.draw(st.sampled_from(list(BAD_VALUES.values())))
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=2 * num_blocks))
    befores = [raw(t).clone() for t in tensors]
    cache = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(layers)]
    result = check_blocks(cache, ids, block_dim=block_dim)
    nan, inf = naive(tensors, ids, block_dim)
    expect(result, nan, inf, checked=len(set(ids)))
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, befores))


# --- validation -----------------------------------------------------------------------------------------


def test_out_of_range_ids():
    cache = torch.ones(NUM_BLOCKS, *BLOCK)
    with pytest.raises(IndexError, match=r"block id 16 .*16 blocks"):
        check_blocks(cache, [0, 16])
    with pytest.raises(IndexError, match=r"block id -1 .*16 blocks"):
        check_blocks(cache, [-1, 3])


@pytest.mark.parametrize("ids", [[1.0], [True], ["3"], torch.tensor([1.0]), np.array([0.5]), [None]])
def test_non_integer_ids(ids):
    with pytest.raises(TypeError, match="integers"):
        check_blocks(torch.ones(NUM_BLOCKS, *BLOCK), ids)


def test_invalid_caches():
    with pytest.raises(ValueError, match="disagree"):
        check_blocks([torch.ones(4, 2), torch.ones(5, 2)], [0])
    with pytest.raises(ValueError, match="block_dim 3"):
        check_blocks(torch.ones(4, 2, 2), [0], block_dim=3)
    with pytest.raises(ValueError, match="no tensors"):
        check_blocks([], [0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_blocks({"k": torch.ones(4)}, [0])
    for dtype in (torch.int32, torch.bool, torch.uint8, torch.complex64):
        with pytest.raises(TypeError, match="floating-point"):
            check_blocks(torch.zeros(4, 2, dtype=dtype), [0])


def test_empty_blocks_are_clean():
    expect(check_blocks(torch.ones(4, 0), [1, 2]), checked=2)


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
