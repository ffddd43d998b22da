"""The LLMDeployment spec as pydantic models: the one source of truth the CRD schema is generated from (crd.py).

Field names are camelCase on the wire (aliases) and snake_case in Python. Defaults here become schema defaults,
so the API server fills them in and `kubectl get -o yaml` shows what the operator acts on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pagekube.operator import engine_flags as flags

GROUP = "serving.pagekube.io"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SHORT_NAME = "llmd"

DEFAULT_ENGINE_IMAGE = "ghcr.io/pagekube/engine:0.1.0"
DEFAULT_OPERATOR_IMAGE = "ghcr.io/pagekube/operator:0.1.0"  # also runs the activator
# `server ... resolve` (re-resolving the headless Service as pods come and go) needs open-source nginx >= 1.27.3.
DEFAULT_NGINX_IMAGE = "nginx:1.29-alpine"

QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
SIZE = r"^[0-9]+[kKmMgG]?$"  # nginx size syntax (client_max_body_size)
SOURCE = r"^(hf://[^/\s]+/[^/\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?|s3://[^/\s]+(/\S*)?|file:///\S*)$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"  # the engine's adapter names (engine/lora/names.py)
RESERVED_VOLUMES = ("models", "dshm", "adapters", "api-key")  # the engine pod's own volumes (and adapter-claim-*)


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# Kubernetes types we pass through untouched (the API server validates them when it stores the Pod template).
class _Passthrough(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


class EnvVar(_Passthrough):
    name: str = Field(min_length=1)


class Toleration(_Passthrough):
    pass


class Volume(_Passthrough):
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)


class VolumeMount(_Passthrough):
    name: str = Field(min_length=1)
    mount_path: str = Field(alias="mountPath", min_length=1)


class EnvFromSource(_Passthrough):
    pass


class SecurityContext(_Passthrough):
    pass


class LocalObjectReference(_Spec):
    name: str = Field(min_length=1)


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="Secret in the same namespace")
    key: str = Field("api-key", min_length=1, description="Key in the Secret holding the API key")


class ModelCacheSpec(_Spec):
    """A PersistentVolumeClaim the operator creates for hf:// and s3:// sources: the first pod's download fills it,
    every later pod (ReadWriteMany) finds the files there and skips them."""

    enabled: bool = False
    size: str | None = Field(None, pattern=QUANTITY, description="The claim's size (default: model.sizeHint)")
    storage_class_name: str | None = Field(None, description="Default: the cluster's default StorageClass")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany", description="ReadWriteMany: every replica on any node shares it; ReadWriteOnce: one node")


class ModelSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.cache) || !self.cache.enabled || has(self.cache.size) || has(self.sizeHint)",
        "message": "model.cache needs a size (model.cache.size or model.sizeHint)"}]})

    name: str = Field(min_length=1, max_length=256, description="Model name the API serves (the OpenAI `model` field)")
    source: str = Field(
        pattern=SOURCE, description="Where the weights are: hf://org/repo, pvc://claim/path, s3://bucket/prefix or file:///path"
    )
    revision: str | None = Field(None, description="Hugging Face revision (branch, tag or commit) for hf:// sources")
    dtype: Literal[tuple(flags.choices("dtype"))] = flags.default("dtype")
    quantization: Literal[tuple(flags.choices("quantization"))] | None = Field(
        None, description="The checkpoint's weight quantization (the engine's --quantization); default: what its "
                          "config.json says. Set it to have pods refuse a checkpoint quantized otherwise")
    max_model_len: int | None = Field(None, ge=flags.bound("max_model_len", "minimum"),
                                      description="Longest prompt + output in tokens (default: the model's)")
    size_hint: str | None = Field(None, pattern=QUANTITY, description="Disk the downloaded weights take, e.g. 20Gi: "
                                  "the download volume's sizeLimit and ephemeral-storage request, the cache's size")
    cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec)

    @model_validator(mode="after")
    def _cache_has_a_size(self) -> ModelSpec:
        if self.cache.enabled and not (self.cache.size or self.size_hint):
            raise ValueError("model.cache needs a size (model.cache.size or model.sizeHint)")
        return self


class AdapterSpec(_Spec):
    name: str = Field(pattern=ADAPTER_NAME, description="The name requests send as `model` to use the adapter")
    source: str = Field(pattern=SOURCE, description="Where the PEFT adapter is: hf://org/repo, pvc://claim/path, "
                        "s3://bucket/prefix or file:///path")
    revision: str | None = Field(None, description="Hugging Face revision (branch, tag or commit) for hf:// sources")


class EngineSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"!has(self.volumes) || self.volumes.all(v, !(v.name in {list(RESERVED_VOLUMES)}) && "
                "!v.name.startsWith('adapter-claim-'))",
        "message": f"engine.volumes: the names {', '.join(RESERVED_VOLUMES)} and adapter-claim-* are the operator's own "
                   "volumes"}]})
    image: str = Field(DEFAULT_ENGINE_IMAGE, min_length=1)
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs one engine shards the model over (--tensor-parallel-size)")
    pipeline_parallel_size: int = Field(
        1, ge=1, le=64, description="Pods (nodes) one engine spans, a pipeline stage each (--pipeline-parallel-size): "
        "each replica is a LeaderWorkerSet group of this many pods with resources.gpu GPUs each")
    # Defaults and ranges are the engine's own (engine_flags.json); block sizes are those every backend runs.
    gpu_memory_utilization: float = Field(flags.default("gpu_memory_utilization"),
                                          gt=flags.bound("gpu_memory_utilization", "exclusiveMinimum"),
                                          le=flags.bound("gpu_memory_utilization", "maximum"))
    max_num_seqs: int = Field(flags.default("max_num_seqs"), ge=flags.bound("max_num_seqs", "minimum"))
    max_num_batched_tokens: int = Field(flags.default("max_num_batched_tokens"),
                                        ge=flags.bound("max_num_batched_tokens", "minimum"))
    block_size: Literal[tuple(flags.BLOCK_SIZES)] = flags.default("block_size")
    enable_prefix_caching: bool = flags.default("enable_prefix_caching")
    max_loras: int | None = Field(None, ge=flags.bound("max_loras", "minimum"),
                                  description="LoRA adapters one step may use (--max-loras; default: the engine's, 1)")
    max_lora_rank: int | None = Field(None, ge=flags.bound("max_lora_rank", "minimum"),
                                      description="Largest adapter rank accepted (--max-lora-rank; default: 16)")
    extra_args: list[str] = Field(default_factory=list, description="Appended to the `pagekube serve` command line")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables (Kubernetes EnvVar)")
    env_from: list[EnvFromSource] = Field(default_factory=list, description="ConfigMaps/Secrets as environment (envFrom)")
    # The engine pods, as platform teams adjust them (IRSA / Workload Identity, gVisor or Kata, sidecar injection).
    pod_labels: dict[str, str] = Field(default_factory=dict, description="Added to the engine pods (ours win on clash)")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Added to the engine pods")
    service_account_name: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    runtime_class_name: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    volumes: list[Volume] = Field(default_factory=list, max_length=64,
                                  description=f"Extra pod volumes (not {', '.join(RESERVED_VOLUMES)}, adapter-claim-*)")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=64,
                                             description="Extra mounts in the engine container")
    shm_size: str | None = Field(None, pattern=QUANTITY, description="sizeLimit of the memory-backed /dev/shm")
    security_context: SecurityContext | None = Field(
        None, description="Merged over the engine container's restricted securityContext (e.g. readOnlyRootFilesystem)")

    @field_validator("volumes")
    @classmethod
    def _not_ours(cls, volumes: list[Volume]) -> list[Volume]:
        taken = [v.name for v in volumes if v.name in RESERVED_VOLUMES or v.name.startswith("adapter-claim-")]
        if taken:
            raise ValueError(f"volume names {sorted(RESERVED_VOLUMES)} and adapter-claim-* are the operator's: "
                             f"rename {taken}")
        return volumes


class ResourcesSpec(_Spec):
    gpu: int = Field(1, ge=0, le=64, description="GPUs per engine replica (0: CPU only)")
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1)
    cpu: str | None = Field(None, pattern=QUANTITY, description="CPU request and limit, e.g. '8'")
    memory: str | None = Field(None, pattern=QUANTITY, description="Memory request and limit, e.g. '64Gi'")

    @field_validator("cpu", "memory")
    @classmethod
    def _a_real_quantity(cls, value: str | None) -> str | None:
        """The schema's pattern lets through strings like '1.2.3' that Kubernetes refuses: catch them here."""
        if value is not None:
            try:
                parse_quantity(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
        return value


class ActivatorSpec(_Spec):
    """The request holder NGINX falls back to while no engine is up (created when minReplicas is 0)."""

    max_pending: int = Field(256, ge=1, le=100_000, description="Requests held at once while scaled to zero; then 429")
    hold_timeout_seconds: int = Field(300, ge=1, le=3600, description="Longest hold for an engine to start; then 503")
    image: str = Field(DEFAULT_OPERATOR_IMAGE, min_length=1, description="Image with `pagekube-operator activator`")


class FallbackSpec(_Spec):
    """KEDA's fallback: when the queue-depth query fails `failureThreshold` times in a row (Prometheus down), hold
    `replicas` engines instead of scaling on no data (`behavior` as KEDA defines it)."""

    failure_threshold: int = Field(3, ge=1, description="Failed metric reads in a row before the fallback applies")
    replicas: int = Field(ge=0, description="Engine replicas while the metric cannot be read")
    behavior: Literal["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"] = "static"


class AutoscalingSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must be <= maxReplicas"}
            ]
        }
    )
    enabled: bool = False
    min_replicas: int = Field(1, ge=0, description="0 allows scale to zero")
    max_replicas: int = Field(4, ge=1)
    queue_depth_target: int = Field(4, ge=1, description="Waiting requests per replica KEDA aims for")
    activation_queue_depth: int = Field(0, ge=0, description="Waiting requests above which KEDA scales up from zero")
    kv_cache_usage_target: float | None = Field(None, gt=0, le=1, description="Also scale on mean KV-cache usage")
    prometheus_address: str = Field("http://prometheus-operated.monitoring.svc:9090", pattern=r"^https?://\S+$")
    polling_interval: int = Field(15, ge=1, description="Seconds between KEDA's queries")
    cooldown_period: int = Field(300, ge=0, description="Seconds of no load before scaling to zero")
    scale_down_stabilization_seconds: int = Field(300, ge=0, description="HPA scale-down stabilization window")
    activator: ActivatorSpec = Field(default_factory=ActivatorSpec)
    fallback: FallbackSpec | None = Field(None, description="Replicas to hold while the metric cannot be read")

    @property
    def scales_to_zero(self) -> bool:
        return self.enabled and self.min_replicas == 0


