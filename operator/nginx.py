"""The NGINX load balancer in front of the engine pods: its config, ConfigMap, Deployment and Service.

least_conn suits LLM traffic (requests last seconds to minutes, so open connections measure load). PrefixHash
sends requests that share a prompt prefix to one replica, whose prefix cache then serves it: an njs router
(prefix_route.js) makes the key, `hash ... consistent` picks the replica, `max_conns` bounds its load. Streaming
needs proxy_buffering off. A generation is never replayed: nginx retries failures to connect, and requests an
engine refused with 503 before starting them (draining, loading); a POST that reached an engine and then failed
is not passed on.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from importlib import resources

from pagekube.operator import naming
from pagekube.operator.availability import topology_spread
from pagekube.operator.placement import request_path_placement
from pagekube.operator.pod_security import container_security_context, pod_security_context
from pagekube.operator.services import cluster_ip_service
from pagekube.operator.spec import LLMDeploymentSpec

CONFIG_KEY = "nginx.conf"
SCRIPT_KEY = "prefix_route.js"  # PrefixHash's router, beside the config
NJS_MODULE = "/usr/lib/nginx/modules/ngx_http_js_module.so"  # in the official nginx images and Debian's libnginx-mod-http-js
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
                      listen: str = str(naming.LB_PORT), backups: list[str] = (), script_dir: str = CONFIG_DIR) -> str:
    """nginx.conf for these upstream addresses (host:port). Host names are re-resolved (`resolve`, nginx >= 1.27.3).
    `backups` (the activator) get requests only while no engine can take them: none resolved, or all refusing
    connections (scaled to zero, all restarting). `script_dir` holds prefix_route.js (PrefixHash).

    Paths are relative to nginx's prefix (`-p`, a writable folder), so the file runs as is under a non-root user.
    """
    lb = spec.load_balancer
    prefix_hash = lb.strategy == "PrefixHash"
    needs_dns = any(not _is_ip(u) for u in [*upstreams, *backups])

    def server(address: str, extra: str) -> str:
        return f"        server {address}{'' if _is_ip(address) else ' resolve'}{extra};"

    def upstream(name: str, balancing: str, servers: list[str]) -> str:
        return f"""    upstream {name} {{
        zone {name} 256k;
        {balancing};
{chr(10).join(servers)}
        keepalive 128;
        keepalive_timeout 60s;  # below the engine's 75 s, so nginx closes idle connections first
    }}
"""

    engines = [server(u, " max_fails=1 fail_timeout=5s") for u in upstreams]
    upstreams_conf = upstream("engine", "least_conn", [*engines, *(server(b, " backup") for b in backups)])
    if prefix_hash:
        # max_conns: at its bound a replica is skipped and the key goes to the next one on the ring.
        bound = f" max_conns={max_connections_per_replica(spec)}"
        upstreams_conf += "\n" + upstream("engine_prefix", "hash $pagekube_route_key consistent",
                                          [server(u, " max_fails=1 fail_timeout=5s" + bound) for u in upstreams])
    resolver_line = f"    resolver {resolver};\n" if needs_dns else ""
    proxy = f"""            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Request-ID $request_id;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_cache off;
            proxy_connect_timeout 5s;
            proxy_send_timeout {lb.read_timeout_seconds}s;
            proxy_read_timeout {lb.read_timeout_seconds}s;"""
    retries = """
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;"""
    # The engine answered 503 (draining, loading, stopped) before starting the request, as a pod whose endpoint
    # removal has not reached us yet does: pass it on. Should the retry land on a refusing engine too, that 503
    # counts as its failure (max_fails), so the next try and the next 5 s go elsewhere. Not with the activator as
    # backup: its own 503 (no engine woke in time) is the answer, and must reach the client as it is.
    refused = "" if backups else f"""
        location @refused {{
            proxy_pass http://engine;
{proxy}
            proxy_next_upstream http_503 non_idempotent;
            proxy_next_upstream_tries 3;
        }}
"""
    intercept_503 = "" if backups else """
            proxy_intercept_errors on;  # only codes with an error_page: 503
            error_page 503 = @refused;"""
    least = f"""            proxy_pass http://engine;
{proxy}{retries}"""
    if prefix_hash:
        locations = f"""        location / {{
            js_content router.route;  # reads the body, sets $pagekube_route_key: @prefix, or @least without one
        }}

        location @least {{
{least}{intercept_503}
        }}

        location @prefix {{
            proxy_pass http://engine_prefix;
{proxy}{retries}
            proxy_intercept_errors on;  # only codes with an error_page: 502{'' if backups else ', 503'}
            error_page 502 = @spill;{'' if backups else chr(10) + '            error_page 503 = @refused;'}
        }}

        # No engine on the ring took the request: every replica at its bound (nginx's "no live upstreams"), none
        # resolved, or each refused the connection. Least connections takes it (and the activator, at zero
        # replicas). A 502 after the request reached an engine is passed on: a generation is never replayed. (No
        # 503 interception here: an error page's own error pages do not apply, and an engine's 503 keeps its body.)
        location @spill {{
            if ($pagekube_nothing_sent = 0) {{
                return 502;
            }}
{least}
        }}
"""
        js = f"""    js_path "{script_dir}";
    js_import router from prefix_route.js;
    js_var $pagekube_route_key;
    js_var $pagekube_prefix_characters {lb.prefix_hash.prefix_characters};
    map $upstream_bytes_sent $pagekube_nothing_sent {{
        "~^[-0 ,:]*$" 1;  # no engine got a byte of the request: none free, none up, or connections refused
        default 0;
    }}
"""
        # The router reads the body from memory: up to the largest accepted body (allocated per request as needed).
        body_buffer = f"\n        client_body_buffer_size {lb.max_body_size};"
        module = f"load_module {NJS_MODULE};\n"
    else:
        locations = f"""        location / {{
{least}{intercept_503}
        }}
"""
        js = body_buffer = module = ""
    return f"""# Rendered by pagekube-operator. Do not edit: the operator restores it.
{module}worker_processes auto;
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
{resolver_line}{js}
{upstreams_conf}
    server {{
        listen {listen};
        client_max_body_size {lb.max_body_size};{body_buffer}

        location = /nginx-health {{
            access_log off;
            return 200 "ok\\n";
        }}

{locations}{refused}    }}
}}
"""


def max_connections_per_replica(spec: LLMDeploymentSpec) -> int:
    """PrefixHash's bound for one NGINX pod: by default its share of the requests one engine runs at once."""
    lb = spec.load_balancer
    return lb.prefix_hash.max_connections_per_replica or max(1, spec.engine.max_num_seqs // lb.replicas)


@functools.cache  # package data: read once, not on every reconcile pass
def prefix_route_script() -> str:
    return resources.files("pagekube.operator").joinpath(SCRIPT_KEY).read_text()


def build_nginx_configmap(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": naming.metadata(naming.lb_name(name), namespace, name, "load-balancer"),
        "data": nginx_files(name, namespace, spec),
    }


def nginx_files(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, str]:
    """The ConfigMap's files: the config, and PrefixHash's router beside it."""
    files = {CONFIG_KEY: cluster_nginx_conf(name, namespace, spec)}
    if spec.load_balancer.strategy == "PrefixHash":
        files[SCRIPT_KEY] = prefix_route_script()
    return files


def build_nginx_deployment(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict:
    config = "".join(nginx_files(name, namespace, spec).values())
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
