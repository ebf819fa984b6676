"""One trace per request across SGLang's prefill and decode nodes: two processes, the real OTLP exporter.

Each process runs SGLang's real PD code with kvobs (`instrument_pd`): the prefill process a CommonKVSender
sending a request in two chunks, the decode process a CommonKVReceiver waiting for it. The request's trace
context leaves the prefill inside SGLang's own status message (`_encode_kv_status_message`) and the decode's
receive transfer continues it. Both export to one OTLP receiver.

Simulated (there is no RDMA or ZMQ here): the transfer backend's write into decode memory is a file the
prefill's backend thread writes and the decode's listener copies into its pool before it parses the status
message; the ZMQ socket carrying the status frames is a pipe (hex-encoded frames, one JSON line). SGLang's
code builds, encodes, parses and applies the message as it does between real nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import upstream
from sglang_harness import ROOM
from support import otlp_receiver

from kvobs import semconv as sc

REPO = Path(__file__).resolve().parents[3]
SOURCE_PAGES = [3, 4, 5]
DESTINATION_PAGES = [9, 10, 11]

NODE = """
import json, math, sys
import torch
from prometheus_client import CollectorRegistry
import kvobs
from kvobs.integrations import sglang as kvobs_sglang
import sglang_harness as support
import upstream

role, endpoint, wire_file = sys.argv[1:4]
source, destination = json.loads(sys.argv[4]), json.loads(sys.argv[5])
engine = upstream.load_sglang()  # the PD modules only
provider = kvobs.configure_tracing(f"sglang-{role}", endpoint=endpoint, set_global=False)
obs = kvobs.KVObserver(role, lock=None, page_size=support.PAGE, tracer_provider=provider,
                       registry=CollectorRegistry())
with engine.active():
    poll = engine.attr("sglang.srt.disaggregation.base.conn:KVPoll")
    undo = kvobs_sglang.instrument_pd(obs, cache=lambda manager: manager.pool)
    manager_type = support.cpu_kv_manager(engine)
    rows = support.page_rows(destination)
    if role == "prefill":
        wire = support.device_pool(engine, math.nan)  # decode memory as the backend writes it
        deliver = lambda frames: print(json.dumps([f.hex() for f in frames]), flush=True)
        manager = manager_type(support.device_pool(engine, 1.25), deliver=deliver)
        manager.expect(support.ROOM, wire, destination)

        def written(room, last):
            torch.save([t[rows] for t in [*wire.k_buffer, *wire.v_buffer]], wire_file)
            manager.conclude_transfer(bootstrap_room=room, status=poll.Success)

        manager.outcome = written
        sender = support.sender(engine, manager, pages=len(source))
        sender.send(source[:2])
        sender.send(source[2:])
        manager.join()
        assert sender.poll() == poll.Success
    else:
        manager = manager_type(support.device_pool(engine, math.nan))
        receiver = support.receiver(engine, manager)
        receiver.send_metadata(destination)
        frames = [bytes.fromhex(h) for h in json.loads(sys.stdin.readline())]
        for tensor, pages in zip([*manager.pool.k_buffer, *manager.pool.v_buffer], torch.load(wire_file)):
            tensor[rows] = pages  # the backend's write landed before its status message
        manager.listen(frames)
        print(json.dumps({"poll": receiver.poll() == poll.Success}), flush=True)
    undo()
provider.shutdown()
"""


def _start(role: str, endpoint: str, wire: Path, stdin: object = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", NODE, role, endpoint, str(wire), json.dumps(SOURCE_PAGES),
               json.dumps(DESTINATION_PAGES)]
    return subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=REPO)


def _wheel_or_skip() -> None:
    try:
        upstream.wheel("sglang", upstream.SGLANG_VERSION)
    except upstream.UpstreamUnavailable as exc:
        if upstream._in_ci():
            pytest.fail(f"CI=true and the upstream sglang code is unavailable: {exc}")
        pytest.skip(f"upstream sglang unavailable: {exc}")


def test_the_decode_receive_continues_the_prefill_send_trace(tmp_path: Path) -> None:
    _wheel_or_skip()  # both nodes load SGLang from the cached wheel
    with otlp_receiver() as (receiver, port):
        endpoint = f"http://127.0.0.1:{port}"
        prefill = _start("prefill", endpoint, tmp_path / "wire.pt")
        decode = _start("decode", endpoint, tmp_path / "wire.pt", stdin=prefill.stdout)
        prefill.stdout.close()  # the decode node owns the pipe now
        decode_out, decode_err = decode.communicate(timeout=300)
        _, prefill_err = prefill.communicate(timeout=300)
        assert prefill.returncode == 0, prefill_err.decode()[-3000:]
        assert decode.returncode == 0, decode_err.decode()[-3000:]
        assert json.loads(decode_out.decode().strip().splitlines()[-1]) == {"poll": True}
        deadline = time.monotonic() + 20
        while len(receiver.spans) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    sends = [(service, span) for service, span in receiver.spans if span.name == "kvobs.send"]
    receives = [(service, span) for service, span in receiver.spans if span.name == "kvobs.receive"]
    assert len(sends) == 2 and len(receives) == 1
    first = min((span for _, span in sends), key=lambda span: span.start_time_unix_nano)
    decode_service, receive = receives[0]
    assert {service["service.name"] for service, _ in sends} == {"sglang-prefill"}
    assert decode_service["service.name"] == "sglang-decode"
    assert {span.trace_id for _, span in sends + receives} == {first.trace_id}  # one trace, both nodes
    assert receive.parent_span_id == first.span_id
    attributes = {a.key: a.value for a in receive.attributes}
    assert attributes[sc.ATTR_REQUEST_ID].string_value == str(ROOM)
