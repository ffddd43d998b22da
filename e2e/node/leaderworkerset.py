"""The LeaderWorkerSet controller on the node: the upstream manager (built by build.sh from sigs.k8s.io/lws), run as
a node process like KEDA, with its CRD and its admission webhooks.

The webhooks matter: LWS injects LWS_LEADER_ADDRESS, LWS_WORKER_INDEX and the group labels into each pod at
creation, through its pod webhook. In a cluster the manager serves them behind a Service with certificates of its
own making; here it serves them on the node's address with the node's serving certificate (signed by the cluster
CA, which the webhook configurations name), and its internal certificate management is off.
"""

from __future__ import annotations

import base64
import json
import subprocess

import yaml

from e2e.node.node import NODE_IP, in_netns
from e2e.waiting import wait_established

WEBHOOK_PORT = 9443
SELECTS_LWS_PODS = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def _webhooks(kind: str, ca_bundle: str) -> dict:
    """The manager's MutatingWebhookConfiguration or ValidatingWebhookConfiguration (config/webhook in the module),
    pointed at the node by URL."""
    verb = "mutate" if kind == "Mutating" else "validate"

    def hook(name: str, path: str, group: str, resource: str, operations: list[str], pods: bool) -> dict:
        hook = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "clientConfig": {"url": f"https://{NODE_IP}:{WEBHOOK_PORT}{path}", "caBundle": ca_bundle},
                "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": operations,
                           "resources": [resource]}]}
        if pods:  # only the pods LWS makes: every other pod is created without it
            hook["objectSelector"] = SELECTS_LWS_PODS
        return hook

    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": f"{kind}WebhookConfiguration",
            "metadata": {"name": f"lws-{verb}"},
            "webhooks": [hook(f"{verb[0]}leaderworkerset.kb.io", f"/{verb}-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                              "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"], False),
                         hook(f"{verb[0]}pod.kb.io", f"/{verb}--v1-pod", "", "pods",
                              ["CREATE"] if verb == "mutate" else ["CREATE", "UPDATE"], True)]}


def start_leaderworkerset(node, lws_bin) -> None:
    """CRD, the manager (a node process: node.stop() ends it), then its webhooks once it serves them."""
    # Both of the module's CRDs: the manager also runs a DisaggregatedSet controller, and exits when its kind is
    # not served (its cache never syncs).
    crds = sorted(lws_bin.glob("*.yaml"))
    node.kubectl("apply", "--server-side", *[a for c in crds for a in ("-f", str(c))])
    wait_established(node.kubectl, "crd/leaderworkersets.leaderworkerset.x-k8s.io")
    config = node.workdir / "lws-config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        # The node's serving certificate (SAN: the node's IP), in the layout controller-runtime reads.
        "webhook": {"host": NODE_IP, "port": WEBHOOK_PORT, "certDir": str(node.workdir / "keda-certs")},
        "metrics": {"bindAddress": "127.0.0.1:18443"},
        "health": {"healthProbeBindAddress": "127.0.0.1:18081"},
    }))
    node.spawn("lws-manager", [str(lws_bin / "lws-manager"), f"--config={config}"], env=node.env)
    node.wait("the LWS webhook server", lambda: _serves(node), 120)
    ca = base64.b64encode((node.workdir / "ca.crt").read_bytes()).decode()
    node.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        _webhooks("Mutating", ca), _webhooks("Validating", ca)]}))


def _serves(node) -> bool:
    r = subprocess.run(in_netns("curl", "-sk", "-o", "/dev/null", "-w", "%{http_code}",
                                f"https://{NODE_IP}:{WEBHOOK_PORT}/mutate--v1-pod"), capture_output=True, text=True,
                       timeout=10)
    return r.stdout not in ("", "000")
