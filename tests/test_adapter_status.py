"""status.adapters and the AdaptersReady condition (operator/adapter_status.py): the engines' metric as the operator
parses it, the status from the ready pods' reports, and each pod read once per engine start over real HTTP."""

from __future__ import annotations

import http.server
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pagekube.engine.server.metrics import EngineMetrics
from pagekube.operator.adapter_status import AdapterReports, adapter_status, metrics_url, parse_loaded
from pagekube.operator.spec import LLMDeploymentSpec

ERROR = "LoRA adapter 'bad' (/adapters/bad): rank 64 exceeds --max-lora-rank 16"


class Manager:  # what LoRAMetrics reads of the engine's LoRAManager
    def __init__(self, states: dict[str, str]):
        self._states = states

    def states(self) -> dict[str, str]:
        return dict(self._states)


def engine_page(states: dict[str, str]) -> str:
    metrics = EngineMetrics("base", CollectorRegistry(), max_loras=2)
    metrics.lora.refresh_loaded(Manager(states))
    return generate_latest(metrics.registry).decode()


def spec(*names: str) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate({"model": {"name": "base", "source": "hf://o/base"},
                                            "adapters": [{"name": n, "source": f"hf://o/{n}"} for n in names]})


def test_the_operator_reads_what_the_engine_exports():
    assert parse_loaded(engine_page({"sql": "", "bad": ERROR})) == {"sql": "", "bad": ERROR}
    assert parse_loaded(engine_page({})) == {}


def test_an_adapter_dropped_at_run_time_leaves_the_metric():
    metrics = EngineMetrics("base", CollectorRegistry(), max_loras=2)
    metrics.lora.refresh_loaded(Manager({"sql": "", "chat": ""}))
    metrics.lora.refresh_loaded(Manager({"sql": ""}))
    assert parse_loaded(generate_latest(metrics.registry).decode()) == {"sql": ""}


def test_every_adapter_served_by_every_ready_replica():
    entries, cond = adapter_status(spec("sql", "chat"), {"p1": {"sql": "", "chat": ""}, "p2": {"sql": "", "chat": ""}}, 4)
    assert entries == [{"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 2}]
    assert cond == {"type": "AdaptersReady", "status": "True", "reason": "AllAdaptersServed",
                    "message": "2 adapter(s) served by each of 2 ready replica(s)", "observedGeneration": 4}


def test_a_bad_adapter_is_a_condition_and_the_others_still_count():
    entries, cond = adapter_status(spec("sql", "bad"), {"p1": {"sql": "", "bad": ERROR}, "p2": {"sql": "", "bad": ERROR}}, 1)
    assert entries == [{"name": "sql", "readyReplicas": 2}, {"name": "bad", "readyReplicas": 0, "message": ERROR}]
    assert (cond["status"], cond["reason"]) == ("False", "AdapterFailed")
    assert "'bad' failed to load on 2 of 2 ready replicas (p1: " + ERROR in cond["message"]
    assert "the other adapters serve" in cond["message"]


def test_pods_from_before_an_adapter_was_added_and_pods_that_do_not_answer():
    entries, cond = adapter_status(spec("sql", "new"), {"old": {"sql": ""}, "fresh": {"sql": "", "new": ""}}, 2)
    assert entries == [{"name": "sql", "readyReplicas": 2}, {"name": "new", "readyReplicas": 1}]
    assert (cond["status"], cond["reason"]) == ("False", "AdapterNotServed")
    assert cond["message"] == "'new' is served by 1 of 2 ready replicas"
    entries, cond = adapter_status(spec("sql"), {"p1": {"sql": ""}, "p2": "GET http://10.0.0.2:8000/metrics: timed out"}, 2)
    assert entries == [{"name": "sql", "readyReplicas": 1}]
    assert (cond["status"], cond["reason"]) == ("Unknown", "EngineUnreachable") and "p2: GET" in cond["message"]
    entries, cond = adapter_status(spec("sql"), {}, 2)
    assert entries == [{"name": "sql", "readyReplicas": 0}] and cond["reason"] == "NoReadyEngines"


@pytest.fixture
def engine_pages():
    """A loopback HTTP server standing in for engine pods' /metrics: {port: page}; counts the GETs."""
    pages, hits = {}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = pages["page"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], pages, hits
    server.shutdown()


def pod(name: str, port: int, ready: bool = True, restarts: int = 0, uid: str | None = None) -> dict:
    return {"metadata": {"name": name, "uid": uid or f"uid-{name}"},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "engine", "restartCount": restarts}]}}


def test_each_ready_pod_is_read_once_per_engine_start(engine_pages):
    port, pages, hits = engine_pages
    pages["page"] = engine_page({"sql": ""})
    reports = AdapterReports()
    owner = ("ns", "m")
    assert metrics_url(pod("a", port)) == f"http://127.0.0.1:{port}/metrics"
    assert reports.read(owner, [pod("a", port), pod("b", port, ready=False)]) == {"a": {"sql": ""}}
    pages["page"] = engine_page({"sql": "", "bad": ERROR})
    assert reports.read(owner, [pod("a", port)]) == {"a": {"sql": ""}}  # not read again
    assert hits == ["/metrics"]
    assert reports.read(owner, [pod("a", port, restarts=1)]) == {"a": {"sql": "", "bad": ERROR}}  # a new engine
    assert len(hits) == 2
    unreachable = reports.read(owner, [pod("c", 1)])  # nothing listens on port 1
    assert isinstance(unreachable["c"], str) and unreachable["c"].startswith("GET http://127.0.0.1:1/metrics: ")
