"""The engine as a LeaderWorkerSet (engine.pipelineParallelSize > 1): each replica is a group of PP pods, one
pipeline stage each, created, restarted and rolled together (sigs.k8s.io/lws, as KServe and llm-d run multi-node
vLLM). Services, NGINX and the PodDisruptionBudget select the leaders (component engine) only."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.engine_deployment import engine_pod_template
from pagekube.operator.rollout import deployment_strategy
from pagekube.operator.spec import LLMDeploymentSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"


def engine_workload(name: str, spec: LLMDeploymentSpec) -> tuple[str, str, str]:
    """(apiVersion, kind, object name) of what runs this spec's engines: a Deployment, or a LeaderWorkerSet."""
    if spec.engine.pipeline_parallel_size > 1:
        return API_VERSION, KIND, naming.engine_group_name(name)
    return "apps/v1", "Deployment", naming.engine_name(name)


def _rolling_update(spec: LLMDeploymentSpec, replicas: int | None, gpu_starved: bool) -> dict:
    """rollout.strategy in LWS's terms: groups surge or are replaced one at a time, as engine Deployments do."""
    strategy = deployment_strategy(spec, replicas, gpu_starved)
    if strategy["type"] == "Recreate":
        return {"maxUnavailable": "100%", "maxSurge": 0}
    return dict(strategy["rollingUpdate"])


def build_engine_leader_worker_set(name: str, namespace: str, spec: LLMDeploymentSpec, replicas: int | None = None,
                                   gpu_starved: bool = False) -> dict:
    lws_spec: dict = {
        # Workers start with their leader: it cannot be ready before every rank has joined its rendezvous.
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {"type": "RollingUpdate",
                            "rollingUpdateConfiguration": _rolling_update(spec, replicas, gpu_starved)},
        "leaderWorkerTemplate": {
            "size": spec.engine.pipeline_parallel_size,
            # A lost rank ends the engine: the group restarts as one, never a worker alone under a live leader.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": engine_pod_template(name, spec, "leader"),
            "workerTemplate": engine_pod_template(name, spec, "worker"),
        },
    }
    if not spec.autoscaling.enabled:  # with autoscaling on, KEDA's HPA owns replicas (through the scale subresource)
        lws_spec["replicas"] = spec.replicas
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": naming.metadata(naming.engine_group_name(name), namespace, name, "engine"), "spec": lws_spec}
