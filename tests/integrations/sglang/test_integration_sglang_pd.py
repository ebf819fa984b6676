"""kvobs on SGLang 0.5.23's PD transfer, against the real CommonKVSender, CommonKVReceiver and the
CommonKVManager status path, with a CPU transfer backend (see the support module): sends are transfers
completed when `poll()` reports the outcome, receives are checked before decode uses them."""

# ruff: noqa: F811  (the `engine` fixture imported from the support module is a parameter of the tests)

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang_harness import (  # noqa: F401  (engine: a fixture)
    PAGE,
    ROOM,
    cpu_kv_manager,
    device_pool,
    engine,
    page_rows,
    receiver,
    sender,
)
from support import wait_until

import kvobs
from kvobs import semconv as sc
from kvobs.errors import CopyNotConfirmed, CorruptKVError
from kvobs.integrations import sglang as kvobs_sglang
from kvobs.telemetry._recorder import TransferRecord
from kvobs.testing import capture

SOURCE_PAGES = [3, 4, 5]
DESTINATION_PAGES = [9, 10, 11]


class Nodes:
    """A prefill and a decode node in one process: the prefill manager's status frames go straight to the
    decode manager's listener, its transfer threads write into the decode pool."""

    def __init__(self, engine: Any) -> None:
        self.poll = engine.attr("sglang.srt.disaggregation.base.conn:KVPoll")
        manager = cpu_kv_manager(engine)
        self.prefill_pool, self.decode_pool = device_pool(engine, 1.0), device_pool(engine, math.nan)
        self.decode = manager(self.decode_pool)
        self.prefill = manager(self.prefill_pool, deliver=self.decode.listen)
        self.receiver = receiver(engine, self.decode)
        self.sender = sender(engine, self.prefill, pages=len(SOURCE_PAGES))
        self.prefill.expect(ROOM, self.decode_pool, DESTINATION_PAGES)

    def transfer(self, *chunks: list[int]) -> tuple[Any, Any]:
        """Decode asks for the pages, prefill sends them chunk by chunk; both sides' final poll."""
        self.receiver.send_metadata(DESTINATION_PAGES)
        for chunk in chunks:
            self.sender.send(chunk)
        self.prefill.join()
        return self.sender.poll(), self.receiver.poll()


@pytest.fixture
def records() -> list[TransferRecord]:
    return []


@pytest.fixture
def observed(engine: Any, records: list[TransferRecord]) -> Iterator[tuple[Any, Nodes]]:
    with capture(engine="sglang", lock=None, page_size=PAGE, deadline=30, hooks=[records.append]) as cap:
        nodes = Nodes(engine)
        undo = kvobs_sglang.instrument_pd(cap.observer, cache=lambda manager: manager.pool)
        yield cap, nodes
        undo()


def _ended(records: list[TransferRecord], path: str) -> list[TransferRecord]:
    return [r for r in records if r.path == path]


def test_a_send_completes_when_poll_reports_success_and_decode_checks_what_landed(
        observed: tuple[Any, Nodes], records: list) -> None:
    cap, nodes = observed
    nodes.receiver.send_metadata(DESTINATION_PAGES)
    nodes.prefill.outcome = lambda room, last: None  # the backend holds the room's conclusion back
    nodes.sender.send(SOURCE_PAGES)
    nodes.prefill.join()
    assert nodes.sender.poll() == nodes.poll.Bootstrapping  # queued and copied, not concluded: still open
    assert cap.observer.open.count(sc.PATH_SEND) == 1 and not records
    nodes.prefill.conclude_transfer(bootstrap_room=ROOM, status=nodes.poll.Success, )
    assert nodes.sender.poll() == nodes.poll.Success
    assert nodes.receiver.poll() == nodes.poll.Success
    (send,) = _ended(records, sc.PATH_SEND)
    (receive,) = _ended(records, sc.PATH_RECEIVE)
    assert (send.outcome, send.blocks, send.request_id) == (sc.OUTCOME_OK, 3, ROOM)
    assert (receive.outcome, receive.blocks, receive.request_id) == (sc.OUTCOME_OK, 3, ROOM)
    assert cap.value("kvobs_nan_checks_total", path=sc.PATH_RECEIVE, result="clean") == 1
    assert cap.value("kvobs_nan_checks_total", path=sc.PATH_SEND, result="clean") == 2  # at send, at conclusion


