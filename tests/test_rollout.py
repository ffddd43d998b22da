"""The rollout strategy rule and the InsufficientGPU condition (pure functions; the real control plane runs them in
e2e/test_gpu_rollout.py)."""

from __future__ import annotations

import pytest

from pagekube.operator.desired import desired_objects
from pagekube.operator.metrics_check import MetricsCheck
from pagekube.operator.rollout import (
    RECREATE,
    REPLACE,
    SURGE,
    deployment_strategy,
    insufficient_gpu,
    rolling_out,
)
from pagekube.operator.status import compute_status
from tests.test_operator_builders import spec_of

SCHEDULER_MESSAGE = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available"


def unschedulable(message: str) -> dict:
    return {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}}


@pytest.mark.parametrize("overrides, replicas, starved, expected", [
    ({"replicas": 1}, None, False, REPLACE),  # one replica: its GPU is most likely the only one
    ({"replicas": 3}, None, False, SURGE),  # capacity never drops while a spare GPU exists
    ({"replicas": 3}, None, True, REPLACE),  # ...and once a new pod waits for a GPU, replace in place
    ({"replicas": 0}, None, False, REPLACE),
    ({"replicas": 1, "resources": {"gpu": 0}}, None, False, SURGE),  # CPU pods do not wait for GPUs
    ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8}}, 5, False, SURGE),  # KEDA's count
    ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8}}, 1, False, REPLACE),
    ({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}}, None, False, SURGE),  # offline: min
    ({"replicas": 1, "rollout": {"strategy": "Surge"}}, None, True, SURGE),  # an explicit choice is kept
    ({"replicas": 4, "rollout": {"strategy": "Replace"}}, None, False, REPLACE),
    ({"replicas": 4, "rollout": {"strategy": "Recreate"}}, None, False, RECREATE),
])
def test_auto_strategy_replaces_in_place_when_no_spare_gpu_is_likely(overrides, replicas, starved, expected):
    spec = spec_of(**overrides)
    assert deployment_strategy(spec, replicas, starved) == expected
    engine = desired_objects("m", "ns", "uid", spec, replicas, starved)[2]
    assert engine["kind"] == "Deployment" and engine["spec"]["strategy"] == expected


def test_insufficient_gpu_reads_the_schedulers_message_for_the_configured_resource():
    scheduled = {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    assert insufficient_gpu([scheduled, unschedulable(SCHEDULER_MESSAGE)], "nvidia.com/gpu") == SCHEDULER_MESSAGE
    assert insufficient_gpu([unschedulable(SCHEDULER_MESSAGE)], "amd.com/gpu") is None
    assert insufficient_gpu([unschedulable("0/1 nodes are available: 1 Insufficient cpu.")], "nvidia.com/gpu") is None
    assert insufficient_gpu([{"status": {}}, {}], "nvidia.com/gpu") is None


def test_only_an_unsettled_deployment_needs_its_pods_read():
    settled = {"spec": {"replicas": 2}, "status": {"replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}}
    assert not rolling_out(settled) and not rolling_out(None)
    assert rolling_out({"spec": {"replicas": 2}, "status": {"replicas": 3, "updatedReplicas": 1, "unavailableReplicas": 1}})
    assert rolling_out({"spec": {"replicas": 2}, "status": {"replicas": 2, "updatedReplicas": 2, "unavailableReplicas": 1}})


def test_a_pod_waiting_for_a_gpu_stalls_progressing_and_metrics_get_their_own_condition():
    spec = spec_of(replicas=2)
    dep = {"metadata": {"generation": 2}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 2, "replicas": 3, "readyReplicas": 2, "availableReplicas": 2, "updatedReplicas": 1}}
    status = compute_status("m", "ns", 1, spec, dep, [], gpu_wait=SCHEDULER_MESSAGE,
                            metrics=MetricsCheck("False", "NoSeries", "no series"))
    conds = {c["type"]: c for c in status["conditions"]}
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == ("False", "InsufficientGPU")
    assert conds["Progressing"]["message"] == SCHEDULER_MESSAGE
    assert conds["Ready"]["status"] == "True"  # the old pods still serve
    assert (conds["MetricsAvailable"]["status"], conds["MetricsAvailable"]["reason"]) == ("False", "NoSeries")
    assert "MetricsAvailable" not in {c["type"] for c in compute_status("m", "ns", 1, spec, dep, [])["conditions"]}
