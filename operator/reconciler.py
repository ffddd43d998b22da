"""One reconcile pass: apply what differs, delete what is no longer wanted, write status.

Writes are compare-then-apply: a child whose live state already contains every field we want gets no request at
all; one that differs gets a server-side apply under one field manager. So an unchanged resource costs zero
writes, and fields we leave out (the Deployment's replicas when KEDA owns them) are never touched.

Reads come from the controller's watch-fed caches (controller.py): a pass sends no GET or LIST for the children.
Without a cache (a one-off pass), one LIST per owned kind serves comparison and pruning. The API-key Secret is
read by name (never listed), and a Secret once found is trusted for SECRET_RECHECK_SECONDS; the engine pods are
listed only while a GPU rollout is under way (to see pods waiting for a GPU) or when adapters are declared (each
ready engine pod's /metrics is read once, for status.adapters: operator/adapter_status.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from kubernetes import client
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from kubernetes.utils import parse_quantity

from pagekube.operator import naming
from pagekube.operator.adapter_status import AdapterReports, adapter_status
from pagekube.operator.desired import desired_objects
from pagekube.operator.leader_worker_set import engine_workload
from pagekube.operator.metrics_check import check_metrics
from pagekube.operator.model_revision import model_status, pinned_commit, pinned_spec
from pagekube.operator.multi_node import unscheduled_group_pod
from pagekube.operator.rollout import insufficient_gpu, rolling_out
from pagekube.operator.spec import GROUP, PLURAL, VERSION, LLMDeploymentSpec
from pagekube.operator.status import compute_status, merge_transition_times, status_changed

FIELD_MANAGER = "pagekube-operator"
log = logging.getLogger("pagekube.operator")

# Kinds the operator may own; children of these kinds it no longer wants are deleted.
OWNED_KINDS = [
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
]
CRD_HINT = {"keda.sh/v1alpha1": "KEDA", "monitoring.coreos.com/v1": "prometheus-operator",
            "inference.networking.k8s.io/v1": "the Gateway API Inference Extension's CRDs",
            "leaderworkerset.x-k8s.io/v1": "LeaderWorkerSet (sigs.k8s.io/lws)"}


def contains(live, want) -> bool:
    """Whether `live` already holds every field of `want` (extra live fields, e.g. server defaults, are fine)."""
    if isinstance(want, dict):
        # An empty list we ask for reads back as absent (Go's omitempty).
        return isinstance(live, dict) and all(
            contains(live[k], v) if k in live else v == [] for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(contains(a, b) for a, b in zip(live, want))
    return live == want or _same_quantity(live, want)


def _same_quantity(live, want) -> bool:
    """The API server rewrites quantities canonically ("0.5" -> "500m", "1024Mi" -> "1Gi"): equal, not drift."""
    if not (isinstance(live, str) and isinstance(want, str)):
        return False
    try:
        return parse_quantity(live) == parse_quantity(want)
    except ValueError:
        return False


@dataclass
class ReconcileResult:
    writes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    status: dict | None = None


SECRET_RECHECK_SECONDS = 600.0


class SecretChecks:
    """Whether a referenced Secret exists with its key: read by name; a Secret found is not read again for
    SECRET_RECHECK_SECONDS (a resync must not GET it), one missing is read on every pass until it appears."""

    def __init__(self, core: client.CoreV1Api, recheck_seconds: float = SECRET_RECHECK_SECONDS):
        self.core, self.recheck_seconds = core, recheck_seconds
        self._found: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()

    def problems(self, namespace: str, spec: LLMDeploymentSpec) -> list[tuple[str, str]]:
        """What the schema cannot see but keeps the spec from running: (reason, message) pairs."""
        ref = spec.auth.api_key_secret_ref
        if not ref:
            return []
        key = (namespace, ref.name, ref.key)
        with self._lock:
            if self._found.get(key, 0) > time.monotonic():
                return []
        try:
            secret = self.core.read_namespaced_secret(ref.name, namespace)
        except client.ApiException as e:
            if e.status != 404:
                raise
            return [("SecretNotFound", f"Secret {namespace}/{ref.name} (auth.apiKeySecretRef) does not exist")]
        if ref.key not in (secret.data or {}):
            return [("SecretKeyMissing", f"Secret {namespace}/{ref.name} has no key {ref.key!r}")]
        with self._lock:
            self._found[key] = time.monotonic() + self.recheck_seconds
        return []


class ChildCache(Protocol):
    def live_children(self, namespace: str, owner: str) -> dict[tuple[str, str], dict | None]: ...
    def engine_pods(self, namespace: str, owner: str) -> list[dict]: ...


class Reconciler:
    def __init__(self, api: client.ApiClient | None = None, cache: ChildCache | None = None):
        self.api = api or client.ApiClient()
        self.dynamic = DynamicClient(self.api)
        self.core = client.CoreV1Api(self.api)
        self.cache = cache
        self.secrets = SecretChecks(self.core)
        self.adapter_reports = AdapterReports()
        self._written: dict[tuple[str, str], dict] = {}  # the last status written per object (caches lag it)

    def _resource(self, api_version: str, kind: str):
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def _live_children(self, name: str, namespace: str) -> dict[tuple[str, str], dict | None]:
        """{(apiVersion, kind): {child name: live object}} for every owned kind; None for a kind not served."""
        if self.cache is not None:
            return self.cache.live_children(namespace, name)
        live: dict = {}
        for api_version, kind in OWNED_KINDS:
            try:
                resource = self._resource(api_version, kind)
            except ResourceNotFoundError:
                live[(api_version, kind)] = None  # that CRD is not installed, so nothing of that kind can exist
                continue
            items = resource.get(namespace=namespace, label_selector=f"{naming.OWNER_LABEL}={name}").to_dict()["items"]
            live[(api_version, kind)] = {item["metadata"]["name"]: item for item in items}
        return live

    def _apply(self, obj: dict, live: dict | None, result: ReconcileResult) -> dict:
        """Make the child match `obj` (`live`: its current state, or None); returns it as it now is."""
        if live is not None and contains(live, obj):
            return live
        meta = obj["metadata"]
        applied = self._resource(obj["apiVersion"], obj["kind"]).server_side_apply(
            body=obj, name=meta["name"], namespace=meta["namespace"], field_manager=FIELD_MANAGER,
            force_conflicts=True).to_dict()
        result.writes.append(f"{obj['kind']}/{meta['name']}")
        log.info("applied %s %s/%s (%s)", obj["kind"], meta["namespace"], meta["name"], "created" if live is None else "updated")
        return applied

    def _prune(self, namespace: str, uid: str, live: dict, keep: set[tuple[str, str]], result: ReconcileResult) -> None:
        for (api_version, kind), items in live.items():
            for child_name, item in (items or {}).items():
                owners = item["metadata"].get("ownerReferences") or []
                if (kind, child_name) in keep or not any(o.get("uid") == uid for o in owners):
                    continue
                try:
                    self._resource(api_version, kind).delete(name=child_name, namespace=namespace)
                except NotFoundError:
                    pass  # already gone
                result.writes.append(f"delete {kind}/{child_name}")

    def _engine_pods(self, name: str, namespace: str) -> list[dict]:
        if self.cache is not None:
            return self.cache.engine_pods(namespace, name)
        listed = self.core.list_namespaced_pod(namespace, label_selector=naming.engine_pods_selector(name))
        return self.api.sanitize_for_serialization(listed)["items"]

    def _pods_waiting_for_gpu(self, name: str, namespace: str, spec: LLMDeploymentSpec, live_engine: dict | None) -> str | None:
        """The scheduler's message for an engine pod it cannot place for want of GPUs (None: no such pod)."""
        if spec.resources.gpu == 0 or not rolling_out(live_engine):
            return None
        return insufficient_gpu(self._engine_pods(name, namespace), spec.resources.gpu_resource_name)

    def _group_not_scheduled(self, name: str, namespace: str, spec: LLMDeploymentSpec, live_engine: dict | None) -> str | None:
        """For a LeaderWorkerSet with groups not ready: 'pod X: the scheduler's message' for a pod it cannot place."""
        if spec.engine.pipeline_parallel_size == 1 or live_engine is None:
            return None
        if ((live_engine.get("status") or {}).get("readyReplicas") or 0) >= live_engine["spec"].get("replicas", 1):
            return None
        return unscheduled_group_pod(self._engine_pods(name, namespace))

    def _pinned_commit(self, name: str, namespace: str, spec: LLMDeploymentSpec, status: dict | None) -> str | None:
        """The hf:// commit the pods download (operator/model_revision.py); pods are read only until one is known."""
        if not spec.model.source.startswith("hf://"):
            return None
        recorded = pinned_commit(spec, status, [])
        return recorded or pinned_commit(spec, status, self._engine_pods(name, namespace))

    def reconcile(self, body: dict) -> ReconcileResult:
        """Bring the children of one LLMDeployment (its full object as a dict) in line with its spec."""
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        spec = LLMDeploymentSpec.model_validate(body.get("spec") or {})
        commit = self._pinned_commit(name, namespace, spec, body.get("status"))
        spec_as_run = pinned_spec(spec, commit)  # what the pods download: the spec's revision, or the pinned commit
        result = ReconcileResult(problems=self.secrets.problems(namespace, spec))
        blocked = bool(result.problems)
        deployment = gpu_wait = group_wait = metrics = None
        engine_api, engine_kind, engine_object = engine_workload(name, spec)
        if not blocked:
            live = self._live_children(name, namespace)
            if live.get((engine_api, engine_kind)) is None:  # nothing could run the engines: refuse the spec
                result.problems.append(("MissingCRD", f"{engine_kind} ({engine_api}) is not served: install "
                                        f"{CRD_HINT[engine_api]} or set engine.pipelineParallelSize to 1"))
                blocked = True
        if not blocked:
            live_engine = live[(engine_api, engine_kind)].get(engine_object)
            gpu_wait = self._pods_waiting_for_gpu(name, namespace, spec, live_engine)
            group_wait = self._group_not_scheduled(name, namespace, spec, live_engine)
            replicas = (live_engine or {}).get("spec", {}).get("replicas") if spec.autoscaling.enabled else None
            wanted = desired_objects(name, namespace, uid, spec_as_run, replicas, gpu_starved=gpu_wait is not None)
            for obj in wanted:
                of_kind = live.get((obj["apiVersion"], obj["kind"]))
                if of_kind is None:
                    hint = CRD_HINT.get(obj["apiVersion"], obj["apiVersion"])
                    result.problems.append(("MissingCRD", f"{obj['kind']} ({obj['apiVersion']}) is not served: "
                                                          f"install {hint} or turn that feature off"))
                    continue
                current = self._apply(obj, of_kind.get(obj["metadata"]["name"]), result)
                if obj["kind"] == engine_kind and obj["metadata"]["name"] == engine_object:
                    deployment = current
            self._prune(namespace, uid, live, {(o["kind"], o["metadata"]["name"]) for o in wanted}, result)
            if spec.autoscaling.enabled:
                ready = ((deployment or {}).get("status") or {}).get("readyReplicas") or 0
                metrics = check_metrics(name, namespace, spec, ready)
        new = compute_status(name, namespace, meta.get("generation", 0), spec, deployment, result.problems, blocked,
                             gpu_wait, metrics, group_wait)
        new["model"] = model_status(spec, commit)
        new["adapters"] = None  # removed from the status once the spec declares none
        if spec.adapters and not blocked:
            reports = self.adapter_reports.read((namespace, name), self._engine_pods(name, namespace))
            new["adapters"], adapters_ready = adapter_status(spec, reports, meta.get("generation", 0))
            new["conditions"].append(adapters_ready)
        old = body.get("status") or {}
        new = merge_transition_times(new, old)
        if status_changed(new, old) and self._written.get((namespace, uid)) != new:
            client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": new})
            self._written[(namespace, uid)] = new
            result.status = new
        return result
