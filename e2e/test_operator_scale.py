"""The operator at fleet scale, on the real control plane: steady state sends nothing but watches, drift is restored
within 2 s with only the writes it needs, a burst of child events is one or a few passes, and the controller's
metrics (controller-runtime's names) move and feed the dashboard row and the alert in a real Prometheus."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client, config

from e2e.cluster import WRITE_VERBS, stop_process_group
from e2e.conftest import start_operator
from e2e.loopback import Prometheus
from e2e.waiting import wait_for
from pagekube.operator.monitoring import OPERATOR_RECONCILE_ERRORS
from tests.k8s_tools import REPO
from tests.server_process import json_log_lines

NS, FLEET, RESYNC = "fleet", 50, 5
OPERATOR_AGENTS = ("OpenAPI-Generator", "kopf")  # the operator's clients (kubectl and the KCM are someone else)


def manifests(ns: str, n: int) -> str:
    docs = [{"apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment",
             "metadata": {"name": f"m{i}", "namespace": ns},
             "spec": {"model": {"name": f"m{i}", "source": "hf://org/model"}, "resources": {"gpu": 0, "cpu": "1"}}}
            for i in range(n)]
    return yaml.safe_dump_all(docs)


def operator_requests(cp, since: int, verbs) -> list[str]:
    return [f"{e['verb']} {e['objectRef'].get('namespace')}/{e['objectRef'].get('resource')}/{e['objectRef'].get('name')}"
            for e in cp.requests(None, verbs)[since:] if e.get("userAgent", "").startswith(OPERATOR_AGENTS)]


def passes(op, name: str) -> int:
    return sum(e.get("message", "").startswith(f"reconciled {NS}/{name}:") for e in json_log_lines(op.log_path))


def samples(op) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(op.metrics).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@pytest.fixture(scope="module")
def fleet(control_plane, tmp_path_factory):
    cp = control_plane
    op = start_operator(cp.env, Path(tmp_path_factory.mktemp("operator-scale")) / "operator.log", f"--resync-seconds={RESYNC}")
    cp.kubectl("create", "namespace", NS)
    try:
        cp.kubectl("apply", "--server-side", "-f", "-", input=manifests(NS, FLEET))
        wait_for(lambda: sum(1 for i in range(FLEET) if passes(op, f"m{i}")) == FLEET, timeout=120, what="a pass each")
        ready = lambda: json.loads(cp.kubectl("get", "llmd", "-n", NS, "-o", "json").stdout)["items"]  # noqa: E731
        wait_for(lambda: all((o.get("status") or {}).get("observedGeneration") for o in ready()), timeout=120,
                 what="every status written")
        yield cp, op
    finally:
        stop_process_group(op, grace=15)
        cp.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def settle(cp, seconds: float = 3.0, timeout: float = 60) -> None:
    """Until nobody has written for `seconds` (the Deployments' status moves a few times after creation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = len(cp.requests(None, WRITE_VERBS))
        time.sleep(seconds)
        if len(cp.requests(None, WRITE_VERBS)) == before:
            return


def test_steady_state_sends_no_reads_and_no_writes_across_two_resyncs(fleet):
    cp, op = fleet
    settle(cp)
    start, passes_before = len(cp.requests(None, ("get", "list", *WRITE_VERBS))), passes(op, "m0")
    time.sleep(2 * RESYNC * 1.1 + 1)
    seen = operator_requests(cp, start, ("get", "list", *WRITE_VERBS))
    assert passes(op, "m0") - passes_before >= 2  # the resyncs ran, from the caches
    assert seen == [], seen[:10]


def test_a_deleted_or_edited_child_is_restored_within_2s_with_only_its_write(fleet):
    cp, op = fleet
    settle(cp)
    start = len(cp.requests(None, ("get", "list", *WRITE_VERBS)))
    began = time.monotonic()
    cp.kubectl("delete", "service", "m7-engine", "-n", NS)
    wait_for(lambda: cp.kubectl("get", "service", "m7-engine", "-n", NS, check=False).returncode == 0,
             timeout=5, interval=0.05, what="Service restored")
    restored = time.monotonic() - began
    cp.kubectl("patch", "configmap", "m8-lb", "-n", NS, "--type=merge", "-p", '{"data": {"nginx.conf": "events {}"}}')
    wait_for(lambda: "events {}" not in cp.kubectl("get", "configmap", "m8-lb", "-n", NS, "-o", "json").stdout,
             timeout=5, interval=0.05, what="ConfigMap restored")
    settle(cp, 2.0)
    print(f"[e2e] deleted Service restored in {restored:.2f} s")
    assert restored < 2.0
    assert sorted(operator_requests(cp, start, ("get", "list", *WRITE_VERBS))) == [
        f"patch {NS}/configmaps/m8-lb", f"patch {NS}/services/m7-engine"]  # server-side apply: PATCH, create too


def test_a_burst_of_100_child_events_is_a_handful_of_passes(fleet):
    cp, op = fleet
    settle(cp)
    config.load_kube_config(str(cp.kubeconfig))
    core = client.CoreV1Api()
    before = passes(op, "m3")
    with ThreadPoolExecutor(8) as pool:  # 100 label changes on one child, as fast as the API server takes them
        list(pool.map(lambda i: core.patch_namespaced_config_map(
            "m3-lb", NS, {"metadata": {"annotations": {"burst": str(i)}}}), range(100)))
    time.sleep(2)
    made = passes(op, "m3") - before
    print(f"[e2e] 100 child events -> {made} passes")
    assert 1 <= made <= 6


def test_controller_metrics_move_and_a_failing_pass_counts_an_error(fleet, tmp_path):
    cp, op = fleet
    m = samples(op)
    assert m['controller_runtime_reconcile_total{controller="llmdeployment",result="success"}'] >= FLEET
    assert m['workqueue_adds_total{controller="llmdeployment",name="llmdeployment"}'] >= FLEET
    assert any(k.startswith('rest_client_requests_total{code="200",') and 'method="GET"' in k for k in m)
    assert 'workqueue_depth{controller="llmdeployment",name="llmdeployment"}' in m
    prom = Prometheus(tmp_path, [(op.metrics.removeprefix("http://").removesuffix("/metrics"),
                                  {"namespace": "pagekube-system", "pod": "operator-1"}, "/metrics")])
    try:
        # Someone's ClusterIP Service already holds the headless Service's name: clusterIP is immutable, so every
        # pass of that LLMDeployment fails at its apply (and is retried with backoff).
        cp.kubectl("create", "namespace", "taken")
        cp.kubectl("create", "service", "clusterip", "m0-engine-pods", "--tcp=80:80", "-n", "taken")
        errors = m.get('controller_runtime_reconcile_errors_total{controller="llmdeployment"}', 0)
        cp.kubectl("apply", "--server-side", "-f", "-", input=manifests("taken", 1))
        wait_for(lambda: samples(op)['controller_runtime_reconcile_errors_total{controller="llmdeployment"}'] > errors,
                 timeout=30, what="an error counted")
        assert samples(op)['controller_runtime_reconcile_total{controller="llmdeployment",result="error"}'] >= 1
        # The alert's expression and every operator panel of the dashboard return data from the real scrapes.
        wait_for(lambda: prom.query(OPERATOR_RECONCILE_ERRORS), timeout=30, what="the alert's expression firing")
        dashboard = json.loads((REPO / "charts/pagekube/files/grafana-dashboard.json").read_text())
        panels = [p for p in dashboard["panels"] if p["title"].startswith("Operator:")]
        assert len(panels) == 4
        for panel in panels:
            for target in panel["targets"]:
                promql = target["expr"].replace("$__rate_interval", "1m")
                wait_for(lambda q=promql: prom.query(q) is not None, timeout=30, what=f"{panel['title']}: {promql}")
    finally:
        prom.stop()
        cp.kubectl("delete", "namespace", "taken", "--wait=false", check=False)


def test_operator_scale_benchmark_smoke():
    """bench/operator_scale.py end to end on a few LLMDeployments (its own control plane): every number is there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "bench/operator_scale.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 6 | 2 |")]
    assert len(rows) == 1 and "| 0.0 |" in rows[0], out.stdout  # steady state: no requests
