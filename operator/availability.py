"""What keeps a deployment serving through voluntary disruptions: a PodDisruptionBudget per component (a node drain
evicts at most `maxUnavailable` engine pods, and as many NGINX pods, at a time) and topology spread constraints,
so that one node going away does not take every replica with it."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.spec import LLMDeploymentSpec


def build_pod_disruption_budget(name: str, namespace: str, component: str, spec: LLMDeploymentSpec) -> dict:
    resource_name = naming.engine_name(name) if component == "engine" else naming.lb_name(name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": naming.metadata(resource_name, namespace, name, component),
        "spec": {
            "maxUnavailable": spec.availability.max_unavailable,
            "selector": {"matchLabels": naming.selector(name, component)},
            # A pod that is not ready (starting, or stuck) may be evicted even when the budget is spent: it serves
            # nothing, and keeping it would block a drain for good.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def topology_spread(name: str, component: str, spec: LLMDeploymentSpec) -> list[dict]:
    spread = spec.availability.topology_spread
    if not spread.enabled:
        return []
    return [{"maxSkew": spread.max_skew, "topologyKey": spread.topology_key,
             "whenUnsatisfiable": spread.when_unsatisfiable,
             "labelSelector": {"matchLabels": naming.selector(name, component)},
             "matchLabelKeys": ["pod-template-hash"]}]  # count this rollout's pods only, not the old ones leaving
