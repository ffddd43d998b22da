"""Monitoring on the real node as users run it: prometheus-operator (installed from its bundle) runs a Prometheus that
finds the engine pods only through the operator-rendered ServiceMonitor, loads the rendered PrometheusRule, and
fires one of its alerts under a real burst; every query of the Grafana dashboard returns data from it (the operator's
panels through the chart's own ServiceMonitor)."""

from __future__ import annotations

import json

import pytest

from e2e.node.monitoring import prometheus_api, query
from e2e.node.test_real_node import (
    LONG,
    MAX_TOKENS,
    assert_all_finished,
    condition,
    engine_pods,
    llmdeployment,
    routed_lb_url,
)
from e2e.waiting import wait_for
from pagekube.operator.spec import ALERTS
from tests.k8s_tools import REPO

NAME = "watched"
BURST = 10  # streams of LONG tokens at maxNumSeqs 2: eight wait, over the queue-depth threshold of 1, for a minute


def watched_llmdeployment() -> dict:
    manifest = llmdeployment(replicas=1, name=NAME)
    spec = manifest["spec"]
    spec.pop("adapters")
    spec["engine"]["maxNumSeqs"] = 2
    spec["loadBalancer"]["replicas"] = 1
    spec["monitoring"] = {"serviceMonitor": True, "prometheusRule": True, "thresholds": {"queueDepth": 1},
                          "alertFor": {"PagekubeQueueDepthHigh": "10s"}}  # 5m by default: too long for a test
    return manifest


@pytest.fixture(scope="module")
def watched(node, operator_release, model_claim, prometheus):
    node.kubectl("apply", "-f", "-", input=json.dumps(watched_llmdeployment()))
    try:
        wait_for(lambda: condition(node, "Ready", NAME).get("status"), lambda s: s == "True", timeout=300,
                 what="Ready=True", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None
    yield routed_lb_url(node, NAME)
    node.kubectl("delete", "llmd", NAME, "--wait=true", "--timeout=300s", timeout=320)


def dashboard_queries() -> list[str]:
    """The dashboard's queries (engines' and operator's panels), its variables as Grafana fills them for "All"."""
    dashboard = json.loads((REPO / "charts/pagekube/files/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return [e.replace('=~"$model_name"', '=~".*"').replace("$__rate_interval", "1m") for e in exprs]


def test_the_service_monitor_alone_brings_the_engine_metrics_with_namespace_and_pod_labels(node, watched,
                                                                                             stream_runs):
    assert_all_finished(stream_runs(watched, streams=2, max_tokens=MAX_TOKENS).results(), 2)
    pod = engine_pods(node, NAME)[0]["metadata"]["name"]
    series = wait_for(lambda: query(node, f'vllm:num_requests_running{{namespace="default",pod="{pod}"}}'),
                      timeout=120, what="the engine's metrics in Prometheus", interval=2)
    assert series[0]["metric"]["job"] == f"{NAME}-engine" and series[0]["metric"]["endpoint"] == "http", series
    # The operator wrote Prometheus's whole scrape configuration from ServiceMonitors: this one is the only way in.
    pools = {t["scrapePool"] for t in prometheus_api(node, "targets")["activeTargets"] if t["labels"].get("pod") == pod}
    assert pools == {f"serviceMonitor/default/{NAME}-engine/0"}, pools
    queries = dashboard_queries()
    assert len(queries) >= 20
    # rate() needs two scrapes of the requests above (the ServiceMonitors scrape every 15 s and 30 s); the operator
    # panels read the chart's ServiceMonitor (e2e/node/conftest.py installs it with metrics.serviceMonitor.enabled)
    empty = wait_for(lambda: [q for q in queries if not query(node, q)], lambda left: not left, timeout=120,
                     what="every dashboard query returning data", interval=5)
    assert empty == []


def test_a_burst_fires_the_rendered_queue_depth_alert_in_prometheus(node, watched, stream_runs):
    group = wait_for(lambda: [g for g in prometheus_api(node, "rules")["groups"] if g["name"] == f"pagekube.default.{NAME}"],
                     timeout=90, what="the PrometheusRule's group loaded", interval=2)[0]
    assert {r["name"] for r in group["rules"]} == set(ALERTS) - {"PagekubeActivatorMetricAbsent"}
    assert all(r["health"] == "ok" for r in group["rules"]), group["rules"]

    def firing() -> list[dict]:
        return [a for a in prometheus_api(node, "alerts")["alerts"]
                if a["labels"]["alertname"] == "PagekubeQueueDepthHigh" and a["state"] == "firing"]

    assert firing() == []
    run = stream_runs(watched, streams=BURST, max_tokens=LONG)
    try:
        alert = wait_for(firing, timeout=120, what="PagekubeQueueDepthHigh firing", interval=2)[0]
    except AssertionError as e:
        waiting = query(node, 'max_over_time(vllm:num_requests_waiting{namespace="default"}[3m])')
        rule = next(r for g in prometheus_api(node, "rules")["groups"] for r in g["rules"]
                    if r["name"] == "PagekubeQueueDepthHigh")
        raise AssertionError(f"{e}\nmost waiting in 3 min: {waiting}\nthe rule: {rule}") from None
    assert alert["labels"] | {"namespace": "default", "llmdeployment": NAME, "severity": "warning"} == alert["labels"]
    assert float(alert["value"]) > 1
    assert_all_finished(run.results(), BURST, LONG)
    wait_for(firing, lambda a: a == [], timeout=120, what="the alert resolving once the queue drained", interval=3)
