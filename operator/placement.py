"""Where pods run. The engine takes the LLMDeployment's nodeSelector, tolerations and affinity (GPU nodes); NGINX and
the activator, the request path, take `loadBalancer`'s own (CPU nodes, usually). Priority and image pull secrets
apply to every pod: the request path matters as much as the engines, and a private registry serves them all."""

from __future__ import annotations

from pagekube.operator.spec import LLMDeploymentSpec


def _placement(spec: LLMDeploymentSpec, node_selector: dict, tolerations: list, affinity: dict | None) -> dict:
    out: dict = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.model_dump(exclude_none=True) for t in tolerations]
    if affinity:
        out["affinity"] = affinity
    if spec.priority_class_name:
        out["priorityClassName"] = spec.priority_class_name
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    return out


def engine_placement(spec: LLMDeploymentSpec) -> dict:
    return _placement(spec, spec.node_selector, spec.tolerations, spec.affinity)


def request_path_placement(spec: LLMDeploymentSpec) -> dict:
    lb = spec.load_balancer
    return _placement(spec, lb.node_selector, lb.tolerations, lb.affinity)
