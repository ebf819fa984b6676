"""The scheduler half of KVObsConnector: request bookkeeping and one trace across prefill and decode.

On a prefill node, `request_finished` is where the wrapped connector hands a finished request's transfer
metadata (`kv_transfer_params`) to the decode node: a `send` transfer begins there (the request's blocks,
no cache: the scheduler holds none) and completes when the workers report the request in
`finished_sending` (at once if the connector keeps no blocks for the peer). Its W3C trace context travels
in kv_transfer_params under `TRACE_CONTEXT_KEY`, the one key kvobs adds to what the connector returns.

On a decode node, `update_state_after_alloc` sees that context in the request's kv_transfer_params; it is
shipped to the workers with the step's connector metadata (`KVObsConnectorMetadata`, which carries the
wrapped connector's metadata unchanged), where the `receive` transfer continues the prefill's trace.

Loads the workers found corrupt come back as vLLM's `invalid_block_ids` (or `failed_recving`). vLLM then
recomputes them (see `load_failure_policy`), but the stored copy is still there and still corrupt: asked
again, the wrapped connector would offer the same chunk, kvobs would reject it again, and the request would
never finish. So the prefix hashes of the bad blocks are remembered (a bounded set), and any lookup whose
loaded range covers one of them is answered as a miss: the request computes its prefix instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from kvobs import semconv as sc
from kvobs.integrations.vllm._options import TRACE_CONTEXT_KEY
from kvobs.integrations.vllm._receive import flat, per_group
from kvobs.integrations.vllm._transfers import Transfers

MAX_BAD_PREFIXES = 65536  # prefix hashes of corrupt stored blocks remembered, oldest forgotten first


def load_failure_policy(transfer_config: Any, mode: str, recompute: bool, logger: Any) -> None:
    """Make vLLM recompute the loads kvobs finds corrupt, and say at start-up what a corrupt load does.

    vLLM's `kv_load_failure_policy` defaults to `fail`, which ends the request with an error; vLLM reads it
    once, right after building the scheduler's connector, so the wrapper sets it here. It applies to every
    failed load, the wrapped connector's own too: `recompute=false` leaves it to the user."""
    if mode != "report":
        return
    policy = getattr(transfer_config, "kv_load_failure_policy", None)
    if recompute and policy != "recompute":
        transfer_config.kv_load_failure_policy = "recompute"
        logger.info("kvobs.vllm: kv_load_failure_policy set to recompute: a load kvobs finds corrupt, or the "
                    "wrapped connector reports failed, is computed again (kvobs option recompute=false keeps "
                    "vLLM's policy)", was=policy)
    elif policy != "recompute":
        logger.warning("kvobs.vllm: kv_load_failure_policy is fail: a load kvobs finds corrupt ends its request "
                       "with finish_reason=error (set it to recompute, or drop kvobs option recompute=false)")


class SchedulerSide:
    """Observation for one scheduler-side KVObsConnector; `block_size` is the tokens per KV block (the one
    KV group's; per prefix hash too, which vLLM keeps equal with a single group)."""

    def __init__(self, transfers: Transfers, block_size: int) -> None:
        self.transfers = transfers
        self.block_size = block_size
        self._trace_contexts: dict[str, dict[str, str]] = {}
        self._loading: dict[str, tuple[Any, tuple[list[int], ...]]] = {}  # request id -> (request, block ids)
        self._bad_prefixes: OrderedDict[Any, None] = OrderedDict()

    def matched(self, request: Any, num_computed_tokens: int, result: tuple[Any, bool]) -> tuple[Any, bool]:
        """After the wrapped `get_num_new_matched_tokens`: a miss when the offered range covers a block once
        loaded corrupt."""
        tokens = result[0]
        if not tokens or not self._bad_prefixes:
            return result
        hashes = getattr(request, "block_hashes", None) or ()
        first = num_computed_tokens // self.block_size
        last = -(-(num_computed_tokens + tokens) // self.block_size)
        if any(h in self._bad_prefixes for h in hashes[first:last]):
            return 0, False
        return result

    def allocated(self, request: Any, blocks: Any = None, num_external_tokens: int = 0) -> None:
        """After the wrapped `update_state_after_alloc`: the blocks a load fills, to name them if they come
        back corrupt; a prefill node's trace context, for the workers."""
        if num_external_tokens and blocks is not None:
            self._loading[request.request_id] = (request, tuple(blocks.get_block_ids()))
        params = getattr(request, "kv_transfer_params", None)
        carrier = params.get(TRACE_CONTEXT_KEY) if isinstance(params, Mapping) else None
        if isinstance(carrier, Mapping) and carrier:
            self._trace_contexts[request.request_id] = dict(carrier)

    def take_trace_contexts(self) -> dict[str, dict[str, str]]:
        """The trace contexts noted since the last step's metadata was built, for this step's."""
        contexts, self._trace_contexts = self._trace_contexts, {}
        return contexts

    def finished(self, request: Any, block_ids: Any, result: tuple[bool, Any]) -> tuple[bool, Any]:
        """After the wrapped `request_finished(_all_groups)`: a send begins when the connector hands transfer
        metadata to a peer; its trace context joins that metadata."""
        self._loading.pop(request.request_id, None)
        delay_free, params = result
        if not isinstance(params, Mapping):
            return result
        request_id = request.request_id
        ids, sizes = flat(per_group(block_ids))
        self.transfers.begin(sc.PATH_SEND, request_id, request_id=request_id, block_ids=ids, group_sizes=sizes)
        send = self.transfers.obs.open_transfer(sc.PATH_SEND, request_id)
        carrier = {} if send is None else send.carrier()
        if not delay_free:
            self.transfers.complete(sc.PATH_SEND, request_id)  # no blocks kept for the peer: nothing to wait for
        if not carrier:
            return result
        return delay_free, {**params, TRACE_CONTEXT_KEY: carrier}

    def output(self, connector_output: Any) -> None:
        """After the wrapped `update_connector_output`: the sends the workers finished; the loads that failed."""
        for request_id in getattr(connector_output, "finished_sending", None) or ():
            self.transfers.complete(sc.PATH_SEND, request_id)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._corrupt_blocks(set(invalid))
        for request_id in getattr(connector_output, "failed_recving", None) or ():
            self._corrupt_request(request_id)
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.pop(request_id, None)

    def _corrupt_blocks(self, invalid: set[int]) -> None:
        """Loads with a bad block (one KV group): every block from the first bad one on is suspect."""
        for request, groups in list(self._loading.values()):
            ids = groups[0] if groups else []
            first_bad = next((i for i, block in enumerate(ids) if block in invalid), None)
            if first_bad is not None:
                self._remember(request, first_bad, len(ids))

    def _corrupt_request(self, request_id: str) -> None:
        """A failed receive named by request (several KV groups): its whole load is suspect."""
        loading = self._loading.get(request_id)
        if loading is not None:
            request, groups = loading
            self._remember(request, 0, max((len(g) for g in groups), default=0))

    def _remember(self, request: Any, first: int, last: int) -> None:
        hashes: Iterable[Any] = (getattr(request, "block_hashes", None) or ())[first:last]
        for block_hash in hashes:
            self._bad_prefixes[block_hash] = None
            self._bad_prefixes.move_to_end(block_hash)
        while len(self._bad_prefixes) > MAX_BAD_PREFIXES:
            self._bad_prefixes.popitem(last=False)
        self._loading.pop(request.request_id, None)
