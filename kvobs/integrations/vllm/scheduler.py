"""The scheduler half of KVObsConnector: request bookkeeping and one trace across prefill and decode.

On a prefill node, `request_finished` is where the wrapped connector hands a finished request's transfer
metadata (`kv_transfer_params`) to the decode node: a `send` transfer begins there (the request's blocks,
no cache: the scheduler holds none) and completes when the workers report the request in
`finished_sending` (at once if the connector keeps no blocks for the peer). Its W3C trace context travels
in kv_transfer_params under `TRACE_CONTEXT_KEY`, the one key kvobs adds to what the connector returns.

On a decode node, `update_state_after_alloc` sees that context in the request's kv_transfer_params; it is
shipped to the workers with the step's connector metadata (`KVObsConnectorMetadata`, which carries the
wrapped connector's metadata unchanged), where the `receive` transfer continues the prefill's trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvobs import semconv as sc
from kvobs.integrations.vllm.options import TRACE_CONTEXT_KEY
from kvobs.integrations.vllm.receive import flat, per_group
from kvobs.integrations.vllm.transfers import Transfers


class SchedulerSide:
    """Observation for one scheduler-side KVObsConnector."""

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self._trace_contexts: dict[str, dict[str, str]] = {}

    def allocated(self, request: Any) -> None:
        """After the wrapped `update_state_after_alloc`: a prefill node's trace context, for the workers."""
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
        """After the wrapped `update_connector_output`: the sends the workers finished."""
        for request_id in getattr(connector_output, "finished_sending", None) or ():
            self.transfers.complete(sc.PATH_SEND, request_id)
