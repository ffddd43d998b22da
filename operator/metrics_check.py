"""The MetricsAvailable condition: does KEDA's Prometheus answer the ScaledObject's query, from real series?

The query itself always yields a number (each side ends in `or vector(0)`, so that zero replicas read as 0), so a
wrong address or a Prometheus that never scrapes the engines would silently autoscale on a constant 0. The operator
therefore runs the exact query (it must answer) and then checks that the series behind it exist: the activator's
pending count whenever the deployment scales to zero (it is always exported), and the engines' waiting count
whenever an engine is ready.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from pagekube.operator.autoscaling import activator_pending_series, queue_depth_query, waiting_series
from pagekube.operator.spec import LLMDeploymentSpec

TIMEOUT_SECONDS = 3.0  # per query: a pass must not stall on an address that drops packets


@dataclass(frozen=True)
class MetricsCheck:
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


class QueryError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def instant_query(address: str, query: str, timeout: float = TIMEOUT_SECONDS) -> list[dict]:
    """The result vector of a Prometheus instant query; QueryError(PrometheusUnreachable | QueryFailed)."""
    url = f"{address.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # Prometheus says why in JSON (bad query: 400, errorType "bad_data")
        try:
            detail = json.load(e).get("error", "")
        except ValueError:
            detail = ""
        raise QueryError("QueryFailed", f"{address} answered HTTP {e.code} to {query!r}: {detail or e.reason}") from e
    except (OSError, ValueError) as e:  # refused, unresolvable, timed out; or not JSON (not a Prometheus)
        kind = "QueryFailed" if isinstance(e, ValueError) else "PrometheusUnreachable"
        raise QueryError(kind, f"GET {address}/api/v1/query: {getattr(e, 'reason', e)}") from e
    if body.get("status") != "success":
        raise QueryError("QueryFailed", f"{address} could not run {query!r}: {body.get('error', body)}")
    return body["data"]["result"]


def check_metrics(name: str, namespace: str, spec: LLMDeploymentSpec, ready_engines: int) -> MetricsCheck:
    address = spec.autoscaling.prometheus_address
    needed = []
    if spec.autoscaling.scales_to_zero:
        needed.append(activator_pending_series(name, namespace))
    if ready_engines > 0:
        needed.append(waiting_series(name, namespace))
    try:
        instant_query(address, queue_depth_query(name, namespace, spec))
        missing = [series for series in needed if not instant_query(address, f"count({series})")]
    except QueryError as e:
        return MetricsCheck("False", e.reason, str(e))
    if missing:
        return MetricsCheck("False", "NoSeries", f"{address} has no series {', '.join(missing)}: is it scraping "
                                                 "them (ServiceMonitor or scrape annotations)?")
    if not needed:
        return MetricsCheck("Unknown", "NoReadyEngines", f"{address} answers the query; no engine is ready yet to "
                                                         "export vllm:num_requests_waiting")
    return MetricsCheck("True", "SeriesFound", f"{address} answers the ScaledObject query from {', '.join(needed)}")
