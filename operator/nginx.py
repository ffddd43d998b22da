"""The NGINX load balancer in front of the engine pods: its config, ConfigMap, Deployment and Service.

least_conn suits LLM traffic (requests last seconds to minutes, so open connections measure load). Streaming
needs proxy_buffering off. A generation is never replayed: nginx retries failures to connect, and requests an
engine refused with 503 before starting them (draining, loading); a POST that reached an engine and then failed
is not passed on.
"""

from __future__ import annotations

import hashlib
import ipaddress

from pagekube.operator import naming
from pagekube.operator.availability import topology_spread
from pagekube.operator.placement import request_path_placement
from pagekube.operator.pod_security import container_security_context, pod_security_context
from pagekube.operator.services import cluster_ip_service
from pagekube.operator.spec import LLMDeploymentSpec

CONFIG_KEY = "nginx.conf"
NGINX_UID = 101  # the nginx user of the Debian and official images
CONFIG_DIR = "/etc/nginx/pagekube"
NGINX = ["nginx", "-p", "/tmp", "-e", "stderr", "-c", f"{CONFIG_DIR}/{CONFIG_KEY}"]  # the pid file: /tmp/nginx.pid
NGINX_COMMAND = [*NGINX, "-g", "daemon off;"]
# Before the kubelet's SIGTERM (nginx's fast shutdown, which cuts open streams): wait for the endpoint removal to
# reach clients, ask for a graceful quit (QUIT: in-flight requests finish, streams included) with the same prefix
# and config as the server (a bare `nginx -s quit` looks for the image's default pid file and fails), and return
# only when the master has exited, so SIGTERM finds nothing left to cut.
NGINX_PRE_STOP = ["sh", "-c", f"sleep 5; {' '.join(NGINX)} -s quit; while [ -e /tmp/nginx.pid ]; do sleep 1; done"]
# kube-dns is resolved once at start by the system resolver; `valid` bounds how stale the pod list can get.
CLUSTER_RESOLVER = "kube-dns.kube-system.svc.cluster.local valid=5s ipv6=off"


