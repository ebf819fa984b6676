"""The wrapped connector: its config and class, found the way vLLM's MultiConnector finds its children.

Its `kv_transfer_config` is the dict under `kv_connector_extra_config["connector"]`, completed with the
wrapper's `engine_id` and `kv_role` when it leaves them out; its `VllmConfig` is a shallow copy of the
wrapper's carrying that config. The class comes from vLLM's own factory (registry or module path).

HMA support is decided by vLLM from the configured class alone, so each wrapper class must claim exactly
what its child supports: `KVObsConnector` for children that support the hybrid KV cache manager,
`KVObsConnectorNoHMA` for the others; a mismatch would change how vLLM runs the model, and is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvobs.integrations.vllm._options import Options, read_options

_seen: list[type] = []  # wrapped classes met in this process, newest last


def child_transfer_config(parent: Any, connector: Mapping[str, Any]) -> Any:
    """The wrapped connector's KVTransferConfig."""
    from vllm.config.kv_transfer import KVTransferConfig

    inherited = {"engine_id": parent.engine_id, "kv_role": parent.kv_role}
    return KVTransferConfig(**{**inherited, **connector})


def child_class(transfer_config: Any) -> type:
    """The wrapped connector's class, remembered for the classmethods vLLM calls without a config."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(transfer_config)
    if cls in _seen:
        _seen.remove(cls)
    _seen.append(cls)
    return cls


def child_of(vllm_config: Any) -> tuple[type, Any, Options]:
    """(class, VllmConfig, kvobs options) of the connector a wrapper configured by `vllm_config` wraps."""
    parent = vllm_config.kv_transfer_config
    options = read_options(parent.kv_connector_extra_config)
    config = copy.copy(vllm_config)
    config.kv_transfer_config = child_transfer_config(parent, options.connector)
    return child_class(config.kv_transfer_config), config, options


def child_of_transfer_config(transfer_config: Any) -> tuple[type, Any]:
    """(class, KVTransferConfig) of the wrapped connector, from the wrapper's KVTransferConfig alone."""
    options = read_options(transfer_config.kv_connector_extra_config)
    child = child_transfer_config(transfer_config, options.connector)
    return child_class(child), child


def last_seen_child() -> type | None:
    """The wrapped class this process met last (vLLM's stats loggers ask the wrapper class for it)."""
    return _seen[-1] if _seen else None


def check_hma(wrapper: type, child_config: Any) -> None:
    """Refuse a wrapper class whose HMA claim differs from its child's."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    child_hma = KVConnectorFactory.supports_hma_config(child_config)
    if child_hma == issubclass(wrapper, SupportsHMA):
        return
    right = "KVObsConnector" if child_hma else "KVObsConnectorNoHMA"
    raise ValueError(
        f"{child_config.kv_connector} {'supports' if child_hma else 'does not support'} vLLM's hybrid KV cache "
        f"manager (HMA), {wrapper.__name__} {'does not' if child_hma else 'does'}: use kv_connector=\"{right}\", "
        f"so that vLLM runs the wrapped {child_config.kv_connector} exactly as it would run it alone"
    )
