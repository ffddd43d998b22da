"""The KEDA ScaledObject: engine replicas follow the queue depth (waiting requests per replica)."""

from __future__ import annotations

from pagekube.operator import naming
from pagekube.operator.leader_worker_set import engine_workload
from pagekube.operator.spec import LLMDeploymentSpec


def pod_selector(name: str, namespace: str) -> str:
    """PromQL label matchers for this deployment's engine pods.

    The pod name pattern (<name>-engine-<replicaset hash>-<suffix>) holds whether Prometheus found the pods by
    ServiceMonitor or by scrape annotations, so the query needs no relabelling.
    """
    return f'namespace="{namespace}",pod=~"{naming.engine_name(name)}-[a-z0-9]+-[a-z0-9]+"'


def waiting_series(name: str, namespace: str) -> str:
    return f"vllm:num_requests_waiting{{{pod_selector(name, namespace)}}}"


def activator_pending_series(name: str, namespace: str) -> str:
    return f'pagekube:activator_requests_pending{{namespace="{namespace}",llmdeployment="{name}"}}'


def queue_depth_query(name: str, namespace: str, spec: LLMDeploymentSpec | None = None) -> str:
    # `or vector(0)`: with no pods (scaled to zero) the sum is empty; KEDA must read 0, not an error.
    waiting = f"(sum({waiting_series(name, namespace)}) or vector(0))"
    if spec is None or not spec.autoscaling.scales_to_zero:
        return waiting
    # At zero the engines' metric does not exist: requests the activator holds are the queue that wakes KEDA.
    return f"{waiting} + (sum({activator_pending_series(name, namespace)}) or vector(0))"


def kv_cache_query(name: str, namespace: str) -> str:
    return f"avg(vllm:kv_cache_usage_perc{{{pod_selector(name, namespace)}}}) or vector(0)"


def build_scaled_object(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    a = spec.autoscaling
    triggers = [
        {
            "type": "prometheus",
            "name": "queue-depth",
            # AverageValue: HPA asks for ceil(total waiting / queueDepthTarget) replicas.
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": a.prometheus_address,
                "query": queue_depth_query(name, namespace, spec),
                "threshold": str(a.queue_depth_target),
                "activationThreshold": str(a.activation_queue_depth),
            },
        }
    ]
    if a.kv_cache_usage_target is not None:
        triggers.append({
            "type": "prometheus",
            "name": "kv-cache-usage",
            # Value: HPA scales replicas by (mean usage / target).
            "metricType": "Value",
            "metadata": {
                "serverAddress": a.prometheus_address,
                "query": kv_cache_query(name, namespace),
                "threshold": str(a.kv_cache_usage_target),
            },
        })
    scaled_object = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": naming.metadata(naming.engine_name(name), namespace, name, "engine"),
        "spec": {
            "scaleTargetRef": dict(zip(("apiVersion", "kind", "name"), engine_workload(name, spec), strict=True)),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": a.polling_interval,
            "cooldownPeriod": a.cooldown_period,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        # GPU pods are slow to start and costly to flap: shrink slowly, one pod a minute.
                        "scaleDown": {
                            "stabilizationWindowSeconds": a.scale_down_stabilization_seconds,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        }
                    }
                }
            },
            "triggers": triggers,
        },
    }
    if a.fallback is not None:
        scaled_object["spec"]["fallback"] = a.fallback.model_dump(by_alias=True)
    return scaled_object
