"""Check a dashboard's JSON against Grafana's schema as grafana-foundation-sdk types it (Grafana 11.6).

The SDK is generated from Grafana's own schema (the dashboard kind, each panel plugin's options and field
config, each datasource's query). Two checks, both needed:

- round trip: the JSON is decoded into the SDK's models and encoded again; a key the schema does not know is
  dropped on the way (reported as unknown), a field the schema requires but the JSON lacks comes back with its
  default (reported as missing);
- types: every value the models hold is compared with the type hint of its field (int, float, str, bool,
  enums, Literal, lists, nested models), because decoding copies scalars without looking at them.

What it cannot see: constraints the SDK's Python types do not carry (number ranges, string lengths and
patterns of the CUE schema), and options typed as free-form objects (a query variable's `query` object).
"""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as dashboard_model

register_default_plugins()  # panel options, field config and queries decode into their plugin's models

MODELS_PACKAGE = "grafana_foundation_sdk.models."
FREE_FORM = (typing.Any, object)


def dashboard_schema_problems(data: dict) -> list[str]:
    """Every way `data` departs from Grafana's dashboard schema; [] when it conforms."""
    try:
        model = dashboard_model.Dashboard.from_json(data)
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        return [f"does not decode as a Grafana dashboard: {exc!r}"]
    encoded = json.loads(json.dumps(model, cls=JSONEncoder))
    return round_trip_problems(data, encoded, "") + type_problems(model, "")


def round_trip_problems(original: Any, encoded: Any, path: str) -> list[str]:
    if isinstance(original, dict) and isinstance(encoded, dict):
        problems = [f"{path}.{key}: not in Grafana's schema" for key in original.keys() - encoded.keys()]
        problems += [f"{path}.{key}: absent, Grafana's schema fills in {encoded[key]!r}" for key in encoded.keys() - original.keys()]
        for key in original.keys() & encoded.keys():
            problems += round_trip_problems(original[key], encoded[key], f"{path}.{key}")
        return problems
    if isinstance(original, list) and isinstance(encoded, list) and len(original) == len(encoded):
        return [p for i, (o, e) in enumerate(zip(original, encoded)) for p in round_trip_problems(o, e, f"{path}[{i}]")]
    if original != encoded:
        return [f"{path}: {original!r} does not survive Grafana's schema (comes back as {encoded!r})"]
    return []


def is_model(value: Any) -> bool:
    return type(value).__module__.startswith(MODELS_PACKAGE) and not isinstance(value, enum.Enum)


def type_problems(model: Any, path: str) -> list[str]:
    """Compare every field of an SDK model (recursively) with its type hint."""
    hints = typing.get_type_hints(type(model))
    problems = []
    for field, hint in hints.items():
        problems += value_problems(getattr(model, field, None), hint, f"{path}.{field}")
    return problems


def value_problems(value: Any, hint: Any, path: str) -> list[str]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return []
        attempts = [value_problems(value, option, path) for option in options if option is not type(None)]
        return [] if any(not attempt for attempt in attempts) else min(attempts, key=len)
    if is_model(value):  # a nested model, also where the hint is free-form (plugin options, queries)
        if not (hint in FREE_FORM or isinstance(hint, type) and isinstance(value, hint)):
            return [f"{path}: a {type(value).__name__} where the schema wants {hint}"]
        return type_problems(value, path)
    if hint in FREE_FORM:
        return []
    if origin is typing.Literal:
        return [] if value in typing.get_args(hint) else [f"{path}: {value!r} is not one of {typing.get_args(hint)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        (item,) = typing.get_args(hint)
        return [p for i, v in enumerate(value) for p in value_problems(v, item, f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not an object"]
        _, item = typing.get_args(hint)
        return [p for k, v in value.items() for p in value_problems(v, item, f"{path}.{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [member.value for member in hint]
        ok = isinstance(value, hint) or (value in allowed and type(value) is type(allowed[0]))
        return [] if ok else [f"{path}: {value!r} is not one of {allowed}"]
    return scalar_problems(value, hint, path)


def scalar_problems(value: Any, hint: Any, path: str) -> list[str]:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is str:
        ok = isinstance(value, str)
    elif isinstance(hint, type):
        ok = isinstance(value, hint)
    else:
        return [f"{path}: type {hint} is not understood by this check"]
    return [] if ok else [f"{path}: {value!r} is not a {getattr(hint, '__name__', hint)}"]
