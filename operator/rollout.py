"""How the engine Deployment rolls: the `rollout.strategy` rule, and spotting pods that wait for a GPU.

With one GPU per pod and no spare GPU, the Deployment default (a surge pod before an old one goes) leaves the new
pod Pending forever. Auto therefore replaces in place (maxSurge 0, maxUnavailable 1) when there is one replica (its
GPU is most likely the only one) or when a pod of the engine is seen Unschedulable for lack of GPUs; otherwise it
surges, so capacity never drops during a rollout.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagekube.operator.spec import LLMDeploymentSpec

SURGE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
REPLACE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
RECREATE = {"type": "Recreate"}


def deployment_strategy(spec: LLMDeploymentSpec, replicas: int | None = None, gpu_starved: bool = False) -> dict:
    """The Deployment's `strategy`. `replicas`: how many run now (KEDA's choice when it owns them; None: unknown);
    `gpu_starved`: an engine pod is Unschedulable for want of GPUs (see insufficient_gpu)."""
    chosen = spec.rollout.strategy
    if chosen == "Auto":
        if replicas is None:
            replicas = spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas
        needs_no_spare = spec.resources.gpu > 0 and (replicas <= 1 or gpu_starved)
        chosen = "Replace" if needs_no_spare else "Surge"
    return {"Surge": SURGE, "Replace": REPLACE, "Recreate": RECREATE}[chosen]


def unschedulable(pods: list[dict]) -> Iterator[tuple[dict, str]]:
    """(pod, the scheduler's message) for each pod it reports it cannot place."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                yield pod, cond.get("message") or ""


def insufficient_gpu(pods: list[dict], gpu_resource_name: str) -> str | None:
    """The scheduler's message for the first pod it could not place for lack of `gpu_resource_name`, else None."""
    return next((m for _, m in unschedulable(pods) if f"Insufficient {gpu_resource_name}" in m), None)


def rolling_out(deployment: dict | None) -> bool:
    """Whether the live Deployment has pods not yet updated or available: only then can a pod be waiting for a GPU
    (so a settled deployment costs no pod LIST)."""
    if deployment is None:
        return False
    status, want = deployment.get("status") or {}, (deployment.get("spec") or {}).get("replicas", 1)
    return (status.get("unavailableReplicas", 0) > 0 or status.get("updatedReplicas", 0) < want
            or status.get("replicas", 0) > want)
