"""`helm upgrade` to a chart whose CRD gained fields: Helm leaves the installed CRD as it was (it never upgrades
`crds/`), and the operator, running on the chart's own RBAC with the chart's `--manage-crd`, brings it up to date,
after which a new field survives a round trip through the API server (before, the server pruned it)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import yaml

from e2e.cluster import stop_process_group
from e2e.conftest import start_operator
from e2e.test_operator import get, manifest
from e2e.waiting import wait_for
from pagekube.operator.crd import crd
from tests.k8s_tools import REPO, helm

NAMESPACE, RELEASE = "crd-upgrade", "crdup"
NEW_FIELDS = ("availability", "networkPolicy")  # what this version added over the previous one


def previous_crd() -> dict:
    """The CRD as the previous chart version shipped it: this one without the fields it added."""
    old = copy.deepcopy(crd())
    spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for field in NEW_FIELDS:
        del spec["properties"][field]
    return old


def installed_fields(cp) -> set[str]:
    live = json.loads(cp.kubectl("get", "crd", "llmdeployments.serving.pagekube.io", "-o", "json").stdout)
    return set(live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def previous_chart(tmp_path) -> str:
    """This chart as the previous version shipped it: its crds/ without the new fields."""
    chart = tmp_path / "previous-chart"
    shutil.copytree(REPO / "charts/pagekube", chart)
    (chart / "crds/llmdeployment.yaml").write_text(yaml.safe_dump(previous_crd(), sort_keys=False))
    return str(chart)


def test_helm_upgrade_then_the_operator_brings_the_crd_up_to_date(control_plane, tmp_path):
    cp = control_plane
    cp.kubectl("create", "namespace", NAMESPACE)
    # The previous chart's install: Helm applied its crds/ (as field manager "helm").
    cp.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm", "-f", "-",
               input=yaml.safe_dump(previous_crd()))
    proc = None
    try:
        values = ["-n", NAMESPACE, "--set", f"watchNamespaces={{{NAMESPACE}}}", "--set", "replicas=1"]
        for verb, chart in (("install", previous_chart(tmp_path)), ("upgrade", str(REPO / "charts/pagekube"))):
            done = subprocess.run([helm(), verb, RELEASE, chart, *values], env=cp.env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        assert not installed_fields(cp) & set(NEW_FIELDS), "Helm upgraded crds/ (it never does): nothing to test"

        token = cp.kubectl("create", "token", f"{RELEASE}-pagekube", "-n", NAMESPACE).stdout.strip()
        config = yaml.safe_load(cp.kubeconfig.read_text())
        config["users"][0]["user"] = {"token": token}
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        proc = start_operator({**cp.env, "KUBECONFIG": str(kubeconfig)}, tmp_path / "operator.log", "--manage-crd",
                              f"--namespace={NAMESPACE}")
        wait_for(lambda: installed_fields(cp) >= set(NEW_FIELDS), what="the operator applying its CRD")
        cp.kubectl("apply", "-f", "-", input=manifest("upgraded", NAMESPACE, availability={"maxUnavailable": 0}))
        assert get(cp, "llmd", "upgraded", "-n", NAMESPACE)["spec"]["availability"]["maxUnavailable"] == 0
        wait_for(lambda: get(cp, "pdb", "upgraded-engine", "-n", NAMESPACE), what="the new field acted on")
    finally:
        if proc is not None:
            stop_process_group(proc, grace=15)
        cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds/llmdeployment.yaml"))
        subprocess.run([helm(), "uninstall", RELEASE, "-n", NAMESPACE], env=cp.env, capture_output=True)
        cp.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
