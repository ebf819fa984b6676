"""Per-KV-group NaN/Inf checks: block ids are unique only within a KV group, and `group_sizes` says which
group loads which ids, so each id is checked in its own group's layers only (a stale NaN in a group that did
not load the block is no finding)."""

from __future__ import annotations

import itertools

import torch
from prometheus_client import CollectorRegistry

import kvobs
from kvobs.integrations.vllm._transfers import Transfers
from kvobs.integrations.vllm._worker import WorkerSide

NUM_BLOCKS = 16
_labels = itertools.count()


def worker_side() -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    obs = kvobs.KVObserver(f"vllm-groups-{next(_labels)}", lock=None, registry=CollectorRegistry())
    side = WorkerSide(Transfers(obs, "report"), num_blocks=NUM_BLOCKS, group_layers=[["layer.0"], ["layer.1"]],
                      block_size=16, offloading_worker=type("NoWorker", (), {}), transfer_result=tuple)
    caches = {name: torch.zeros(NUM_BLOCKS, 2, 16, 1, 8) for name in ("layer.0", "layer.1")}
    side.registered(object(), caches)
    return side, caches


def test_a_stale_nan_in_a_group_that_did_not_load_the_block_is_no_finding():
    side, caches = worker_side()
    caches["layer.1"][5] = float("nan")  # group 1 holds stale NaN at block 5; only group 0 loads block 5
    side.transfers.begin("prefetch", 1, request_id="r", block_ids=[5, 6], group_sizes=[1, 1])
    assert side.transfers.complete("prefetch", 1) == ()


def test_nan_in_the_group_that_loaded_the_block_is_found():
    side, caches = worker_side()
    caches["layer.1"][6] = float("nan")  # group 1 loads block 6
    side.transfers.begin("prefetch", 2, request_id="r", block_ids=[5, 6], group_sizes=[1, 1])
    assert side.transfers.complete("prefetch", 2) == (6,)
    assert not side.transfers.is_open("prefetch", 2)


def test_a_corrupt_loads_blocks_are_zeroed_in_the_group_that_loaded_them_only():
    """vLLM frees a failed request's blocks as they are (several groups); the NaN must not stay for the next."""
    side, caches = worker_side()
    caches["layer.0"][6] = 7.0  # group 0's data at block 6 (group 0 did not load it)
    caches["layer.1"][6] = float("nan")
    caches["layer.1"][6, 0, 0, 0, 0] = 1.0
    side.transfers.begin("prefetch", 3, request_id="r", block_ids=[5, 6], group_sizes=[1, 1])
    assert side.transfers.complete("prefetch", 3) == (6,)
    assert bool((caches["layer.1"][6] == 0).all())
    assert bool((caches["layer.0"][6] == 7.0).all())


def test_check_every_samples_whole_transfers_so_every_group_of_a_checked_one_is_checked():
    """One transfer in `check_every` is checked, all of it: a sampler drawn per group part would check
    group 0 of every other transfer and group 1 never."""
    obs = kvobs.KVObserver(f"vllm-groups-{next(_labels)}", lock=None, registry=CollectorRegistry())
    side = WorkerSide(Transfers(obs, "report", every=2), num_blocks=NUM_BLOCKS,
                      group_layers=[["layer.0"], ["layer.1"]], block_size=16,
                      offloading_worker=type("NoWorker", (), {}), transfer_result=tuple)
    caches = {name: torch.zeros(NUM_BLOCKS, 2, 16, 1, 8) for name in ("layer.0", "layer.1")}
    side.registered(object(), caches)
    found = []
    for key in range(4):
        caches["layer.1"][6] = float("nan")  # group 1 loads block 6 in every transfer (a finding zeroes it)
        side.transfers.begin("prefetch", key, request_id="r", block_ids=[5, 6], group_sizes=[1, 1])
        found.append(side.transfers.complete("prefetch", key))
    assert found == [(6,), (), (6,), ()]
