"""The operator at fleet scale on a real control plane (etcd + kube-apiserver + kube-controller-manager, loopback).

    python bench/operator_scale.py                 # N = 100, 300, 1000 in 10/10/20 namespaces; docs/bench_operator_scale.*
    python bench/operator_scale.py --smoke         # N = 6 in 2 namespaces, short windows (CI)

For each N, a fresh control plane and `pagekube-operator run` (its defaults: 600 s resync, 4 workers), CPU specs:
  - reconciled: seconds from `kubectl apply` of all N until every status has observedGeneration == generation,
    with the operator's and kube-apiserver's CPU seconds over that time (where the time goes);
  - steady state, nothing changing (the controller-manager paused, so no Deployment status moves): the operator's
    API requests/s from the audit log (watches are not logged: they are the point), its CPU share and RSS;
  - spec change latency: one LLMDeployment's engine.maxNumSeqs changed until its Deployment carries it, with all N
    present, and again 2 s after a tenth of them changed spec (their Deployments rolling out: churn).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402
from e2e.cluster import ControlPlane, stop_process_group  # noqa: E402
from e2e.conftest import start_operator  # noqa: E402

OPERATOR_AGENTS = ("OpenAPI-Generator", "kopf")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def manifests(n: int, namespaces: int, max_num_seqs: int = 256, only: range | None = None) -> str:
    docs = [{"apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment",
             "metadata": {"name": f"m{i}", "namespace": f"ns{i % namespaces}"},
             "spec": {"model": {"name": f"m{i}", "source": "hf://org/model"}, "resources": {"gpu": 0, "cpu": "1"},
                      "engine": {"maxNumSeqs": max_num_seqs}}}
            for i in (only if only is not None else range(n))]
    return yaml.safe_dump_all(docs)


def all_reconciled(cp: ControlPlane, n: int) -> bool:
    items = json.loads(cp.kubectl("get", "llmd", "-A", "-o", "json").stdout)["items"]
    return len(items) == n and all((o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"]
                                   for o in items)


def operator_request_kinds(cp: ControlPlane, since: int) -> dict[str, int]:
    entries = cp.requests(None, ("get", "list", "create", "update", "patch", "delete", "deletecollection"))[since:]
    counts: dict[str, int] = {}
    for e in entries:
        if e.get("userAgent", "").startswith(OPERATOR_AGENTS):
            key = f"{e['verb']} {(e.get('objectRef') or {}).get('resource')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def settle(cp: ControlPlane, quiet: float = 5.0, timeout: float = 300.0) -> float:
    """Seconds until nobody (controller-manager, operator) has written for `quiet` seconds."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        before = len(cp.requests(None, ("create", "update", "patch", "delete")))
        time.sleep(quiet)
        if len(cp.requests(None, ("create", "update", "patch", "delete"))) == before:
            break
    return time.monotonic() - start


def audit_count(cp: ControlPlane) -> int:
    return len(cp.requests(None, ("get", "list", "create", "update", "patch", "delete", "deletecollection")))


def spec_change_latency(cp: ControlPlane, name: str, namespace: str, value: int) -> float:
    from kubernetes import client, config

    config.load_kube_config(str(cp.kubeconfig))
    apps, custom = client.AppsV1Api(), client.CustomObjectsApi()
    start = time.monotonic()
    custom.patch_namespaced_custom_object("serving.pagekube.io", "v1alpha1", namespace, "llmdeployments", name,
                                          {"spec": {"engine": {"maxNumSeqs": value}}})
    while time.monotonic() - start < 120:
        args = apps.read_namespaced_deployment(f"{name}-engine", namespace).spec.template.spec.containers[0].args
        if f"--max-num-seqs={value}" in args or any(a == str(value) for a in args):
            return time.monotonic() - start
        time.sleep(0.02)
    raise TimeoutError(f"{namespace}/{name}: maxNumSeqs {value} not applied in 120 s")


