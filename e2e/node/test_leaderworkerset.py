"""One engine across two pods on the real node: an LLMDeployment with `engine.pipelineParallelSize: 2` becomes a
LeaderWorkerSet group (the real LWS controller and its webhooks, e2e/node/leaderworkerset.py), whose leader and
worker pods run one engine over gloo between them (CPU), behind NGINX. Names carry "leaderworkerset" and
"multi_node" (the issue's selectors). The tests share the group (model loads are the slow part); each one waits for
it to be Ready first, so any of them runs alone.
"""

from __future__ import annotations

import json

import pytest

from e2e.node.conftest import ENGINE_IMAGE, NGINX_IMAGE
from e2e.node.test_real_node import assert_all_finished, chat, component_pods, ready, routes
from e2e.waiting import wait_for
from pagekube.operator import naming

NAME = "pp"
MODEL = "SmolLM2-135M-Instruct"
LONG = 200  # tokens: streams that outlast the start of a rollout's drain


def llmdeployment(rollout: str = "1") -> dict:
    return {
        "apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"name": MODEL, "source": "pvc://models/smollm2"},
            "engine": {"image": ENGINE_IMAGE, "maxNumSeqs": 8, "pipelineParallelSize": 2,
                       "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                       "podAnnotations": {"example.com/rollout": rollout}},  # a new value rolls the group
            "resources": {"gpu": 0, "memory": "2Gi"},
            "replicas": 1,
            "loadBalancer": {"image": NGINX_IMAGE},
            "drain": {"timeoutSeconds": 300, "preStopDelaySeconds": 3},
        },
    }


def leaders(node) -> list[dict]:
    return component_pods(node, "engine", NAME)


def workers(node) -> list[dict]:
    return component_pods(node, naming.ENGINE_WORKER, NAME)


def lb_url(node) -> str:
    ip = node.kubectl("get", "service", f"{NAME}-lb", "-o", "jsonpath={.spec.clusterIP}").stdout
    return f"http://{ip}/v1"


def group_ready(node) -> dict:
    """The group's one live leader once it is ready and NGINX routes to it."""
    manager = node.procs["lws-manager"]
    assert manager.poll() is None, (node.workdir / "lws-manager.log").read_text()[-3000:]
    def live_leader():
        live = [p for p in leaders(node) if ready(p)]
        return live[0] if len(live) == 1 and len(leaders(node)) == 1 else None
    try:
        leader = wait_for(live_leader, timeout=420, what="one ready leader", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None
    wait_for(lambda: routes(lb_url(node)), timeout=60, what="NGINX routing to the leader", interval=0.5)
    return leader


@pytest.fixture(scope="module")
def group(node, operator_release, model_claim, leaderworkerset):
    node.kubectl("apply", "-f", "-", input=json.dumps(llmdeployment()))
    group_ready(node)
    yield lb_url(node)
    node.kubectl("delete", "llmd", NAME, "--wait=true", "--timeout=300s", timeout=320)


def test_leaderworkerset_group_serves_a_chat_completion_through_nginx(node, group):
    leader = group_ready(node)
    (worker,) = workers(node)
    # The LWS webhook gave each pod its place in the group; the operator's args turned it into the engine's flags.
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["LWS_WORKER_INDEX"] == "1" and env["LWS_LEADER_ADDRESS"].startswith(f"{NAME}-engine-group-0.")
    assert worker["status"]["phase"] == "Running"
    code, body = chat(group, MODEL)
    assert code == 200 and body["choices"][0]["message"]["content"], body
    log = node.kubectl("logs", leader["metadata"]["name"]).stdout
    assert "parallel: 2 ranks (tensor 1 x pipeline 2) on 2 node(s)" in log, log[-2000:]
    llmd = json.loads(node.kubectl("get", "llmd", NAME, "-o", "json").stdout)
    assert llmd["status"]["readyReplicas"] == 1


def test_multi_node_deleting_the_worker_recreates_the_group_and_it_serves_again(node, group):
    before = group_ready(node)["metadata"]["uid"]
    (worker,) = workers(node)
    node.kubectl("delete", "pod", worker["metadata"]["name"], "--wait=false")
    # RecreateGroupOnPodRestart: the leader goes too, and a new group comes up whole.
    try:
        wait_for(lambda: [p["metadata"]["uid"] for p in leaders(node) if ready(p)],
                 lambda uids: uids and before not in uids, timeout=420, what="a new ready leader", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None
    group_ready(node)
    wait_for(lambda: chat(group, MODEL)[0], lambda code: code == 200, timeout=60, what="a chat completion again")


def test_multi_node_rollout_of_the_group_loses_no_stream(node, group, stream_runs):
    before = group_ready(node)["metadata"]["name"]
    old_uid = next(p["metadata"]["uid"] for p in leaders(node) if p["metadata"]["name"] == before)
    run = stream_runs(group, streams=4, max_tokens=LONG)
    run.wait_first_tokens(4)
    node.kubectl("apply", "-f", "-", input=json.dumps(llmdeployment(rollout="2")))
    # The old leader gets preStop + SIGTERM while its streams run: it drains them, then stops its worker.
    try:
        wait_for(lambda: [p for p in leaders(node) if p["metadata"]["uid"] == old_uid
                          and p["metadata"].get("deletionTimestamp")], timeout=420, what="the old leader terminating",
                 interval=1)
    except AssertionError as e:
        lws = node.kubectl("get", "leaderworkerset", "-o", "yaml", check=False).stdout[-3000:]
        raise AssertionError(f"{e}\n{lws}\n{node.diagnostics()}") from None
    finished_by_then = sum(e["event"] == "result" for e in run.events)
    results = run.results()
    assert finished_by_then < 4, "every stream ended before the rollout reached the old group: nothing was drained"
    assert_all_finished(results, 4, LONG)
    leader = group_ready(node)
    assert leader["metadata"]["annotations"]["example.com/rollout"] == "2"
    assert_all_finished(stream_runs(group, streams=2, max_tokens=16).results(), 2, 16)
