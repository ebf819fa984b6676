"""FastDeploy's prefill cache messager under kvobs: an early layer0 signal is kept until its task registers
(the incident: `if not self.cache_info: continue` and the send thread's assertion lost it), without editing
the messager's loops; its IPC sends are send transfers, checked before the copy and completed at the sync."""

from __future__ import annotations

import pickle
import threading
from contextlib import ExitStack

import numpy as np
import pytest
from fastdeploy_shaped import cache_messager
from fastdeploy_shaped.prefill import BLOCKS, DECODE_GPU, LAYERS, prefill_node
from fastdeploy_shaped.tensors import ids
from support import wait_until

from kvobs import semconv as sc
from kvobs.errors import CorruptKVError, LockTimeout
from kvobs.integrations import fastdeploy as kvfd
from kvobs.locks._block_lock import BlockLock
from kvobs.signals import StepAlignedSignalBuffer
from kvobs.testing import capture

SRC, DEST, TOKENS, SLOT = [5, 6, 7], [1, 2, 3], 10, 3  # 10 tokens: 3 blocks of 4


@pytest.fixture
def stack():
    with ExitStack() as s:
        yield s


def node(stack: ExitStack, n_ranks: int = 1):
    prefill = prefill_node(n_ranks)
    stack.callback(prefill.stop)
    return prefill


def bridged(stack: ExitStack, prefill, cap, buffers=None) -> None:
    for i, m in enumerate(prefill.messagers):
        buffer = buffers[i] if buffers else cap.observer.signal_buffer()
        stack.callback(kvfd.bridge_cache_messager(m, buffer))
        stack.callback(kvfd.instrument_ipc_comm_manager(m.messager["ipc"], cap.observer))
    prefill.settle()  # a read in progress while the bridge was installed ran without it


def early_signal_then_registration(prefill, within: float = 60.0) -> list:
    prefill.start_sending()
    prefill.prefill_info("req", SLOT, SRC, TOKENS)
    prefill.run_layers(SLOT, TOKENS)  # every layer prefilled before the decode node's blocks arrive
    prefill.decode_info("req", DEST)
    return prefill.finished(within)


def sent_correctly(prefill, rank: int = 0) -> bool:
    src, dest = prefill.prefill_cache(rank), prefill.decode_cache(rank)
    return all(np.array_equal(dest[layer][DEST], src[layer][SRC]) for layer in range(LAYERS))


def test_upstream_loses_the_early_signal_and_the_request_hangs(stack):
    prefill = node(stack)
    assert early_signal_then_registration(prefill, within=1.5) == []  # (bridged, it takes milliseconds)
    assert not sent_correctly(prefill)


def test_the_bridge_keeps_the_early_signal_until_the_task_registers(stack):
    prefill = node(stack)
    cap = stack.enter_context(capture("fd-messager", integrity="raise", lock=None))
    bridged(stack, prefill, cap)
    assert early_signal_then_registration(prefill) == [["req", "finished"]]
    assert sent_correctly(prefill)  # every layer, although their signals came before the task
    assert cap.value("kvobs_signals_total", outcome="recovered") == 1
    assert cap.value("kvobs_transfers_total", path="send", outcome="ok") == LAYERS
    assert prefill.messagers[0].idx_cache_task_dict == {} and cap.observer.open.count("send") == 0


def test_a_registered_task_sends_as_before(stack):
    prefill = node(stack)
    cap = stack.enter_context(capture("fd-messager", integrity="raise", lock=None))
    bridged(stack, prefill, cap)
    prefill.start_sending()
    prefill.prefill_info("req", SLOT, SRC, TOKENS)
    prefill.decode_info("req", DEST)
    wait_until(lambda: SLOT in prefill.messagers[0].idx_cache_task_dict)
    prefill.run_layers(SLOT, TOKENS)
    assert prefill.finished() == [["req", "finished"]] and sent_correctly(prefill)
    assert cap.value("kvobs_signals_total", outcome="ready") == 1


