"""The engine's Services: a ClusterIP one for clients, and a headless one the load balancer resolves to pod IPs."""

from __future__ import annotations

from pagekube.operator import naming


def _service(name: str, namespace: str, service_name: str, headless: bool) -> dict:
    # The headless Service gets its own component label so the ServiceMonitor (which selects the ClusterIP one)
    # does not scrape every pod twice.
    spec: dict = {
        "selector": naming.selector(name, "engine"),
        "ports": [{"name": "http", "port": naming.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec["clusterIP"] = "None"
    else:
        spec["type"] = "ClusterIP"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(service_name, namespace, name, "engine-pods" if headless else "engine"),
        "spec": spec,
    }


def build_engine_service(name: str, namespace: str) -> dict:
    return _service(name, namespace, naming.engine_name(name), headless=False)


def build_headless_service(name: str, namespace: str) -> dict:
    return _service(name, namespace, naming.headless_name(name), headless=True)


def cluster_ip_service(name: str, namespace: str, object_name: str, component: str, port: int) -> dict:
    """A ClusterIP Service over one component's pods, `port` -> their port named http (LB, activator)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(object_name, namespace, name, component),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector(name, component),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
