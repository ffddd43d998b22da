"""The engine Deployment: GPU pods running `pagekube serve`, with probes and a drain-aware shutdown."""

from __future__ import annotations

import math

from kubernetes.utils import parse_quantity

from pagekube.operator import engine_flags, naming
from pagekube.operator.adapters import adapter_volumes, lora_flags
from pagekube.operator.availability import topology_spread
from pagekube.operator.model_revision import DOWNLOAD_CONTAINER
from pagekube.operator.multi_node import RENDEZVOUS_PORT, multi_node_flags
from pagekube.operator.placement import engine_placement
from pagekube.operator.pod_security import container_security_context, pod_security_context
from pagekube.operator.rollout import deployment_strategy
from pagekube.operator.spec import LLMDeploymentSpec

MODELS_DIR = "/models"
API_KEY_DIR, API_KEY_FILE = "/var/run/secrets/pagekube", "api-key"  # auth.apiKeySecretRef, mounted (see _api_key_volume)
ENGINE_UID = 1000  # the engine image's user (images/engine/Dockerfile)
S3_IMAGE = "amazon/aws-cli:2.22.35"
# Runs in the engine image (huggingface_hub comes with transformers); HF_TOKEN etc. come from engine.env. Resolves the
# revision (a branch, a tag, none: the default branch) to its commit, downloads that commit and reports it as the
# container's termination message, which the operator records and pins later pods to (operator/model_revision.py).
HF_DOWNLOAD = (
    "import sys; from huggingface_hub import HfApi, snapshot_download\n"
    "repo, revision, target, report = (sys.argv[1:] + ['/dev/termination-log'])[:4]\n"
    "commit = HfApi().model_info(repo, revision=revision or None).sha\n"
    "snapshot_download(repo_id=repo, revision=commit, local_dir=target)\n"
    "print('downloaded', repo, 'at', commit, flush=True)\n"
    "try:\n"
    "    open(report, 'w').write(commit)\n"
    "except OSError as err:\n"
    "    print('could not report the commit:', err)"
)
GRACE_MARGIN_SECONDS = 15  # after preStop + drain: process exit, log flush


def grace_period_seconds(spec: LLMDeploymentSpec) -> int:
    return spec.drain.pre_stop_delay_seconds + spec.drain.timeout_seconds + GRACE_MARGIN_SECONDS


def model_source(spec: LLMDeploymentSpec) -> tuple[str, str]:
    """("hf" | "pvc" | "s3" | "file", the rest of the URL)."""
    scheme, rest = spec.model.source.split("://", 1)
    return scheme, rest


def model_path(spec: LLMDeploymentSpec) -> str:
    """Where the engine finds the weights inside its container."""
    scheme, rest = model_source(spec)
    if scheme == "file":
        return rest
    if scheme == "pvc":
        _claim, _, sub = rest.partition("/")
        return f"{MODELS_DIR}/{sub}".rstrip("/")
    if scheme == "hf" and spec.model.cache.enabled:  # one folder per revision: a new one never overwrites files
        return f"{MODELS_DIR}/{spec.model.revision or 'main'}"  # that running replicas have mapped
    return f"{MODELS_DIR}/model"


def uses_model_cache(spec: LLMDeploymentSpec) -> bool:
    return spec.model.cache.enabled and model_source(spec)[0] in ("hf", "s3")


