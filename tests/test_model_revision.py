"""hf:// models pinned to one commit (operator/model_revision.py): the download step against a stand-in Hugging Face
Hub on loopback (the real one cannot be reached from here) resolves the revision and reports the commit; the operator's
pure functions turn a reported commit into a pin, the pin into what later pods download, and status.model."""

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagekube.operator.engine_deployment import HF_DOWNLOAD, build_engine_deployment
from pagekube.operator.model_revision import model_status, pinned_commit, pinned_spec, reported_commit
from pagekube.operator.spec import LLMDeploymentSpec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 64}


class StandInHub(BaseHTTPRequestHandler):
    """The Hub endpoints huggingface_hub's model_info and snapshot_download call: the repo's commit for a revision,
    its file tree, and each file at that commit."""

    requests: list[str] = []

    def do_GET(self):
        path = self.path.split("?")[0]
        self.requests.append(f"{self.command} {path}")
        if path.startswith("/api/models/org/repo/tree/"):
            tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()} for f, d in FILES.items()]
            return self._send(200, json.dumps(tree).encode())
        if path.startswith("/api/models/org/repo"):
            return self._send(200, json.dumps({"id": "org/repo", "sha": COMMIT, "siblings": [{"rfilename": f} for f in FILES]}).encode())
        prefix = f"/org/repo/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix):] in FILES:
            data = FILES[path[len(prefix):]]
            return self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
        self._send(404, b"{}")

    do_HEAD = do_GET

    def _send(self, code: int, body: bytes, headers: dict | None = None):
        self.send_response(code)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    StandInHub.requests = []
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def spec_of(**model) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate({"model": {"name": "m", "source": "hf://org/repo", **model}})


def test_the_download_step_fetches_the_commit_its_revision_names_and_reports_it(hub, tmp_path):
    target, report = tmp_path / "model", tmp_path / "termination-log"
    env = {"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", HF_DOWNLOAD, "org/repo", "", str(target), str(report)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert report.read_text() == COMMIT and f"at {COMMIT}" in out.stdout
    assert {f: (target / f).read_bytes() for f in FILES} == FILES
    # Every file was asked for at the commit the revision resolved to, never at a moving branch.
    assert all(f"/resolve/{COMMIT}/" in r for r in StandInHub.requests if "/resolve/" in r), StandInHub.requests


def pod(source="org/repo", requested="", exit_code=0, message=COMMIT) -> dict:
    return {"spec": {"initContainers": [{"name": "model-download", "command": ["python", "-c", "...", source, requested, "/models/model"]}]},
            "status": {"initContainerStatuses": [{"name": "model-download", "state": {"terminated": {
                "exitCode": exit_code, "message": message}}}]}}


def test_a_commit_counts_only_from_a_finished_download_of_this_source_and_revision():
    spec = spec_of()
    assert reported_commit([pod()], spec) == COMMIT
    assert reported_commit([pod(exit_code=1)], spec) is None
    assert reported_commit([pod(message="Completed")], spec) is None
    assert reported_commit([pod(source="org/other")], spec) is None  # a pod of the spec before the last change
    assert reported_commit([pod(requested="v2")], spec) is None
    assert reported_commit([pod(requested="v2")], spec_of(revision="v2")) == COMMIT


def test_the_pin_comes_from_status_first_then_from_a_pod_and_resets_with_the_source():
    spec = spec_of()
    recorded = {"model": {"source": "hf://org/repo", "revision": OTHER}}
    assert pinned_commit(spec, recorded, [pod()]) == OTHER  # recorded once, kept
    assert pinned_commit(spec, None, [pod()]) == COMMIT
    assert pinned_commit(spec, {"model": {"source": "hf://org/old", "revision": OTHER}}, [pod()]) == COMMIT
    assert pinned_commit(spec_of(revision="v2"), recorded, [pod()]) is None  # asked for another revision: none yet
    assert pinned_commit(spec_of(revision=OTHER), None, [pod()]) is None  # the spec pins a commit itself
    assert pinned_commit(LLMDeploymentSpec.model_validate({"model": {"name": "m", "source": "pvc://c/m"}}), None, []) is None


def test_later_pods_download_the_pinned_commit_into_its_own_cache_folder():
    spec = spec_of(cache={"enabled": True, "size": "1Gi"})
    before = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]["initContainers"][0]["command"]
    after = build_engine_deployment("m", "ns", pinned_spec(spec, COMMIT))["spec"]["template"]["spec"]
    assert before[-3:] == ["org/repo", "", "/models/main"]
    assert after["initContainers"][0]["command"][-3:] == ["org/repo", COMMIT, f"/models/{COMMIT}"]
    assert after["containers"][0]["args"][0] == f"/models/{COMMIT}"
    assert pinned_spec(spec, None) is spec


def test_status_names_the_source_the_requested_revision_and_the_commit():
    # None: the key goes (status is written as a merge patch, so a commit of an older source must be removed)
    assert model_status(spec_of(), None) == {"source": "hf://org/repo", "requested": None, "revision": None}
    assert model_status(spec_of(), COMMIT) == {"source": "hf://org/repo", "requested": None, "revision": COMMIT}
    assert model_status(spec_of(revision="v2"), COMMIT) == {"source": "hf://org/repo", "requested": "v2", "revision": COMMIT}
    assert model_status(spec_of(revision=OTHER), None)["revision"] == OTHER


def test_a_removed_commit_is_not_a_change_once_the_status_has_dropped_it():
    from pagekube.operator.status import status_changed

    new = {"model": model_status(spec_of(), None)}
    assert status_changed(new, {"model": {"source": "hf://org/repo", "revision": OTHER}})
    assert not status_changed(new, {"model": {"source": "hf://org/repo"}})
