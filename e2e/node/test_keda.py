"""KEDA on the real node: the operator-rendered ScaledObject, the real KEDA operator and metrics adapter, the HPA
controller in kube-controller-manager, and the operator-run Prometheus scraping the engine pods through the rendered
ServiceMonitor (KEDA queries it by its Service DNS name). Queued requests scale the engine 1 -> 2; idleness scales it
back."""

from __future__ import annotations

import json

import pytest

from e2e.node.test_real_node import (
    LONG,
    assert_all_finished,
    engine_pods,
    engine_replicas,
    llmdeployment,
    ready,
    routed_lb_url,
)
from e2e.waiting import wait_for

NAME = "scaled"


def scaled_llmdeployment(prometheus: str) -> dict:
    manifest = llmdeployment(replicas=1, name=NAME)
    spec = manifest["spec"]
    del spec["replicas"]  # KEDA's HPA owns them
    spec["engine"]["maxNumSeqs"] = 2  # two sequences at a time: the rest of a burst waits, which the trigger reads
    spec["loadBalancer"]["replicas"] = 1
    spec["monitoring"] = {"serviceMonitor": True}  # how Prometheus finds the engine pods
    spec["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "queueDepthTarget": 2,
                           "prometheusAddress": prometheus, "pollingInterval": 5, "cooldownPeriod": 30,
                           # long enough for the second pod to load after a burst this engine drains in a minute
                           "scaleDownStabilizationSeconds": 60}
    return manifest


def replicas(node) -> int:
    return engine_replicas(node, NAME)


@pytest.fixture(scope="module")
def scaled(node, operator_release, model_claim, keda):
    node.kubectl("apply", "-f", "-", input=json.dumps(scaled_llmdeployment(keda)))
    try:
        wait_for(lambda: node.kubectl("get", "scaledobject", f"{NAME}-engine", "-o",
                                      "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False).stdout,
                 lambda s: s == "True", timeout=300, what="ScaledObject Ready", interval=2)
        wait_for(lambda: [ready(p) for p in engine_pods(node, NAME)], lambda r: r == [True], timeout=300,
                 what="one ready engine pod", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None
    yield routed_lb_url(node, NAME)
    node.kubectl("delete", "llmd", NAME, "--wait=true", "--timeout=300s", timeout=320)


def test_queued_requests_scale_out_and_idleness_scales_back(node, scaled, stream_runs):
    assert replicas(node) == 1
    hpa = json.loads(node.kubectl("get", "hpa", f"keda-hpa-{NAME}-engine", "-o", "json").stdout)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 2)
    run = stream_runs(scaled, streams=8, max_tokens=LONG)
    run.wait_first_tokens(2)
    wait_for(lambda: replicas(node), lambda r: r == 2, timeout=180, what="KEDA's HPA scaling to 2", interval=2)
    wait_for(lambda: [ready(p) for p in engine_pods(node, NAME)], lambda r: r == [True, True], timeout=180,
             what="the second engine pod ready", interval=2)
    assert_all_finished(run.results(), 8, LONG)
    try:
        wait_for(lambda: replicas(node), lambda r: r == 1, timeout=240, what="the scale back to 1 when idle",
                 interval=3)
    except AssertionError as e:
        hpa = node.kubectl("get", "hpa", f"keda-hpa-{NAME}-engine", "-o", "jsonpath={.status}").stdout
        raise AssertionError(f"{e}\nHPA status: {hpa}\n{node.diagnostics()}") from None
