"""engine.pipelineParallelSize > 1 on a real kube-apiserver with the real LeaderWorkerSet CRD (sigs.k8s.io/lws
v0.9.0), run by `pagekube-operator run`.

No LWS controller and no kubelet run here: where a test needs group pods or a group's status, it writes them as the
LWS controller and the scheduler would, and says so. (The LWS controller itself is not built in this repo yet.)
"""

from __future__ import annotations

import json

import pytest
import yaml

from e2e.test_operator import apply_manifest, condition, get, manifest
from e2e.waiting import wait_established, wait_for
from pagekube.operator import naming
from pagekube.operator.cli import render
from pagekube.operator.reconciler import contains
from tests.k8s_tools import third_party_crd_files

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
GROUP = {"engine": {"pipelineParallelSize": 2}, "resources": {"gpu": 1}}


@pytest.fixture
def namespace(control_plane, request):
    ns = request.node.name.replace("_", "-")[:50].strip("-").lower()
    control_plane.kubectl("create", "namespace", ns)
    return ns


def create_unschedulable_pod(cp, ns: str, name: str, owner: str) -> None:
    """A group's worker pod as the LWS controller makes it, then Unschedulable as the scheduler reports it."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns, "labels": naming.labels(owner, naming.ENGINE_WORKER)},
           "spec": {"containers": [{"name": "engine", "image": "pagekube/engine"}]}}
    wait_for(lambda: cp.kubectl("apply", "-f", "-", input=json.dumps(pod), check=False).returncode == 0,
             what="the pod (its namespace's ServiceAccount first)")
    status = {"status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    cp.kubectl("patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status))


def test_leaderworkerset_group_is_applied_and_its_groups_reported(control_plane, operator, namespace):
    cp, ns = control_plane, namespace
    text = manifest("big", ns, **GROUP)
    apply_manifest(cp, text)
    lws = wait_for(lambda: get(cp, "leaderworkerset", "big-engine-group", "-n", ns), what="the LeaderWorkerSet")
    assert get(cp, "deployment", "big-engine", "-n", ns) is None
    (want,) = [o for o in render([yaml.safe_load(text)], ns) if o["kind"] == "LeaderWorkerSet"]
    assert contains(lws, want)  # the API server kept every field (the CRD's schema prunes unknown ones)
    # A worker the scheduler cannot place: the group cannot start, and the status says which pod and why.
    create_unschedulable_pod(cp, ns, "big-engine-group-0-1", "big")
    stalled = wait_for(lambda: condition(cp, ns, "big", "Progressing").get("reason") == "GroupPartiallyScheduled"
                       and condition(cp, ns, "big", "Progressing"), what="GroupPartiallyScheduled")
    assert stalled["status"] == "False"
    assert "pod big-engine-group-0-1: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in stalled["message"]
    # The group comes up (as the LWS controller reports it): Ready, counted in groups.
    generation = get(cp, "leaderworkerset", "big-engine-group", "-n", ns)["metadata"]["generation"]
    status = {"status": {"observedGeneration": generation, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}
    cp.kubectl("patch", "leaderworkerset", "big-engine-group", "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(status))
    ready = wait_for(lambda: condition(cp, ns, "big", "Ready").get("status") == "True"
                     and condition(cp, ns, "big", "Ready"), what="Ready")
    assert ready["reason"] == "Available" and ready["message"] == "1/1 engine replicas ready"
    assert get(cp, "llmd", "big", "-n", ns)["status"]["readyReplicas"] == 1


def test_leaderworkerset_crd_missing_refuses_the_spec_with_a_condition(control_plane, operator, namespace):
    cp, ns = control_plane, namespace
    cp.kubectl("delete", "crd", LWS_CRD)
    try:
        wait_for(lambda: cp.kubectl("get", "crd", LWS_CRD, check=False).returncode != 0, what="the CRD gone")
        # As in a cluster that never had it: the operator's watch has found the kind not served.
        wait_for(lambda: "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) is not served by this cluster"
                 in operator.log_path.read_text(), what="the operator to see the CRD gone")
        apply_manifest(cp, manifest("big", ns, **GROUP))
        ready = wait_for(lambda: condition(cp, ns, "big", "Ready").get("reason") == "MissingCRD"
                         and condition(cp, ns, "big", "Ready"), what="Ready False, MissingCRD")
        assert ready["status"] == "False"
        assert "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) is not served: install LeaderWorkerSet" in ready["message"]
        assert condition(cp, ns, "big", "Degraded")["status"] == "True"
        assert get(cp, "services", "-n", ns, "-l", f"{naming.OWNER_LABEL}=big")["items"] == []  # nothing half-made
    finally:
        (crd,) = [f for f in third_party_crd_files() if f.name.startswith("leaderworkerset")]
        cp.kubectl("apply", "--server-side", "-f", str(crd))
        wait_established(cp.kubectl, "crd", LWS_CRD)
