"""Validation of rendered Kubernetes objects: core objects against the `kubernetes` client's models (pydantic,
strict: unknown fields, wrong types, missing required fields, plus the JSON field names themselves, since the models
also accept their Python names); InferencePool, PodMonitor, HTTPRoute and KEDA's ScaledObject against the closed
subsets below, written from the published CRDs for the fields tokend's manifests use (no PyPI package ships those
schemas)."""

from __future__ import annotations

import re

import jsonschema
import kubernetes.client as k8s

# -- validation against the Kubernetes API -------------------------------------------------------------------------


# How the models name their fields' types: List[V1Container], Dict[str, str].
_LIST_OF = re.compile(r"^List\[(.+)\]$")
_MAP_OF = re.compile(r"^Dict\[str, (.+)\]$")


def _json_name_errors(value: object, type_name: str, path: str) -> list[str]:
    """Keys that are not the API's JSON field names (the pydantic models also take `image_pull_policy` for
    `imagePullPolicy`, which the API server would refuse)."""
    if (items := _LIST_OF.match(type_name)) and isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _json_name_errors(item, items[1], f"{path}[{i}]")]
    if (values := _MAP_OF.match(type_name)) and isinstance(value, dict):
        return [e for key, item in value.items() for e in _json_name_errors(item, values[1], f"{path}.{key}")]
    model = getattr(k8s, type_name, None)
    if model is None or not isinstance(value, dict):
        return []  # a primitive or free-form JSON: the model's validation checks its type
    by_json_name = {json_name: attribute for attribute, json_name in model.attribute_map.items()}
    errors = []
    for key, item in value.items():
        if key not in by_json_name:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += _json_name_errors(item, model.openapi_types[by_json_name[key]], f"{path}.{key}")
    return errors


def _served_by_api(obj: dict) -> bool:
    """Whether the client has the API that serves this apiVersion and kind (apps/v1 Deployment: AppsV1Api)."""
    group, _, version = obj["apiVersion"].rpartition("/")
    prefix = "".join(part.capitalize() for part in group.removesuffix(".k8s.io").split(".")) if group else "Core"
    api = getattr(k8s, f"{prefix}{version.capitalize()}Api", None)
    kind = re.sub(r"(?<!^)(?=[A-Z])", "_", obj["kind"]).lower()
    return api is not None and (hasattr(api, f"create_namespaced_{kind}") or hasattr(api, f"create_{kind}"))


