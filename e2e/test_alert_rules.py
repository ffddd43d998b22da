"""The alert rules (the operator's PrometheusRule and the chart's plain rules file) under `promtool check rules` and
`promtool test rules`: each alert fires on a synthetic bad series and stays quiet on a healthy one."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from pagekube.operator.monitoring import build_prometheus_rule
from pagekube.operator.spec import AlertThresholds
from tests.k8s_tools import REPO

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) not installed")

POD = 'namespace="default",pod="demo-engine-7f9c6d5b8-a1b2c"'
# What an on-call engineer reads for the bad series below (the templates rendered with those values).
SUMMARIES = {
    "PagekubeKVCacheSaturated": "KV cache above 99%: requests queue and get preempted",
    "PagekubeQueueDepthHigh": "40 requests waiting per engine replica",
    "PagekubeTTFTHigh": "p99 time to first token is 4.975s",
    "PagekubeErrorRatioHigh": "10% of requests end aborted",
    "PagekubeEngineDown": "engine demo-engine-7f9c6d5b8-a1b2c is not answering scrapes",
    "PagekubePreemptionRateHigh": "3 preemptions/s: the KV cache is too small for the load",
    "PagekubeLoRAAdapterNotLoaded": "demo-engine-7f9c6d5b8-a1b2c could not load LoRA adapter sql: rank 64 exceeds "
                                    "--max-lora-rank 16",
}
ALERTS = ["PagekubeKVCacheSaturated", "PagekubeQueueDepthHigh", "PagekubeTTFTHigh", "PagekubeErrorRatioHigh",
          "PagekubeEngineDown", "PagekubePreemptionRateHigh", "PagekubeLoRAAdapterNotLoaded"]
ADAPTER = {"adapter": "sql", "error": "rank 64 exceeds --max-lora-rank 16"}


def series(bad: bool) -> list[dict]:
    """Twenty minutes at one-minute steps. Bad: every alert's condition holds throughout; healthy: none does."""
    def s(name, values):
        return {"series": f"{name}{{{POD}}}", "values": values}

    ttft = "+60x20" if bad else "+0x20"  # bad: 60 requests/min all slower than 2.5 s; healthy: all under 0.5 s
    return [
        s("vllm:kv_cache_usage_perc", "0.99x20" if bad else "0.40x20"),
        s("vllm:num_requests_waiting", "40x20" if bad else "1x20"),
        *[{"series": f'vllm:time_to_first_token_seconds_bucket{{{POD},le="{le}"}}',
           "values": f"0{'+0x20' if (bad and le != '+Inf' and float(le) < 5) else ttft}"}
          for le in ("0.5", "2.5", "5", "+Inf")],
        {"series": f'vllm:request_success_total{{{POD},finished_reason="stop"}}', "values": "0+90x20" if bad else "0+100x20"},
        {"series": f'vllm:request_success_total{{{POD},finished_reason="abort"}}', "values": "0+10x20" if bad else "0+0x20"},
        {"series": f'up{{{POD},job="pagekube-engine"}}', "values": "0x20" if bad else "1x20"},
        s("vllm:num_preemptions_total", "0+180x20" if bad else "0+6x20"),  # 3/s vs 0.1/s
        {"series": f'pagekube:lora_adapter_loaded{{{POD},adapter="sql",error="{ADAPTER["error"] if bad else ""}"}}',
         "values": "0x20" if bad else "1x20"},
    ]


def expected(alert: str, per_deployment: bool = True) -> list[dict]:
    labels = {"severity": "critical" if alert in ("PagekubeErrorRatioHigh", "PagekubeEngineDown") else "warning",
              "namespace": "default"}
    if per_deployment:  # the operator's PrometheusRule names the LLMDeployment; the chart's generic file cannot
        labels["llmdeployment"] = "demo"
    if alert == "PagekubeEngineDown":
        labels.update(pod="demo-engine-7f9c6d5b8-a1b2c", job="pagekube-engine")
    if alert == "PagekubeLoRAAdapterNotLoaded":
        labels.update(pod="demo-engine-7f9c6d5b8-a1b2c", **ADAPTER)
    annotations = {"summary": SUMMARIES[alert], "runbook_url": f"https://pagekube.io/docs/alerts#{alert.lower()}"}
    return [{"exp_labels": labels, "exp_annotations": annotations}]


