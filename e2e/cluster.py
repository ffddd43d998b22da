"""A real Kubernetes control plane on loopback (envtest-style): etcd + kube-apiserver + kube-controller-manager.

No kubelet and no scheduler: Pods stay Pending; a test that needs a workload "ready" patches its status the way
the kubelet and controllers would, and says so.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e.waiting import wait_established
from tests.k8s_tools import REPO, kubectl, third_party_crd_files, tool_paths
from tests.server_process import free_port, json_log_lines

ADMIN_TOKEN = "pagekube-e2e-admin-token"
# Every request that writes, with its verb and object: the idempotence tests count them.
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection, get, list]
  - level: None
"""


def stop_process_group(p: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM the process group (started with start_new_session), SIGKILL what outlives the grace period."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost signed by it, and the service-account signing key."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=pagekube-e2e-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


@dataclass
class ControlPlane:
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0
    startup_seconds: float = 0.0

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run([kubectl(), *args], env=self.env, capture_output=True, text=True, input=input, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr}")
        return r

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ready(self, timeout: float = 120) -> None:
        ctx = ssl.create_default_context(cafile=str(self.workdir / "ca.crt"))
        req = urllib.request.Request(f"https://127.0.0.1:{self.api_port}/readyz",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.workdir / f'{name}.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("kube-apiserver not ready")

    def start(self) -> ControlPlane:
        start = time.monotonic()
        bins = tool_paths()["PAGEKUBE_CONTROLPLANE_BIN"]
        d = self.workdir
        _certificates(d)
        (d / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')
        (d / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_port, peer_port, self.api_port, kcm_port = free_port(), free_port(), free_port(), free_port()
        self._spawn("etcd", [
            str(bins / "etcd"), "--data-dir", str(d / "etcd"), "--unsafe-no-fsync",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}", "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}", "--log-level", "warn",
        ])
        self._spawn("kube-apiserver", [
            str(bins / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}", f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=false",
            f"--audit-policy-file={d / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
        ])
        self.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {{server: "https://127.0.0.1:{self.api_port}", certificate-authority: "{d / 'ca.crt'}"}}
users:
- name: admin
  user: {{token: "{ADMIN_TOKEN}"}}
contexts:
- name: e2e
  context: {{cluster: e2e, user: admin, namespace: default}}
current-context: e2e
""")
        self._wait_ready()
        self._spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}",
            "--controllers=garbage-collector-controller,deployment-controller,replicaset-controller,"
            "serviceaccount-controller,serviceaccount-token-controller,namespace-controller",
            f"--service-account-private-key-file={d / 'sa.key'}", f"--root-ca-file={d / 'ca.crt'}",
            "--use-service-account-credentials=false", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--concurrent-gc-syncs=5",
        ])
        crds = [REPO / "crds/llmdeployment.yaml", *third_party_crd_files()]
        self.kubectl("apply", "--server-side", *[a for c in crds for a in ("-f", str(c))])
        wait_established(self.kubectl, "crd", "--all")
        # Established comes before the storage behind it answers (a LIST can still get 429 "storage is
        # (re)initializing"): wait until every served kind lists, so the first operator pass sees no retry.
        served = ",".join(f"{c['spec']['names']['plural']}.{c['spec']['group']}"
                          for p in crds for c in yaml.safe_load_all(p.read_text()) if c)
        deadline = time.monotonic() + 60
        while self.kubectl("get", served, "-A", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"custom resources never listed: {served}")
            time.sleep(0.3)
        # Namespace "default" gets its ServiceAccount from the controller; Pods need it before they can be created.
        deadline = time.monotonic() + 60
        while self.kubectl("get", "serviceaccount", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError("default ServiceAccount never appeared")
            time.sleep(0.3)
        self.startup_seconds = time.monotonic() - start
        return self

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            stop_process_group(self.procs[name])

    def requests(self, namespace: str | None = None, verbs: tuple[str, ...] = WRITE_VERBS,
                 exclude_users: tuple[str, ...] = ()) -> list[dict]:
        """Requests in the audit log so far (one entry per request, at ResponseComplete); watches are not logged."""
        events = []
        for e in json_log_lines(self.audit_log):
            ref = e.get("objectRef") or {}
            if e.get("stage") != "ResponseComplete" or (namespace and ref.get("namespace") != namespace):
                continue
            if e.get("verb") not in verbs or e.get("user", {}).get("username") in exclude_users:
                continue
            events.append(e)
        return events

    def writes(self, namespace: str | None = None, exclude_users: tuple[str, ...] = ()) -> list[dict]:
        return self.requests(namespace, WRITE_VERBS, exclude_users)
