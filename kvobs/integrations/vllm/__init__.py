"""Put kvobs on vLLM (0.32 and 0.33, V1 KV connector API): a KV connector that wraps any other one.

    --kv-transfer-config '{"kv_connector": "KVObsConnector",
                           "kv_connector_module_path": "kvobs.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "connector": {"kv_connector": "OffloadingConnector",
                                             "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}},
                               "engine": "vllm", "integrity": "report"}}'

The wrapped connector runs exactly as it would alone (same calls, same results, same errors). kvobs sees,
per request: each offloading load job as a `prefetch` and each store job as a `write_back` transfer (from
the job's submission to the worker reporting it done), each receive named by the metadata (NIXL's
`reqs_to_recv`) as a `receive` transfer, each load and store of a connector that copies during the
forward pass (the shared-storage connector) as a `prefetch` / `write_back`, and each request a prefill node
hands to a decode node as a `send` transfer whose trace context travels in `kv_transfer_params`, so the
decode node's receive continues the same trace. Use `KVObsConnectorNoHMA` to wrap a connector without HMA support.

Options (`kv_connector_extra_config`): `connector` (the wrapped connector's kv_transfer_config; `engine_id`
and `kv_role` default to the wrapper's), `engine` (the kvobs engine label), `integrity` (`report`, the
default: corrupt loads are reported to vLLM as load failures and recomputed, corrupt stores are left out;
`raise`; `count`; `off`), `recompute` (true, the default: kvobs sets vLLM's `kv_load_failure_policy` to
`recompute`; false keeps vLLM's), `deadline` (seconds before an open transfer is abandoned).

No lock is taken by default: vLLM keeps many transfers open at once, which one global lock would serialise.
For a `BlockLock`, or a registry, tracer provider or hooks of your own, build the observer yourself and
`use_observer(obs)` in that process before vLLM builds its connectors.

Importing this module does not import vLLM; the connector classes are built on first access.
"""

from __future__ import annotations

from typing import Any

from kvobs.integrations.vllm._observers import use_observer
from kvobs.integrations.vllm._options import INTEGRITY_MODES, TRACE_CONTEXT_KEY

__all__ = ["INTEGRITY_MODES", "TRACE_CONTEXT_KEY", "KVObsConnector", "KVObsConnectorMetadata",
           "KVObsConnectorNoHMA", "use_observer"]

_CLASSES = ("KVObsConnector", "KVObsConnectorNoHMA", "KVObsConnectorMetadata")


def __getattr__(name: str) -> Any:
    """The connector classes, built from the vLLM installed (imported now, on first access)."""
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvobs.integrations.vllm._classes import build

    try:
        return build()[name]
    except ImportError as exc:
        raise ImportError(f"{__name__}.{name} needs vLLM 0.33 (pip install vllm==0.33.0): {exc}") from exc
