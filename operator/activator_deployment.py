"""The activator's Deployment and Service (only for an LLMDeployment that scales to zero): see activator.py."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.nginx import cluster_upstreams
from pagekube.operator.placement import request_path_placement
from pagekube.operator.pod_security import container_security_context, pod_security_context
from pagekube.operator.services import cluster_ip_service
from pagekube.operator.spec import LLMDeploymentSpec

METRICS_PATH = "/activator/metrics"
ACTIVATOR_UID = 1000  # the operator image's user (images/operator/Dockerfile)


def build_activator_deployment(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    a = spec.autoscaling.activator
    probe = {"httpGet": {"path": "/activator/healthz", "port": "http"}, "periodSeconds": 5}
    args = ["activator", "--llmdeployment", name, "--port", str(naming.ACTIVATOR_PORT),
            "--max-pending", str(a.max_pending), "--hold-timeout", str(a.hold_timeout_seconds)]
    for upstream in cluster_upstreams(name, namespace):
        args += ["--upstream", upstream]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(naming.activator_name(name), namespace, name, "activator"),
        "spec": {
            "replicas": 1,  # the pending count is per activator: one keeps KEDA's sum exact
            "selector": {"matchLabels": naming.selector(name, "activator")},
            "template": {
                "metadata": {
                    "labels": naming.labels(name, "activator"),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(naming.ACTIVATOR_PORT),
                                    "prometheus.io/path": METRICS_PATH},
                },
                "spec": {
                    "containers": [{
                        "name": "activator",
                        "image": a.image,
                        "command": ["pagekube-operator"],
                        "args": args,
                        "ports": [{"name": "http", "containerPort": naming.ACTIVATOR_PORT, "protocol": "TCP"}],
                        "readinessProbe": probe,
                        "livenessProbe": probe,
                        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        "securityContext": container_security_context(read_only_root=True),
                    }],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "securityContext": pod_security_context(ACTIVATOR_UID),
                    **request_path_placement(spec),
                    # Held requests wait for an engine; a restart would drop them, so let them finish first.
                    "terminationGracePeriodSeconds": a.hold_timeout_seconds + 10,
                    "enableServiceLinks": False,
                },
            },
        },
    }


def build_activator_service(name: str, namespace: str) -> dict:
    return cluster_ip_service(name, namespace, naming.activator_name(name), "activator", naming.ACTIVATOR_PORT)
