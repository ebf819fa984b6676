"""Connectors that load and save inside the forward pass, as vLLM's example shared-storage (disk) connector
does: its metadata lists `requests`, each with a `slot_mapping` (token slots in the paged cache) and
`is_store`; `start_load_kv` copies the loads in, `save_kv_layer` writes each layer out during the pass.

Each load is a `prefetch` transfer from just before `start_load_kv` to `wait_for_save`, the first point where
vLLM guarantees every layer has landed (a connector that loads layer by layer finishes in
`wait_for_layer_load`, within the pass); its destination blocks are checked then, and vLLM hears of corrupt
ones in the same step, before it keeps the tokens the pass sampled. Each store is a `write_back` transfer over
`wait_for_save`; its source blocks, complete once the pass is over, are checked when it begins. These
connectors write during the pass, so a corrupt store is reported, not prevented: the load that reads it back
is what kvobs stops.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from kvobs import semconv as sc
from kvobs.integrations._common import int_list
from kvobs.integrations.vllm._offloading import LoadFailure
from kvobs.integrations.vllm._transfers import Transfers


def slot_requests(metadata: Any) -> list[Any] | None:
    """The metadata's slot-mapped requests, or None when it is not this kind of metadata."""
    requests = getattr(metadata, "requests", None)
    if not isinstance(requests, list) or not all(hasattr(r, "slot_mapping") and hasattr(r, "is_store")
                                                 for r in requests):
        return None
    return requests


class SyncWatch:
    """Loads and stores of synchronous connectors, begun and ended around the wrapper's calls."""

    def __init__(self, transfers: Transfers, block_size: int) -> None:
        self.transfers = transfers
        self.block_size = block_size
        self._keys = itertools.count()
        self._loads: list[tuple[int, tuple[int, ...]]] = []
        self._stores: list[int] = []

    @property
    def loads_open(self) -> bool:
        return bool(self._loads)

    @property
    def stores_open(self) -> bool:
        return bool(self._stores)

    def loading(self, parts: Iterable[Any]) -> None:
        """Before the wrapped `start_load_kv`: a prefetch per load request of the step."""
        for requests in _requests(parts):
            for request in requests:
                if not request.is_store:
                    key = next(self._keys)
                    ids = self._block_ids(request)
                    self.transfers.begin(sc.PATH_PREFETCH, key, request_id=None, block_ids=list(ids))
                    self._loads.append((key, ids))

    def saving(self, parts: Iterable[Any]) -> list[LoadFailure]:
        """Before the wrapped `wait_for_save`: end the step's loads (corrupt ones returned); a write-back per
        store request begins, its sources checked now."""
        failures = []
        for key, ids in self._loads:
            bad = self.transfers.complete(sc.PATH_PREFETCH, key)
            if bad:
                failures.append(LoadFailure(None, tuple(bad), True))
        self._loads = []
        for requests in _requests(parts):
            for request in requests:
                if request.is_store:
                    key = next(self._keys)
                    self.transfers.begin(sc.PATH_WRITE_BACK, key, request_id=None,
                                         block_ids=list(self._block_ids(request)))
                    self._stores.append(key)
        return failures

    def saved(self) -> None:
        """After the wrapped `wait_for_save`: the step's stores are written."""
        for key in self._stores:
            self.transfers.complete(sc.PATH_WRITE_BACK, key)
        self._stores = []

    def _block_ids(self, request: Any) -> tuple[int, ...]:
        slots = request.slot_mapping
        blocks = slots // self.block_size
        return tuple(sorted(set(int_list(blocks))))


def _requests(parts: Iterable[Any]) -> Iterable[list[Any]]:
    for part in parts:
        requests = slot_requests(part)
        if requests:
            yield requests
