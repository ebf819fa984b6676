"""A strict check of PrometheusRule and PodMonitor (monitoring.coreos.com/v1) against prometheus-operator's API.

No package that the test environment installs carries the operator's CRDs as a JSON schema (PyPI has them only
as pydantic models that need the cloudcoil client; npm only as compiled validators that need node), so this
is a JSON Schema written from the operator's API reference (v0.8x: RuleGroup, Rule, PodMonitorSpec,
PodMetricsEndpoint, RelabelConfig, NamespaceSelector), stricter than the CRD in one way: a field the API
does not document is an error here, where the API server would prune it silently.

What it checks: every field name at every level kvobs uses, the required fields, types, the Duration
pattern, the scheme and relabel action enums, that each rule is either an alert or a recording rule, and
that rule group names are unique (the CRD keys the list by name).
What it does not: the content of the auth and TLS objects (typed `object` only; kvobs sets none), the
operator's admission webhook and CEL rules, and PromQL (promtool checks the rule groups separately).
The objects' metadata is checked against Kubernetes' ObjectMeta schema from kubernetes-validate.
"""

from __future__ import annotations

import functools

import jsonschema
import referencing
from kubernetes_validate import utils as kubernetes_schemas

API_VERSION = "monitoring.coreos.com/v1"
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OPAQUE = {"type": "object"}  # documented, not used by kvobs: only its type is checked
RELABEL_ACTIONS = ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap", "LabelMap",
                   "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                   "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]
NOT_ONE_RULE = ("neither an alerting nor a recording rule: exactly one of alert and record, and for, keep_firing_for "
                "and annotations only with alert")


def strict(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


RULE = {
    **strict({
        "alert": {"type": "string", "minLength": 1},
        "record": {"type": "string", "minLength": 1},
        "expr": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},
        "for": DURATION,
        "keep_firing_for": {**DURATION, "minLength": 1},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    }, ["expr"]),
    # exactly one of alert and record; for, keep_firing_for and annotations belong to alerts only
    "oneOf": [
        {"required": ["alert"], "not": {"required": ["record"]}},
        {"required": ["record"], "not": {"anyOf": [{"required": [k]} for k in ("alert", "for", "keep_firing_for",
                                                                                "annotations")]}},
    ],
}

RULE_GROUP = strict({
    "name": {"type": "string", "minLength": 1},
    "interval": DURATION,
    "query_offset": DURATION,
    "limit": {"type": "integer"},
    "labels": STRING_MAP,
    "partial_response_strategy": {"type": "string", "pattern": "^(?i)(abort|warn)?$"},
    "rules": {"type": "array", "items": RULE, "minItems": 1},
}, ["name", "rules"])

LABEL_SELECTOR = strict({
    "matchLabels": STRING_MAP,
    "matchExpressions": {"type": "array", "items": strict({
        "key": {"type": "string"},
        "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": {"type": "array", "items": {"type": "string"}},
    }, ["key", "operator"])},
})

RELABEL_CONFIG = strict({
    "action": {"enum": RELABEL_ACTIONS},
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"},
    "targetLabel": {"type": "string"},
    "regex": {"type": "string"},
    "modulus": {"type": "integer", "minimum": 0},
    "replacement": {"type": "string"},
})

