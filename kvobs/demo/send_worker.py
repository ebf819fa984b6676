"""The cache messager's send worker thread: sends a request's KV to the decode node layer by layer, each layer
as soon as the model runner has marked it ready, through `send_layer` guarded by `obs.send(...)`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvobs.demo.guarded import TransferWorker
from kvobs.demo.messages import SendEnded
from kvobs.demo.model_runner import LayerProgress
from kvobs.demo.workload import Request


@dataclass(eq=False, kw_only=True)
class SendWorker(TransferWorker[Request]):
    """One started send at a time; reports every send, complete or given up, as a SendEnded."""

    num_layers: int
    layer_s: float  # the copy of one layer
    progress: LayerProgress
    ended: Callable[[SendEnded], None]
    decode_side: dict[int, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.send_layer = self.guarded(
            self.observer.send(block_ids="req.gpu_block_ids", cache="self.gpu_cache"), type(self)._copy_layer)

    def _copy_layer(self, req: Request, layer: int) -> int:
        """Copy one layer's KV of the request to the decode node (here: a dict)."""
        time.sleep(self.layer_s)
        self.decode_side[req.slot] = self.gpu_cache[req.gpu_block_ids].clone()
        return len(req.gpu_block_ids)

    def handle(self, req: Request) -> None:
        self.ended(SendEnded(req, sent=self._send_all_layers(req)))

    def _send_all_layers(self, req: Request) -> bool:
        for layer in range(self.num_layers):
            if not self.progress.wait_for(req, layer, self.stop):
                return False
            try:
                result = self.send_layer(req, layer)
            except Exception:  # noqa: BLE001 - lock timeout, rejection: the send is given up
                self.stats.add(transfer_errors=1)
                return False
            if result is None:  # skip policy: the NaN check refused it
                self.stats.add(send_rejected=1)
                return False
            self.stats.add(send_done=1)
        return True
