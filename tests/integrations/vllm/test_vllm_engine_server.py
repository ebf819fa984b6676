"""kvobs inside vLLM's OpenAI API server, its engine core (scheduler and worker) in a process of its own, as
operators run it: the wrapped OffloadingConnector serves the plain engine's text, reuses prefixes through
kvobs (`cached_tokens`), and kvobs's series appear on the server's own `/metrics` when PROMETHEUS_MULTIPROC_DIR
is set (the documented way: kvobs records in the engine-core process, the server answers /metrics), without
the gauges of an engine process that was killed.
"""

from __future__ import annotations

import pytest

from running_vllm import harness
from running_vllm.harness import prompt, samples

TEXT = prompt(11)


@pytest.fixture(scope="module")
def reference() -> str:
    with harness.engine(None) as plain:
        (out,) = plain.generate([TEXT])
    return out["text"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_dir = tmp_path_factory.mktemp("prometheus-multiproc")
    harness.leave_a_dead_engines_gauges(metrics_dir)  # a previous run's engine core, killed mid-load
    log = tmp_path_factory.mktemp("server") / "server.log"
    with harness.api_server(harness.offloading(), log, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
                            VLLM_SERVER_DEV_MODE="1") as running:
        yield running


def test_api_server_serves_the_plain_text_and_reuses_prefixes_through_kvobs(server, reference):
    first = server.complete(TEXT)
    server.post("/reset_prefix_cache")
    second = server.complete(TEXT)
    assert first["choices"][0]["text"] == reference
    assert second["choices"][0]["text"] == reference
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_kvobs_series_are_on_the_servers_metrics(server):
    server.complete(TEXT)
    text = server.metrics()
    assert samples(text, "kvobs_transfers_total", path="write_back", outcome="ok") >= 1
    assert samples(text, "kvobs_transfers_total", path="prefetch", outcome="ok") >= 1
    assert samples(text, "kvobs_nan_checks_total", path="prefetch", result="clean") >= 1
    assert samples(text, "kvobs_lock_wait_seconds_count", path="prefetch") >= 1
    assert "vllm:" in text, "vLLM's own series are missing: not the engine's /metrics"


def test_a_killed_engines_loads_are_not_in_flight_on_the_servers_metrics(server):
    """The directory held a killed engine's load in flight (the fixture left it): the engine core that
    started since cleared it, and its own loads have all ended."""
    server.complete(TEXT)
    text = server.metrics()
    assert samples(text, "kvobs_transfers_total") >= 1  # kvobs's series are there...
    assert samples(text, "kvobs_transfers_in_flight", path="prefetch") == 0
    assert samples(text, "kvobs_transfer_oldest_open_age_seconds", path="prefetch") == 0