def run(n: int, namespaces: int, steady_seconds: float, workdir: Path) -> dict:
    (workdir / f"cp-{n}").mkdir()
    cp = ControlPlane(workdir / f"cp-{n}")
    cp.start()
    try:
        for i in range(namespaces):
            cp.kubectl("create", "namespace", f"ns{i}")
        op = start_operator(cp.env, workdir / f"operator-{n}.log", "--resync-seconds=600")
        apiserver = cp.procs["kube-apiserver"].pid
        try:
            op_cpu, api_cpu, start = cpu_seconds(op.pid), cpu_seconds(apiserver), time.monotonic()
            cp.kubectl("apply", "--server-side", "-f", "-", input=manifests(n, namespaces))
            while not all_reconciled(cp, n):
                time.sleep(1)
            reconciled = time.monotonic() - start
            reconcile_op_cpu, reconcile_api_cpu = cpu_seconds(op.pid) - op_cpu, cpu_seconds(apiserver) - api_cpu
            # Nothing changing: the controller-manager (still creating pods for the new Deployments, minutes at
            # N=1000, and moving their status) is paused for the window, so only the operator could send anything.
            kcm = cp.procs["kube-controller-manager"].pid
            os.kill(kcm, signal.SIGSTOP)
            try:
                settled = settle(cp, timeout=60)
                since, op_cpu, t0 = audit_count(cp), cpu_seconds(op.pid), time.monotonic()
                time.sleep(steady_seconds)
                window = time.monotonic() - t0
            finally:
                os.kill(kcm, signal.SIGCONT)
            seen = operator_request_kinds(cp, since)
            steady = {"requests_per_s": round(sum(seen.values()) / window, 3), "requests": seen,
                      "settled_after_s": round(settled, 1),
                      "cpu_percent": round(100 * (cpu_seconds(op.pid) - op_cpu) / window, 2),
                      "rss_mb": round(rss_mb(op.pid), 1)}
            quiet = spec_change_latency(cp, "m0", "ns0", 128)
            tenth = range(1, 1 + max(1, n // 10))
            cp.kubectl("apply", "--server-side", "-f", "-", input=manifests(n, namespaces, 200, only=tenth))
            time.sleep(2)  # their passes are done; their Deployments roll out (new ReplicaSets, pods, status events)
            churn = spec_change_latency(cp, "m0", "ns0", 64)
            result = {"n": n, "namespaces": namespaces, "reconciled_s": round(reconciled, 1),
                      "reconcile_cpu_s": {"operator": round(reconcile_op_cpu, 1), "kube_apiserver": round(reconcile_api_cpu, 1)},
                      "steady": steady, "spec_change_s": {"quiet": round(quiet, 3), "churn": round(churn, 3)},
                      "rss_mb_after": round(rss_mb(op.pid), 1)}
            print(json.dumps(result), flush=True)
            return result
        finally:
            stop_process_group(op, grace=15)
    finally:
        cp.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100:10,300:10,1000:20", help="N:namespaces,...")
    ap.add_argument("--steady-seconds", type=float, default=60.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="docs/bench_operator_scale")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.steady_seconds = "6:2", 3.0
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="operator-scale-") as tmp:
        results = [run(n, m, args.steady_seconds, Path(tmp)) for n, m in sizes]
    print("\n| N | namespaces | all reconciled | operator / apiserver CPU while reconciling | steady requests/s | "
          "steady CPU | RSS | spec change (quiet / churn) |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['n']} | {r['namespaces']} | {r['reconciled_s']} s | {r['reconcile_cpu_s']['operator']} s / "
              f"{r['reconcile_cpu_s']['kube_apiserver']} s | {r['steady']['requests_per_s']} | "
              f"{r['steady']['cpu_percent']}% | {r['rss_mb_after']} MB | {r['spec_change_s']['quiet']} s / "
              f"{r['spec_change_s']['churn']} s |")
    if args.smoke:
        return
    Path(args.out + ".json").write_text(json.dumps(results, indent=2) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
        ns = [r["n"] for r in results]
        axes[0].plot(ns, [r["reconciled_s"] for r in results], "o-")
        axes[0].set_title("all reconciled after apply (s)")
        axes[1].plot(ns, [r["rss_mb_after"] for r in results], "o-", color="tab:orange")
        axes[1].set_title("operator RSS (MB)")
        axes[2].plot(ns, [r["spec_change_s"]["quiet"] for r in results], "o-", label="quiet")
        axes[2].plot(ns, [r["spec_change_s"]["churn"] for r in results], "o-", label="a tenth rolling out")
        axes[2].set_title("one spec change applied (s)")
        axes[2].legend()
        for ax in axes:
            ax.set_xlabel("LLMDeployments")
        save(fig, args.out + ".png")


if __name__ == "__main__":
    main()
