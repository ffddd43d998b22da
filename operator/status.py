"""LLMDeployment status from what exists: Kubernetes-convention conditions Ready / Progressing / Degraded, and
MetricsAvailable when autoscaling is on."""

from __future__ import annotations

from datetime import datetime, timezone

from pagekube.operator import naming
from pagekube.operator.metrics_check import MetricsCheck
from pagekube.operator.spec import LLMDeploymentSpec


def endpoint(name: str, namespace: str, spec: LLMDeploymentSpec) -> str:
    if spec.load_balancer.enabled:
        return f"http://{naming.lb_name(name)}.{namespace}.svc.cluster.local/v1"
    return f"http://{naming.engine_name(name)}.{namespace}.svc.cluster.local:{naming.ENGINE_PORT}/v1"


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def _rollout(deployment: dict | None, autoscaling: bool) -> tuple[bool, bool, str, str]:
    """(progressing, ready, reason, message) of the engine Deployment (or LeaderWorkerSet: its replicas are groups,
    and a ready group is an available one)."""
    if deployment is None:
        return True, False, "Creating", "engine workload is being created"
    status = deployment.get("status") or {}
    want = (deployment.get("spec") or {}).get("replicas", 1)
    ready = status.get("readyReplicas", 0)
    available = status.get("availableReplicas", ready if deployment.get("kind") == "LeaderWorkerSet" else 0)
    updated = status.get("updatedReplicas", 0)
    observed = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    if want == 0:
        return False, autoscaling, "ScaledToZero", "0 engine replicas" + (" (KEDA scales up on demand)" if autoscaling else "")
    if observed and updated >= want and available >= want and status.get("replicas", 0) == want:
        return False, True, "Available", f"{ready}/{want} engine replicas ready"
    reason = "RollingOut" if available > 0 else "Starting"
    return True, available > 0, reason, f"{ready}/{want} engine replicas ready, {updated} updated"


def compute_status(name: str, namespace: str, generation: int, spec: LLMDeploymentSpec,
                   deployment: dict | None, problems: list[tuple[str, str]], blocked: bool = False,
                   gpu_wait: str | None = None, metrics: MetricsCheck | None = None,
                   group_wait: str | None = None) -> dict:
    """The status to write. `problems` are (reason, message) pairs of what is wrong; `blocked`: they keep the
    engines from being created at all (else, e.g. KEDA missing, the engines may still serve). `gpu_wait`: the
    scheduler's message for an engine pod waiting for a GPU; `metrics`: the autoscaling metric check, if run;
    `group_wait`: 'pod X: message' for a pod of a pipeline-parallel group the scheduler cannot place."""
    progressing, ready, reason, message = _rollout(deployment, spec.autoscaling.enabled)
    if problems:
        degraded = _condition("Degraded", True, problems[0][0], "; ".join(m for _, m in problems), generation)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "all children reconciled", generation)
    if blocked:
        ready_cond = _condition("Ready", False, problems[0][0], degraded["message"], generation)
        progressing_cond = _condition("Progressing", False, problems[0][0], "waiting for the spec to be fixed", generation)
    else:
        ready_cond = _condition("Ready", ready, reason, message, generation)
        progressing_cond = _condition("Progressing", progressing, reason if progressing else "Complete", message, generation)
    if gpu_wait and not blocked:  # the rollout cannot finish until a GPU frees up: stalled, not progressing
        progressing_cond = _condition("Progressing", False, "InsufficientGPU", gpu_wait, generation)
    if group_wait and not blocked:  # its other pods hold their GPUs and serve nothing until this one is placed
        progressing_cond = _condition("Progressing", False, "GroupPartiallyScheduled",
                                      f"an engine group cannot start: {group_wait}", generation)
    conditions = [ready_cond, progressing_cond, degraded]
    if metrics is not None:
        conditions.append({"type": "MetricsAvailable", "status": metrics.status, "reason": metrics.reason,
                           "message": metrics.message, "observedGeneration": generation})
    dstatus = (deployment or {}).get("status") or {}
    return {
        "observedGeneration": generation,
        "replicas": dstatus.get("replicas", 0),
        "readyReplicas": dstatus.get("readyReplicas", 0),
        "selector": naming.selector_string(name, "engine"),
        "endpoint": endpoint(name, namespace, spec),
        "conditions": conditions,
    }


def merge_transition_times(new: dict, old: dict | None, now: datetime | None = None) -> dict:
    """Keep lastTransitionTime where a condition's status did not change (API conventions)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    previous = {c["type"]: c for c in (old or {}).get("conditions", [])}
    for cond in new["conditions"]:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime")
        cond["lastTransitionTime"] = before["lastTransitionTime"] if same else stamp
    return new


def _set(value):
    """`value` as the API server stores it after a merge patch: keys whose value is None are absent."""
    return {k: _set(v) for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def status_changed(new: dict, old: dict | None) -> bool:
    """Whether writing `new` changes anything (only our own keys count; kopf keeps its own under status too)."""
    old = old or {}
    return any(old.get(k) != _set(v) for k, v in new.items())
