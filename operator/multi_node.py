"""Engines that span pods (engine.pipelineParallelSize > 1): the flags that make a LeaderWorkerSet group's pods one
engine, and spotting a group the scheduler placed only in part.

Each pod is a pipeline stage (TP = GPUs per pod, PP = pods). LeaderWorkerSet gives every pod LWS_LEADER_ADDRESS and
LWS_WORKER_INDEX; Kubernetes expands $(VAR) in args from the container's environment. The leader (index 0) serves the
API and hosts the rendezvous; workers run --headless with their index as node rank.
"""

from __future__ import annotations

from pagekube.operator.rollout import unschedulable
from pagekube.operator.spec import LLMDeploymentSpec

RENDEZVOUS_PORT = 29501  # vLLM's default --master-port


def multi_node_flags(spec: LLMDeploymentSpec, group_role: str | None) -> dict:
    if group_role is None:
        return {}
    flags = {"nnodes": spec.engine.pipeline_parallel_size, "master_addr": "$(LWS_LEADER_ADDRESS)",
             "master_port": RENDEZVOUS_PORT}
    if group_role == "worker":
        flags.update(node_rank="$(LWS_WORKER_INDEX)", headless=True)
    return flags


def unscheduled_group_pod(pods: list[dict]) -> str | None:
    """'pod NAME: the scheduler's message' for the first pod it could not place, else None. A group with one such
    pod holds the others' GPUs and serves nothing (the partial-scheduling deadlock, kubernetes-sigs/lws#167)."""
    return next((f"pod {pod['metadata']['name']}: {message}" for pod, message in unschedulable(pods)), None)