class PrefixHashSpec(_Spec):
    """Which replica a request's prefix goes to (operator/nginx.py). A fixed bound per replica, not KubeAI's load
    factor: nginx counts each replica's connections but keeps no mean over them, and a bound needs no shared state."""

    prefix_characters: int = Field(100, ge=1, le=1_000_000, description="Characters of the system and first user "
                                   "message (chat) or of the prompt that, with the model name, pick the replica")
    max_connections_per_replica: int | None = Field(
        None, ge=1, description="Requests one NGINX pod sends one engine at once before its keys spill to the next "
                                "replica on the ring (default: engine.maxNumSeqs / loadBalancer.replicas)")


class LoadBalancerSpec(_Spec):
    enabled: bool = True
    strategy: Literal["LeastConnections", "PrefixHash"] = Field(
        "LeastConnections", description="LeastConnections: the least busy replica; PrefixHash: requests that share a "
                                        "prefix go to one replica (its prefix cache), bounded by prefixHash")
    prefix_hash: PrefixHashSpec = Field(default_factory=PrefixHashSpec)
    replicas: int = Field(2, ge=1, le=100)
    image: str = Field(DEFAULT_NGINX_IMAGE, min_length=1)
    read_timeout_seconds: int = Field(600, ge=1, le=86400, description="Longest wait for the next byte of a response")
    max_body_size: str = Field("10m", pattern=SIZE, description="Largest request body (nginx size: 10m, 512k)")
    # The request path's placement (NGINX and the activator); the top-level fields place the engines.
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


