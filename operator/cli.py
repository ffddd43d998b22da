"""`pagekube-operator run` (the kopf controller) and `pagekube-operator render -f FILE` (offline preview)."""

from __future__ import annotations

import argparse
import os
import sys

import yaml
from pydantic import ValidationError

from pagekube.operator import naming
from pagekube.operator.crd import crd_yaml
from pagekube.operator.desired import desired_objects
from pagekube.operator.spec import GROUP, KIND, LLMDeploymentSpec


def render(documents: list[dict], namespace: str = "default") -> list[dict]:
    """The children the operator would create for each LLMDeployment in `documents` (other kinds are skipped).

    ownerReferences are left out: they need the uid the API server assigns; the operator adds them.
    """
    out = []
    for doc in documents:
        if not doc or doc.get("kind") != KIND or not str(doc.get("apiVersion", "")).startswith(f"{GROUP}/"):
            continue
        meta = doc.get("metadata") or {}
        spec = LLMDeploymentSpec.model_validate(doc.get("spec") or {})
        for obj in desired_objects(meta["name"], meta.get("namespace", namespace), "", spec):
            del obj["metadata"]["ownerReferences"]
            out.append(obj)
    return out


def _render(args) -> int:
    with (sys.stdin if args.file == "-" else open(args.file)) as f:
        documents = list(yaml.safe_load_all(f))
    try:
        objects = render(documents, args.namespace)
    except ValidationError as e:
        print(f"error: {args.file}: invalid LLMDeployment spec:\n{e}", file=sys.stderr)
        return 1
    if not objects:
        print(f"error: {args.file}: no {GROUP} {KIND} in it", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=120))
    return 0


def _crd(_args) -> int:
    sys.stdout.write(crd_yaml())
    return 0


def _run(args) -> int:
    os.environ["PAGEKUBE_RESYNC_SECONDS"] = str(args.resync_seconds)  # read when the handlers module loads
    os.environ["PAGEKUBE_WORKERS"] = str(args.workers)
    os.environ["PAGEKUBE_NAMESPACES"] = ",".join(args.namespace or [])
    os.environ["PAGEKUBE_METRICS_BIND_ADDRESS"] = args.metrics_bind_address
    os.environ["PAGEKUBE_LEADER_ELECT"] = "1" if args.leader_elect else "0"
    os.environ["PAGEKUBE_MANAGE_CRD"] = "1" if args.manage_crd else "0"
    os.environ["PAGEKUBE_LEADER_ELECTION_ID"] = args.leader_election_id
    os.environ["PAGEKUBE_LEADER_ELECTION_NAMESPACE"] = args.leader_election_namespace
    import kopf

    from pagekube.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL)
    kopf.run(
        standalone=True,  # kopf only runs the process; replicas coordinate by --leader-elect (a Lease), not peering
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
    )
    return 0


def _activator(args) -> int:
    from pagekube.operator.activator import run_activator

    return run_activator(args.llmdeployment, args.upstream, args.host, args.port, args.max_pending, args.hold_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagekube-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the controller (kopf) against the current kubeconfig or in-cluster")
    run.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable; default: all)")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint")
    run.add_argument("--resync-seconds", type=float, default=600.0,
                     help="period of each resource's resync from the caches (plus up to 10%% jitter)")
    run.add_argument("--workers", type=int, default=4, help="reconcile passes that may run at once")
    run.add_argument("--metrics-bind-address", default="0.0.0.0:8383",
                     help="where /metrics (controller-runtime's names) listens; empty: off")
    run.add_argument("--manage-crd", action="store_true",
                     help="at start, apply this version's CRD where the installed one is older (Helm never upgrades it)")
    run.add_argument("--leader-elect", action="store_true",
                     help="run several replicas, one active: leader election on a coordination.k8s.io Lease")
    run.add_argument("--leader-election-id", default="pagekube-operator", help="the Lease's name")
    run.add_argument("--leader-election-namespace", default="",
                     help="the Lease's namespace (default: the pod's own)")
    run.add_argument("--log-format", choices=["json", "text"], default="json")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(fn=_run)
    ren = sub.add_parser("render", help="print the objects the operator would create for a manifest (offline)")
    ren.add_argument("-f", "--file", required=True, help="LLMDeployment manifest (YAML, multi-document ok; - for stdin)")
    ren.add_argument("-n", "--namespace", default="default", help="namespace for manifests that name none")
    ren.set_defaults(fn=_render)
    crd = sub.add_parser("crd", help="print the LLMDeployment CustomResourceDefinition")
    crd.set_defaults(fn=_crd)
    act = sub.add_parser("activator", help="hold requests while no engine is up (NGINX's backup upstream at zero)")
    act.add_argument("--llmdeployment", required=True, help="the LLMDeployment it serves (the metric's label)")
    act.add_argument("--upstream", action="append", required=True,
                     help="engine host:port to resolve and probe (the headless Service; repeatable)")
    act.add_argument("--host", default="0.0.0.0")
    act.add_argument("--port", type=int, default=naming.ACTIVATOR_PORT)
    act.add_argument("--max-pending", type=int, default=256, help="requests held at once; past it 429")
    act.add_argument("--hold-timeout", type=float, default=300.0, help="seconds a request waits; then 503")
    act.set_defaults(fn=_activator)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
