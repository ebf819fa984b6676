"""kvobs inside a running vLLM (in-process engine): vLLM's OffloadingConnector wrapped by KVObsConnector, on
the tiny random-weight Llama, greedy. One plain engine gives the reference tokens; one wrapped engine (with
tracing to an OTLP receiver on loopback) serves every test of the module, each with prompts of its own.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from running_vllm import harness
from running_vllm.harness import prompt, samples
from support import otlp_receiver

PROMPTS = {name: prompt(seed) for seed, name in enumerate(("reuse", "corrupt", "disk"), start=1)}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Tokens of a plain engine (no connector) for every prompt of the module."""
    with harness.engine(None) as plain:
        outputs = plain.generate(list(PROMPTS.values()))
    return {name: out["token_ids"] for name, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def receiver() -> Any:
    with otlp_receiver() as (receiver, port):
        yield receiver, port


@pytest.fixture(scope="module")
def wrapped(receiver: Any) -> Any:
    _, port = receiver
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_SERVICE_NAME": "vllm-engine-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with harness.engine(harness.offloading(tracing=True), **otel) as running:
        yield running


@pytest.fixture(scope="module")
def disk(tmp_path_factory: Any) -> Any:
    """vLLM's example shared-storage connector (loads in start_load_kv, writes during the pass), wrapped."""
    path = tmp_path_factory.mktemp("kv-files")
    with harness.engine(harness.shared_storage(path)) as running:
        yield running, path


def reuse(engine: harness.Engine, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Serve `text` (its blocks are stored), empty vLLM's own prefix cache, serve it again: the prefix must
    now come back through the connector."""
    (first,) = engine.generate([text])
    engine.call("reset_prefix_cache")
    (second,) = engine.generate([text])
    return first, second


def scrape(engine: harness.Engine) -> str:
    return engine.call("scrape")["text"]


def spans(receiver: Any, name: str, timeout: float = 20.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [span for _, span in receiver.spans if span.name == name]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def attributes(span: Any) -> dict[str, Any]:
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        values[attribute.key] = ([v.int_value for v in value.array_value.values] if kind == "array_value"
                                 else getattr(value, kind))
    return values


def test_wrapped_engine_serves_the_plain_engine_tokens_and_loads_through_kvobs(wrapped, reference):
    first, second = reuse(wrapped, PROMPTS["reuse"])
    assert first["token_ids"] == reference["reuse"]
    assert second["token_ids"] == reference["reuse"]
    assert second["num_cached_tokens"] > 0, "the second request did not load its prefix through the connector"
    text = scrape(wrapped)
    assert samples(text, "kvobs_transfers_total", path="prefetch", outcome="ok") >= 1
    assert samples(text, "kvobs_transfers_total", path="write_back", outcome="ok") >= 1
    assert samples(text, "kvobs_nan_checks_total", path="prefetch", result="clean") >= 1
    assert samples(text, "kvobs_lock_wait_seconds_count", path="prefetch") >= 1


def test_spans_reach_an_otlp_receiver(wrapped, receiver):
    received, _ = receiver
    reuse(wrapped, PROMPTS["reuse"])
    loads = spans(received, "kvobs.prefetch")
    assert loads, "no kvobs.prefetch span arrived over OTLP"
    services = {service.get("service.name") for service, span in received.spans if span.name == "kvobs.prefetch"}
    assert services == {"vllm-engine-test"}
    assert all(attributes(span)["kvobs.bytes"] > 0 for span in loads), "kvobs.bytes is 0 on a load that moved blocks"


def test_a_corrupt_load_is_recomputed_to_the_clean_tokens(wrapped, reference, receiver):
    received, _ = receiver
    (stored,) = wrapped.generate([PROMPTS["corrupt"]])
    assert stored["token_ids"] == reference["corrupt"]
    wrapped.call("reset_prefix_cache")
    assert wrapped.call("poison")["poisoned"] == 1
    before = scrape(wrapped)

    (healed,) = wrapped.generate([PROMPTS["corrupt"]], timeout=60)  # a livelock never answers

    assert healed["finish_reason"] == "length"
    assert healed["token_ids"] == reference["corrupt"]
    after = scrape(wrapped)
    nan = samples(after, "kvobs_nan_checks_total", path="prefetch", result="nan") - samples(
        before, "kvobs_nan_checks_total", path="prefetch", result="nan")
    assert nan >= 1
    rejected_loads = samples(after, "kvobs_transfers_total", path="prefetch", outcome="rejected") - samples(
        before, "kvobs_transfers_total", path="prefetch", outcome="rejected")
    assert rejected_loads >= 1
    assert any("kvobs.integrity.bad_blocks" in line for line in wrapped.log)
    assert any("kv_load_failure_policy set to recompute" in line for line in wrapped.log), "not said at start-up"
    rejected = [span for span in spans(received, "kvobs.prefetch") if span.status.code == 2]
    assert rejected, "no kvobs.prefetch span with ERROR status for the corrupt load"
    assert attributes(rejected[-1]).get("kvobs.integrity.bad_block_ids"), "the bad block ids are not on the span"

    # the corrupt copy is never loaded again: later requests are recomputed from the first bad block
    wrapped.call("reset_prefix_cache")
    (again,) = wrapped.generate([PROMPTS["corrupt"]], timeout=60)
    assert again["token_ids"] == reference["corrupt"]
    again_nan = samples(scrape(wrapped), "kvobs_nan_checks_total", path="prefetch", result="nan")
    assert again_nan == samples(after, "kvobs_nan_checks_total", path="prefetch", result="nan")


def test_shared_storage_loads_and_stores_are_observed_and_a_corrupt_file_is_recomputed(disk, reference):
    engine, path = disk
    first, second = reuse(engine, PROMPTS["disk"])
    assert first["token_ids"] == reference["disk"]
    assert second["token_ids"] == reference["disk"]
    assert second["num_cached_tokens"] > 0
    text = scrape(engine)
    assert samples(text, "kvobs_transfers_total", path="write_back", outcome="ok") >= 1
    assert samples(text, "kvobs_transfers_total", path="prefetch", outcome="ok") >= 1
    assert samples(text, "kvobs_nan_checks_total", path="prefetch", result="clean") >= 1

    assert engine.call("poison_files", path=str(path))["poisoned"] >= 1
    engine.call("reset_prefix_cache")
    (healed,) = engine.generate([PROMPTS["disk"]], timeout=60)
    assert healed["token_ids"] == reference["disk"]
    assert samples(scrape(engine), "kvobs_nan_checks_total", path="prefetch", result="nan") >= 1
