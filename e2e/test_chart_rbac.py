"""The chart's least-privilege RBAC is enough: the operator, authenticated as the chart's ServiceAccount (a real
token from the TokenRequest API, RBAC enforced by the API server), reconciles an LLMDeployment end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from e2e.cluster import stop_process_group
from e2e.conftest import start_operator
from e2e.test_operator import children, condition, manifest
from e2e.waiting import wait_for
from tests.k8s_tools import REPO, helm

NAMESPACE, RELEASE_NS = "team-rbac", "pagekube-system"


def test_operator_runs_on_the_charts_rbac_alone(control_plane, tmp_path):
    cp = control_plane
    for ns in (NAMESPACE, RELEASE_NS):
        cp.kubectl("create", "namespace", ns)
    out = subprocess.run([helm(), "template", "pk", str(REPO / "charts/pagekube"), "-n", RELEASE_NS,
                          "--set", f"watchNamespaces={{{NAMESPACE}}}"], check=True, capture_output=True, text=True).stdout
    rbac = [d for d in yaml.safe_load_all(out) if d and d["kind"] != "Deployment"]  # no kubelet to run the pod
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    token = cp.kubectl("create", "token", "pk-pagekube", "-n", RELEASE_NS).stdout.strip()
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    denied = cp.kubectl("auth", "can-i", "list", "secrets", "-n", NAMESPACE, f"--token={token}", check=False)
    assert denied.stdout.strip() == "no"  # least privilege: it may read a Secret by name, never list them

    proc = start_operator({**cp.env, "KUBECONFIG": str(kubeconfig)}, tmp_path / "operator.log", f"--namespace={NAMESPACE}")
    try:
        cp.kubectl("apply", "-f", "-", input=manifest("rbac", NAMESPACE, autoscaling={"enabled": True},
                                                       monitoring={"serviceMonitor": True, "prometheusRule": True}))
        wait_for(lambda: len(children(cp, NAMESPACE, "rbac")) == 11, what="11 children made with the chart's RBAC")
        wait_for(lambda: condition(cp, NAMESPACE, "rbac", "Progressing").get("status") == "True", what="status written")
        cp.kubectl("delete", "configmap", "rbac-lb", "-n", NAMESPACE)
        wait_for(lambda: cp.kubectl("get", "configmap", "rbac-lb", "-n", NAMESPACE, check=False).returncode == 0,
                 what="drift corrected (watch on children allowed)")
    finally:
        stop_process_group(proc, grace=15)
    log = Path(tmp_path / "operator.log").read_text()
    problems = [json.loads(line)["message"] for line in log.splitlines()
                if line.startswith("{") and ("forbidden" in line.lower() or '"severity": "error"' in line)]
    assert problems == []
