"""Monitoring objects: a ServiceMonitor for the engine pods and a PrometheusRule with pagekube's alerts.

The same rules also ship as a plain Prometheus rules file (charts/pagekube/files/alerts.yaml, generic over every
LLMDeployment) for clusters without prometheus-operator; `promtool test rules` covers both forms.
"""

from __future__ import annotations

import sys

import yaml

from pagekube.operator import naming
from pagekube.operator.autoscaling import activator_pending_series, pod_selector
from pagekube.operator.spec import AlertThresholds

ANY_ENGINE_POD = 'pod=~".+-engine-[a-z0-9]+-[a-z0-9]+"'  # the generic rules file: every LLMDeployment's engines


def alert_rules(selector: str, t: AlertThresholds, by: str = "namespace") -> list[dict]:
    """Alerting rules over engine pods matched by `selector` (PromQL label matchers), grouped `by` labels."""

    def rule(alert: str, expr: str, duration: str, severity: str, summary: str) -> dict:
        return {
            "alert": alert,
            "expr": expr,
            "for": duration,
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "runbook_url": f"https://pagekube.io/docs/alerts#{alert.lower()}"},
        }

    s = selector
    return [
        rule("PagekubeKVCacheSaturated", f"max by ({by}) (vllm:kv_cache_usage_perc{{{s}}}) > {t.kv_cache_usage}", "5m",
             "warning", "KV cache above {{ $value | humanizePercentage }}: requests queue and get preempted"),
        rule("PagekubeQueueDepthHigh",
             f"sum by ({by}) (vllm:num_requests_waiting{{{s}}}) / count by ({by}) (vllm:num_requests_waiting{{{s}}})"
             f" > {t.queue_depth}", "5m",
             "warning", "{{ $value }} requests waiting per engine replica"),
        rule("PagekubeTTFTHigh",
             f"histogram_quantile(0.99, sum by ({by}, le) (rate(vllm:time_to_first_token_seconds_bucket{{{s}}}[5m])))"
             f" > {t.ttft_p99_seconds}", "10m",
             "warning", "p99 time to first token is {{ $value | humanizeDuration }}"),
        rule("PagekubeErrorRatioHigh",
             f'sum by ({by}) (rate(vllm:request_success_total{{{s},finished_reason="abort"}}[5m]))'
             f" / sum by ({by}) (rate(vllm:request_success_total{{{s}}}[5m])) > {t.error_ratio}", "5m",
             "critical", "{{ $value | humanizePercentage }} of requests end aborted"),
        rule("PagekubeEngineDown", f"up{{{s}}} == 0", "2m", "critical", "engine {{ $labels.pod }} is not answering scrapes"),
        rule("PagekubePreemptionRateHigh",
             f"sum by ({by}) (rate(vllm:num_preemptions_total{{{s}}}[5m])) > {t.preemptions_per_second}", "10m",
             "warning", "{{ $value }} preemptions/s: the KV cache is too small for the load"),
        rule("PagekubeLoRAAdapterNotLoaded", f"pagekube:lora_adapter_loaded{{{s}}} == 0", "5m", "warning",
             "{{ $labels.pod }} could not load LoRA adapter {{ $labels.adapter }}: {{ $labels.error }}"),
    ]


OPERATOR_RECONCILE_ERRORS = 'sum by (namespace, pod) (rate(controller_runtime_reconcile_errors_total{controller="llmdeployment"}[5m])) > 0'


def operator_rules() -> list[dict]:
    """The operator's own alert: passes keep failing (children are not kept in line with their LLMDeployments)."""
    return [{"alert": "PagekubeOperatorReconcileErrors", "expr": OPERATOR_RECONCILE_ERRORS, "for": "15m",
             "labels": {"severity": "warning"},
             "annotations": {"summary": "the pagekube operator {{ $labels.pod }} fails {{ printf \"%.2f\" $value }} "
                                        "reconcile passes/s: see its log for the object and the error",
                             "runbook_url": "https://pagekube.io/docs/alerts#pagekubeoperatorreconcileerrors"}}]


def activator_absent_rule(name: str, namespace: str) -> dict:
    """At zero replicas the activator's pending count is the only signal that wakes KEDA: its absence is an outage
    waiting for the first request (the activator always exports it, 0 when idle)."""
    return {
        "alert": "PagekubeActivatorMetricAbsent",
        "expr": f"absent({activator_pending_series(name, namespace)})",
        "for": "10m",
        "labels": {"severity": "critical"},
        "annotations": {"summary": "no activator pending-count series: requests at zero replicas cannot wake "
                                   "{{ $labels.llmdeployment }}",
                        "runbook_url": "https://pagekube.io/docs/alerts#pagekubeactivatormetricabsent"},
    }


def build_prometheus_rule(name: str, namespace: str, thresholds: AlertThresholds, scales_to_zero: bool = False,
                          alert_for: dict[str, str] | None = None) -> dict:
    """The LLMDeployment's alerts; `alert_for` replaces the pending periods (`for`) of the alerts it names."""
    rules = alert_rules(pod_selector(name, namespace), thresholds)
    if scales_to_zero:
        rules.append(activator_absent_rule(name, namespace))
    for r in rules:
        r["labels"]["llmdeployment"] = name
        r["for"] = (alert_for or {}).get(r["alert"], r["for"])
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": naming.metadata(naming.engine_name(name), namespace, name, "engine"),
        "spec": {"groups": [{"name": f"pagekube.{namespace}.{name}", "rules": rules}]},
    }


def build_service_monitor(name: str, namespace: str, component: str = "engine", path: str = "/metrics") -> dict:
    """Scrape the engines (or, with component="activator", the activator, whose pending count wakes KEDA)."""
    object_name = naming.engine_name(name) if component == "engine" else naming.activator_name(name)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": naming.metadata(object_name, namespace, name, component),
        "spec": {
            "selector": {"matchLabels": {**naming.selector(name, component)}},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": path, "interval": "15s"}],
        },
    }


def generic_rules_file() -> str:
    """The plain Prometheus rules file shipped in the chart: every LLMDeployment's engines, default thresholds."""
    groups = {"groups": [{"name": "pagekube", "rules": alert_rules(ANY_ENGINE_POD, AlertThresholds())},
                         {"name": "pagekube-operator", "rules": operator_rules()}]}
    header = "# Generated by `python -m pagekube.operator.monitoring` (operator/monitoring.py). Do not edit by hand.\n"
    return header + yaml.safe_dump(groups, sort_keys=False, width=200)


if __name__ == "__main__":
    sys.stdout.write(generic_rules_file())
