"""Everything an LLMDeployment should own, as plain dicts: the operator applies exactly this, `render` prints it."""

from __future__ import annotations

from pagekube.operator.activator_deployment import (
    METRICS_PATH,
    build_activator_deployment,
    build_activator_service,
)
from pagekube.operator.autoscaling import build_scaled_object
from pagekube.operator.availability import build_pod_disruption_budget
from pagekube.operator.engine_deployment import (
    build_engine_deployment,
    build_model_cache_claim,
    uses_model_cache,
)
from pagekube.operator.inference_pool import build_inference_pool
from pagekube.operator.leader_worker_set import build_engine_leader_worker_set
from pagekube.operator.monitoring import build_prometheus_rule, build_service_monitor
from pagekube.operator.network_policy import build_engine_network_policy
from pagekube.operator.nginx import build_nginx_configmap, build_nginx_deployment, build_nginx_service
from pagekube.operator.services import build_engine_service, build_headless_service
from pagekube.operator.spec import GROUP, KIND, VERSION, LLMDeploymentSpec


def owner_reference(name: str, uid: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def desired_objects(name: str, namespace: str, uid: str, spec: LLMDeploymentSpec, replicas: int | None = None,
                    gpu_starved: bool = False) -> list[dict]:
    """The children in apply order (config before the pods that read it). `replicas` and `gpu_starved`: what runs
    now, for the engine's rollout strategy (offline rendering leaves them unknown)."""
    objects = [build_model_cache_claim(name, namespace, spec)] if uses_model_cache(spec) else []
    objects += [
        build_engine_service(name, namespace),
        build_headless_service(name, namespace),
        build_engine_leader_worker_set(name, namespace, spec, replicas, gpu_starved)
        if spec.engine.pipeline_parallel_size > 1 else build_engine_deployment(name, namespace, spec, replicas, gpu_starved),
    ]
    if spec.load_balancer.enabled:
        objects += [
            build_nginx_configmap(name, namespace, spec),
            build_nginx_deployment(name, namespace, spec),
            build_nginx_service(name, namespace),
        ]
    if spec.availability.pod_disruption_budget:
        objects.append(build_pod_disruption_budget(name, namespace, "engine", spec))
        if spec.load_balancer.enabled:
            objects.append(build_pod_disruption_budget(name, namespace, "load-balancer", spec))
    if spec.network_policy.enabled:
        objects.append(build_engine_network_policy(name, namespace, spec))
    if spec.autoscaling.enabled:
        objects.append(build_scaled_object(name, namespace, spec))
    if spec.autoscaling.scales_to_zero:
        objects += [build_activator_service(name, namespace), build_activator_deployment(name, namespace, spec)]
    if spec.monitoring.service_monitor:
        objects.append(build_service_monitor(name, namespace))
        if spec.autoscaling.scales_to_zero:
            objects.append(build_service_monitor(name, namespace, "activator", METRICS_PATH))
    if spec.monitoring.prometheus_rule:
        objects.append(build_prometheus_rule(name, namespace, spec.monitoring.thresholds,
                                             spec.autoscaling.scales_to_zero, spec.monitoring.alert_for))
    if spec.gateway.inference_pool:
        objects.append(build_inference_pool(name, namespace, spec))
    for obj in objects:
        obj["metadata"]["ownerReferences"] = [owner_reference(name, uid)]
        if obj["kind"] in ("ServiceMonitor", "PrometheusRule"):  # what the Prometheus' selectors look for
            obj["metadata"]["labels"] = {**spec.monitoring.labels, **obj["metadata"]["labels"]}
    return objects
