"""Receives named by a connector's metadata (`reqs_to_recv`, as `NixlConnectorMetadata` has them): each a
`receive` transfer from the step its request is handed to the worker to the step vLLM reports it received.

The destination blocks are the request's `local_block_ids`, one list per KV group (the blocks still to be
filled: a local prefix-cache hit is not among them, so a partial hit is never checked where nothing
arrived). A receive vLLM will not report (`awaiting_kvs` False: a notification only) is not begun, so it is
never abandoned for a completion that cannot come.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvobs import semconv as sc
from kvobs.errors import EngineReportedFailure
from kvobs.integrations._common import int_list
from kvobs.integrations.vllm._offloading import LoadFailure
from kvobs.integrations.vllm._transfers import Transfers

NULL_BLOCK = 0  # vLLM's placeholder for a block a KV group does not hold (e.g. out of a sliding window)


def per_group(block_ids: Any) -> list[list[int]]:
    """vLLM's BlockIds (a list per KV group, or one flat list) as a list per group, without null blocks."""
    groups = list(block_ids or ())
    if groups and not isinstance(groups[0], (list, tuple)):
        groups = [groups]
    return [[b for b in int_list(group) if b != NULL_BLOCK] for group in groups]


def flat(groups: list[list[int]]) -> tuple[list[int], list[int]]:
    """(block ids in group order, group sizes), as kvobs validates ids repeated across groups."""
    return [b for group in groups for b in group], [len(group) for group in groups]


class ReceiveWatch:
    """Receive transfers of the requests in the metadata handed to the worker."""

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers

    def start(self, metadata: Any, trace_contexts: Mapping[str, Any]) -> None:
        """Begin a receive per request `metadata` hands over (before the wrapped connector starts it)."""
        requests = getattr(metadata, "reqs_to_recv", None)
        if not isinstance(requests, Mapping):
            return
        for request_id, request in requests.items():
            if not getattr(request, "awaiting_kvs", True) or self.transfers.is_open(sc.PATH_RECEIVE, request_id):
                continue
            ids, sizes = flat(per_group(getattr(request, "local_block_ids", ())))
            self.transfers.begin(sc.PATH_RECEIVE, request_id, request_id=request_id, block_ids=ids,
                                 group_sizes=sizes, trace_context=trace_contexts.get(request_id))

    def finish(self, finished: Any, failed: Any) -> list[LoadFailure]:
        """End the receives vLLM reports; the ones that arrived corrupt, for vLLM to hear about."""
        if not finished and not failed:
            return []
        failures = []
        failed = set(failed or ())
        for request_id in set(finished or ()) | failed:
            if not self.transfers.is_open(sc.PATH_RECEIVE, request_id):
                continue
            if request_id in failed:
                reason = "the connector reported the request in failed_recving"
                self.transfers.fail(sc.PATH_RECEIVE, request_id, EngineReportedFailure(sc.PATH_RECEIVE, request_id, reason))
                continue
            bad = self.transfers.complete(sc.PATH_RECEIVE, request_id)
            if bad:
                failures.append(LoadFailure(request_id, bad, False))
        return failures
