"""The model runner thread: emits each layer's "ready" signal for a request's batch slot as soon as its prefill
is done, layer 0 first, and publishes per-slot progress (an IPC flag in a real engine) for the send worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvobs.demo.messages import LayerReady
from kvobs.demo.worker import QueueWorker
from kvobs.demo.workload import Request

LAYER_WAIT_S = 2.0  # a send worker gives up on a layer that is not ready by then
LAYER_POLL_S = 0.0002


class LayerProgress:
    """slot -> (request id, last layer ready). Written by the model runner, cleared by the scheduler when the
    slot is reused, polled by the send worker. Single dict operations: atomic under the GIL."""

    def __init__(self) -> None:
        self._ready: dict[int, tuple[int, int]] = {}

    def mark(self, req: Request, layer: int) -> None:
        self._ready[req.slot] = (req.req_id, layer)

    def clear(self, slot: int) -> None:
        self._ready.pop(slot, None)

    def wait_for(self, req: Request, layer: int, stop: threading.Event) -> bool:
        """Poll until `layer` of this request is ready; False when stopped or after LAYER_WAIT_S."""
        end = time.monotonic() + LAYER_WAIT_S
        while not stop.is_set() and time.monotonic() < end:
            rid, ready = self._ready.get(req.slot, (-1, -1))
            if rid == req.req_id and ready >= layer:
                return True
            time.sleep(LAYER_POLL_S)
        return False


@dataclass(eq=False, kw_only=True)
class ModelRunner(QueueWorker[Request]):
    """For each prefilled request: every layer's ready signal to the messager, `layer_gap_s` apart."""

    progress: LayerProgress
    signal: Callable[[LayerReady], None]
    num_layers: int
    layer_gap_s: float

    def handle(self, req: Request) -> None:
        for layer in range(self.num_layers):
            self.progress.mark(req, layer)
            self.signal(LayerReady(req.slot, layer, req.tokens))
            time.sleep(self.layer_gap_s)
