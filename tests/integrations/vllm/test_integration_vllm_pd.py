"""vLLM's PD path under KVObsConnector: the REAL NixlConnector scheduler halves of vLLM 0.33 on both nodes
(prefill: `request_finished` hands kv_transfer_params to the decode node; decode: matches, allocates and
builds the real `NixlConnectorMetadata`), and on the decode worker a connector that performs NIXL's read on a
thread (NIXL itself needs RDMA hardware; see vllm_pd_harness).

The prefill's `send` transfer carries its trace context in kv_transfer_params; the decode's `receive`
continues it: shown across two processes with the real OTLP exporter and a receiver.
"""

# ruff: noqa: F811  (pytest fixtures imported from upstream are parameters of the tests)
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import upstream
from prometheus_client import CollectorRegistry
from support import otlp_receiver
from upstream import vllm  # noqa: F401  (the fixture)
from vllm_harness import (
    create,
    default_engine_observer,  # noqa: F401  (autouse fixture)
    engine_label,
    layer_caches,
    wait_until,
    wrapper_config,
)
from vllm_pd_harness import (
    REMOTE_BLOCKS,
    decode_request,
    decode_schedule,
    finished_prefill,
    nixl_child,
    receive_until,
    simulated_worker_child,
)

import kvobs
from kvobs import semconv as sc
from kvobs.integrations.vllm import TRACE_CONTEXT_KEY, use_observer
from kvobs.testing import Captured, capture

REPO = Path(__file__).resolve().parents[3]


class Nodes:
    """A prefill scheduler, a decode scheduler and a decode worker, all wrapped, on one captured observer."""

    def __init__(self, vllm: upstream.Upstream, cap: Captured, **options: Any) -> None:
        self.vllm = vllm
        label = cap.observer.engine
        self.prefill = create(vllm, wrapper_config(vllm, nixl_child("kv_producer"), engine=label, **options),
                              role="SCHEDULER")
        self.decode = create(vllm, wrapper_config(vllm, nixl_child("kv_consumer"), engine=label, **options),
                             role="SCHEDULER")
        self.worker = create(vllm, wrapper_config(vllm, simulated_worker_child(), engine=label, **options))
        self.caches = layer_caches()

    def hand_over(self, request_id: str, prefill_blocks: list[int], values: list[float]) -> dict[str, Any]:
        """The prefill node finishes `request_id`: its blocks hold `values`; returns its kv_transfer_params."""
        delay_free, params = self.prefill.request_finished_all_groups(
            finished_prefill(self.vllm, request_id), (prefill_blocks,))
        assert delay_free is True
        for block, value in zip(prefill_blocks, values):
            REMOTE_BLOCKS[(params["remote_engine_id"], block)] = value
        return params

    def receive(self, request_id: str, params: dict[str, Any], local_blocks: list[int]) -> None:
        """The decode node schedules the request and its worker starts the read."""
        metadata = decode_schedule(self.vllm, self.decode, decode_request(request_id, params), local_blocks)
        self.worker.bind_connector_metadata(metadata)
        self.worker.start_load_kv(None)


@pytest.fixture
def nodes(vllm: upstream.Upstream, request: pytest.FixtureRequest) -> Iterator[tuple[Nodes, Captured]]:
    options = getattr(request, "param", {})
    records: list[Any] = []
    with capture(engine=engine_label(), lock=None, hooks=[records.append], **options.pop("observer", {})) as cap:
        cap.records = records  # type: ignore[attr-defined]
        undo = use_observer(cap.observer)
        made = Nodes(vllm, cap, **options)
        made.worker.register_kv_caches(made.caches)
        try:
            yield made, cap
        finally:
            undo()


def outcomes(cap: Captured, path: str) -> list[tuple[Any, str]]:
    return [(r.key, r.outcome) for r in cap.records if r.path == path]  # type: ignore[attr-defined]


def test_the_prefill_send_carries_its_trace_context_and_ends_when_the_workers_report_it(
        nodes: tuple[Nodes, Captured], vllm: upstream.Upstream) -> None:
    pd, cap = nodes
    params = pd.hand_over("req-1", [1, 2], [0.5, 0.25])
    send = cap.observer.open_transfer(sc.PATH_SEND, "req-1")
    assert params[TRACE_CONTEXT_KEY] == send.carrier() and params["remote_block_ids"] == ([1, 2],)
    pd.prefill.update_connector_output(vllm.attr("vllm.v1.outputs:KVConnectorOutput")(finished_sending={"req-1"}))
    assert outcomes(cap, sc.PATH_SEND) == [("req-1", sc.OUTCOME_OK)]


