"""One reconcile pass against the API server: apply what differs, delete what is no longer wanted, write status.

Writes are compare-then-apply: a child whose live state already contains every field we want gets no request at
all; one that differs gets a server-side apply under one field manager. So an unchanged resource costs zero
writes, and fields we leave out (the Deployment's replicas when KEDA owns them) are never touched.

Reads: one LIST per owned kind (by the owner label) serves both the comparison and the pruning, so a pass costs
one read per kind (six), plus the API-key Secret when one is referenced, instead of one GET per child on top; and
one LIST of the engine pods while a rollout is under way (to see pods waiting for a GPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from kubernetes.utils import parse_quantity

from pagekube.operator import naming
from pagekube.operator.desired import desired_objects
from pagekube.operator.metrics_check import check_metrics
from pagekube.operator.rollout import insufficient_gpu, rolling_out
from pagekube.operator.spec import GROUP, PLURAL, VERSION, LLMDeploymentSpec
from pagekube.operator.status import compute_status, merge_transition_times, status_changed

FIELD_MANAGER = "pagekube-operator"
log = logging.getLogger("pagekube.operator")

# Kinds the operator may own; children of these kinds it no longer wants are deleted.
OWNED_KINDS = [
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
]
CRD_HINT = {"keda.sh/v1alpha1": "KEDA", "monitoring.coreos.com/v1": "prometheus-operator"}


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


def check_servable(core: client.CoreV1Api, namespace: str, spec: LLMDeploymentSpec) -> list[tuple[str, str]]:
    """What the schema cannot see but keeps the spec from running: (reason, message) pairs."""
    problems = []
    ref = spec.auth.api_key_secret_ref
    if ref:
        try:
            secret = core.read_namespaced_secret(ref.name, namespace)
            if ref.key not in (secret.data or {}):
                problems.append(("SecretKeyMissing", f"Secret {namespace}/{ref.name} has no key {ref.key!r}"))
        except client.ApiException as e:
            if e.status != 404:
                raise
            problems.append(("SecretNotFound", f"Secret {namespace}/{ref.name} (auth.apiKeySecretRef) does not exist"))
    return problems


class Reconciler:
    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or client.ApiClient()
        self.dynamic = DynamicClient(self.api)
        self.core = client.CoreV1Api(self.api)

    def _resource(self, api_version: str, kind: str):
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def _live_children(self, name: str, namespace: str) -> dict[tuple[str, str], dict | None]:
        """{(apiVersion, kind): {child name: live object}} for every owned kind; None for a kind not served."""
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

    def _pods_waiting_for_gpu(self, name: str, namespace: str, spec: LLMDeploymentSpec, live_engine: dict | None) -> str | None:
        """The scheduler's message for an engine pod it cannot place for want of GPUs (None: no such pod)."""
        if spec.resources.gpu == 0 or not rolling_out(live_engine):
            return None
        pods = self.core.list_namespaced_pod(namespace, label_selector=naming.selector_string(name, "engine"))
        return insufficient_gpu(self.api.sanitize_for_serialization(pods)["items"], spec.resources.gpu_resource_name)

    def reconcile(self, body: dict) -> ReconcileResult:
        """Bring the children of one LLMDeployment (its full object as a dict) in line with its spec."""
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        spec = LLMDeploymentSpec.model_validate(body.get("spec") or {})
        result = ReconcileResult(problems=check_servable(self.core, namespace, spec))
        blocked = bool(result.problems)
        deployment = gpu_wait = metrics = None
        if not blocked:
            live = self._live_children(name, namespace)
            live_engine = (live[("apps/v1", "Deployment")] or {}).get(naming.engine_name(name))
            gpu_wait = self._pods_waiting_for_gpu(name, namespace, spec, live_engine)
            replicas = (live_engine or {}).get("spec", {}).get("replicas") if spec.autoscaling.enabled else None
            wanted = desired_objects(name, namespace, uid, spec, replicas, gpu_starved=gpu_wait is not None)
            for obj in wanted:
                of_kind = live.get((obj["apiVersion"], obj["kind"]))
                if of_kind is None:
                    hint = CRD_HINT.get(obj["apiVersion"], obj["apiVersion"])
                    result.problems.append(("MissingCRD", f"{obj['kind']} ({obj['apiVersion']}) is not served: "
                                                          f"install {hint} or turn that feature off"))
                    continue
                current = self._apply(obj, of_kind.get(obj["metadata"]["name"]), result)
                if obj["kind"] == "Deployment" and obj["metadata"]["name"] == naming.engine_name(name):
                    deployment = current
            self._prune(namespace, uid, live, {(o["kind"], o["metadata"]["name"]) for o in wanted}, result)
            if spec.autoscaling.enabled:
                ready = ((deployment or {}).get("status") or {}).get("readyReplicas") or 0
                metrics = check_metrics(name, namespace, spec, ready)
        new = compute_status(name, namespace, meta.get("generation", 0), spec, deployment, result.problems, blocked,
                             gpu_wait, metrics)
        old = body.get("status") or {}
        if status_changed(merge_transition_times(new, old), old):
            client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": new})
            result.status = new
        return result