def build_model_cache_claim(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    """The PersistentVolumeClaim the downloads fill once (owned: deleting the LLMDeployment deletes it)."""
    cache = spec.model.cache
    claim = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": cache.size or spec.model.size_hint}}}
    if cache.storage_class_name:
        claim["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": naming.metadata(naming.model_cache_name(name), namespace, name, "engine"), "spec": claim}


def engine_args(spec: LLMDeploymentSpec, group_role: str | None = None) -> list[str]:
    """`pagekube serve` arguments for this spec, through the engine's own flag schema. `group_role`: "leader" or
    "worker" for a pod of a pipeline-parallel group (operator/leader_worker_set.py)."""
    e, cpu_only = spec.engine, spec.resources.gpu == 0
    return engine_flags.to_args({
        "model": model_path(spec),
        "served_model_name": spec.model.name,
        "host": "0.0.0.0",
        "port": naming.ENGINE_PORT,
        "dtype": spec.model.dtype,
        "quantization": spec.model.quantization,
        "max_model_len": spec.model.max_model_len,
        "device": "cpu" if cpu_only else None,
        "gpu_memory_utilization": None if cpu_only else e.gpu_memory_utilization,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "block_size": e.block_size,
        "tensor_parallel_size": e.tensor_parallel_size if e.tensor_parallel_size > 1 else None,
        "pipeline_parallel_size": e.pipeline_parallel_size if e.pipeline_parallel_size > 1 else None,
        **multi_node_flags(spec, group_role),
        "enable_prefix_caching": e.enable_prefix_caching,
        "drain_timeout": spec.drain.timeout_seconds,
        "api_key_file": f"{API_KEY_DIR}/{API_KEY_FILE}" if spec.auth.api_key_secret_ref else None,
        **lora_flags(spec),
    }) + list(e.extra_args)


def _resources(spec: LLMDeploymentSpec) -> dict:
    r = spec.resources
    amounts: dict[str, str] = {}
    if r.gpu:
        amounts[r.gpu_resource_name] = str(r.gpu)
    if r.cpu:
        amounts["cpu"] = r.cpu
    if r.memory:
        amounts["memory"] = r.memory
    out = {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}
    if spec.model.size_hint and model_source(spec)[0] in ("hf", "s3") and not uses_model_cache(spec):
        # The downloaded weights live in an emptyDir: schedule the pod where its node's disk can hold them.
        out.setdefault("requests", {})["ephemeral-storage"] = spec.model.size_hint
    return out


def _user_env(spec: LLMDeploymentSpec) -> list[dict]:
    """engine.env as Kubernetes EnvVars (the engine and the model download both get them: HF_TOKEN, AWS_*)."""
    return [e.model_dump(by_alias=True, exclude_none=True) for e in spec.engine.env]


def cpu_threads(cpu: str) -> int:
    """Threads that fit a CPU limit ('500m' -> 1, '2.5' -> 3). torch otherwise starts one OpenMP thread per core of
    the node, and threads beyond the CFS quota spin and get throttled: a CPU engine then runs several times slower."""
    return max(1, math.ceil(parse_quantity(cpu)))


def _env_from(spec: LLMDeploymentSpec) -> list[dict]:
    return [s.model_dump(by_alias=True) for s in spec.engine.env_from]


def _env(spec: LLMDeploymentSpec) -> list[dict]:
    env = _user_env(spec)
    cpu = spec.resources.cpu
    if cpu and not any(e["name"] == "OMP_NUM_THREADS" for e in env):  # engine.env wins
        env.append({"name": "OMP_NUM_THREADS", "value": str(cpu_threads(cpu))})
    return env


def _api_key_volume(spec: LLMDeploymentSpec) -> tuple[list[dict], list[dict]]:
    """The auth Secret as a volume, not an env var: the kubelet updates a mounted Secret in place and the engine
    re-reads the file (--api-key-file), so a rotated key takes effect without a restart."""
    ref = spec.auth.api_key_secret_ref
    if not ref:
        return [], []
    volume = {"name": "api-key", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": API_KEY_FILE}]}}
    return [volume], [{"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}]


def _model_volume_and_init(name: str, spec: LLMDeploymentSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, init containers) that put the weights at model_path()."""
    scheme, rest = model_source(spec)
    if scheme == "file":
        return [], []
    if scheme == "pvc":
        claim = rest.partition("/")[0]
        return [{"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}], []
    if uses_model_cache(spec):
        volume = {"name": "models", "persistentVolumeClaim": {"claimName": naming.model_cache_name(name)}}
    else:  # the pod's own copy, counted against its ephemeral storage
        volume = {"name": "models", "emptyDir": {"sizeLimit": spec.model.size_hint} if spec.model.size_hint else {}}
    mounts = [{"name": "models", "mountPath": MODELS_DIR}]
    env = _user_env(spec)
    if scheme == "hf":
        init = {
            "name": DOWNLOAD_CONTAINER,
            "image": spec.engine.image,
            "command": ["python", "-c", HF_DOWNLOAD, rest, spec.model.revision or "", model_path(spec)],
        }
    else:  # s3
        init = {"name": DOWNLOAD_CONTAINER, "image": S3_IMAGE, "args": ["s3", "sync", spec.model.source, model_path(spec)]}
        env = [{"name": "HOME", "value": "/tmp"}, *env]  # runs as the pod's non-root user: aws-cli needs a writable home
    # The download writes only to the models volume and its own caches (HOME in the image): root stays writable.
    if spec.engine.env_from:  # credentials kept in a Secret reach the download too
        init["envFrom"] = _env_from(spec)
    init.update({"env": env, "volumeMounts": mounts, "securityContext": container_security_context(read_only_root=False)})
    return [volume], [init]


def _probe(path: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def engine_pod_template(name: str, spec: LLMDeploymentSpec, group_role: str | None = None) -> dict:
    """The engine pod. `group_role` "leader": a pipeline-parallel group's first pod, which serves the API (and the
    rendezvous); "worker": one of the others, headless (no API: no probes, no preStop, not selected by Services)."""
    grace = grace_period_seconds(spec)
    volumes, init_containers = _model_volume_and_init(name, spec)
    mounts = [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}] if volumes else []
    e = spec.engine
    shm = {"medium": "Memory", **({"sizeLimit": e.shm_size} if e.shm_size else {})}
    volumes.append({"name": "dshm", "emptyDir": shm})  # NCCL and torch need a real /dev/shm
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    adapter_vols, adapter_mounts, adapter_inits = adapter_volumes(spec, e.image, _user_env(spec), _env_from(spec),
                                                                  S3_IMAGE)
    volumes += adapter_vols
    mounts += adapter_mounts
    key_vols, key_mounts = _api_key_volume(spec)
    volumes += key_vols
    mounts += key_mounts
    init_containers += adapter_inits
    volumes += [v.model_dump(by_alias=True) for v in e.volumes]
    mounts += [m.model_dump(by_alias=True) for m in e.volume_mounts]
    ports = [{"name": "http", "containerPort": naming.ENGINE_PORT, "protocol": "TCP"}]
    if group_role == "leader":
        ports.append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    container = {
        "name": "engine",
        "image": spec.engine.image,
        "command": ["pagekube", "serve"],
        "args": engine_args(spec, group_role),
        "ports": ports,
        "env": _env(spec),
        **({"envFrom": _env_from(spec)} if e.env_from else {}),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Model load can take many minutes; the startup probe holds the others off until /health is 200.
        "startupProbe": _probe("/health", 10, 180),
        # /health turns 503 the moment a drain starts, so endpoints drop the pod at once.
        "readinessProbe": _probe("/health", 5, 1),
        # ...which is why liveness tolerates 503 for a whole drain: a draining pod must not be restarted.
        "livenessProbe": _probe("/health", 10, max(3, math.ceil(grace / 10))),
        # The sleep lets endpoint removal reach every load balancer before SIGTERM starts the drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(spec.drain.pre_stop_delay_seconds)]}}},
        # Writable root: the engine compiles and caches kernels (CPU extension, Triton) under its HOME.
        "securityContext": {**container_security_context(read_only_root=False),
                            **(e.security_context.model_dump(by_alias=True) if e.security_context else {})},
    }
    pod_spec: dict = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(ENGINE_UID, fs_group=True),
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if e.service_account_name:  # IRSA, Workload Identity: the cloud identity the download and the engine use
        pod_spec["serviceAccountName"] = e.service_account_name
    if e.runtime_class_name:
        pod_spec["runtimeClassName"] = e.runtime_class_name
    if spread := topology_spread(name, "engine", spec):
        pod_spec["topologySpreadConstraints"] = spread
    pod_spec.update(engine_placement(spec))
    if group_role == "worker":  # a headless rank: no API to probe; it stops when the leader stops it
        for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
            container.pop(key)
        return {"metadata": {"labels": {**e.pod_labels, **naming.labels(name, naming.ENGINE_WORKER)},
                             "annotations": {**e.pod_annotations, "kubectl.kubernetes.io/default-container": "engine"}},
                "spec": pod_spec}
    return {
        "metadata": {
            "labels": {**e.pod_labels, **naming.labels(name, "engine")},  # the selector's labels stay ours
            "annotations": {
                **e.pod_annotations,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(naming.ENGINE_PORT),
                "prometheus.io/path": "/metrics",
                "kubectl.kubernetes.io/default-container": "engine",
            },
        },
        "spec": pod_spec,
    }


def build_engine_deployment(name: str, namespace: str, spec: LLMDeploymentSpec, replicas: int | None = None,
                            gpu_starved: bool = False) -> dict:
    """`replicas` and `gpu_starved` are what the operator sees live (rollout.deployment_strategy's inputs)."""
    deployment_spec: dict = {
        "selector": {"matchLabels": naming.selector(name, "engine")},
        "strategy": deployment_strategy(spec, replicas, gpu_starved),
        "template": engine_pod_template(name, spec),
    }
    if not spec.autoscaling.enabled:  # with autoscaling on, KEDA's HPA owns replicas: never write them
        deployment_spec["replicas"] = spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(naming.engine_name(name), namespace, name, "engine"),
        "spec": deployment_spec,
    }
