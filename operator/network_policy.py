"""An optional NetworkPolicy for the engine pods: they take connections only from this deployment's NGINX and
activator (the request path), from the monitoring namespaces (Prometheus' scrapes), from the operator when adapters
are declared (it reads each engine's /metrics for status.adapters) and, when an engine spans pods, from the other
pods of its group (any port). Off by default: a cluster whose network plugin enforces policies decides to turn it
on."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.spec import LLMDeploymentSpec

OPERATOR_POD = {"app.kubernetes.io/name": "pagekube-operator"}  # charts/pagekube: pagekube.selectorLabels


def build_engine_network_policy(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    port = [{"protocol": "TCP", "port": naming.ENGINE_PORT}]
    peers = [{"podSelector": {"matchLabels": naming.selector(name, component)}}
             for component in ("load-balancer", "activator")]
    scrapers = {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In",
        "values": list(spec.network_policy.monitoring_namespaces)}]}}
    pods = {"matchLabels": naming.selector(name, "engine")}
    if spec.adapters:  # the chart's operator pods, in whatever namespace it is installed
        peers.append({"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD}})
    ingress = [{"from": peers, "ports": port}, {"from": [scrapers], "ports": port}]
    if spec.engine.pipeline_parallel_size > 1:  # a group's ranks meet on the rendezvous port and gloo/NCCL's own
        pods = group_pods(name)
        ingress.append({"from": [{"podSelector": group_pods(name)}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(naming.engine_name(name), namespace, name, "engine"),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def group_pods(name: str) -> dict:
    """The leaders and workers of a pipeline-parallel engine's groups."""
    match = {k: v for k, v in naming.selector(name, "engine").items() if k != "app.kubernetes.io/component"}
    return {"matchLabels": match, "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                        "values": ["engine", naming.ENGINE_WORKER]}]}
