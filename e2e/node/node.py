"""A real single-node Kubernetes, inside a network namespace of its own.

containerd (Debian's) + runc + the CNI bridge plugins, etcd, kube-apiserver, kube-controller-manager (every
controller), kube-scheduler, kubelet, kube-proxy (iptables) and CoreDNS, all from the caches that
e2e/controlplane/build.sh, e2e/node/build.sh and e2e/node/images.sh fill. Images come from local tarballs
imported into containerd: nothing is pulled.

Every component runs in the network namespace NETNS, joined to the host by one veth pair (HOST_IP <-> NODE_IP), so
the pod and Service CIDRs, the cni0 bridge and every iptables rule kube-proxy and the kubelet write exist only in
there; stopping deletes the namespace with all of it. Tests reach the API server at NODE_IP and run clients inside
the namespace (`in_netns`) to reach Service ClusterIPs through kube-proxy's rules.

Traps this machine has (found by ../shared/realnode-recipe): cgroup v1 (kubelet needs failCgroupV1: false), no
CAP_SYS_RESOURCE (containerd's restrict_oom_score_adj), no pause image (e2e/node/pause), kube-proxy must not set
conntrack limits (maxPerCore: 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e.cluster import stop_process_group
from tests.k8s_tools import REPO, helm, kubectl, tool_paths

NETNS = "pagekube-node"
HOST_IP, NODE_IP = "10.77.0.1", "10.77.0.2"
POD_CIDR, SERVICE_CIDR, DNS_IP = "10.244.0.0/24", "10.96.0.0/16", "10.96.0.10"
ADMIN_TOKEN = "pagekube-node-admin-token"
CNI_BIN = "/usr/lib/cni"
# Static tokens: who each component is. The kubelet is system:node:<name> so the Node authorizer applies to it.
TOKENS = {"admin": ("admin", "system:masters"), "proxy": ("system:kube-proxy", ""),
          "scheduler": ("system:kube-scheduler", ""), "controller-manager": ("admin", "system:masters")}


def _run(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def in_netns(*args: str) -> list[str]:
    """A command line that runs inside the node's network namespace (where ClusterIPs and pod IPs route).
    nsenter, not `ip netns exec`: that one also gives the command a mount namespace of its own, and the kubelet's
    volume mounts must be the ones containerd sees."""
    return ["nsenter", f"--net=/run/netns/{NETNS}", *args]


def node_tools() -> dict[str, Path]:
    """Binaries and image tarballs from the caches (images.sh builds them once per machine, and build.sh's
    binaries before them, and prints where all of them are)."""
    out = _run(str(REPO / "e2e/node/images.sh"), timeout=3600).stdout
    return {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}


def _certificates(d: Path, node_name: str) -> None:
    """One CA for serving and KEDA's mutual TLS, and the front-proxy CA the API server's aggregation layer uses to
    call KEDA's metrics adapter."""
    def openssl(*args):
        _run("openssl", *args, cwd=d)

    def sign(name: str, ca: str, subject: str, san: str = "") -> None:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", subject)
        ext = f"subjectAltName={san}\n" if san else ""
        (d / f"{name}.ext").write_text(ext + "extendedKeyUsage=serverAuth,clientAuth\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")

    for ca in ("ca", "front-proxy-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                "-days", "2", "-subj", f"/CN=pagekube-node-{ca}")
    sign("apiserver", "ca", "/CN=kube-apiserver",
         f"IP:{NODE_IP},IP:10.96.0.1,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
         "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    sign("kubelet", "ca", "/CN=kubelet", f"IP:{NODE_IP},DNS:{node_name}")
    sign("keda", "ca", "/CN=keda", f"IP:127.0.0.1,IP:{NODE_IP},DNS:localhost,"
         "DNS:keda-operator.keda.svc.cluster.local,DNS:keda-metrics-apiserver.keda.svc")
    sign("front-proxy-client", "front-proxy-ca", "/CN=front-proxy-client")
    openssl("genrsa", "-out", "sa.key", "2048")
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
    keda = d / "keda-certs"  # the layout KEDA's operator and adapter read (--cert-dir)
    keda.mkdir()
    for src, dst in (("ca.crt", "ca.crt"), ("keda.crt", "tls.crt"), ("keda.key", "tls.key")):
        (keda / dst).write_bytes((d / src).read_bytes())


CONTAINERD_CONFIG = """version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:1"
  disable_apparmor = true
  restrict_oom_score_adj = true  # root here lacks CAP_SYS_RESOURCE: sandboxes could not set oom_score_adj -998
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""

# The cluster has no outside world: CoreDNS answers cluster.local and nothing else (no `forward`).
COREDNS = """apiVersion: v1
kind: ServiceAccount
metadata: {{name: coredns, namespace: kube-system}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: "system:coredns"}}
rules:
- {{apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}}
- {{apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: "system:coredns"}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}}
subjects: [{{kind: ServiceAccount, name: coredns, namespace: kube-system}}]
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: coredns, namespace: kube-system}}
data:
  Corefile: |
    .:53 {{
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {{
           pods insecure
        }}
        cache 5
    }}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: coredns, namespace: kube-system, labels: {{k8s-app: kube-dns}}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{k8s-app: kube-dns}}}}
  template:
    metadata: {{labels: {{k8s-app: kube-dns}}}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      containers:
      - name: coredns
        image: {image}
        imagePullPolicy: Never
        args: ["-conf", "/etc/coredns/Corefile"]
        volumeMounts: [{{name: config, mountPath: /etc/coredns, readOnly: true}}]
        ports:
        - {{containerPort: 53, name: dns, protocol: UDP}}
        - {{containerPort: 53, name: dns-tcp, protocol: TCP}}
        securityContext: {{capabilities: {{add: [NET_BIND_SERVICE]}}}}
        readinessProbe: {{httpGet: {{path: /ready, port: 8181}}, periodSeconds: 2}}
      volumes: [{{name: config, configMap: {{name: coredns}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: kube-dns, namespace: kube-system, labels: {{k8s-app: kube-dns}}}}
spec:
  selector: {{k8s-app: kube-dns}}
  clusterIP: {dns_ip}
  ports:
  - {{name: dns, port: 53, protocol: UDP}}
  - {{name: dns-tcp, port: 53, protocol: TCP}}
"""


@dataclass
class Node:
    workdir: Path
    name: str = "pagekube-node"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    tools: dict[str, Path] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    @property
    def containerd_sock(self) -> Path:
        return self.workdir / "containerd.sock"

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run([kubectl(), *args], env=self.env, capture_output=True, text=True, input=input,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr}")
        return r

    def helm(self, *args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([helm(), *args], env=self.env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr}")
        return r

    def diagnostics(self) -> str:
        """What a person would look at first when something on the node did not come up."""
        out = [self.kubectl("get", "pods,deployments,services", "-A", "-o", "wide", check=False).stdout,
               self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
        pods = self.kubectl("get", "pods", "-A", "-o", "jsonpath={range .items[*]}{.metadata.namespace}/"
                            "{.metadata.name} {end}", check=False).stdout.split()
        for pod in pods:
            ns, name = pod.split("/")
            logs = self.kubectl("logs", "-n", ns, name, "--all-containers", "--tail=10", check=False)
            out.append(f"--- {pod}\n{(logs.stdout + logs.stderr)[-2500:]}")
        for name, p in self.procs.items():  # a node process (KEDA, Prometheus, the kubelet) that exited early
            if p.poll() is not None:
                out.append(f"--- {name} exited with {p.returncode}\n{(self.workdir / f'{name}.log').read_text()[-2500:]}")
        return "\n".join(out)

    def spawn(self, name: str, args: list[str], env: dict | None = None, cluster_dns: bool = False) -> None:
        """Start a node process inside the network namespace; stop() ends it. With cluster_dns it resolves Service
        names as a pod does (CoreDNS, the pod search path), from a mount namespace of its own whose
        /etc/resolv.conf says so: the kubelet and CoreDNS keep the host's."""
        if cluster_dns:
            resolv = self.workdir / "cluster-resolv.conf"
            resolv.write_text(f"nameserver {DNS_IP}\nsearch default.svc.cluster.local svc.cluster.local "
                              "cluster.local\noptions ndots:5\n")
            args = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv), *args]
        log = open(self.workdir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(in_netns(*args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def wait(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.workdir / f'{name}.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready in {timeout} s")
            time.sleep(0.3)

    def _network(self) -> None:
        self._remove_network()
        _run("ip", "netns", "add", NETNS)
        _run("ip", "link", "add", "pk-host", "type", "veth", "peer", "name", "pk-node")
        _run("ip", "link", "set", "pk-node", "netns", NETNS)
        _run("ip", "addr", "add", f"{HOST_IP}/30", "dev", "pk-host")
        _run("ip", "link", "set", "pk-host", "up")
        for cmd in (["ip", "addr", "add", f"{NODE_IP}/30", "dev", "pk-node"], ["ip", "link", "set", "pk-node", "up"],
                    ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", HOST_IP],
                    ["sysctl", "-qw", "net.ipv4.ip_forward=1"]):
            _run(*in_netns(*cmd))
        # br_netfilter's switch is per namespace: Service traffic between pods on one bridge goes through iptables
        _run(*in_netns("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"), check=False)

    @staticmethod
    def _remove_network() -> None:
        _run("ip", "netns", "del", NETNS, check=False)  # takes cni0, the pods' veths and every rule inside with it
        _run("ip", "link", "del", "pk-host", check=False)

    def _containerd(self) -> None:
        cache = self.tools["PAGEKUBE_NODE_IMAGES"].parent
        root = cache / "containerd"  # images persist across runs: a 4 GB import happens once per image build
        (self.workdir / "cni").mkdir()
        (self.workdir / "cni/10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "pagekube", "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.workdir / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
                {"type": "loopback"}]}))
        (self.workdir / "containerd.toml").write_text(CONTAINERD_CONFIG.format(
            root=root, state=self.workdir / "containerd-state", sock=self.containerd_sock, cni_bin=CNI_BIN,
            cni_conf=self.workdir / "cni"))
        self.spawn("containerd", ["containerd", "--config", str(self.workdir / "containerd.toml")])
        self.wait("containerd", lambda: _run(*self.ctr("version"), check=False).returncode == 0, 30)

    def ctr(self, *args: str) -> list[str]:
        return ["ctr", "-a", str(self.containerd_sock), "-n", "k8s.io", *args]

    def _import_images(self) -> None:
        """Import each tarball that changed since its last import (a stamp per image in the images folder)."""
        images = self.tools["PAGEKUBE_NODE_IMAGES"]
        for tar in sorted(images.glob("*.tar")):
            stamp = images / f"{tar.stem}.imported"
            if stamp.exists() and stamp.stat().st_mtime >= tar.stat().st_mtime:
                continue
            _run(*self.ctr("images", "import", "--no-unpack", str(tar)), timeout=900)
            stamp.touch()
        self._prune_replaced_images()

    def _prune_replaced_images(self) -> None:
        """An image rebuilt under the same tag leaves the old one behind (the CRI also names every image by its ID),
        5 GB per engine build: remove each name whose image no tag points at any more; containerd's GC frees it."""
        rows = [line.split()[:3] for line in _run(*self.ctr("images", "ls")).stdout.splitlines()[1:]]
        tagged = {digest for ref, _, digest in rows if not ref.startswith("sha256:") and "@" not in ref}
        stale = [ref for ref, _, digest in rows if digest not in tagged]
        if stale:
            _run(*self.ctr("images", "rm", "--sync", *stale), timeout=300)

    def _kubeconfig(self, path: Path, token: str) -> None:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "node", "cluster": {"server": f"https://{NODE_IP}:6443",
                                                      "certificate-authority": str(self.workdir / "ca.crt")}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "node", "context": {"cluster": "node", "user": "u", "namespace": "default"}}]}))

    def _control_plane(self) -> None:
        d, bins = self.workdir, self.tools["PAGEKUBE_CONTROLPLANE_BIN"]
        tokens = {**TOKENS, "kubelet": (f"system:node:{self.name}", "system:nodes")}
        (d / "tokens.csv").write_text("".join(f'{who}-token,{user},{who}-uid,"{group}"\n'
                                              for who, (user, group) in tokens.items()))
        for who in tokens:
            self._kubeconfig(d / f"{who}.kubeconfig", f"{who}-token")
        self.spawn("etcd", [str(bins / "etcd"), "--data-dir", str(d / "etcd"), "--unsafe-no-fsync",
                             "--listen-client-urls", "http://127.0.0.1:2379",
                             "--advertise-client-urls", "http://127.0.0.1:2379",
                             "--listen-peer-urls", "http://127.0.0.1:2380", "--log-level", "warn"])
        self.spawn("kube-apiserver", [
            str(bins / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379", "--bind-address=0.0.0.0",
            f"--advertise-address={NODE_IP}", "--secure-port=6443",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}", f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            # the aggregation layer, for KEDA's external metrics API
            f"--requestheader-client-ca-file={d / 'front-proxy-ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={d / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={d / 'front-proxy-client.key'}", "--enable-aggregator-routing=true"])
        self.wait("kube-apiserver", lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, 120)
        self.spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"), f"--kubeconfig={d / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={d / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={d / 'controller-manager.kubeconfig'}",
            f"--service-account-private-key-file={d / 'sa.key'}", f"--root-ca-file={d / 'ca.crt'}",
            "--use-service-account-credentials=false", "--leader-elect=false", "--bind-address=127.0.0.1",
            "--secure-port=10257", "--concurrent-gc-syncs=5"])
        self.spawn("kube-scheduler", [
            str(self.tools["PAGEKUBE_NODE_BIN"] / "kube-scheduler"), f"--kubeconfig={d / 'scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={d / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={d / 'scheduler.kubeconfig'}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=10259"])

    def _kubelet_and_proxy(self) -> None:
        d, bins = self.workdir, self.tools["PAGEKUBE_NODE_BIN"]
        (d / "kubelet.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # The node lives in a namespace only this machine reaches: the kubelet API needs no auth here
            # (kubectl logs/exec go through the API server to it).
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "tlsCertFile": str(d / "kubelet.crt"), "tlsPrivateKeyFile": str(d / "kubelet.key"),
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "clusterDNS": [DNS_IP], "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(d / "pod-logs"), "serializeImagePulls": False,
            "evictionHard": {"memory.available": "200Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "syncFrequency": "5s", "fileCheckFrequency": "5s"}))
        self.spawn("kubelet", [str(bins / "kubelet"), f"--config={d / 'kubelet.yaml'}",
                                f"--kubeconfig={d / 'kubelet.kubeconfig'}", f"--root-dir={d / 'kubelet'}",
                                f"--hostname-override={self.name}", f"--node-ip={NODE_IP}", "--v=1"])
        (d / "proxy.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(d / "proxy.kubeconfig")}, "mode": "iptables",
            "clusterCIDR": POD_CIDR, "hostnameOverride": self.name, "bindAddress": "0.0.0.0",
            "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
            # the namespace shares the host's conntrack table: leave its global limits alone
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}}))
        self.spawn("kube-proxy", [str(bins / "kube-proxy"), f"--config={d / 'proxy.yaml'}"])

    def _node_ready(self) -> bool:
        r = self.kubectl("get", "node", self.name, "-o",
                         "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
        return r.stdout.strip() == "True"

    def start(self) -> Node:
        t0 = time.monotonic()
        self.tools = {**tool_paths(), **node_tools()}
        self.timings["build"] = time.monotonic() - t0
        self.workdir.mkdir(parents=True, exist_ok=True)
        _certificates(self.workdir, self.name)
        self._network()
        t1 = time.monotonic()
        self._containerd()
        self._import_images()
        self.timings["images"] = time.monotonic() - t1
        t2 = time.monotonic()
        self._control_plane()
        self._kubelet_and_proxy()
        self.wait("node", self._node_ready, 120)
        coredns = COREDNS.format(image=f"localhost/coredns:{self.tools['PAGEKUBE_NODE_BIN'].name.split('coredns-')[1]}",
                                 dns_ip=DNS_IP)
        self.kubectl("apply", "-f", "-", input=coredns)
        self.kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=120s")
        self.wait("default ServiceAccount",
                  lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0, 60)
        self.timings["cluster"] = time.monotonic() - t2
        return self

    def stop(self) -> None:
        """Pods first (the kubelet tears down their networks and mounts), then every process by PID, then what is
        left on the host: mounts under the work folder and containerd's root, and the network namespace."""
        if "kubelet" in self.procs and self.procs["kubelet"].poll() is None:
            self.kubectl("delete", "pods", "--all", "-A", "--grace-period=1", "--timeout=60s", check=False,
                         timeout=90)
        for name in ("kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"):
            if name in self.procs:
                stop_process_group(self.procs[name])
        if "containerd" in self.procs:
            for task in _run(*self.ctr("tasks", "ls", "-q"), check=False).stdout.split():
                _run(*self.ctr("tasks", "kill", "-s", "SIGKILL", task), check=False)
            time.sleep(1)
            for task in _run(*self.ctr("tasks", "ls", "-q"), check=False).stdout.split():
                _run(*self.ctr("tasks", "rm", "-f", task), check=False)
            for c in _run(*self.ctr("containers", "ls", "-q"), check=False).stdout.split():
                _run(*self.ctr("containers", "rm", c), check=False)
        for name in reversed(list(self.procs)):
            stop_process_group(self.procs[name])
        roots = [str(self.workdir)]
        if "PAGEKUBE_NODE_IMAGES" in self.tools:
            roots.append(str(self.tools["PAGEKUBE_NODE_IMAGES"].parent / "containerd"))
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if any(m.startswith(r) for r in roots)), reverse=True):
            _run("umount", "-l", m, check=False)
        for ns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
            if ns.startswith("cni-"):  # the pods' namespaces, if the kubelet could not remove them
                _run("ip", "netns", "del", ns.split()[0], check=False)
        self._remove_network()