def test_a_nan_source_is_not_sent_and_the_request_ends_in_error(stack):
    prefill = node(stack)
    cap = stack.enter_context(capture("fd-messager", integrity="raise", lock=None))
    bridged(stack, prefill, cap)
    prefill.prefill_cache()[1][6, 0, 0, 0] = np.nan
    assert early_signal_then_registration(prefill) == [["req", "write cache error"]]  # reported, no hang
    decode = prefill.decode_cache()
    assert not decode[1][DEST].any() and np.array_equal(decode[0][DEST], prefill.prefill_cache()[0][SRC])
    assert cap.value("kvobs_nan_checks_total", path="send", result="nan") == 1
    assert cap.value("kvobs_transfers_total", path="send", outcome="rejected") == 1


def test_tensor_parallel_ranks_release_the_same_batches(stack):
    prefill = node(stack, n_ranks=2)
    cap = stack.enter_context(capture("fd-messager", integrity="raise", lock=None))
    bridged(stack, prefill, cap, buffers=[StepAlignedSignalBuffer(), StepAlignedSignalBuffer()])
    prefill.start_sending()
    prefill.prefill_info("req", SLOT, SRC, TOKENS)
    prefill.run_layers(SLOT, TOKENS)  # step 1 on both ranks: no task yet, the layer0 signal is kept
    prefill.decode_info("req", DEST)
    wait_until(lambda: len(prefill.server.finished_add) == 2)  # registered on both ranks
    prefill.run_layers(9, 4, range(1))  # step 2: another slot's layer0; both ranks decide alike
    assert prefill.finished() == [["req", "finished"]]  # the ranks' send barriers lined up
    assert sent_correctly(prefill, 0) and sent_correctly(prefill, 1)


def test_undo_restores_the_messager_and_its_module(stack):
    prefill = node(stack)
    m = prefill.messagers[0]
    reader = cache_messager.get_output_kv_signal
    before = dict(vars(m.engine_worker_queue)), dict(vars(m.messager["ipc"]))
    with capture("fd-messager", lock=None) as cap:
        undo = [kvfd.bridge_cache_messager(m, cap.observer.signal_buffer()),
                kvfd.bridge_cache_messager(m, cap.observer.signal_buffer()),  # twice: wraps once
                kvfd.instrument_ipc_comm_manager(m.messager["ipc"], cap.observer)]
        assert cache_messager.get_output_kv_signal is not reader and not undo[1].active
        for u in reversed(undo):
            u()
    assert cache_messager.get_output_kv_signal is reader
    assert (dict(vars(m.engine_worker_queue)), dict(vars(m.messager["ipc"]))) == before


def test_the_bridge_refuses_what_is_not_a_signal_buffer(stack):
    prefill = node(stack)
    with pytest.raises(TypeError, match="EarlySignalBuffer or StepAlignedSignalBuffer"):
        kvfd.bridge_cache_messager(prefill.messagers[0], object())


def test_sends_need_a_lock_that_lets_them_share(stack):
    prefill = node(stack)
    with capture("fd-messager") as cap, pytest.raises(ValueError, match="lock=None"):  # default ThreadLock
        kvfd.instrument_ipc_comm_manager(prefill.messagers[0].messager["ipc"], cap.observer)


def test_a_registration_kvobs_cannot_place_is_logged_and_the_others_go_on(stack):
    prefill = node(stack)
    m = prefill.messagers[0]
    with capture("fd-messager", lock=None) as cap:
        buffer = cap.observer.signal_buffer()
        stack.callback(kvfd.bridge_cache_messager(m, buffer, logger=cap.observer.logger))
        m.cache_info.update({"ok": {"current_id": 4, "need_prefill_tokens": 8}, "no-slot": {}})
        m.engine_worker_queue.put_finished_add_cache_task_req(["no-slot", "unknown", "ok"])
        assert buffer.registered_slots() == {4}
        assert prefill.server.finished_add == [["no-slot", "unknown", "ok"]]  # FastDeploy's report unchanged
        assert [e["request_id"] for e in cap.logs if e["event"] == "kvobs.fastdeploy.register_failed"] == [
            "no-slot", "unknown"]