def test_chunks_of_one_request_are_one_trace_and_only_sent_pages_are_checked(
        observed: tuple[Any, Nodes], records: list) -> None:
    cap, nodes = observed
    for tensor in [*nodes.prefill_pool.k_buffer, *nodes.prefill_pool.v_buffer]:
        tensor[page_rows([6, 7])] = math.nan  # pages of the request not sent (yet): no alarm
    assert nodes.transfer(SOURCE_PAGES[:2], SOURCE_PAGES[2:]) == (nodes.poll.Success, nodes.poll.Success)
    sends = _ended(records, sc.PATH_SEND)
    assert [r.outcome for r in sends] == [sc.OUTCOME_OK, sc.OUTCOME_OK] and [r.blocks for r in sends] == [2, 1]
    spans = {s.name: s for s in cap.spans if s.name != "kvobs.send"}
    chunk_spans = [s for s in cap.spans if s.name == "kvobs.send"]
    first = min(chunk_spans, key=lambda s: s.start_time)
    assert {s.context.trace_id for s in chunk_spans} == {first.context.trace_id}
    assert spans["kvobs.receive"].context.trace_id == first.context.trace_id
    assert spans["kvobs.receive"].parent.span_id == first.context.span_id


@pytest.mark.parametrize("carries_reason", [False, True], ids=["mooncake-status", "nixl-status"])
def test_a_nan_send_is_not_queued_and_the_request_fails_on_both_nodes(observed: tuple[Any, Nodes],
                                                                       records: list, engine: Any,
                                                                       carries_reason: bool) -> None:
    _, nodes = observed
    nodes.prefill.kv_status_msg_carries_reason = nodes.decode.kv_status_msg_carries_reason = carries_reason
    nodes.prefill_pool.k_buffer[1][page_rows([4])[1]] = math.inf
    assert nodes.transfer(SOURCE_PAGES) == (nodes.poll.Failed, nodes.poll.Failed)
    assert nodes.prefill.requests == []  # never queued: nothing copied to decode
    assert all(math.isnan(v) for v in nodes.decode_pool.k_buffer[0][page_rows(DESTINATION_PAGES)].flatten())
    (send,) = _ended(records, sc.PATH_SEND)
    assert isinstance(send.error, CorruptKVError) and send.bad_block_ids == (4,)
    (receive,) = _ended(records, sc.PATH_RECEIVE)
    assert receive.outcome == sc.OUTCOME_ERROR and isinstance(receive.error, CopyNotConfirmed)
    told = "kvobs stopped the send" if carries_reason else nodes.decode.DEFAULT_PREFILL_FAILURE_REASON
    assert told in str(receive.error)  # what the prefill's status message could say
    transfer_error = engine.attr("sglang.srt.disaggregation.common.conn:KVTransferError")
    with pytest.raises(transfer_error, match="kvobs stopped the send"):
        nodes.sender.failure_exception()  # how SGLang's prefill scheduler aborts the request