POD_METRICS_ENDPOINT = strict({
    "port": {"type": "string", "minLength": 1},
    "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
    "targetPort": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "path": {"type": "string"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "trackTimestampsStaleness": {"type": "boolean"},
    "filterRunning": {"type": "boolean"},
    "relabelings": {"type": "array", "items": RELABEL_CONFIG},
    "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
    "enableHttp2": {"type": "boolean"},
    "followRedirects": {"type": "boolean"},
    "proxyUrl": {"type": "string"},
    "noProxy": {"type": "string"},
    "proxyFromEnvironment": {"type": "boolean"},
    "proxyConnectHeader": OPAQUE,
    "authorization": OPAQUE,
    "basicAuth": OPAQUE,
    "bearerTokenSecret": OPAQUE,
    "oauth2": OPAQUE,
    "tlsConfig": OPAQUE,
})

POD_MONITOR_SPEC = strict({
    "selector": LABEL_SELECTOR,
    "namespaceSelector": strict({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}),
    "podMetricsEndpoints": {"type": "array", "items": POD_METRICS_ENDPOINT, "minItems": 1},
    "jobLabel": {"type": "string"},
    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
    "sampleLimit": {"type": "integer", "minimum": 0},
    "targetLimit": {"type": "integer", "minimum": 0},
    "labelLimit": {"type": "integer", "minimum": 0},
    "labelNameLengthLimit": {"type": "integer", "minimum": 0},
    "labelValueLengthLimit": {"type": "integer", "minimum": 0},
    "keepDroppedTargets": {"type": "integer", "minimum": 0},
    "bodySizeLimit": {"type": "string"},
    "attachMetadata": strict({"node": {"type": "boolean"}}),
    "scrapeClass": {"type": "string", "minLength": 1},
    "scrapeProtocols": {"type": "array", "items": {"enum": [
        "PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
        "PrometheusText1.0.0"]}},
    "fallbackScrapeProtocol": {"enum": [
        "PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
        "PrometheusText1.0.0"]},
    "selectorMechanism": {"enum": ["RelabelConfig", "RoleSelector"]},
    "scrapeNativeHistograms": {"type": "boolean"},
    "scrapeClassicHistograms": {"type": "boolean"},
    "convertClassicHistogramsToNHCB": {"type": "boolean"},
    "nativeHistogramBucketLimit": {"type": "integer", "minimum": 0},
    "nativeHistogramMinBucketFactor": {"anyOf": [{"type": "string"}, {"type": "number"}]},
}, ["selector", "podMetricsEndpoints"])

OBJECT_META = {"$ref": "https://kubernetes.io/api/objectmeta/meta/v1"}  # the $id of kubernetes-validate's schema

SCHEMAS = {
    "PrometheusRule": strict({
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": "PrometheusRule"},
        "metadata": OBJECT_META,
        "spec": strict({"groups": {"type": "array", "items": RULE_GROUP, "minItems": 1}}, ["groups"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    "PodMonitor": strict({
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": "PodMonitor"},
        "metadata": OBJECT_META,
        "spec": POD_MONITOR_SPEC,
    }, ["apiVersion", "kind", "metadata", "spec"]),
}


@functools.lru_cache(maxsize=None)
def object_meta_registry(kubernetes_version: str) -> referencing.Registry:
    """Kubernetes' strict ObjectMeta schema (with its definitions) from kubernetes-validate's offline copy."""
    schema_dir = f"kubernetes-json-schema/v{kubernetes_version}-local-strict"
    meta = kubernetes_schemas.schema_contents(f"{schema_dir}/objectmeta-meta-v1.json", kubernetes_version)
    definitions = kubernetes_schemas.schema_contents(f"{schema_dir}/_definitions.json", kubernetes_version)
    resources = [referencing.Resource.from_contents(meta), referencing.Resource.from_contents(definitions)]
    return referencing.Registry().with_resources((resource.id(), resource) for resource in resources)


def operator_object_problems(obj: dict, kubernetes_version: str) -> list[str]:
    """Every departure of a PrometheusRule or PodMonitor from the documented API; [] when it conforms."""
    schema = SCHEMAS.get(obj.get("kind"))
    if schema is None or obj.get("apiVersion") != API_VERSION:
        return [f"not a {API_VERSION} PrometheusRule or PodMonitor: {obj.get('apiVersion')} {obj.get('kind')}"]
    validator = jsonschema.Draft202012Validator(schema, registry=object_meta_registry(kubernetes_version))
    problems = [f"{error.json_path}: {NOT_ONE_RULE if error.validator == 'oneOf' else error.message}"
                for error in validator.iter_errors(obj)]
    return problems + duplicate_group_names(obj)


def duplicate_group_names(obj: dict) -> list[str]:
    """spec.groups is a list map keyed by name (x-kubernetes-list-map-keys): a repeated name is refused."""
    groups = obj.get("spec", {}).get("groups", []) if obj.get("kind") == "PrometheusRule" else []
    names = [group.get("name") for group in groups if isinstance(group, dict)]
    return [f"$.spec.groups: group name {name!r} appears {names.count(name)} times"
            for name in sorted({n for n in names if names.count(n) > 1}, key=str)]
