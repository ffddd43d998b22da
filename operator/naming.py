"""Names and labels of an LLMDeployment's children: one place, so builders, status and the LB config agree."""

from __future__ import annotations

from pagekube.operator.spec import GROUP

MANAGED_BY = "pagekube-operator"
OWNER_LABEL = f"{GROUP}/llmdeployment"
ENGINE_PORT = 8000
ACTIVATOR_PORT = 8081
ENGINE_WORKER = "engine-worker"  # the component of a pipeline-parallel group's pods other than its leader
LB_PORT = 8080  # nginx listens unprivileged (non-root container); the LB Service maps 80 -> 8080


def engine_name(name: str) -> str:
    return f"{name}-engine"


def engine_group_name(name: str) -> str:
    """The LeaderWorkerSet of pipeline-parallel engines (not engine_name: LWS makes a headless Service of its own
    name, and the engine Service has that one)."""
    return f"{name}-engine-group"


def headless_name(name: str) -> str:
    return f"{name}-engine-pods"


def activator_name(name: str) -> str:
    return f"{name}-activator"


def activator_upstream(name: str, namespace: str) -> str:
    """How NGINX reaches the activator: its Service, as host:port."""
    return f"{activator_name(name)}.{namespace}.svc.cluster.local:{ACTIVATOR_PORT}"


def model_cache_name(name: str) -> str:
    return f"{name}-model-cache"


def lb_name(name: str) -> str:
    return f"{name}-lb"


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagekube",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: name,
    }


def selector(name: str, component: str) -> dict[str, str]:
    """The immutable subset of labels that Deployments and Services select on."""
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": component, OWNER_LABEL: name}


def selector_string(name: str, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name, component).items())


ENGINE_PODS = f"app.kubernetes.io/component in (engine,{ENGINE_WORKER})"  # leaders and workers of a group


def engine_pods_selector(name: str) -> str:
    return f"app.kubernetes.io/instance={name},{OWNER_LABEL}={name},{ENGINE_PODS}"


def metadata(object_name: str, namespace: str, name: str, component: str) -> dict:
    """A child's metadata: its own name, in the LLMDeployment's namespace, with the LLMDeployment's labels."""
    return {"name": object_name, "namespace": namespace, "labels": labels(name, component)}
