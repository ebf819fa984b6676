"""validate_cache: a cache that cannot be checked fails once, up front, with an error naming the problem; a
validated cache is described (blocks, devices, dtypes, methods) and reused by every check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvobs.integrity import ValidatedCache, check_blocks, validate_cache

NUM_BLOCKS = 16


def kv(blocks: int = NUM_BLOCKS, dtype=torch.float16) -> torch.Tensor:
    return torch.ones(blocks, 4, 2, 8, dtype=dtype)


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        (torch.int32, r"torch.int32|int32 tensor \(cache\).*floating-point"),
        (torch.uint8, "uint8 tensor"),
        (torch.bool, "bool tensor"),
        (torch.complex64, "complex64 tensor"),
        (torch.float4_e2m1fn_x2, "float4_e2m1fn_x2, which cannot encode NaN or Inf"),
    ],
)
def test_dtypes_that_hold_no_nan(dtype, message):
    with pytest.raises(TypeError, match=message):
        validate_cache(torch.zeros(4, 2, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else
                       torch.zeros(4, 2, dtype=dtype))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_meta_and_sparse_tensors():
    with pytest.raises(ValueError, match=r"cache\[1\] is on the meta device"):
        validate_cache([kv(), torch.ones(NUM_BLOCKS, 4, device="meta")])
    with pytest.raises(TypeError, match="sparse_coo tensor: only dense"):
        validate_cache(kv().to_sparse())
    with pytest.raises(TypeError, match="sparse_csr tensor"):
        validate_cache(torch.ones(NUM_BLOCKS, 4).to_sparse_csr())


def test_meta_tensor_block_ids_are_a_clear_error():
    with pytest.raises(ValueError, match="block ids are a meta tensor: it holds no values to read"):
        check_blocks(kv(), torch.tensor([1, 2], device="meta"))


def test_block_dim_out_of_range_names_the_tensor_and_shape():
    with pytest.raises(ValueError, match=r"block_dim 3 out of range for cache\[0\]\[1\] of shape \(16, 4\)"):
        validate_cache([(kv(), torch.ones(NUM_BLOCKS, 4))], block_dim=3)
    with pytest.raises(ValueError, match="block_dim -5 out of range"):
        validate_cache(kv(), block_dim=-5)
    with pytest.raises(TypeError):
        validate_cache(kv(), block_dim=1.0)


def test_tensors_disagreeing_on_the_block_count_are_named():
    with pytest.raises(ValueError, match=r"disagree .* dim 0: 16 in cache\[0\], 15 in cache\[1\]\[0\]"):
        validate_cache([kv(), (kv(15), kv())])


@pytest.mark.parametrize("cache", [[], (), [[], ()]])
def test_no_tensors(cache):
    with pytest.raises(ValueError, match="no tensors"):
        validate_cache(cache)


@pytest.mark.parametrize("cache", [{"k": kv()}, "cache", 3, None, [kv(), object()]])
def test_not_a_tensor(cache):
    with pytest.raises(TypeError, match="must be a tensor .*DLPack"):
        validate_cache(cache)


def test_dlpack_object_that_refuses_is_a_type_error():
    class Refuses:
        def __dlpack__(self, *args, **kwargs):
            raise BufferError("no export")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match=r"cache\[0\]: cannot read this Refuses through DLPack.*no export"):
        validate_cache([Refuses()])


def test_description():
    cache = [(kv(dtype=torch.bfloat16), kv(dtype=torch.bfloat16)), (kv(), kv())]
    validated = validate_cache(cache)
    assert validated.num_blocks == NUM_BLOCKS and validated.block_dim == 0
    assert validated.devices == ("cpu",)
    assert validated.dtypes == ("bfloat16", "float16")
    assert len(validated.tensors) == 4 and validated.tensors[0] is cache[0][0]
    assert set(validated.methods) <= {"kernel", "torch"} and len(validated.methods) == 4
    text = repr(validated)
    assert "4 tensors" in text and "num_blocks=16" in text and "tensor(" not in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        validated.num_blocks = 3  # type: ignore[misc]
    layers_first = validate_cache(torch.ones(3, 10, 4), block_dim=1)
    assert layers_first.num_blocks == 10 and layers_first.block_dim == 1


def test_a_validated_cache_is_reused_as_it_is():
    validated = validate_cache(torch.ones(4, 10, 4), block_dim=1)
    assert validate_cache(validated) is validated
    assert validate_cache(validated, block_dim=1) is validated
    with pytest.raises(ValueError, match="validated with block_dim=1, not 0"):
        validate_cache(validated, block_dim=0)
    with pytest.raises(ValueError, match="validated with block_dim=1, not 0"):
        check_blocks(validated, [1], block_dim=0)
    assert check_blocks(validated, [1, 9], block_dim=1).checked_blocks == 2


def test_a_validated_cache_is_not_validated_again(monkeypatch):
    from kvobs.integrity import _layout as layout

    validated = validate_cache(kv())
    monkeypatch.setattr(layout, "_validate_tensor", lambda *args: pytest.fail("validated again"))
    monkeypatch.setattr(layout, "_flatten", lambda *args: pytest.fail("flattened again"))
    assert check_blocks(validated, [1, 2]).clean


def test_block_ids_beyond_the_cache():
    validated = validate_cache(kv())
    for ids in ([0, 16], [-1, 3], np.array([3, 99])):
        bad = max(ids) if max(ids) >= NUM_BLOCKS else min(ids)
        with pytest.raises(IndexError, match=rf"block id {bad} out of range: the cache has 16 blocks \(ids 0..15\)"):
            check_blocks(validated, ids)
        with pytest.raises(IndexError, match=rf"block id {bad} out of range"):
            validated.block_ids(ids)
    for ids in ([15, 0, 15], (15, 0, 15), np.array([15, 0, 15]), torch.tensor([15, 0, 15])):
        normalized = validated.block_ids(ids)
        assert normalized.dtype == np.int64 and normalized.tolist() == [0, 15]


@pytest.mark.parametrize(
    "ids", [[1.0], [True], ["3"], torch.tensor([1.0]), torch.tensor([True]), np.array([0.5]), [None], None, 3,
            [3, True], (2, 1.0), [1, 2.5, 3]]
)
def test_non_integer_ids(ids):
    with pytest.raises(TypeError, match="integers|iterable"):
        check_blocks(kv(), ids)


@pytest.mark.parametrize("ids", [[1, 2**63], (2**70, 3), [-(2**64), 0]])
def test_ids_beyond_int64_are_named_out_of_range(ids):
    bad = max(ids) if max(ids) >= NUM_BLOCKS else min(ids)
    with pytest.raises(IndexError, match=rf"block id {bad} out of range"):
        check_blocks(kv(), ids)


def test_lists_of_other_int_types_take_the_general_path():
    cache = kv()
    cache[4, 0, 0] = float("nan")
    assert check_blocks(cache, [np.int32(4), np.uint8(4), 2]).nan_block_ids == (4,)


@pytest.mark.parametrize(("ids", "kind"), [(np.array([0.5]), "a float64 array"), (np.array([True]), "a bool array"),
                                           (torch.tensor([1.0]), "a torch.float32 tensor")])
def test_a_non_integer_id_array_is_named_as_what_it_is(ids, kind):
    with pytest.raises(TypeError, match=f"block ids must be integers, got {kind}"):
        check_blocks(kv(), ids)


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of auto, kernel, torch, got 'fast'"):
        check_blocks(kv(), [1], method="fast")


def test_validated_cache_is_exported():
    from kvobs import integrity

    assert integrity.ValidatedCache is ValidatedCache
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        integrity.nope  # noqa: B018
