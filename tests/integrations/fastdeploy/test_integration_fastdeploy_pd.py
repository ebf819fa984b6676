"""One trace per request across FastDeploy's prefill and decode engines: two real processes, the real OTLP
exporter, a receiver. The prefill engine's send transfer rides with the request's `disaggregate_info` to the
decode engine, whose receive transfer continues it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from fastdeploy_shaped.engine_worker_queue import EngineWorkerQueue, WorkerQueueServer
from fastdeploy_shaped.splitwise_connector import Request, SplitwiseConnector
from support import otlp_receiver

from kvobs import semconv as sc
from kvobs.integrations import fastdeploy as kvfd
from kvobs.testing import capture

REPO = Path(__file__).resolve().parents[3]

NODE = """
import json, sys
from prometheus_client import CollectorRegistry
import kvobs
from kvobs.integrations import fastdeploy as kvfd
from fastdeploy_shaped.engine_worker_queue import EngineWorkerQueue, WorkerQueueServer
from fastdeploy_shaped.splitwise_connector import Request, SplitwiseConnector
role, endpoint = sys.argv[1], sys.argv[2]
provider = kvobs.configure_tracing(f"fd-{role}", endpoint=endpoint, set_global=False)
obs = kvobs.KVObserver(role, tracer_provider=provider, registry=CollectorRegistry(), lock=None, integrity=None)
queue = EngineWorkerQueue(WorkerQueueServer(1))
connector = SplitwiseConnector(queue, role)
if role == "prefill":
    kvfd.instrument_prefill_connector(connector, obs)
    task = Request("req-9", block_tables=[4, 5], disaggregate_info={
        "transfer_protocol": "rdma", "cache_info": {"rdma": {"ip": "10.0.0.2", "port": 7000}}})
    connector.send_splitwise_tasks([task], current_id=3)  # the request goes to the decode engine
    queue.put_finished_req([["req-9", "finished"]])  # its cache messager reports the cache sent
    assert queue.get_finished_req() == [["req-9", "finished"]]  # the engine reads it: the send completes
    print(connector.outbox[0].decode(), flush=True)  # what the decode engine receives
else:
    message = json.loads(sys.stdin.readline())
    task = Request(**message["payload"][0])
    task.disaggregate_info["block_tables"] = [11, 12]  # the decode engine allocated its blocks
    receives = kvfd.instrument_decode_connector(connector, obs)
    connector.send_cache_info_to_prefill([task])  # and tells the prefill node where to write
    receives.received("req-9")  # the cache arrived (the decode engine got the first token)
provider.shutdown()
"""


def _node(role: str, endpoint: str, stdin: str | None = None) -> str:
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", NODE, role, endpoint], input=stdin, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": path}, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_decode_receive_continues_the_prefill_send_trace():
    with otlp_receiver() as (receiver, port):
        endpoint = f"http://127.0.0.1:{port}"
        message = _node("prefill", endpoint)
        assert json.loads(message)["payload"][0]["disaggregate_info"][kvfd.TRACE_KEY]["traceparent"].startswith("00-")
        _node("decode", endpoint, stdin=message)
        deadline = time.monotonic() + 30
        while len(receiver.spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    spans = {span.name: (service, span) for service, span in receiver.spans}
    (prefill, send), (decode, receive) = spans["kvobs.send"], spans["kvobs.receive"]
    assert (prefill["service.name"], decode["service.name"]) == ("fd-prefill", "fd-decode")
    assert receive.trace_id == send.trace_id and receive.parent_span_id == send.span_id
    attributes = {a.key: a.value for a in receive.attributes}
    assert attributes[sc.ATTR_REQUEST_ID].string_value == "req-9"
    assert [v.int_value for v in attributes[sc.ATTR_BLOCK_IDS].array_value.values] == [11, 12]


def _prefill(cap):
    queue = EngineWorkerQueue(WorkerQueueServer(1))
    connector = SplitwiseConnector(queue, "prefill")
    undo = kvfd.instrument_prefill_connector(connector, cap.observer)
    info = {"transfer_protocol": "rdma", "cache_info": {"rdma": {"ip": "10.0.0.2", "port": 7000}}}
    return queue, connector, undo, info


def test_an_error_status_fails_the_send_and_a_refused_begin_leaves_the_engine_untraced():
    records = []
    with capture("fd-prefill", lock=None, hooks=[records.append]) as cap:
        queue, connector, undo, info = _prefill(cap)
        connector.send_splitwise_tasks([Request("a", disaggregate_info=dict(info))], 1)
        connector.send_splitwise_tasks([Request("a", disaggregate_info=dict(info, cache_info={"rdma": {"ip": "x", "port": 1}}))], 2)
        assert len(connector.outbox) == 2  # the duplicate was refused by kvobs and still sent by the engine
        queue.put_finished_req([["a", "write cache error"]])
        assert queue.get_finished_req() == [["a", "write cache error"]]
        undo()
        assert "send_splitwise_tasks" not in vars(connector) and "get_finished_req" not in vars(queue)
    assert [(r.path, r.outcome) for r in records] == [("send", "rejected"), ("send", "error")]
    error = records[1].error
    assert isinstance(error, kvfd.SendFailed) and (error.request_id, error.status) == ("a", "write cache error")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy)) == (kvfd.SendFailed, "the cache send of request 'a' ended with status 'write cache error'")
    assert any(e["event"] == "kvobs.fastdeploy.transfer_not_begun" for e in cap.logs)