def test_a_launch_that_returns_an_error_code_fails_its_send(stack):
    prefill = node(stack)
    comm = prefill.messagers[0].messager["ipc"]
    comm.write_cache = lambda ip, remote_gpu_id, local_block_ids, remote_block_ids, layer_idx: 1  # a failed write
    records = []
    with capture("fd-messager", lock=None, hooks=[records.append]) as cap:
        undo = kvfd.instrument_ipc_comm_manager(comm, cap.observer)
        assert comm.write_cache("0.0.0.0", 7, ids([5, 6]), ids([1, 2]), 0) == 1  # the engine sees its code
        undo()
    (record,) = records
    assert (record.path, record.outcome) == ("send", "error")
    assert pickle.loads(pickle.dumps(record.error)).args == kvfd.LaunchFailed(7, 0, 1).args
    assert str(record.error) == "write_cache to GPU 7, layer 0, returned 1: not launched"


def test_a_nan_written_between_the_launch_and_the_copy_fails_the_request(stack):
    prefill = node(stack)
    records = []
    cap = stack.enter_context(capture("fd-messager", integrity="raise", lock=None, hooks=[records.append]))
    m = prefill.messagers[0]
    comm = m.messager["ipc"]
    stack.callback(kvfd.bridge_cache_messager(m, cap.observer.signal_buffer()))
    stack.callback(kvfd.instrument_ipc_comm_manager(comm, cap.observer, messager=m))
    prefill.settle()
    comm.connect(DECODE_GPU)
    stream_free = threading.Event()
    comm.comm_map[DECODE_GPU].write_stream.submit(stream_free.wait)  # the decode GPU's stream is busy
    stack.callback(stream_free.set)
    prefill.start_sending()
    prefill.prefill_info("req", SLOT, SRC, TOKENS)
    prefill.decode_info("req", DEST)
    wait_until(lambda: SLOT in m.idx_cache_task_dict)
    prefill.run_layers(SLOT, TOKENS)
    wait_until(lambda: cap.observer.open.count("send") == LAYERS)  # every layer launched and checked, none copied
    prefill.prefill_cache()[1][6, 0, 0, 0] = np.nan  # the source changes before its copy runs (lock=None)
    stream_free.set()
    assert prefill.finished() == [["req", "write cache error"]]  # FastDeploy's own failure report
    assert not sent_correctly(prefill)  # the NaN went to decode: the decode node is told not to use it
    (bad,) = [r for r in records if r.outcome == "error"]
    assert isinstance(bad.error, CorruptKVError) and bad.bad_block_ids == (6,)
    assert sorted(r.outcome for r in records) == ["error"] + ["ok"] * (LAYERS - 1)
    assert cap.value("kvobs_nan_checks_total", path="send", result="nan") == 1
    (span,) = [s for s in cap.spans if s.name == "kvobs.send" and sc.ATTR_BAD_BLOCK_IDS in s.attributes]
    assert list(span.attributes[sc.ATTR_BAD_BLOCK_IDS]) == [6]


def test_a_forward_pass_between_layers_does_not_stall_the_layerwise_send(stack, tmp_path):
    prefill = node(stack)
    comm = prefill.messagers[0].messager["ipc"]
    records = []
    lock = BlockLock("fd-send", BLOCKS, directory=tmp_path)
    cap = stack.enter_context(capture("fd-messager", lock=lock, lock_timeout=2, integrity="raise",
                                      hooks=[records.append]))
    stack.callback(kvfd.instrument_ipc_comm_manager(comm, cap.observer))
    assert comm.write_cache("0.0.0.0", DECODE_GPU, ids(SRC), ids(DEST), 0) == 0  # layer 0 launched
    computed = []

    def forward_pass() -> None:  # writes the next layer of the same blocks
        with cap.observer.hold(block_ids=SRC):
            computed.append(1)

    forward = threading.Thread(target=forward_pass)
    forward.start()
    forward.join(timeout=0.5)  # a forward pass still waiting here is queued behind layer 0's claim
    codes = []
    for layer in range(1, LAYERS):
        try:
            codes.append(comm.write_cache("0.0.0.0", DECODE_GPU, ids(SRC), ids(DEST), layer))
        except LockTimeout:
            codes.append("stalled")
    forward.join(timeout=30)
    comm.write_block_by_sync(DECODE_GPU)
    assert codes == [0] * (LAYERS - 1) and computed == [1]
    assert sorted(r.outcome for r in records if r.path == "send") == ["ok"] * LAYERS
    assert sent_correctly(prefill)
