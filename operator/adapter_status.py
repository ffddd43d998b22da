"""status.adapters and the AdaptersReady condition: which LoRA adapters the ready engine replicas serve.

Each engine says it on /metrics (open without the API key): `pagekube:lora_adapter_loaded{adapter,error}` is 1 for
an adapter it serves and 0, with the reason, for one it could not load. A bad adapter is left out by the engine and
the others serve (engine/llm_engine.py), so it shows here and blocks no other adapter. A pod's adapters are fixed
when it starts (the operator changes adapters by rolling the pods), so each pod is read once, and again only after
its engine container restarts; a pod that does not answer is tried again on the next pass.
"""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagekube.operator import naming
from pagekube.operator.spec import LLMDeploymentSpec

LOADED = "pagekube:lora_adapter_loaded"
FETCH_TIMEOUT_SECONDS = 2.0  # per pod: a pass must not stall on a pod that drops packets
ENGINE_CONTAINER = "engine"

Report = dict[str, str]  # adapter name -> "" (served) or why it could not be loaded


def parse_loaded(metrics_text: str) -> Report:
    """The adapters an engine's /metrics page reports, with their errors ('' for one served)."""
    report: Report = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == LOADED:
                report[sample.labels["adapter"]] = "" if sample.value == 1 else sample.labels.get("error") or "not loaded"
    return report


def _ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return conditions.get("Ready") == "True" and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def metrics_url(pod: dict) -> str:
    """The engine container's /metrics on the pod's IP, at the port the pod declares (`http`)."""
    port = naming.ENGINE_PORT
    for container in pod["spec"].get("containers") or []:
        if container.get("name") == ENGINE_CONTAINER:
            port = next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == "http"), port)
    host = pod["status"]["podIP"]
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def _started(pod: dict) -> tuple:
    """What identifies one run of the pod's engine: its uid and the engine container's restart count."""
    restarts = [s.get("restartCount", 0) for s in (pod.get("status") or {}).get("containerStatuses") or []
                if s.get("name") == ENGINE_CONTAINER]
    return pod["metadata"]["uid"], restarts[0] if restarts else 0


class AdapterReports:
    """Each ready engine pod's report, read once per engine start; shared by the controller's workers."""

    def __init__(self, timeout: float = FETCH_TIMEOUT_SECONDS):
        self.timeout = timeout
        self._reports: dict[tuple[str, str], dict[tuple, Report]] = {}  # per LLMDeployment: by _started(pod)
        self._lock = threading.Lock()

    def read(self, owner: tuple[str, str], pods: list[dict]) -> dict[str, Report | str]:
        """{pod name: its report, or why it could not be read} for every ready pod of `pods` (all the engine pods
        of `owner`, (namespace, name): reports of pods gone or restarted are dropped)."""
        with self._lock:
            known = self._reports.get(owner, {})
        kept: dict[tuple, Report] = {}
        out: dict[str, Report | str] = {}
        for pod in filter(_ready, pods):
            key, name = _started(pod), pod["metadata"]["name"]
            report = known.get(key)
            if report is None:
                url = metrics_url(pod)
                try:
                    with urllib.request.urlopen(url, timeout=self.timeout) as r:
                        report = parse_loaded(r.read().decode())
                except (OSError, ValueError) as e:
                    out[name] = f"GET {url}: {getattr(e, 'reason', e)}"
                    continue
            kept[key] = out[name] = report
        with self._lock:
            self._reports[owner] = kept
        return out


def adapter_status(spec: LLMDeploymentSpec, reports: dict[str, Report | str], generation: int) -> tuple[list[dict], dict]:
    """(status.adapters, the AdaptersReady condition) from the ready pods' reports (a str: the pod did not answer).
    Per adapter: how many ready replicas serve it, and why one could not load it."""
    answered = {pod: r for pod, r in sorted(reports.items()) if isinstance(r, dict)}
    silent = {pod: r for pod, r in sorted(reports.items()) if isinstance(r, str)}
    entries, failed, missing = [], [], []
    for adapter in spec.adapters:
        serving = [pod for pod, r in answered.items() if r.get(adapter.name) == ""]
        errors = {pod: r[adapter.name] for pod, r in answered.items() if r.get(adapter.name)}
        entry = {"name": adapter.name, "readyReplicas": len(serving)}
        if errors:
            pod, error = next(iter(errors.items()))
            entry["message"] = error
            failed.append(f"{adapter.name!r} failed to load on {len(errors)} of {len(answered)} ready replicas "
                          f"({pod}: {error})")
        elif len(serving) < len(answered):
            missing.append(f"{adapter.name!r} is served by {len(serving)} of {len(answered)} ready replicas")
        entries.append(entry)

    def condition(status: str, reason: str, message: str) -> dict:
        return {"type": "AdaptersReady", "status": status, "reason": reason, "message": message,
                "observedGeneration": generation}

    if failed:
        return entries, condition("False", "AdapterFailed", "; ".join(failed) + "; the other adapters serve")
    if missing:  # pods started before the adapter was declared, until the rollout replaces them
        return entries, condition("False", "AdapterNotServed", "; ".join(missing))
    if silent:
        pod, why = next(iter(silent.items()))
        return entries, condition("Unknown", "EngineUnreachable", f"{len(silent)} ready replica(s) did not report "
                                                                  f"their adapters ({pod}: {why})")
    if not answered:
        return entries, condition("Unknown", "NoReadyEngines", "no engine replica is ready to report its adapters")
    return entries, condition("True", "AllAdaptersServed", f"{len(spec.adapters)} adapter(s) served by each of "
                                                           f"{len(answered)} ready replica(s)")
