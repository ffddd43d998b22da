"""prometheus-operator on the node, installed as its README says (its bundle.yaml: CRDs, RBAC, Deployment) from the
locally built image, and one Prometheus resource that selects every ServiceMonitor and PrometheusRule in every
namespace, as kube-prometheus's does. The operator runs Prometheus as a StatefulSet behind its `prometheus-operated`
Service: KEDA queries that DNS name, and the tests read Prometheus's HTTP API through the API server's service proxy.
"""

from __future__ import annotations

import json
import urllib.parse

import yaml

from e2e.node.node import Node
from e2e.waiting import wait_established

NAMESPACE = "monitoring"
PROMETHEUS = "k8s"  # the Prometheus resource's name (its pods: prometheus-k8s-N)
PROMETHEUS_URL = f"http://prometheus-operated.{NAMESPACE}.svc.cluster.local:9090"  # as a ScaledObject names it
SCRAPE_INTERVAL = "2s"  # for ServiceMonitors without an interval of their own, and the rules' evaluation


class _BundleLoader(yaml.SafeLoader):
    """The bundle's CRDs have an enum value `=`, which YAML 1.1 tags as a "value" key: read it as the string."""


_BundleLoader.add_constructor("tag:yaml.org,2002:value", yaml.SafeLoader.construct_yaml_str)


def operator_bundle(text: str, operator_image: str) -> list[dict]:
    """bundle.yaml's objects moved from `default` to NAMESPACE, with the local image for the operator and for the
    config-reloader it puts beside each Prometheus (its tag differs from upstream's: same binary, one image)."""
    docs = [d for d in yaml.load_all(text, Loader=_BundleLoader) if d]
    for doc in docs:
        if "namespace" in doc["metadata"]:
            doc["metadata"]["namespace"] = NAMESPACE
        for subject in doc.get("subjects", []):
            subject["namespace"] = NAMESPACE
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container.update(image=operator_image, imagePullPolicy="Never")
            container["args"] = [f"--prometheus-config-reloader={operator_image}"
                                 if a.startswith("--prometheus-config-reloader=") else a for a in container["args"]]
    return docs


def prometheus_resource(image: str, version: str) -> dict:
    """A Prometheus that scrapes every ServiceMonitor and evaluates every PrometheusRule, in any namespace."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
        "metadata": {"name": PROMETHEUS, "namespace": NAMESPACE},
        "spec": {
            "image": image, "version": version, "imagePullPolicy": "Never", "replicas": 1,
            "serviceAccountName": "prometheus",
            "serviceMonitorSelector": {}, "serviceMonitorNamespaceSelector": {},
            "ruleSelector": {}, "ruleNamespaceSelector": {},
            "scrapeInterval": SCRAPE_INTERVAL, "evaluationInterval": SCRAPE_INTERVAL,
            "resources": {"requests": {"cpu": "50m", "memory": "200Mi"}},
        },
    }


def prometheus_rbac() -> list[dict]:
    """What upstream's example/rbac/prometheus grants: read the objects service discovery lists."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "prometheus"},
         "rules": [{"apiGroups": [""], "resources": ["nodes", "nodes/metrics", "services", "endpoints", "pods"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
                   {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "prometheus"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": NAMESPACE}]},
    ]


def _apply(node: Node, docs: list[dict]) -> None:
    # server-side: the CRDs are larger than client-side apply's last-applied annotation may be
    node.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                 input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))


def start_monitoring(node: Node) -> str:
    """Install prometheus-operator and a Prometheus; wait until that Prometheus answers. Returns PROMETHEUS_URL."""
    tools = node.tools
    node.kubectl("create", "namespace", NAMESPACE, check=False)
    bundle = operator_bundle((tools["PAGEKUBE_MONITORING_BIN"] / "bundle.yaml").read_text(),
                             str(tools["PAGEKUBE_PROMETHEUS_OPERATOR_IMAGE"]))
    crds = [d for d in bundle if d["kind"] == "CustomResourceDefinition"]
    _apply(node, crds)
    wait_established(node.kubectl, *[f"crd/{d['metadata']['name']}" for d in crds])
    _apply(node, [d for d in bundle if d["kind"] != "CustomResourceDefinition"] + prometheus_rbac())
    node.kubectl("-n", NAMESPACE, "rollout", "status", "deployment/prometheus-operator", "--timeout=120s", timeout=150)
    _apply(node, [prometheus_resource(str(tools["PAGEKUBE_PROMETHEUS_IMAGE"]),
                                      str(tools["PAGEKUBE_PROMETHEUS_VERSION"]))])
    node.wait("Prometheus answering", lambda: prometheus_api(node, "status/buildinfo", check=False) is not None, 180)
    return PROMETHEUS_URL


def prometheus_api(node: Node, path: str, check: bool = True, **params: str) -> dict | None:
    """GET /api/v1/<path> of the operator's Prometheus, through the API server's service proxy: its `data`."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    r = node.kubectl("get", "--raw", f"/api/v1/namespaces/{NAMESPACE}/services/prometheus-operated:web/proxy/api/v1/"
                     f"{path}{query}", check=check, timeout=30)
    if r.returncode:
        return None
    return json.loads(r.stdout)["data"]


def query(node: Node, promql: str) -> list[dict]:
    """An instant query's result vector."""
    return prometheus_api(node, "query", query=promql)["result"]

