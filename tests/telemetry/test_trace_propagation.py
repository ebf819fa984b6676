"""One trace per request across prefill and decode: two real processes, the real OTLP exporter, a receiver.

The prefill process sends with `obs.begin("send", ...)` and ships `t.carrier()` (W3C traceparent) with the
transfer's metadata; the decode process receives with `obs.begin("receive", trace_context=...)`. Both
spans reach the receiver in one trace, the receive span a child of the send span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support import otlp_receiver

from kvobs import semconv as sc

REPO = Path(__file__).resolve().parents[2]

NODE = """
import json, sys
from prometheus_client import CollectorRegistry
import kvobs
role, endpoint = sys.argv[1], sys.argv[2]
provider = kvobs.configure_tracing(f"kvobs-{role}", endpoint=endpoint, set_global=False)
obs = kvobs.KVObserver(role, tracer_provider=provider, registry=CollectorRegistry(), integrity=None)
if role == "prefill":
    t = obs.begin("send", block_ids=[1, 2], request_id="req-7")
    print(json.dumps({"carrier": t.carrier(), "request_id": "req-7"}), flush=True)
    t.complete()
else:
    meta = json.loads(sys.stdin.readline())
    t = obs.begin("receive", block_ids=[5, 6], request_id=meta["request_id"], trace_context=meta["carrier"])
    t.complete()
provider.shutdown()
"""


def _node(role: str, endpoint: str, stdin: str | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", NODE, role, endpoint], input=stdin, capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_prefill_send_and_decode_receive_share_one_trace():
    with otlp_receiver() as (receiver, port):
        endpoint = f"http://127.0.0.1:{port}"
        metadata = _node("prefill", endpoint)
        assert json.loads(metadata)["carrier"]["traceparent"].startswith("00-")
        _node("decode", endpoint, stdin=metadata)
        deadline = time.monotonic() + 10
        while len(receiver.spans) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    spans = {span.name: (service, span) for service, span in receiver.spans}
    (prefill_service, send), (decode_service, receive) = spans["kvobs.send"], spans["kvobs.receive"]
    assert prefill_service["service.name"] == "kvobs-prefill"
    assert decode_service["service.name"] == "kvobs-decode"
    assert receive.trace_id == send.trace_id
    assert receive.parent_span_id == send.span_id
    attributes = {a.key: a.value.string_value for a in receive.attributes}
    assert attributes[sc.ATTR_REQUEST_ID] == "req-7"
