"""The node's autoscaling stack: the real KEDA operator and metrics adapter (built by e2e/node/build.sh) behind
the API server's aggregation layer, so that the HPA controller in kube-controller-manager reads KEDA's external
metrics as it does in any cluster. KEDA queries the operator-run Prometheus (e2e/node/monitoring.py) by its Service
DNS name, as a ScaledObject's prometheusAddress says.

They run as processes in the node's network namespace, as the control plane does, resolving cluster names through
CoreDNS as a pod would (the adapter and operator talk mutual TLS with the harness's certificates instead of the ones
KEDA's cert rotation would put in a Secret).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import yaml

from e2e.node.node import NODE_IP, Node
from e2e.waiting import wait_established

ADAPTER_PORT = 6444


def _metrics_api_service(ca_bundle: bytes) -> str:
    """The APIService KEDA's chart installs, pointed at the adapter on the node (a Service without selector)."""
    items = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "keda"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "keda-metrics-apiserver", "namespace": "keda"},
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": ADAPTER_PORT}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "keda-metrics-apiserver", "namespace": "keda",
                      "labels": {"kubernetes.io/service-name": "keda-metrics-apiserver"}},
         "addressType": "IPv4", "ports": [{"name": "https", "port": ADAPTER_PORT, "protocol": "TCP"}],
         "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
         "spec": {"service": {"name": "keda-metrics-apiserver", "namespace": "keda", "port": 443},
                  "group": "external.metrics.k8s.io", "version": "v1beta1", "caBundle": base64.b64encode(ca_bundle).decode(),
                  "groupPriorityMinimum": 100, "versionPriority": 100}},
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def start_autoscaling(node: Node, keda_bin: Path) -> None:
    """Install KEDA's CRDs and start its operator and metrics adapter."""
    d = node.workdir

    # Every CRD KEDA ships, eventing.keda.sh's included: its operator watches them all, and one missing makes it
    # exit two minutes after start (its cache never syncs), which leaves the HPA without metrics.
    crds = sorted(keda_bin.glob("*.yaml"))
    node.kubectl("apply", "--server-side", *[a for crd in crds for a in ("-f", str(crd))])
    names = [yaml.safe_load(crd.read_text())["metadata"]["name"] for crd in crds]
    wait_established(node.kubectl, *[f"crd/{n}" for n in names])
    node.kubectl("apply", "-f", "-", input=_metrics_api_service((d / "ca.crt").read_bytes()))

    env = {**os.environ, "KUBECONFIG": str(node.kubeconfig), "POD_NAMESPACE": "keda", "WATCH_NAMESPACE": "",
           "KEDA_CLUSTER_OBJECT_NAMESPACE": "keda"}  # in a pod, the service account file says it
    certs = d / "keda-certs"
    node.spawn("keda-operator", [
        str(keda_bin / "keda-operator"), "--leader-elect=false", "--enable-cert-rotation=false",
        f"--cert-dir={certs}", "--metrics-bind-address=127.0.0.1:8082", "--health-probe-bind-address=127.0.0.1:8083",
        "--metrics-service-bind-address=127.0.0.1:9666", "--enable-webhook-patching=false",
        "--enable-apiservice-patching=false", "--zap-log-level=info"], env=env, cluster_dns=True)
    node.spawn("keda-adapter", [
        str(keda_bin / "keda-adapter"), f"--secure-port={ADAPTER_PORT}", f"--tls-cert-file={certs / 'tls.crt'}",
        f"--tls-private-key-file={certs / 'tls.key'}", f"--cert-dir={certs}",
        "--metrics-service-address=127.0.0.1:9666", f"--lister-kubeconfig={node.kubeconfig}",
        f"--authentication-kubeconfig={node.kubeconfig}",
        f"--authorization-kubeconfig={node.kubeconfig}", "--port=8084", "--zap-log-level=info"], env=env,
        cluster_dns=True)
    node.wait("the external metrics API", lambda: node.kubectl(
        "get", "--raw", "/apis/external.metrics.k8s.io/v1beta1", check=False).returncode == 0, 120)
