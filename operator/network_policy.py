"""An optional NetworkPolicy for the engine pods: they take connections only from this deployment's NGINX and
activator (the request path) and from the monitoring namespaces (Prometheus' scrapes). Off by default: a cluster
whose network plugin enforces policies decides to turn it on."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.spec import LLMDeploymentSpec


def build_engine_network_policy(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    port = [{"protocol": "TCP", "port": naming.ENGINE_PORT}]
    peers = [{"podSelector": {"matchLabels": naming.selector(name, component)}}
             for component in ("load-balancer", "activator")]
    scrapers = {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In",
        "values": list(spec.network_policy.monitoring_namespaces)}]}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(naming.engine_name(name), namespace, name, "engine"),
        "spec": {
            "podSelector": {"matchLabels": naming.selector(name, "engine")},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": port}, {"from": [scrapers], "ports": port}],
        },
    }