def test_the_decode_receive_is_checked_when_the_data_arrived_and_continues_the_trace(
        nodes: tuple[Nodes, Captured]) -> None:
    pd, cap = nodes
    params = pd.hand_over("req-2", [3, 4], [1.0, 2.0])
    pd.caches["layer.0"][6] = math.nan  # stale data where the KV will arrive
    pd.worker.kvobs_wrapped.gate.clear()
    pd.receive("req-2", params, local_blocks=[6, 7])
    receive = cap.observer.open_transfer(sc.PATH_RECEIVE, "req-2")
    assert receive is not None and outcomes(cap, sc.PATH_RECEIVE) == []
    pd.worker.kvobs_wrapped.gate.set()
    seen = receive_until(pd.worker, "req-2")
    assert seen == {"finished": {"req-2"}, "failed": set(), "invalid": set()}
    assert outcomes(cap, sc.PATH_RECEIVE) == [("req-2", sc.OUTCOME_OK)]
    spans = {span.name: span for span in cap.spans}
    send_context = cap.observer.open_transfer(sc.PATH_SEND, "req-2").span.get_span_context()
    assert spans["kvobs.receive"].context.trace_id == send_context.trace_id
    assert spans["kvobs.receive"].parent.span_id == send_context.span_id


def test_a_nan_receive_is_reported_to_vllm_as_a_load_failure(nodes: tuple[Nodes, Captured]) -> None:
    pd, cap = nodes
    params = pd.hand_over("req-3", [5, 6], [1.0, math.inf])
    pd.receive("req-3", params, local_blocks=[2, 3])
    seen = receive_until(pd.worker, "req-3")
    assert seen["invalid"] == {3} and seen["failed"] == set()
    assert outcomes(cap, sc.PATH_RECEIVE) == [("req-3", sc.OUTCOME_REJECTED)]


def test_a_receive_the_connector_failed_is_a_failed_transfer(nodes: tuple[Nodes, Captured]) -> None:
    pd, cap = nodes
    params = pd.hand_over("req-4", [7, 8], [1.0, 1.0])
    del REMOTE_BLOCKS[(params["remote_engine_id"], 8)]  # the read of that block fails
    pd.receive("req-4", params, local_blocks=[4, 5])
    seen = receive_until(pd.worker, "req-4")
    assert seen["failed"] == {"req-4"}
    (record,) = [r for r in cap.records if r.path == sc.PATH_RECEIVE]  # type: ignore[attr-defined]
    assert record.outcome == sc.OUTCOME_ERROR and "failed_recving" in str(record.error)


@pytest.mark.parametrize("nodes", [{"observer": {"deadline": 0.3}}], indirect=True)
def test_a_receive_never_reported_is_abandoned_at_its_deadline(nodes: tuple[Nodes, Captured]) -> None:
    pd, cap = nodes
    params = pd.hand_over("req-5", [9], [1.0])
    pd.worker.kvobs_wrapped.lose.add("req-5")
    pd.receive("req-5", params, local_blocks=[1])
    wait_until(lambda: outcomes(cap, sc.PATH_RECEIVE) == [("req-5", sc.OUTCOME_ABANDONED)])


def test_with_several_kv_groups_a_nan_receive_fails_the_request(vllm: upstream.Upstream) -> None:
    """vLLM refuses block-level load errors for several KV groups: the request goes to failed_recving."""
    nixl = vllm.module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
    iface = vllm.module("vllm.v1.kv_cache_interface")
    spec = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=__import__("torch").float32)
    groups = iface.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        iface.KVCacheGroupSpec(["layer.0"], spec), iface.KVCacheGroupSpec(["layer.1"], spec)])
    with capture(engine=engine_label(), lock=None) as cap:
        undo = use_observer(cap.observer)
        try:
            factory = vllm.attr("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory")
            worker = factory.create_connector(
                wrapper_config(vllm, simulated_worker_child(), engine=cap.observer.engine),
                vllm.attr("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole").WORKER, groups)
            worker.register_kv_caches(layer_caches())
            REMOTE_BLOCKS.update({("p-engine", 1): 1.0, ("p-engine", 2): math.nan})
            metadata = nixl.NixlConnectorMetadata()
            metadata.add_new_req_to_recv("req-6", ([3], [3]), {  # one id in each group: repeated legitimately
                "remote_block_ids": ([1], [2]), "remote_engine_id": "p-engine", "remote_request_id": "req-6",
                "remote_host": "127.0.0.1", "remote_port": 5600}, awaiting_kvs=True)
            worker.bind_connector_metadata(metadata)
            worker.start_load_kv(None)
            seen = receive_until(worker, "req-6")
        finally:
            undo()
    assert seen == {"finished": {"req-6"}, "failed": {"req-6"}, "invalid": set()}