class RolloutSpec(_Spec):
    """How the engine Deployment replaces pods when the spec changes (see rollout.py)."""

    strategy: Literal["Auto", "Surge", "Replace", "Recreate"] = Field(
        "Auto", description="Surge: a new pod before an old one goes (needs a spare GPU); Replace: one old pod goes, "
                            "then its successor starts (no spare GPU needed); Recreate: all go, then all start; "
                            "Auto: Replace at one replica or when new pods lack GPUs, else Surge")


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef | None = None


class DrainSpec(_Spec):
    timeout_seconds: int = Field(int(flags.default("drain_timeout")), ge=0, le=3600,
                                 description="Time to finish accepted requests after SIGTERM")
    pre_stop_delay_seconds: int = Field(5, ge=0, le=300, description="Sleep before the drain so endpoint removal propagates")


class TopologySpreadSpec(_Spec):
    enabled: bool = True
    topology_key: str = Field("kubernetes.io/hostname", min_length=1, description="Node label whose values to spread over")
    max_skew: int = Field(1, ge=1, description="Most pods one topology value may have above another")
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        "ScheduleAnyway", description="ScheduleAnyway: spreading is a preference; DoNotSchedule: a pod waits instead")


class AvailabilitySpec(_Spec):
    """Voluntary disruptions (node drains, cluster upgrades) and spreading, for the engine pods and NGINX's alike."""

    pod_disruption_budget: bool = Field(True, description="A PodDisruptionBudget each for the engine and NGINX")
    max_unavailable: int = Field(1, ge=0, description="Pods of each that evictions may take down at once")
    topology_spread: TopologySpreadSpec = Field(default_factory=TopologySpreadSpec,
                                                description="Spread each component's replicas over nodes")