def api_errors(obj: dict) -> list[str]:
    """What the API server would refuse in a core object: empty when the object is valid."""
    version = obj["apiVersion"].rpartition("/")[2]
    model = getattr(k8s, f"{version[0].upper()}{version[1:]}{obj['kind']}", None)
    if model is None or not _served_by_api(obj):
        return [f"{obj['apiVersion']} {obj['kind']}: not a Kubernetes API object"]
    errors = _json_name_errors(obj, model.__name__, obj["kind"])
    try:
        model.model_validate(obj)  # unknown fields, wrong types, missing required fields
    except ValueError as error:
        errors.append(str(error))
    return errors


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
_DNS_SUBDOMAIN = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_NAMESPACE = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_SELECTOR = _closed(
    {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                {"key": {"type": "string"}, "operator": {"type": "string"}, "values": {"type": "array"}},
                ("key", "operator"),
            ),
        },
    }
)
# inference.networking.k8s.io_inferencepools.yaml, v1 (Gateway API Inference Extension v1.0 to v1.6).
_INFERENCE_POOL_PORT = _closed({"number": _PORT_NUMBER}, ("number",))
INFERENCE_POOL_SPEC = _closed(
    {
        "selector": _closed(
            {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 64,
                    "additionalProperties": {
                        "type": "string",
                        "maxLength": 63,
                        "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                    },
                }
            },
            ("matchLabels",),
        ),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _INFERENCE_POOL_PORT},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            **_closed(
                {
                    "group": _DNS_SUBDOMAIN,
                    "kind": _KIND,
                    "name": _NAME,
                    "port": _INFERENCE_POOL_PORT,
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                ("name",),
            ),
            # The CRD's CEL rule: a port when the kind is Service, its default.
            "anyOf": [
                {"required": ["port"]},
                {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}},
            ],
        },
    },
    ("selector", "targetPorts"),
)
# monitoring.coreos.com_podmonitors.yaml, v1 (Prometheus Operator v0.93).
PODMONITOR_SPEC = _closed(
    {
        "selector": _LABEL_SELECTOR,
        "namespaceSelector": _closed({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "podMetricsEndpoints": {
            "type": "array",
            "items": _closed(
                {
                    "port": {"type": "string"},
                    "portNumber": _PORT_NUMBER,
                    "path": {"type": "string"},
                    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                    "interval": _DURATION,
                    "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"},
                    "authorization": _closed(
                        {
                            "type": {"type": "string"},
                            "credentials": _closed(
                                {
                                    "name": {"type": "string"},
                                    "key": {"type": "string"},
                                    "optional": {"type": "boolean"},
                                },
                                ("key",),
                            ),
                        }
                    ),
                }
            ),
        },
    },
    ("selector",),
)
# gateway.networking.k8s.io_httproutes.yaml, v1 (Gateway API v1.6, standard channel).
HTTPROUTE_SPEC = _closed(
    {
        "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
        "parentRefs": {
            "type": "array",
            "maxItems": 32,
            "items": _closed(
                {
                    "group": _DNS_SUBDOMAIN,
                    "kind": _KIND,
                    "name": _NAME,
                    "namespace": _NAMESPACE,
                    "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": _PORT_NUMBER,
                },
                ("name",),
            ),
        },
        "rules": {
            "type": "array",
            "maxItems": 16,
            "items": _closed(
                {
                    "name": {"type": "string"},
                    "matches": {
                        "type": "array",
                        "items": _closed(
                            {
                                "path": _closed(
                                    {
                                        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                        "value": {"type": "string", "maxLength": 1024},
                                    }
                                )
                            }
                        ),
                    },
                    "backendRefs": {
                        "type": "array",
                        "items": _closed(
                            {
                                "group": _DNS_SUBDOMAIN,
                                "kind": _KIND,
                                "name": _NAME,
                                "namespace": _NAMESPACE,
                                "port": _PORT_NUMBER,
                                "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
                            },
                            ("name",),
                        ),
                    },
                    "timeouts": _closed({"request": {"type": "string"}, "backendRequest": {"type": "string"}}),
                }
            ),
        },
    }
)
# keda.sh_scaledobjects.yaml, v1alpha1 (KEDA 2.x): the fields tokend's autoscaling component uses, and their kin.
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_HPA_SCALING_RULES = _closed(
    {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "items": _closed(
                {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {**_INT32, "exclusiveMinimum": 0},
                    "periodSeconds": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1800},
                },
                ("type", "value", "periodSeconds"),
            ),  # fmt: skip
        },
        "tolerance": {"type": ["string", "number"]},
    }
)
SCALED_OBJECT_SPEC = _closed(
    {
        "scaleTargetRef": _closed(
            {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "name": {"type": "string"},
                "envSourceContainerName": {"type": "string"},
            },
            ("name",),
        ),  # fmt: skip
        "pollingInterval": _INT32,
        "cooldownPeriod": _INT32,
        "initialCooldownPeriod": _INT32,
        "idleReplicaCount": _INT32,
        "minReplicaCount": _INT32,
        "maxReplicaCount": _INT32,
        "fallback": _closed({"failureThreshold": _INT32, "replicas": _INT32}, ("failureThreshold", "replicas")),
        "advanced": _closed(
            {
                "horizontalPodAutoscalerConfig": _closed(
                    {
                        "name": {"type": "string"},
                        "behavior": _closed({"scaleDown": _HPA_SCALING_RULES, "scaleUp": _HPA_SCALING_RULES}),
                    },
                ),  # fmt: skip
                "restoreToOriginalReplicaCount": {"type": "boolean"},
            }
        ),
        "triggers": {
            "type": "array",
            "items": _closed(
                {
                    "type": {"type": "string"},
                    "name": {"type": "string"},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "authenticationRef": _closed({"name": {"type": "string"}, "kind": {"type": "string"}}, ("name",)),
                },
                ("type", "metadata"),
            ),
        },
    },
    ("scaleTargetRef", "triggers"),
)
CRD_SPECS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_SPEC,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SPEC,
    ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_SPEC,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE_SPEC,
}


def crd_errors(obj: dict) -> list[str]:
    schema = CRD_SPECS.get((obj["apiVersion"], obj["kind"]))
    if schema is None:
        return [f"{obj['apiVersion']} {obj['kind']}: neither a Kubernetes API object nor a known CRD"]
    document = _closed({"apiVersion": {}, "kind": {}, "metadata": {"type": "object"}, "spec": schema}, ("spec",))
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(document).iter_errors(obj)
    ]
    return errors + _json_name_errors(obj["metadata"], "V1ObjectMeta", "metadata") + _metadata_errors(obj["metadata"])


def _metadata_errors(metadata: dict) -> list[str]:
    try:
        k8s.V1ObjectMeta.model_validate(metadata)
    except ValueError as error:
        return [str(error)]
    return []


def is_core(obj: dict) -> bool:
    return (obj["apiVersion"], obj["kind"]) not in CRD_SPECS