def _is_ip(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def cluster_upstreams(name: str, namespace: str) -> list[str]:
    """The headless Service: its DNS name resolves to every ready engine pod."""
    return [f"{naming.headless_name(name)}.{namespace}.svc.cluster.local:{naming.ENGINE_PORT}"]


def cluster_nginx_conf(name: str, namespace: str, spec: LLMDeploymentSpec) -> str:
    """The config as a cluster gets it: upstream = the headless Service, re-resolved; the activator as backup
    when the deployment scales to zero."""
    backups = [naming.activator_upstream(name, namespace)] if spec.autoscaling.scales_to_zero else []
    return render_nginx_conf(spec, cluster_upstreams(name, namespace), backups=backups)


def render_nginx_conf(spec: LLMDeploymentSpec, upstreams: list[str], resolver: str = CLUSTER_RESOLVER,
                      listen: str = str(naming.LB_PORT), backups: list[str] = ()) -> str:
    """nginx.conf for these upstream addresses (host:port). Host names are re-resolved (`resolve`, nginx >= 1.27.3).
    `backups` (the activator) get requests only while no engine can take them: none resolved, or all refusing
    connections (scaled to zero, all restarting).

    Paths are relative to nginx's prefix (`-p`, a writable folder), so the file runs as is under a non-root user.
    """
    lb = spec.load_balancer
    needs_dns = any(not _is_ip(u) for u in [*upstreams, *backups])

    def server(address: str, extra: str) -> str:
        return f"        server {address}{'' if _is_ip(address) else ' resolve'}{extra};"

    servers = "\n".join([*(server(u, " max_fails=1 fail_timeout=5s") for u in upstreams),
                         *(server(b, " backup") for b in backups)])
    resolver_line = f"    resolver {resolver};\n" if needs_dns else ""
    proxy = f"""            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Request-ID $request_id;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_cache off;
            proxy_connect_timeout 5s;
            proxy_send_timeout {lb.read_timeout_seconds}s;
            proxy_read_timeout {lb.read_timeout_seconds}s;"""
    # The engine answered 503 (draining, loading, stopped) before starting the request, as a pod whose endpoint
    # removal has not reached us yet does: pass it on. Should the retry land on a refusing engine too, that 503
    # counts as its failure (max_fails), so the next try and the next 5 s go elsewhere. Not with the activator as
    # backup: its own 503 (no engine woke in time) is the answer, and must reach the client as it is.
    refusals = "" if backups else f"""
            proxy_intercept_errors on;  # only codes with an error_page: 503
            error_page 503 = @refused;
        }}

        location @refused {{
{proxy}
            proxy_next_upstream http_503 non_idempotent;
            proxy_next_upstream_tries 3;"""
    return f"""# Rendered by pagekube-operator. Do not edit: the operator restores it.
worker_processes auto;
pid nginx.pid;
error_log stderr warn;
events {{
    worker_connections 8192;
}}
http {{
    log_format json escape=json '{{"time":"$time_iso8601","remote":"$remote_addr","request":"$request",'
        '"status":$status,"bytes":$body_bytes_sent,"duration":$request_time,"upstream":"$upstream_addr",'
        '"upstream_status":"$upstream_status","request_id":"$request_id"}}';
    access_log /dev/stdout json;
    client_body_temp_path client_body;
    proxy_temp_path proxy;
    fastcgi_temp_path fastcgi;
    uwsgi_temp_path uwsgi;
    scgi_temp_path scgi;
{resolver_line}
    upstream engine {{
        zone engine 256k;
        least_conn;
{servers}
        keepalive 128;
        keepalive_timeout 60s;  # below the engine's 75 s, so nginx closes idle connections first
    }}

    server {{
        listen {listen};
        client_max_body_size {lb.max_body_size};

        location = /nginx-health {{
            access_log off;
            return 200 "ok\\n";
        }}

        location / {{
{proxy}
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;{refusals}
        }}
    }}
}}
"""


def build_nginx_configmap(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": naming.metadata(naming.lb_name(name), namespace, name, "load-balancer"),
        "data": {CONFIG_KEY: cluster_nginx_conf(name, namespace, spec)},
    }


def build_nginx_deployment(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    config = cluster_nginx_conf(name, namespace, spec)
    lb = spec.load_balancer
    probe = {"httpGet": {"path": "/nginx-health", "port": "http"}, "periodSeconds": 5}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(naming.lb_name(name), namespace, name, "load-balancer"),
        "spec": {
            "replicas": lb.replicas,
            "selector": {"matchLabels": naming.selector(name, "load-balancer")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": naming.labels(name, "load-balancer"),
                    # A config change rolls the pods (nginx reads its config once at start).
                    "annotations": {"serving.pagekube.io/config-hash": hashlib.sha256(config.encode()).hexdigest()[:16]},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "nginx",
                            "image": lb.image,
                            "command": NGINX_COMMAND,
                            "ports": [{"name": "http", "containerPort": naming.LB_PORT, "protocol": "TCP"}],
                            "readinessProbe": probe,
                            "livenessProbe": probe,
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                            "volumeMounts": [
                                {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                            "lifecycle": {"preStop": {"exec": {"command": NGINX_PRE_STOP}}},
                            # nginx writes only under its prefix, /tmp (an emptyDir)
                            "securityContext": container_security_context(read_only_root=True),
                        }
                    ],
                    "securityContext": pod_security_context(NGINX_UID),
                    **request_path_placement(spec),
                    **({"topologySpreadConstraints": spread} if (spread := topology_spread(name, "load-balancer", spec)) else {}),
                    "terminationGracePeriodSeconds": lb.read_timeout_seconds + 10,
                    "volumes": [
                        {"name": "config", "configMap": {"name": naming.lb_name(name)}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def build_nginx_service(name: str, namespace: str) -> dict:
    return cluster_ip_service(name, namespace, naming.lb_name(name), "load-balancer", 80)
