"""The demo's cache messager: a send that has not started by its deadline is hung only when its layer0 signal
was given (and lost); a forward pass that is merely slow to reach layer0 (a loaded machine) is waited for."""

from __future__ import annotations

import threading
import time

import kvobs
from kvobs.demo.messager import BufferedSignals, CacheMessager, DroppingSignals
from kvobs.demo.messages import LayerReady, Registration
from kvobs.demo.stats import RunStats
from kvobs.demo.workload import Request

DEADLINE_S = 0.05


def messager(buffered: bool) -> tuple[CacheMessager, RunStats, list[Request], list]:
    stats = RunStats("test")
    signals = (BufferedSignals(kvobs.KVObserver("messager-test", lock=None).signal_buffer(), stats) if buffered
               else DroppingSignals(stats))
    started: list[Request] = []
    ended: list = []
    m = CacheMessager(stop=threading.Event(), signals=signals, stats=stats, start_send=started.append,
                      ended=ended.append, send_deadline_s=DEADLINE_S)
    return m, stats, started, ended


def request(slot: int) -> Request:
    return Request(req_id=slot, family=0, keys=["a", "b"], prefix_blocks=0, register_delay_s=0.0, block_size=4,
                   slot=slot)


def past_the_deadline(m: CacheMessager) -> None:
    time.sleep(3 * DEADLINE_S)
    m.tick()


def test_a_forward_pass_slower_than_the_deadline_is_waited_for_not_counted_hung():
    for buffered in (False, True):
        m, stats, started, ended = messager(buffered)
        req = request(3)
        m.handle(Registration(req, due=time.monotonic()))  # registered before the pass reached layer0
        past_the_deadline(m)
        assert stats.counters()["hung_sends"] == 0 and not ended, buffered
        m.handle(LayerReady(slot=3, layer=0, tokens=req.tokens))  # the slow pass gets there
        assert started == [req], buffered
        past_the_deadline(m)
        assert stats.counters()["hung_sends"] == 0, buffered


def test_a_lost_layer0_signal_hangs_the_send_at_its_deadline():
    m, stats, started, ended = messager(buffered=False)
    req = request(5)
    m.handle(LayerReady(slot=5, layer=0, tokens=req.tokens))  # before the task registers: dropped without kvobs
    m.handle(Registration(req, due=time.monotonic()))
    past_the_deadline(m)
    counters = stats.counters()
    assert counters["hung_sends"] == 1 and counters["lost_layer0_signals"] == 1
    assert not started and len(ended) == 1 and not ended[0].sent


def test_a_buffered_early_signal_starts_the_send_when_the_task_registers():
    m, stats, started, _ = messager(buffered=True)
    req = request(5)
    m.handle(LayerReady(slot=5, layer=0, tokens=req.tokens))
    m.handle(Registration(req, due=time.monotonic()))
    assert started == [req]
    past_the_deadline(m)
    assert stats.counters()["hung_sends"] == 0
