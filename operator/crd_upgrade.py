"""The operator keeps its CRD current: Helm installs a chart's `crds/` once and never upgrades them, so after
`helm upgrade` the API server would still hold the old schema and prune every new field from stored objects.
At start (`--manage-crd`, which the chart sets) the operator applies the CRD it was built with, but only when that
schema covers every field the installed one has: an older operator (a rollback, a replica of the previous
version still running during a rollout) never takes fields away."""

from __future__ import annotations

import logging

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from pagekube.operator.crd import crd
from pagekube.operator.reconciler import FIELD_MANAGER

log = logging.getLogger("pagekube.operator")


def field_paths(schema: dict, prefix: tuple = ()) -> set[tuple]:
    """Every property path an OpenAPI schema declares (list items under "[]")."""
    paths = set()
    for key, sub in (schema.get("properties") or {}).items():
        paths.add((*prefix, key))
        paths |= field_paths(sub, (*prefix, key))
    if "items" in schema:
        paths |= field_paths(schema["items"], (*prefix, "[]"))
    return paths


def _schema(definition: dict) -> dict:
    return definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def upgrade_crd(api: client.ApiClient) -> str:
    """Apply our CRD over the installed one where ours is the same or newer; returns what was done."""
    ours = crd()
    name = ours["metadata"]["name"]
    try:
        installed = client.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    except ApiException as e:
        if e.status == 404:
            log.warning("CRD %s is not installed (install the chart, or `pagekube-operator crd | kubectl apply -f -`)", name)
            return "missing"
        raise
    installed_schema, our_schema = _schema(api.sanitize_for_serialization(installed)), _schema(ours)
    missing = field_paths(installed_schema) - field_paths(our_schema)
    if missing:
        log.warning("CRD %s has fields this operator does not know (%s): a newer version installed it; left as is",
                    name, ", ".join(".".join(p) for p in sorted(missing)[:5]))
        return "newer"
    if installed_schema == our_schema:
        return "current"
    crds = dynamic.DynamicClient(api).resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    crds.server_side_apply(body=ours, name=name, field_manager=FIELD_MANAGER, force_conflicts=True)
    log.info("upgraded CRD %s to this operator's schema", name)
    return "upgraded"