def test_a_notification_only_receive_is_not_observed(nodes: tuple[Nodes, Captured], vllm: upstream.Upstream) -> None:
    """A full local prefix hit: NIXL only notifies the prefill node and never reports the request received."""
    pd, cap = nodes
    params = pd.hand_over("req-7", [2], [1.0])
    request = decode_request("req-7", params)
    pd.decode.get_num_new_matched_tokens(request, 0)
    blocks = vllm.attr("vllm.v1.core.kv_cache_manager:KVCacheBlocks")(blocks=([],))
    pd.decode.update_state_after_alloc(request, blocks, 0)
    metadata = pd.decode.build_connector_meta(vllm.attr("vllm.v1.core.sched.output:SchedulerOutput").make_empty())
    assert metadata.wrapped.reqs_to_recv["req-7"].awaiting_kvs is False
    pd.worker.bind_connector_metadata(metadata)
    pd.worker.start_load_kv(None)
    assert cap.observer.open_transfer(sc.PATH_RECEIVE, "req-7") is None


# --------------------------------------------------------------------------------------------
# One trace across two processes, through the real OTLP exporter
# --------------------------------------------------------------------------------------------

DECODE_NODE = """
import json, sys
sys.path[:0] = ["tests", "."]
import upstream
import vllm_harness as s
import vllm_pd_harness as pd

message = json.loads(sys.stdin.readline())
with upstream.require("vllm").active() as vllm:
    pd.REMOTE_BLOCKS.update({(message["engine_id"], int(b)): v for b, v in message["blocks"].items()})
    options = {"engine": "vllm-decode", "tracing": True}  # spans exported as the OTEL_* variables say
    scheduler = s.create(vllm, s.wrapper_config(vllm, pd.nixl_child("kv_consumer"), **options), role="SCHEDULER")
    worker = s.create(vllm, s.wrapper_config(vllm, pd.simulated_worker_child(), **options))
    worker.register_kv_caches(s.layer_caches())
    request = pd.decode_request(message["request_id"], message["kv_transfer_params"])
    worker.bind_connector_metadata(pd.decode_schedule(vllm, scheduler, request, local_blocks=[6, 7]))
    worker.start_load_kv(None)
    print(json.dumps({k: sorted(v) for k, v in pd.receive_until(worker, request.request_id).items()}), flush=True)
"""


def test_one_trace_across_the_prefill_and_decode_processes(vllm: upstream.Upstream) -> None:
    with otlp_receiver() as (receiver, port):
        endpoint = f"http://127.0.0.1:{port}"
        provider = kvobs.configure_tracing("kvobs-vllm-prefill", endpoint=endpoint, set_global=False)
        undo = use_observer(kvobs.KVObserver("vllm-prefill", lock=None, registry=CollectorRegistry(),
                                             tracer_provider=provider))
        try:
            prefill = create(vllm, wrapper_config(vllm, nixl_child("kv_producer"), engine="vllm-prefill"),
                             role="SCHEDULER")
            _, params = prefill.request_finished_all_groups(finished_prefill(vllm, "req-8"), ([1, 2],))
            message = {"request_id": "dec-8", "kv_transfer_params": params,
                       "engine_id": params["remote_engine_id"], "blocks": {"1": 0.5, "2": 0.25}}
            decoded = _decode_node(endpoint, json.dumps(message))
            output = vllm.attr("vllm.v1.outputs:KVConnectorOutput")(finished_sending={"req-8"})
            prefill.update_connector_output(output)  # the decode node's read is done: the send ends
        finally:
            undo()
        provider.shutdown()
        deadline = time.monotonic() + 10
        while len(receiver.spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert json.loads(decoded) == {"failed": [], "finished": ["dec-8"], "invalid": []}
    spans = {span.name: (service, span) for service, span in receiver.spans}
    (prefill_service, send), (decode_service, receive) = spans["kvobs.send"], spans["kvobs.receive"]
    assert prefill_service["service.name"] == "kvobs-vllm-prefill"
    assert decode_service["service.name"] == "kvobs-vllm-decode"
    assert receive.trace_id == send.trace_id and receive.parent_span_id == send.span_id
    attributes = {a.key: a.value.string_value for a in receive.attributes}
    assert attributes[sc.ATTR_REQUEST_ID] == "dec-8"


def _decode_node(endpoint: str, message: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "kvobs-vllm-decode"}
    out = subprocess.run([sys.executable, "-c", DECODE_NODE], input=message + "\n", capture_output=True,
                         text=True, env=env, timeout=180, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]



def test_null_blocks_of_a_sliding_window_group_are_left_out() -> None:
    """vLLM pads a sliding-window group's blocks with the null block 0: nothing moves there."""
    from kvobs.integrations.vllm._receive import flat, per_group

    assert flat(per_group(([4, 5], [0, 0, 6]))) == ([4, 5, 6], [2, 1])
    assert flat(per_group([7, 8])) == ([7, 8], [2])
