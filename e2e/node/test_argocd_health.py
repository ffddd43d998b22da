"""Argo CD health of a live LLMDeployment, computed by Argo CD's own code (e2e/argocd/argocd-health: its settings
manager reads the shipped argocd-cm customization from the cluster, and gitops-engine runs the Lua script in Argo
CD's Lua VM, as the application controller does). No Argo CD is installed: the health code is all it needs."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from e2e.node.test_real_node import engine_pods, llmdeployment, ready
from e2e.waiting import wait_for
from tests.k8s_tools import REPO

HEALTH_CM = REPO / "examples/argocd/argocd-cm-health.yaml"


@pytest.fixture(scope="module")
def argocd_health(node):
    """health(name) -> {"status", "message"} for LLMDeployment `name` in default, as Argo CD would show it."""
    node.kubectl("create", "namespace", "argocd")
    node.kubectl("apply", "-f", str(HEALTH_CM))  # the shipped example, as a user applies it

    def health(name: str) -> dict:
        r = subprocess.run([str(node.tools["PAGEKUBE_ARGOCD_HEALTH"]), "-kubeconfig", str(node.kubeconfig),
                            "-namespace", "default", name], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    yield health
    node.kubectl("delete", "namespace", "argocd", "--wait=false")


def test_shipped_customization_is_the_one_argo_cd_reads():
    cm = yaml.safe_load(HEALTH_CM.read_text())
    # Argo CD's settings manager only sees an argocd-cm that carries this label; the test below relies on it.
    assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "argocd"
    assert "resource.customizations.health.serving.pagekube.io_LLMDeployment" in cm["data"]


def test_llmdeployment_goes_progressing_then_healthy(node, operator_release, model_claim, argocd_health):
    name = "argo"
    node.kubectl("apply", "-f", "-", input=json.dumps(llmdeployment(1, name)))
    applied = time.monotonic()
    try:
        seen: list[str] = []

        def step() -> dict:
            h = argocd_health(name)
            if not seen or seen[-1] != h["status"]:
                seen.append(h["status"])
            return h

        healthy = wait_for(step, lambda h: h["status"] == "Healthy", timeout=300, interval=1,
                           what="Argo CD health Healthy")
        # Healthy only once the engine pod serves; before that Argo CD shows Progressing, never Degraded.
        assert seen[0] == "Progressing" and seen[-1] == "Healthy" and "Degraded" not in seen, seen
        assert any(ready(p) for p in engine_pods(node, name))
        assert healthy["message"], healthy
        print(f"\n[argocd] health seen: {' -> '.join(seen)} ({time.monotonic() - applied:.0f} s after apply); "
              f"Healthy: {healthy['message']!r}")
    finally:
        node.kubectl("delete", "llmd", name, "--wait=false")


def test_missing_api_key_secret_is_degraded(node, operator_release, argocd_health):
    name = "argo-nokey"
    spec = llmdeployment(1, name)
    spec["spec"]["auth"] = {"apiKeySecretRef": {"name": "no-such-secret"}}
    node.kubectl("apply", "-f", "-", input=json.dumps(spec))
    try:
        degraded = wait_for(lambda: argocd_health(name), lambda h: h["status"] == "Degraded", timeout=120,
                            interval=1, what="Argo CD health Degraded")
        assert "default/no-such-secret" in degraded["message"], degraded
    finally:
        node.kubectl("delete", "llmd", name, "--wait=false")
