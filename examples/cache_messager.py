"""A prefill node's cache messager with kvobs' EarlySignalBuffer between the model runner and the sender.

The model runner reports, per step and layer, which batch slots are ready and how many prompt tokens they hold
(cumulative). A "layer 0 ready" signal starts the send of that slot's KV to the decode node, but the transfer
task for the slot is registered by another thread and may come later. The buffer keeps such early signals,
hands each one over exactly once when its task registers, and drops stale, finished, expired or excess ones
with a counted reason, so no request hangs on the decode side and no send thread dies on an assert.

Part 2 shows the tensor-parallel mode: two ranks see the same step's events in opposite orders and still release
the same batch at the step boundary, so their send barriers line up.

Run: python examples/cache_messager.py
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.signals import EarlySignalBuffer, ReadySignal

registry = CollectorRegistry()  # an application would usually keep prometheus_client's default registry
obs = kvobs.KVObserver("cache-messager-example", registry=registry, lock=None, integrity=None)


def start_send(sig: ReadySignal) -> None:
    """Stands in for the messager's layer-by-layer send of `sig.slot` up to `sig.tokens` prompt tokens."""
    waited = f" after waiting {sig.buffered_s * 1e3:.1f} ms" if sig.buffered_s else ""
    print(f"send started: slot {sig.slot}, {sig.tokens} tokens{waited}")


def single_rank() -> None:
    buf = obs.signal_buffer(ttl_s=0.2, max_pending=64)

    # Slot 0: the task registers first, as the old code assumed; its layer0 signal is ready at once.
    buf.register(0, need_tokens=256)
    # One model-runner step: slots 0 and 1 finished layer 0. Slot 1's task is not registered yet: buffered.
    for sig in buf.signal_batch(0, slots=[0, 1], tokens=[128, 64]):
        start_send(sig)
    # An empty step (the runner's batch count -1) is a no-op.
    assert buf.signal_batch(0, slots=[], tokens=[], count=-1) == []
    time.sleep(0.01)
    # Slot 1's task arrives: the buffered signal is recovered, exactly once.
    if (sig := buf.register(1, need_tokens=64)) is not None:
        start_send(sig)

    # Slot 2: a stale signal left over from an earlier request claims more tokens than the new task needs.
    buf.signal(2, 0, 512)
    assert buf.register(2, need_tokens=128) is None
    # Slot 3: the request failed before its task registered; finish() drops the waiting signal.
    buf.signal(3, 0, 32)
    buf.finish(3)
    # Slot 7: a signal whose task never comes. Its age is visible at every scrape, then it expires.
    buf.signal(7, 0, 16)
    time.sleep(0.05)
    print(f"pending: {buf.pending_count}, oldest waiting {buf.oldest_pending_age() * 1e3:.0f} ms")
    time.sleep(0.2)
    print(f"expired: {buf.expire()}")
    for slot in (0, 1, 2):
        buf.finish(slot)


def tensor_parallel() -> None:
    # each rank is its own process with its own observer; here two bare buffers stand in for them
    ranks = [EarlySignalBuffer(step_aligned=True, ttl_steps=8) for _ in range(2)]
    ranks[0].signal(5, 0, 96)  # step 1: slot 5's layer0 signal, no task yet on either rank
    ranks[1].signal(5, 0, 96)
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
    wanted = ("kvobs_signals_total{", "kvobs_signal_buffered_seconds_count{")
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(wanted) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
