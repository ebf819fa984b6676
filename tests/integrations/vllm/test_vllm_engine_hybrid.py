"""kvobs inside a running vLLM whose model has several KV cache groups: the tiny Llama with a sliding-window
first layer, which vLLM's hybrid KV cache manager keeps in a group of its own. Each offloading job loads
blocks of both groups (`group_sizes`); kvobs checks each group's ids as a transfer of its own.

With several groups vLLM takes no block-level load errors: a corrupt load is reported as the request's
failed receive, and vLLM frees the request's blocks and computes it from the start. Those blocks still
held what the corrupt load wrote, and the next request to get one read the NaN in its unwritten (masked)
slots: the recomputed request answered token 0 throughout. kvobs now zeroes a corrupt load's blocks.
"""

from __future__ import annotations

from typing import Any

import pytest

from running_vllm import harness
from running_vllm.harness import prompt, samples

# five full 32-token blocks each: the sliding-window group loads only the last two
PROMPTS = {name: prompt(seed, words=170) for seed, name in ((21, "reuse"), (22, "corrupt"))}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    with harness.engine(None, model=harness.tiny_model(hybrid=True)) as plain:
        outputs = plain.generate(list(PROMPTS.values()))
    return {name: out["token_ids"] for name, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def hybrid() -> Any:
    with harness.engine(harness.offloading(), model=harness.tiny_model(hybrid=True)) as running:
        yield running


def loads(engine: harness.Engine, outcome: str) -> float:
    return samples(engine.call("scrape")["text"], "kvobs_transfers_total", path="prefetch", outcome=outcome)


def test_each_groups_blocks_load_through_kvobs_and_the_tokens_are_the_plain_engines(hybrid, reference):
    before = loads(hybrid, "ok")
    (first,) = hybrid.generate([PROMPTS["reuse"]])
    hybrid.call("reset_prefix_cache")
    (second,) = hybrid.generate([PROMPTS["reuse"]])
    assert first["token_ids"] == reference["reuse"]
    assert second["token_ids"] == reference["reuse"]
    assert second["num_cached_tokens"] > 0, "the prefix did not load through the connector"
    assert loads(hybrid, "ok") - before == 2  # one load job: a transfer per KV group, both clean


def test_a_corrupt_load_in_a_hybrid_model_is_recomputed_to_the_clean_tokens(hybrid, reference):
    (stored,) = hybrid.generate([PROMPTS["corrupt"]])
    assert stored["token_ids"] == reference["corrupt"]
    hybrid.call("reset_prefix_cache")
    assert hybrid.call("poison")["poisoned"] >= 1
    rejected_before = loads(hybrid, "rejected")

    (healed,) = hybrid.generate([PROMPTS["corrupt"]], timeout=60)

    assert loads(hybrid, "rejected") > rejected_before
    assert healed["token_ids"] == reference["corrupt"]
    hybrid.call("reset_prefix_cache")
    (again,) = hybrid.generate([PROMPTS["corrupt"]], timeout=60)  # the corrupt copy is not loaded again
    assert again["token_ids"] == reference["corrupt"]
