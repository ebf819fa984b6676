"""A prefill node's cache messager: kvobs's EarlySignalBuffer between the model runner and `obs.send`.

Three threads share one buffer, as in FastDeploy's CacheMessager:
- the model runner reports, per layer, which batch slots hold how many prompt tokens (cumulative);
- the scheduler registers each request's transfer task: slot 0's before its signal, slot 1's only after its
  "layer 0 ready" signal arrived (the race the buffer exists for);
- the sender runs each send that may start through `obs.send` (a guarded transfer: span, metrics, lock),
  then finishes the slot's task.
The buffer keeps the early layer0 signal, hands it over exactly once when its task registers, and drops the
stale, failed and orphaned signals with a counted reason, so no request hangs on the decode side and no send
thread dies on an assert.

Part 2 shows tensor-parallel ranks: each rank's StepAlignedSignalBuffer sees the same step's events in
another order and still releases the same batch at the step boundary, so the ranks' send barriers line up.

Run: python examples/cache_messager.py
"""

from __future__ import annotations

import queue
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.signals import ReadySignal, StepAlignedSignalBuffer

LAYERS = 4
registry = CollectorRegistry()  # an application would usually keep prometheus_client's default registry
obs = kvobs.KVObserver("cache-messager-example", registry=registry, lock=None, integrity=None)
ready: queue.Queue[ReadySignal | None] = queue.Queue()  # sends that may start, for the sender thread
signals = obs.signal_buffer(ttl_s=1.0, max_pending=64, on_recovered=ready.put)  # recovered signals go there too
slot0_registered, slot1_signalled, leftovers_signalled = threading.Event(), threading.Event(), threading.Event()


@obs.send(block_ids="block_ids")
def send_kv(slot: int, tokens: int, block_ids: list[int]) -> None:
    """Stands in for the layer-by-layer copy of `slot`'s KV blocks to the decode node."""


def model_runner() -> None:
    slot0_registered.wait()
    for layer in range(LAYERS):  # slots 0 and 1 prefill 128 and 64 tokens; slot 1's task is not registered yet
        for sig in signals.signal_batch(layer, slots=[0, 1], tokens=[128, 64]):
            ready.put(sig)
        slot1_signalled.set()
    signals.signal(2, 0, 512)  # a stale signal left over from slot 2's previous request
    signals.signal(3, 0, 32)  # slot 3's request fails before its task registers
    signals.signal(7, 0, 16)  # slot 7's task never comes
    leftovers_signalled.set()


def scheduler() -> None:
    signals.register(0, need_tokens=256)  # registered before its signal, as the old code assumed: ready at once
    slot0_registered.set()
    slot1_signalled.wait()
    time.sleep(0.01)
    signals.register(1, need_tokens=64)  # the early signal is recovered, exactly once, into `ready`
    ready.join()  # both sends handed over (this only keeps the printed lines in order)
    leftovers_signalled.wait()
    signals.register(2, need_tokens=128)  # the stale signal claims more tokens than this task needs
    print(f"slot 2 registered, stale signal dropped: {signals.progress(2) is None}")
    signals.finish(3)  # the failed request: its waiting signal is dropped


def sender() -> None:
    while (sig := ready.get()) is not None:
        send_kv(sig.slot, sig.tokens, block_ids=list(range(sig.slot * 8, sig.slot * 8 + 8)))
        waited = f" after waiting {sig.buffered_s * 1e3:.1f} ms" if sig.buffered_s else ""
        print(f"send started: slot {sig.slot}, {sig.tokens} tokens{waited}")
        signals.finish(sig.slot)
        ready.task_done()


def single_rank() -> None:
    send_thread = threading.Thread(target=sender)
    send_thread.start()
    feeders = [threading.Thread(target=model_runner), threading.Thread(target=scheduler)]
    for t in feeders:
        t.start()
    for t in feeders:
        t.join()
    ready.put(None)
    send_thread.join()
    # slot 7's orphaned signal: its age is visible at every scrape until it expires
    print(f"pending: {signals.pending_count}, oldest waiting {signals.oldest_pending_age() * 1e3:.0f} ms")
    time.sleep(1.05)
    print(f"expired: {signals.expire()}")
    signals.finish(2)


def tensor_parallel() -> None:
    # each rank is its own process with its own observer; here two bare buffers stand in for them
    ranks = [StepAlignedSignalBuffer(ttl_steps=8) for _ in range(2)]
    for rank in ranks:
        rank.signal(5, 0, 96)  # step 1: slot 5's layer0 signal, no task yet on either rank
    assert ranks[0].end_step() == ranks[1].end_step() == []
    # step 2: a newer signal and the registration race, in opposite orders on the two ranks
    ranks[0].register(5, need_tokens=256)
    ranks[0].signal(5, 0, 192)
    ranks[1].signal(5, 0, 192)
    ranks[1].register(5, need_tokens=256)
    batches = [[(s.slot, s.tokens) for s in rank.end_step()] for rank in ranks]
    print(f"step 2 batches: rank 0 {batches[0]}, rank 1 {batches[1]}, identical: {batches[0] == batches[1]}")


def main() -> None:
    single_rank()
    tensor_parallel()
    wanted = ("kvobs_signals_total{", "kvobs_signal_buffered_seconds_count{", "kvobs_transfers_total{")
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(wanted) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
