"""engine.pipelineParallelSize > 1: each replica is a LeaderWorkerSet group of pods, one pipeline stage each. The
builders, against the real LWS CRD's schema and the engine's own flag parser."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pydantic import ValidationError

from pagekube.operator import naming
from pagekube.operator.desired import desired_objects
from pagekube.operator.multi_node import unscheduled_group_pod
from pagekube.operator.spec import LLMDeploymentSpec
from pagekube.operator.status import compute_status
from tests.test_operator_builders import spec_of, validate_custom_resource


def group_spec(**overrides) -> LLMDeploymentSpec:
    return spec_of(engine={"tensorParallelSize": 2, "pipelineParallelSize": 3}, resources={"gpu": 2}, **overrides)


def objects_by_kind(spec: LLMDeploymentSpec) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for obj in desired_objects("m", "ns", "uid", spec):
        found.setdefault(obj["kind"], []).append(obj)
    return found


def templates(lws: dict) -> tuple[dict, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_replica_is_a_group_of_pipeline_stages_that_restarts_together():
    objs = objects_by_kind(group_spec(replicas=2))
    (lws,) = objs["LeaderWorkerSet"]
    assert [d["metadata"]["name"] for d in objs["Deployment"]] == ["m-lb"]  # no engine Deployment
    assert lws["metadata"]["name"] == naming.engine_group_name("m") != naming.engine_name("m")  # LWS' own Service
    del lws["metadata"]["ownerReferences"]
    validate_custom_resource(lws)  # the real CRD's schema (sigs.k8s.io/lws v0.9.0), no field it would prune
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["size"] == 3
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}
    for template in templates(lws):
        pod = {"apiVersion": "v1", "kind": "Pod", **template}
        kubernetes_validate.validate(pod, "1.35.0", strict=True)
        assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"  # TP within a pod


def test_the_leader_serves_and_hosts_the_rendezvous_and_workers_are_headless():
    leader, worker = templates(objects_by_kind(group_spec())["LeaderWorkerSet"][0])
    lead, work = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lead["args"][lead["args"].index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert "--headless" not in lead["args"] and "--node-rank" not in lead["args"]
    assert {"name": "rendezvous", "containerPort": 29501, "protocol": "TCP"} in lead["ports"]
    assert {"startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} <= set(lead)
    assert "--headless" in work["args"] and work["args"][work["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(work)
    # A worker stays through the leader's drain: same grace period, and it ends when the leader stops it.
    assert worker["spec"]["terminationGracePeriodSeconds"] == leader["spec"]["terminationGracePeriodSeconds"]


def test_the_group_flags_parse_as_the_engine_would_run_them():
    """The args, with the variables LWS sets expanded as the kubelet does, make a valid engine config."""
    from pagekube.engine.cli import build_parser, config_from_args

    leader, worker = templates(objects_by_kind(group_spec())["LeaderWorkerSet"][0])
    env = {"$(LWS_LEADER_ADDRESS)": "m-engine-group-0.m-engine-group.ns", "$(LWS_WORKER_INDEX)": "2"}
    configs = []
    for template in (leader, worker):
        args = [env.get(a, a) for a in template["spec"]["containers"][0]["args"]]
        configs.append(config_from_args(build_parser().parse_args(["serve", *args])))
    lead, work = configs
    assert (lead.nnodes, lead.node_rank, lead.headless, lead.pipeline_parallel_size) == (3, 0, False, 3)
    assert (work.node_rank, work.headless, work.master_addr) == (2, True, "m-engine-group-0.m-engine-group.ns")
    assert lead.tensor_parallel_size == work.tensor_parallel_size == 2


def test_services_nginx_and_budgets_select_leaders_only_and_keda_scales_groups():
    objs = objects_by_kind(group_spec(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4}))
    (lws,) = objs["LeaderWorkerSet"]
    leader, worker = (t["metadata"]["labels"] for t in templates(lws))
    for svc in objs["Service"]:
        if svc["metadata"]["name"] in (naming.engine_name("m"), naming.headless_name("m")):
            assert matches(svc["spec"]["selector"], leader) and not matches(svc["spec"]["selector"], worker)
    engine_pdb = next(p for p in objs["PodDisruptionBudget"] if p["metadata"]["name"] == "m-engine")
    assert matches(engine_pdb["spec"]["selector"]["matchLabels"], leader)
    (scaled,) = objs["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                                "kind": "LeaderWorkerSet", "name": "m-engine-group"}
    assert "replicas" not in lws["spec"]  # KEDA's HPA owns them, through LWS' scale subresource


def test_a_group_admits_its_own_ranks_through_the_network_policy():
    objs = objects_by_kind(group_spec(networkPolicy={"enabled": True}))
    (policy,) = objs["NetworkPolicy"]
    del policy["metadata"]["ownerReferences"]
    kubernetes_validate.validate(policy, "1.35.0", strict=True)
    leader, worker = (t["metadata"]["labels"] for t in templates(objs["LeaderWorkerSet"][0]))
    pods = policy["spec"]["podSelector"]
    assert matches(pods["matchLabels"], worker) and worker["app.kubernetes.io/component"] in \
        pods["matchExpressions"][0]["values"]
    (group_rule,) = [r for r in policy["spec"]["ingress"] if "ports" not in r]  # every port: gloo/NCCL pick theirs
    assert group_rule["from"] == [{"podSelector": pods}]


def test_a_single_pod_engine_is_still_a_deployment():
    objs = objects_by_kind(spec_of())
    assert "LeaderWorkerSet" not in objs and "m-engine" in [d["metadata"]["name"] for d in objs["Deployment"]]
    args = objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--pipeline-parallel-size", "--nnodes", "--headless"} & set(args)


@pytest.mark.parametrize(("strategy", "replicas", "rolling"), [
    ("Auto", 1, {"maxSurge": 0, "maxUnavailable": 1}),  # one group's GPUs are likely all there are
    ("Surge", 1, {"maxSurge": 1, "maxUnavailable": 0}),
    ("Recreate", 3, {"maxSurge": 0, "maxUnavailable": "100%"}),
])
def test_groups_roll_as_the_rollout_strategy_says(strategy, replicas, rolling):
    (lws,) = objects_by_kind(group_spec(replicas=replicas, rollout={"strategy": strategy}))["LeaderWorkerSet"]
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == rolling


def test_lora_with_pipeline_parallelism_is_refused():
    with pytest.raises(ValidationError, match="pipelineParallelSize > 1 is not supported yet"):
        group_spec(adapters=[{"name": "a", "source": "hf://o/a"}])


def test_status_counts_ready_groups_and_names_a_pod_the_scheduler_cannot_place():
    spec = group_spec(replicas=2)
    lws = {"kind": "LeaderWorkerSet", "metadata": {"generation": 2}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
    conds = {c["type"]: c for c in compute_status("m", "ns", 1, spec, lws, [])["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("True", "Available")
    pending = {"metadata": {"name": "m-engine-group-1-2"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}
    running = {"metadata": {"name": "m-engine-group-1"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "True"}]}}
    assert unscheduled_group_pod([running]) is None
    wait = unscheduled_group_pod([running, pending])
    assert wait == "pod m-engine-group-1-2: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    lws["status"]["readyReplicas"] = 1
    conds = {c["type"]: c for c in compute_status("m", "ns", 1, spec, lws, [], group_wait=wait)["conditions"]}
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == ("False", "GroupPartiallyScheduled")
    assert "m-engine-group-1-2" in conds["Progressing"]["message"]
    assert conds["Ready"]["status"] == "True"  # one group of two still serves