class NetworkPolicySpec(_Spec):
    enabled: bool = Field(False, description="Engines take traffic only from their NGINX, activator and the monitoring namespaces")
    monitoring_namespaces: list[str] = Field(["monitoring"], min_length=1, description="Where Prometheus scrapes from")


class AlertThresholds(_Spec):
    kv_cache_usage: float = Field(0.95, gt=0, le=1)
    queue_depth: int = Field(16, ge=1, description="Waiting requests per replica")
    ttft_p99_seconds: float = Field(2.0, gt=0)
    error_ratio: float = Field(0.05, gt=0, le=1, description="Aborted / all finished requests")
    preemptions_per_second: float = Field(1.0, gt=0)


# The alerts of the rendered PrometheusRule (operator/monitoring.py), whose pending periods alertFor may change.
ALERTS = ("PagekubeKVCacheSaturated", "PagekubeQueueDepthHigh", "PagekubeTTFTHigh", "PagekubeErrorRatioHigh",
          "PagekubeEngineDown", "PagekubePreemptionRateHigh", "PagekubeLoRAAdapterNotLoaded",
          "PagekubeActivatorMetricAbsent")
PROM_DURATION = r"^([0-9]+(ms|s|m|h|d|w|y))+$"  # Prometheus's duration syntax (a rule's `for`)


class MonitoringSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"!has(self.alertFor) || self.alertFor.all(a, a in {list(ALERTS)})",
        "message": f"monitoring.alertFor: the alerts are {', '.join(ALERTS)}"}]})

    service_monitor: bool = False
    prometheus_rule: bool = False
    labels: dict[str, str] = Field(default_factory=dict, description="Added to the ServiceMonitors and PrometheusRule "
                                   "(kube-prometheus-stack selects them by its release label, e.g. release: kps)")
    thresholds: AlertThresholds = Field(default_factory=AlertThresholds)
    alert_for: dict[str, Annotated[str, Field(pattern=PROM_DURATION)]] = Field(
        default_factory=dict, description="How long an alert's condition must hold before it fires (its rule's "
                                          "`for`), by alert name, e.g. PagekubeQueueDepthHigh: 2m")

    @field_validator("alert_for")
    @classmethod
    def _known_alerts(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(ALERTS))
        if unknown:
            raise ValueError(f"monitoring.alertFor: no alert named {', '.join(unknown)} (the alerts are {', '.join(ALERTS)})")
        return value


class EndpointPickerRef(_Spec):
    """The endpoint picker (the Gateway API Inference Extension's EPP) that the gateway asks which pod to use."""

    name: str = Field(min_length=1, max_length=253, description="Its Service, in this namespace")
    port: int = Field(9002, ge=1, le=65535, description="Its Service's gRPC port")
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class GatewaySpec(_Spec):
    inference_pool: bool = Field(False, description="Render an InferencePool (inference.networking.k8s.io/v1) over "
                                                    "the engine pods, for a gateway that routes through an endpoint picker")
    endpoint_picker: EndpointPickerRef | None = None


class LLMDeploymentSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.resources.gpu == 0 || self.resources.gpu % self.engine.tensorParallelSize == 0",
                    "message": "resources.gpu must be a multiple of engine.tensorParallelSize",
                },
                {
                    "rule": "!has(self.adapters) || self.adapters.all(a, a.name != self.model.name)",
                    "message": "adapters: an adapter cannot take the model's own name",
                },
                {
                    "rule": "!has(self.adapters) || size(self.adapters) == 0 || self.engine.pipelineParallelSize == 1",
                    "message": "adapters: LoRA with engine.pipelineParallelSize > 1 is not supported yet",
                },
            ]
        }
    )
    model: ModelSpec
    adapters: list[AdapterSpec] = Field(
        default_factory=list, max_length=64, description="LoRA adapters every replica serves over the model",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    priority_class_name: str | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    replicas: int = Field(1, ge=0, le=1000, description="Engine replicas when autoscaling is off")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    availability: AvailabilitySpec = Field(default_factory=AvailabilitySpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    load_balancer: LoadBalancerSpec = Field(default_factory=LoadBalancerSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    drain: DrainSpec = Field(default_factory=DrainSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)

    @model_validator(mode="after")
    def _adapters_fit(self) -> LLMDeploymentSpec:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: each name once (got {names})")
        if self.model.name in names:
            raise ValueError("adapters: an adapter cannot take the model's own name")
        if names and self.engine.pipeline_parallel_size > 1:
            raise ValueError("adapters: LoRA with engine.pipelineParallelSize > 1 is not supported yet")
        return self
