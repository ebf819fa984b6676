"""The connectors inside a wrapped connector, each with its own part of the step's metadata.

vLLM composes connectors with `MultiConnector`: its `sub_connectors` receive, in order, the entries of
`MultiKVConnectorMetadata.metadata` (and report through `MultiKVConnectorWorkerMetadata.metadata`). kvobs
observes each leaf with the metadata that leaf gets, as vLLM would have handed it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def leaves(connector: Any, metadata: Any = None) -> Iterator[tuple[Any, Any]]:
    """(leaf connector, its metadata or None) for every connector under `connector`, in order."""
    subs = getattr(connector, "sub_connectors", None)
    if not isinstance(subs, list) or is_kvobs_wrapper(connector):
        yield connector, metadata
        return
    parts = getattr(metadata, "metadata", None)
    for i, sub in enumerate(subs):
        yield from leaves(sub, parts[i] if isinstance(parts, tuple) and i < len(parts) else None)


def is_kvobs_wrapper(connector: Any) -> bool:
    """A KVObsConnector observes its own child: a wrapper around it must not observe that child again."""
    return bool(getattr(type(connector), "__kvobs_wrapper__", False))
