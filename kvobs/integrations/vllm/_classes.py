"""Build the vLLM classes of the integration, once vLLM is importable.

They subclass vLLM's own `KVConnectorBase_V1` (and `SupportsHMA`), so they exist only where vLLM does;
`kvobs.integrations.vllm` builds them on first access. Every public method and property of vLLM's base
classes that `WrapperMethods` does not observe is generated here as a plain pass-through to the wrapped
connector, so a method vLLM adds to its base API is passed through too, never answered by the base class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvobs.integrations.vllm._wrapper import HMAMethods, WrapperMethods

MODULE = "kvobs.integrations.vllm"
_built: dict[Any, dict[str, type]] = {}


def build() -> dict[str, type]:
    """{"KVObsConnector", "KVObsConnectorNoHMA", "KVObsConnectorMetadata"} for the vLLM imported now."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    built = _built.get(base.KVConnectorBase_V1)
    if built is None:
        metadata = _metadata_class(base.KVConnectorMetadata)
        built = {
            "KVObsConnector": _connector_class("KVObsConnector", (HMAMethods, WrapperMethods),
                                               (base.KVConnectorBase_V1, base.SupportsHMA), metadata),
            "KVObsConnectorNoHMA": _connector_class("KVObsConnectorNoHMA", (WrapperMethods,),
                                                    (base.KVConnectorBase_V1,), metadata),
            "KVObsConnectorMetadata": metadata,
        }
        _built[base.KVConnectorBase_V1] = built
    return built


def undelegated_classmethods(vllm_bases: tuple[type, ...]) -> set[str]:
    """Public classmethods of vLLM's base classes that the wrapper does not answer itself (should be none)."""
    answered = {name for mixin in (HMAMethods, WrapperMethods) for name in dir(mixin)}
    return {name for klass in vllm_bases for name, attr in vars(klass).items()
            if isinstance(attr, (classmethod, staticmethod)) and not name.startswith("_") and name not in answered}


def _metadata_class(base_metadata: type) -> type:
    @dataclass
    class KVObsConnectorMetadata(base_metadata):  # type: ignore[misc, valid-type]
        """The wrapped connector's metadata for the step, and the trace contexts of its receives."""

        wrapped: Any
        trace_contexts: dict[str, dict[str, str]] = field(default_factory=dict)

    # pickled by name on its way to the workers: found again as kvobs.integrations.vllm.KVObsConnectorMetadata
    KVObsConnectorMetadata.__module__ = MODULE
    KVObsConnectorMetadata.__qualname__ = "KVObsConnectorMetadata"
    return KVObsConnectorMetadata


def _connector_class(name: str, mixins: tuple[type, ...], vllm_bases: tuple[type, ...], metadata: type) -> type:
    answered = {attr for mixin in mixins for attr in dir(mixin)}
    namespace = _pass_throughs(vllm_bases, answered)
    namespace.update(__module__=MODULE, __qualname__=name, _kvobs_metadata_type=metadata,
                     __doc__=f"{name}: a vLLM KV connector observing the connector it wraps (see {MODULE}).")
    return type(name, (*mixins, *vllm_bases), namespace)


def _pass_throughs(vllm_bases: tuple[type, ...], answered: set[str]) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    for klass in vllm_bases:
        for attr_name, attr in vars(klass).items():
            if attr_name.startswith("_") or attr_name in answered or attr_name in namespace:
                continue
            if isinstance(attr, property):
                namespace[attr_name] = _passed_property(attr_name)
            elif callable(attr) and not isinstance(attr, (classmethod, staticmethod)):
                namespace[attr_name] = _passed_method(attr_name)
    return namespace


def _passed_method(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._kvobs_wrapped, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped connector's `{name}`."
    return method


def _passed_property(name: str) -> property:
    return property(lambda self: getattr(self._kvobs_wrapped, name), doc=f"The wrapped connector's `{name}`.")