def test_a_nan_written_between_the_send_and_its_copy_fails_the_request_on_both_nodes(
        observed: tuple[Any, Nodes], records: list, engine: Any) -> None:
    cap, nodes = observed
    queue = nodes.prefill.add_transfer_request

    def written_while_queued(room: int, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        nodes.prefill_pool.k_buffer[0][page_rows([4])[0]] = math.nan  # after send() checked it, before the copy
        queue(room, kv_indices, *args, **kwargs)

    nodes.prefill.add_transfer_request = written_while_queued
    assert nodes.transfer(SOURCE_PAGES) == (nodes.poll.Failed, nodes.poll.Failed)
    (send,) = _ended(records, sc.PATH_SEND)
    assert send.outcome == sc.OUTCOME_ERROR and isinstance(send.error, CorruptKVError)
    assert send.bad_block_ids == (4,)
    (span,) = [s for s in cap.spans if s.name == "kvobs.send"]
    assert list(span.attributes[sc.ATTR_BAD_BLOCK_IDS]) == [4]
    transfer_error = engine.attr("sglang.srt.disaggregation.common.conn:KVTransferError")
    with pytest.raises(transfer_error, match=r"NaN/Inf in the sent KV pages \[4\]"):
        nodes.sender.failure_exception()  # how SGLang's prefill scheduler aborts the request
    (receive,) = _ended(records, sc.PATH_RECEIVE)  # the decode node was told: it never uses the pages
    assert receive.outcome == sc.OUTCOME_ERROR and isinstance(receive.error, CopyNotConfirmed)


def test_a_nan_receive_is_not_handed_to_decode(observed: tuple[Any, Nodes], records: list, engine: Any) -> None:
    _, nodes = observed

    def corrupting_link(room: int, last: bool) -> None:
        nodes.decode_pool.v_buffer[0][page_rows([10])[0]] = math.nan  # the network garbled one page
        nodes.prefill.conclude_transfer(bootstrap_room=room, status=nodes.poll.Success)

    nodes.prefill.outcome = corrupting_link
    assert nodes.transfer(SOURCE_PAGES) == (nodes.poll.Success, nodes.poll.Failed)
    assert nodes.receiver.poll() == nodes.poll.Failed  # stays failed
    (receive,) = _ended(records, sc.PATH_RECEIVE)
    assert isinstance(receive.error, CorruptKVError) and receive.bad_block_ids == (10,)
    transfer_error = engine.attr("sglang.srt.disaggregation.common.conn:KVTransferError")
    with pytest.raises(transfer_error, match=r"NaN/Inf in the received KV pages \[10\]"):
        nodes.receiver.failure_exception()  # how SGLang's decode scheduler aborts the request


def test_a_failed_transfer_fails_the_send_with_sglangs_reason(observed: tuple[Any, Nodes], records: list) -> None:
    _, nodes = observed
    nodes.prefill.outcome = lambda room, last: nodes.prefill.conclude_failure(
        bootstrap_room=room, failure_reason="RDMA write failed")
    assert nodes.transfer(SOURCE_PAGES) == (nodes.poll.Failed, nodes.poll.Failed)
    (send,) = _ended(records, sc.PATH_SEND)
    assert isinstance(send.error, CopyNotConfirmed) and "RDMA write failed" in str(send.error)


def test_an_aborted_request_fails_its_open_sends(observed: tuple[Any, Nodes], records: list) -> None:
    _, nodes = observed
    nodes.prefill.outcome = lambda room, last: None
    nodes.sender.send(SOURCE_PAGES)
    nodes.sender.abort()
    (send,) = _ended(records, sc.PATH_SEND)
    assert isinstance(send.error, CopyNotConfirmed) and "aborted" in str(send.error)


def test_a_send_never_concluded_is_abandoned_at_the_deadline(engine: Any, records: list) -> None:
    with capture(engine="sglang", lock=None, page_size=PAGE, deadline=0.2, hooks=[records.append]) as cap:
        nodes = Nodes(engine)
        undo = kvobs_sglang.instrument_pd(cap.observer, cache=lambda manager: manager.pool)
        nodes.prefill.outcome = lambda room, last: None  # the backend never reports
        nodes.sender.send(SOURCE_PAGES)
        wait_until(lambda: _ended(records, sc.PATH_SEND), "the send to be abandoned")
        assert _ended(records, sc.PATH_SEND)[0].outcome == sc.OUTCOME_ABANDONED
        nodes.prefill.conclude_transfer(bootstrap_room=ROOM, status=nodes.poll.Success)
        assert nodes.sender.poll() == nodes.poll.Success  # late: SGLang's answer, nothing recorded twice
        assert len(_ended(records, sc.PATH_SEND)) == 1
        undo()


def _session(nodes: Nodes) -> list[Any]:
    polls = nodes.transfer(SOURCE_PAGES[:1], SOURCE_PAGES[1:])
    return [polls, nodes.prefill.requests, nodes.decode.request_status, nodes.prefill.request_status,
            nodes.decode_pool.k_buffer[1].nan_to_num(-1.0).tolist()]


def test_sglang_behaves_the_same_with_and_without_kvobs(engine: Any) -> None:
    classes = [engine.attr(f"sglang.srt.disaggregation.common.conn:{name}")
               for name in ("CommonKVSender", "CommonKVReceiver", "CommonKVManager")]
    originals = [dict(vars(cls)) for cls in classes]
    expected = _session(Nodes(engine))
    with capture(engine="sglang", lock=None, page_size=PAGE) as cap:
        undo = kvobs_sglang.instrument_pd(cap.observer, cache=lambda manager: manager.pool)
        assert kvobs_sglang.instrument_pd(cap.observer).methods == ()  # idempotent
        got = _session(Nodes(engine))
        undo()
    assert got == expected
    assert [dict(vars(cls)) for cls in classes] == originals


def test_a_decode_node_without_kvobs_reads_the_status_message_as_before(engine: Any, records: list) -> None:
    poll = engine.attr("sglang.srt.disaggregation.base.conn:KVPoll")
    frames: list[list[bytes]] = []
    with capture(engine="sglang", lock=None, page_size=PAGE, hooks=[records.append]) as cap:
        manager = cpu_kv_manager(engine)(device_pool(engine), deliver=frames.append)
        manager.expect(ROOM, device_pool(engine), [7])
        undo = kvobs_sglang.instrument_pd(cap.observer)
        sender(engine, manager, pages=1).send([2])
        manager.join()
        undo()  # the decode node: stock SGLang
    sent = frames[0]
    assert sent[:3] == [str(ROOM).encode(), str(poll.Success).encode(), b"0"] and sent[3] == b""
    assert sent[4].startswith(b"kvobs-trace-context:")
    assert manager.parse_kv_status_message(sent) == (ROOM, poll.Success, 0, None)


def test_the_observers_page_size_may_be_left_out(engine: Any, records: list) -> None:
    with capture(engine="sglang", lock=None, hooks=[records.append]) as cap:  # ids are then pages
        nodes = Nodes(engine)
        undo = kvobs_sglang.instrument_pd(cap.observer, cache=lambda manager: manager.pool)
        nodes.prefill_pool.k_buffer[0][page_rows([5])] = torch.nan
        nodes.transfer(SOURCE_PAGES)
        undo()
    (send,) = _ended(records, sc.PATH_SEND)
    assert send.bad_block_ids == (5,) and send.blocks == 3


def test_a_cache_that_cannot_be_had_leaves_the_transfer_unobserved(engine: Any, records: list) -> None:
    def broken(manager: Any) -> Any:
        raise LookupError("no pool registered for this manager")

    with capture(engine="sglang", lock=None, page_size=PAGE, hooks=[records.append]) as cap:
        nodes = Nodes(engine)
        undo = kvobs_sglang.instrument_pd(cap.observer, cache=broken)
        assert nodes.transfer(SOURCE_PAGES) == (nodes.poll.Success, nodes.poll.Success)
        undo()
    assert not _ended(records, sc.PATH_SEND)
    failed = [e for e in cap.logs if e["event"] == "kvobs.telemetry.failed" and e["stage"] == "hook"]
    assert {e["where"] for e in failed} == {"send_cache", "receive"}
    assert cap.value("kvobs_telemetry_errors_total", stage="hook") == len(failed)


def test_the_failure_kvobs_records_pickles_with_its_fields() -> None:
    error = pickle.loads(pickle.dumps(CopyNotConfirmed(sc.PATH_SEND, "RDMA write failed")))
    assert (type(error), error.path, error.reason) == (CopyNotConfirmed, sc.PATH_SEND, "RDMA write failed")
    assert str(error) == "SGLang did not confirm the send copy: RDMA write failed"


def test_a_second_observer_is_refused_and_the_same_one_changes_nothing(engine: Any) -> None:
    with capture(engine="sglang", lock=None, page_size=PAGE) as first, \
            capture(engine="sglang-2", lock=None, page_size=PAGE) as second:
        undo = kvobs_sglang.instrument_pd(first.observer)
        try:
            assert kvobs_sglang.instrument_pd(first.observer).methods == ()
            with pytest.raises(kvobs.AlreadyInstrumented, match="CommonKVSender.send is already instrumented by "
                                                                "kvobs for observer 'sglang'"):
                kvobs_sglang.instrument_pd(second.observer)
            sender = engine.attr("sglang.srt.disaggregation.common.conn:CommonKVSender")
            assert kvobs_sglang.is_instrumented(sender.send) and kvobs_sglang.is_instrumented(sender.poll)
        finally:
            undo()
        assert not kvobs_sglang.is_instrumented(sender.send)
