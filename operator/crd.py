"""The LLMDeployment CustomResourceDefinition, generated from the pydantic spec (spec.py is the one source of truth).

`python -m pagekube.operator.crd > crds/llmdeployment.yaml` regenerates the file; a test checks that the file, the
Helm chart's copy and this generator agree.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from pagekube.operator.spec import GROUP, KIND, PLURAL, SHORT_NAME, VERSION, LLMDeploymentSpec

_DROP = {"title", "additionalProperties"}  # structural schemas forbid additionalProperties beside properties


def _structural(node: Any, defs: dict) -> Any:
    """JSON Schema (pydantic, draft 2020-12) -> Kubernetes structural OpenAPI v3 schema."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _structural({**defs[node["$ref"].split("/")[-1]], **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    any_of = node.get("anyOf")
    if any_of and {"type": "null"} in any_of:  # Optional[X]: absent means unset, never an explicit null
        rest = [a for a in any_of if a != {"type": "null"}]
        merged = {**{k: v for k, v in node.items() if k not in ("anyOf", "default")}, **rest[0]}
        return _structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "properties":
            required = set(node.get("required", []))
            props = {}
            for name, sub in value.items():
                prop = _structural(sub, defs)
                # An optional sub-object without required fields defaults to its fields' defaults, so the API
                # server fills them in (and CEL rules see them) even when the user leaves the whole object out.
                if name not in required and "properties" in prop and not prop.get("required"):
                    prop["default"] = {k: v["default"] for k, v in prop["properties"].items() if "default" in v}
                props[name] = prop
            out["properties"] = props
        else:
            out[key] = _structural(value, defs)
    if "additionalProperties" in out and "properties" in out:
        del out["additionalProperties"]
    return out


def _status_schema() -> dict:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "observedGeneration": {"type": "integer"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
        },
    }
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,  # kopf keeps its own bookkeeping under status
        "properties": {
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "selector": {"type": "string"},
            "endpoint": {"type": "string"},
            "model": {
                "type": "object",
                "description": "The model the pods serve; for hf:// the commit they download (pinned after the first)",
                "properties": {"source": {"type": "string"}, "requested": {"type": "string"},
                               "revision": {"type": "string"}},
            },
            "adapters": {
                "type": "array",
                "description": "Each LoRA adapter of spec.adapters: how many ready replicas serve it, and why one could "
                               "not load it",
                "items": {"type": "object", "required": ["name"],
                          "properties": {"name": {"type": "string"}, "readyReplicas": {"type": "integer"},
                                         "message": {"type": "string"}}},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
    }


def spec_schema() -> dict:
    raw = LLMDeploymentSpec.model_json_schema(by_alias=True)
    return _structural({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {}))


def crd() -> dict:
    columns = [
        ("Model", "string", ".spec.model.name"),
        ("Replicas", "integer", ".status.replicas"),
        ("Ready", "integer", ".status.readyReplicas"),
        ("Status", "string", '.status.conditions[?(@.type=="Ready")].reason'),
        ("Endpoint", "string", ".status.endpoint"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": ["all", "pagekube"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM served by pagekube engines behind NGINX, autoscaled by KEDA.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": _status_schema(),
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": n, "type": t, "jsonPath": p} for n, t, p in columns
                    ],
                }
            ],
        },
    }


class _NoAliases(yaml.SafeDumper):
    """Each default written out where it applies: no &anchors for readers (and tools) to follow."""

    def ignore_aliases(self, data) -> bool:
        return True


def crd_yaml() -> str:
    header = "# Generated by `python -m pagekube.operator.crd` from operator/spec.py. Do not edit by hand.\n"
    return header + yaml.dump(crd(), Dumper=_NoAliases, sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
