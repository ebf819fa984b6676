"""Batches: one guarded call or transfer for many requests (vLLM NIXL's reqs_to_recv, FastDeploy's per-layer
write_cache over several requests' blocks): one lock claim, one span naming every request, per-request
counts and hook records."""

from __future__ import annotations

import pytest
import torch

import kvobs
from kvobs import semconv as sc
from support import lock_is_free


def test_a_batch_claims_once_and_counts_per_request(cap):
    records = []
    obs = kvobs.KVObserver("batch", registry=cap.registry, tracer_provider=cap.provider, integrity="raise",
                           block_bytes=100, hooks=[records.append])
    cache = torch.zeros(32, 4)

    @obs.send(requests="reqs", cache=cache)
    def write_cache(layer, reqs):
        return layer

    assert write_cache(0, {"r1": [1, 2], "r2": [2, 3, 4], "r3": [9]}) == 0  # r1 and r2 share block 2
    assert cap.value(sc.TRANSFERS_TOTAL, engine="batch", path="send", outcome="ok") == 3
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, engine="batch", path="send") == 6
    assert cap.value(sc.TRANSFER_BYTES_TOTAL, engine="batch", path="send") == 600
    assert cap.value(sc.LOCK_WAIT_SECONDS + "_count", engine="batch", lock="thread", path="send") == 3
    assert cap.value(sc.NAN_CHECKS_TOTAL, engine="batch", path="send", result="clean") == 1  # one check
    (span,) = cap.spans
    assert span.attributes[sc.ATTR_REQUEST_IDS] == ("r1", "r2", "r3")
    assert span.attributes[sc.ATTR_BLOCKS] == 6
    assert [(r.request_id, r.blocks, r.bytes) for r in records] == [("r1", 2, 200), ("r2", 3, 300), ("r3", 1, 100)]
    assert lock_is_free(obs.lock)


def test_a_batch_checks_the_union_of_its_blocks_once_and_names_the_bad_one(cap):
    obs = kvobs.KVObserver("batch2", registry=cap.registry, integrity="raise")
    cache = torch.zeros(32, 4)
    cache[3] = float("nan")
    with pytest.raises(kvobs.CorruptKVError) as info:
        obs.begin("write_back", requests={"a": [1, 2], "b": [3]}, cache=cache)
    assert info.value.bad_block_ids == (3,)
    assert lock_is_free(obs.lock)


@pytest.mark.parametrize("requests, message", [
    ({}, "non-empty mapping"),
    ([("a", [1])], "non-empty mapping"),
    ({"a": [1, 1]}, "request 'a': block id 1 appears more than once"),
    ({"a": [1], "b": None}, "request 'b': block ids resolved to None"),
    ({"a": [1, 2], "b": [3, -4]}, "request 'b': block id -4 is negative"),  # a plain list, checked with the union
    ({"a": [1, 2.5], "b": [3]}, "request 'a': block id 2.5 is a float, not an int"),
])
def test_bad_batches_are_rejected_naming_the_request(cap, requests, message):
    obs = kvobs.KVObserver("batch3", registry=cap.registry, integrity=None)
    with pytest.raises(kvobs.TransferRejected, match=message):
        obs.begin("send", requests=requests)
    assert lock_is_free(obs.lock)


def test_block_ids_and_requests_together_are_refused(cap):
    with pytest.raises(kvobs.TransferRejected, match="not both"):
        cap.observer.begin("send", requests={"a": [1]}, block_ids=[1])


# -- a batch of token slots ----------------------------------------------------------------------------------


def test_a_batch_of_token_slots_claims_the_union_of_its_pages(registry):
    paged = kvobs.KVObserver("paged", registry=registry, integrity=None, capacity=16, page_size=4)
    t = paged.begin("prefetch", requests={"a": [0, 1, 5], "b": [5, 9], "c": []})
    assert t.blocks.distinct == (0, 1, 2)  # slots 0, 1 -> page 0; 5 -> page 1 (shared); 9 -> page 2
    assert t.requests == {"a": 2, "b": 2, "c": 0}  # pages per request
    t.complete()