def promtool(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(params=["operator-prometheusrule", "chart-rules-file"])
def rule_file(tmp_path, request):
    path = tmp_path / "rules.yaml"
    if request.param == "chart-rules-file":
        shutil.copy(REPO / "charts/pagekube/files/alerts.yaml", path)
    else:
        rule = build_prometheus_rule("demo", "default", AlertThresholds())
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path, request.param == "operator-prometheusrule"


def test_promtool_check_rules_passes(rule_file):
    rule_file, per_deployment = rule_file
    r = promtool("check", "rules", str(rule_file), cwd=rule_file.parent)
    count = 7 if per_deployment else 8  # the chart's file also has the operator's own alert
    assert r.returncode == 0 and f"SUCCESS: {count} rules found" in r.stdout, r.stdout + r.stderr


def test_each_alert_fires_on_a_bad_series_and_stays_quiet_on_a_healthy_one(rule_file, tmp_path):
    rule_file, per_deployment = rule_file
    tests = []
    for bad in (True, False):
        tests.append({
            "interval": "1m",
            "input_series": series(bad),
            "alert_rule_test": [{"eval_time": "20m", "alertname": a, "exp_alerts": expected(a, per_deployment) if bad else []} for a in ALERTS],
        })
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": [rule_file.name], "evaluation_interval": "1m",
                                                         "tests": tests}, sort_keys=False))
    r = promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_the_rule_tests_can_fail(rule_file, tmp_path):
    """A healthy series expected to fire must fail promtool: the test above is not vacuous."""
    rule_file, per_deployment = rule_file
    tests = [{"interval": "1m", "input_series": series(False),
              "alert_rule_test": [{"eval_time": "20m", "alertname": "PagekubeEngineDown", "exp_alerts": expected("PagekubeEngineDown", per_deployment)}]}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": [rule_file.name], "tests": tests}))
    assert promtool("test", "rules", "test.yaml", cwd=tmp_path).returncode != 0


def test_at_zero_replicas_a_missing_activator_series_pages(tmp_path):
    """Only a scale-to-zero deployment's rule has it: there the activator's count is what wakes KEDA."""
    rule = build_prometheus_rule("demo", "default", AlertThresholds(), scales_to_zero=True)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    pending = 'pagekube:activator_requests_pending{namespace="default",llmdeployment="demo"}'
    fired = [{"exp_labels": {"severity": "critical", "namespace": "default", "llmdeployment": "demo"},
              "exp_annotations": {"summary": "no activator pending-count series: requests at zero replicas cannot wake demo",
                                  "runbook_url": "https://pagekube.io/docs/alerts#pagekubeactivatormetricabsent"}}]
    tests = [
        {"interval": "1m", "input_series": [{"series": 'up{job="other"}', "values": "1x20"}],
         "alert_rule_test": [{"eval_time": "20m", "alertname": "PagekubeActivatorMetricAbsent", "exp_alerts": fired}]},
        {"interval": "1m", "input_series": [{"series": pending, "values": "0x20"}],
         "alert_rule_test": [{"eval_time": "20m", "alertname": "PagekubeActivatorMetricAbsent", "exp_alerts": []}]},
    ]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}, sort_keys=False))
    r = promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PagekubeActivatorMetricAbsent" not in str(build_prometheus_rule("demo", "default", AlertThresholds()))


def test_the_operator_alert_fires_while_passes_keep_failing(tmp_path):
    shutil.copy(REPO / "charts/pagekube/files/alerts.yaml", tmp_path / "rules.yaml")
    errors = 'controller_runtime_reconcile_errors_total{controller="llmdeployment",namespace="pagekube-system",pod="op-1"}'
    fired = [{"exp_labels": {"severity": "warning", "namespace": "pagekube-system", "pod": "op-1"},
              "exp_annotations": {"summary": "the pagekube operator op-1 fails 0.05 reconcile passes/s: see its log for "
                                             "the object and the error",
                                  "runbook_url": "https://pagekube.io/docs/alerts#pagekubeoperatorreconcileerrors"}}]
    tests = [{"interval": "1m", "input_series": [{"series": errors, "values": values}],
              "alert_rule_test": [{"eval_time": "30m", "alertname": "PagekubeOperatorReconcileErrors", "exp_alerts": exp}]}
             for values, exp in (("0+3x30", fired), ("5x30", []))]  # 3 errors a minute vs none since the start
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}, sort_keys=False))
    r = promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
