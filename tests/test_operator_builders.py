"""Pure builders: every example's rendered objects against the real schemas (Kubernetes 1.35 OpenAPI, the KEDA and
prometheus-operator CRDs), the NGINX config through a real `nginx -t`, and the spec -> object rules."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from pagekube.operator import naming
from pagekube.operator.autoscaling import queue_depth_query
from pagekube.operator.availability import build_pod_disruption_budget
from pagekube.operator.cli import render
from pagekube.operator.crd import crd, crd_yaml
from pagekube.operator.desired import desired_objects
from pagekube.operator.engine_deployment import build_engine_deployment, engine_args, grace_period_seconds
from pagekube.operator.nginx import SCRIPT_KEY, build_nginx_configmap, prefix_route_script, render_nginx_conf
from pagekube.operator.reconciler import contains
from pagekube.operator.spec import ALERTS, LLMDeploymentSpec
from pagekube.operator.status import compute_status, merge_transition_times, status_changed
from tests.k8s_tools import EXAMPLES, REPO, third_party_crd

K8S_VERSION = "1.35.0"
CR_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
}


def spec_of(**overrides) -> LLMDeploymentSpec:
    base = {"model": {"name": "m", "source": "hf://org/repo"}}
    return LLMDeploymentSpec.model_validate({**base, **overrides})


def rendered(example) -> list[dict]:
    return render(list(yaml.safe_load_all(example.read_text())))


def unknown_fields(obj, schema, path="") -> list[str]:
    """Fields the API server would prune (not in the structural schema): a typo there is silently lost."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if props is None:
            return [] if extra is None else [u for k, v in obj.items() for u in unknown_fields(v, extra or {}, f"{path}.{k}")]
        found = []
        for k, v in obj.items():
            found += unknown_fields(v, props[k], f"{path}.{k}") if k in props else [f"{path}.{k}"]
        return found
    if isinstance(obj, list):
        return [u for i, v in enumerate(obj) for u in unknown_fields(v, schema.get("items", {}), f"{path}[{i}]")]
    return []


def schema_errors(obj: dict, schema: dict) -> list[str]:
    """OpenAPI v3.0 schemas are JSON Schema draft 4 (boolean exclusiveMinimum). No metaschema check: upstream
    patterns use Go regex syntax, e.g. '^(?i)(abort|warn)?$'."""
    return [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]


def validate_custom_resource(obj: dict) -> None:
    crd_doc = third_party_crd(CR_SCHEMAS[(obj["apiVersion"], obj["kind"])])
    version = obj["apiVersion"].split("/")[1]
    schema = next(v for v in crd_doc["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    assert schema_errors(obj, schema) == []
    assert unknown_fields(obj, schema) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_validates_against_real_schemas(example):
    objects = rendered(example)
    assert {o["kind"] for o in objects} >= {"Deployment", "Service"}
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CR_SCHEMAS:
            validate_custom_resource(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_themselves_validate(example):
    """The manifests users apply: Kubernetes kinds by the 1.35 schema, ours by the CRD's and the pydantic model."""
    ours = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for doc in yaml.safe_load_all(example.read_text()):
        if doc["kind"] == "LLMDeployment":
            assert schema_errors(doc, ours) == []
            assert unknown_fields(doc, ours) == []
            LLMDeploymentSpec.model_validate(doc["spec"])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx (Debian package) not installed")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_nginx_config_passes_nginx_t(example, tmp_path):
    """The operator's config with its upstreams pointed at loopback (Debian's nginx 1.22 has no `resolve`)."""
    doc = next(d for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "LLMDeployment")
    spec = LLMDeploymentSpec.model_validate(doc["spec"])
    conf = render_nginx_conf(spec, ["127.0.0.1:18001", "127.0.0.1:18002"], script_dir=str(tmp_path))
    (tmp_path / "nginx.conf").write_text(conf)
    (tmp_path / SCRIPT_KEY).write_text(prefix_route_script())
    r = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(tmp_path / "nginx.conf")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "test is successful" in r.stderr


def test_nginx_pre_stop_quits_the_running_server_and_waits_for_it():
    """`nginx -s quit` finds the master through the pid file its config names, relative to its prefix: the preStop
    must pass the server's own -p and -c (a bare one reads the image's default config and fails, and the kubelet's
    SIGTERM then cuts every open stream), then wait until the master is gone."""
    from pagekube.operator.nginx import NGINX, NGINX_COMMAND, build_nginx_deployment

    c = build_nginx_deployment("m", "ns", spec_of())["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == NGINX_COMMAND
    script = c["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert c["command"][-2:] == ["-g", "daemon off;"]  # the rest: the same -p, -e and -c as the running server
    assert f"{' '.join(c['command'][:-2])} -s quit;" in script and c["command"][:-2] == NGINX
    assert "pid nginx.pid;" in render_nginx_conf(spec_of(), ["10.0.0.1:8000"]) and "[ -e /tmp/nginx.pid ]" in script


def test_nginx_config_streams_and_never_replays():
    conf = render_nginx_conf(spec_of(loadBalancer={"readTimeoutSeconds": 900, "maxBodySize": "20m"}), ["10.0.0.1:8000"])
    for line in ["least_conn;", "proxy_buffering off;", "proxy_read_timeout 900s;", "client_max_body_size 20m;",
                 "proxy_http_version 1.1;", 'proxy_set_header Connection "";', "keepalive 128;",
                 "proxy_next_upstream error timeout;"]:
        assert line in conf
    assert "resolver " not in conf  # IP upstreams need no DNS
    # A POST is passed on only after an engine's 503 (refused before starting it), never after a failure midway.
    main, refused = conf.split("location / {")[1].split("location @refused {")
    assert "non_idempotent" not in main and "error_page 503 = @refused;" in main
    assert "proxy_next_upstream http_503 non_idempotent;" in refused
    # With the activator as backup its own 503 (no engine woke in time) is the answer: nothing intercepts it.
    zero = render_nginx_conf(spec_of(), ["10.0.0.1:8000"], backups=["10.0.0.2:8081"])
    assert "error_page" not in zero and "non_idempotent" not in zero and "10.0.0.2:8081 backup;" in zero
    cluster = render_nginx_conf(spec_of(), ["x-engine-pods.ns.svc.cluster.local:8000"])
    assert "resolve max_fails" in cluster and "resolver kube-dns" in cluster


def test_prefix_hash_routes_by_key_with_a_bound_and_falls_back_to_least_connections():
    spec = spec_of(engine={"maxNumSeqs": 64}, loadBalancer={"replicas": 2, "strategy": "PrefixHash"})
    conf = render_nginx_conf(spec, ["10.0.0.1:8000", "10.0.0.2:8000"])
    prefix = conf.split("upstream engine_prefix {")[1].split("}")[0]
    assert "hash $pagekube_route_key consistent;" in prefix
    assert prefix.count("max_conns=32;") == 2  # default bound: each NGINX pod's share of one engine's 64 sequences
    assert "least_conn;" in conf.split("upstream engine {")[1].split("}")[0]  # the fallback and the spill
    assert "js_content router.route;" in conf.split("location / {")[1].split("}")[0]
    assert "load_module /usr/lib/nginx/modules/ngx_http_js_module.so;" in conf
    assert "js_var $pagekube_prefix_characters 100;" in conf and "client_body_buffer_size 10m;" in conf
    # The spill replays nothing: only a 502 for a request no engine received goes on to least connections.
    spill = conf.split("location @spill {")[1].split("location @refused")[0]
    assert "map $upstream_bytes_sent $pagekube_nothing_sent" in conf
    assert "if ($pagekube_nothing_sent = 0)" in spill and "return 502;" in spill and "error_page" not in spill
    bounded = render_nginx_conf(spec_of(loadBalancer={"strategy": "PrefixHash", "prefixHash": {
        "maxConnectionsPerReplica": 3, "prefixCharacters": 500}}), ["10.0.0.1:8000"])
    assert "max_conns=3;" in bounded and "js_var $pagekube_prefix_characters 500;" in bounded
    # At zero replicas the activator stays least connections' backup (hash upstreams take no backup).
    zero = render_nginx_conf(spec, ["e.ns.svc.cluster.local:8000"], backups=["a.ns.svc.cluster.local:80"])
    assert "backup" not in zero.split("upstream engine_prefix {")[1].split("}")[0]
    assert "a.ns.svc.cluster.local:80 resolve backup;" in zero
    # The router ships in the ConfigMap, and changing it or the strategy rolls the NGINX pods.
    data = build_nginx_configmap("m", "ns", spec)["data"]
    assert data[SCRIPT_KEY] == prefix_route_script() and "function route(r)" in data[SCRIPT_KEY]
    assert SCRIPT_KEY not in build_nginx_configmap("m", "ns", spec_of())["data"]
    assert "js_" not in render_nginx_conf(spec_of(), ["10.0.0.1:8000"])  # LeastConnections needs no njs


def test_inference_pool_selects_the_engine_pods_and_meets_the_published_schema():
    assert not [o for o in desired_objects("m", "ns", "uid", spec_of()) if o["kind"] == "InferencePool"]
    for gateway in ({"inferencePool": True},
                    {"inferencePool": True, "endpointPicker": {"name": "epp", "failureMode": "FailOpen"}}):
        spec = spec_of(gateway=gateway)
        pool = next(o for o in desired_objects("m", "ns", "uid", spec) if o["kind"] == "InferencePool")
        validate_custom_resource(pool)
        engine = build_engine_deployment("m", "ns", spec)
        labels = engine["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pool["spec"]["targetPorts"] == [{"number": naming.ENGINE_PORT}]
        assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid"
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "epp", "port": {"number": 9002},
                                                 "failureMode": "FailOpen"}


def test_prefix_hash_settings_are_validated():
    for bad in ({"strategy": "RoundRobin"}, {"prefixHash": {"prefixCharacters": 0}},
                {"prefixHash": {"maxConnectionsPerReplica": 0}}, {"prefixHash": {"characters": 100}}):
        with pytest.raises(ValidationError):
            spec_of(loadBalancer=bad)


def test_engine_deployment_follows_spec():
    spec = spec_of(
        model={"name": "llama", "source": "pvc://weights/llama-8b", "maxModelLen": 8192, "dtype": "bfloat16"},
        engine={"maxNumSeqs": 64, "blockSize": 32, "enablePrefixCaching": False, "extraArgs": ["--seed", "7"]},
        resources={"gpu": 2, "gpuResourceName": "amd.com/gpu", "cpu": "8", "memory": "64Gi"},
        drain={"timeoutSeconds": 300, "preStopDelaySeconds": 10},
        replicas=3,
    )
    dep = build_engine_deployment("llama", "ns", spec)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"amd.com/gpu": "2", "cpu": "8", "memory": "64Gi"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert pod["terminationGracePeriodSeconds"] == 10 + 300 + 15 == grace_period_seconds(spec)
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    # liveness must outlast a whole drain (/health is 503 while draining) or the kubelet kills a draining pod
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= grace_period_seconds(spec)
    args = c["args"]
    assert args[0] == "/models/llama-8b"
    for flag, value in {"--max-model-len": "8192", "--dtype": "bfloat16", "--max-num-seqs": "64", "--block-size": "32",
                        "--drain-timeout": "300", "--served-model-name": "llama"}.items():
        assert args[args.index(flag) + 1] == value
    assert "--no-enable-prefix-caching" in args and args[-2:] == ["--seed", "7"]
    assert pod["volumes"][0] == {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_tensor_parallel_renders_the_flag_the_gpus_and_a_memory_backed_shm():
    spec = spec_of(engine={"tensorParallelSize": 2}, resources={"gpu": 2})
    pod = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]  # NCCL outgrows the default 64M
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert "--tensor-parallel-size" not in engine_args(spec_of())  # 1: the engine's default, not rendered


def test_model_quantization_passes_the_engine_flag_and_an_unknown_scheme_is_refused():
    args = engine_args(spec_of(model={"name": "m", "source": "hf://org/repo-AWQ", "quantization": "awq"}))
    assert args[args.index("--quantization") + 1] == "awq"
    assert "--quantization" not in engine_args(spec_of())  # the checkpoint's own config says it
    with pytest.raises(ValidationError, match="quantization"):
        spec_of(model={"name": "m", "source": "hf://org/repo", "quantization": "bitsandbytes"})


def test_hf_source_downloads_in_an_init_container_and_cpu_only_has_no_gpu():
    spec = spec_of(model={"name": "m", "source": "hf://org/repo", "revision": "v2"}, resources={"gpu": 0})
    pod = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][-3:] == ["org/repo", "v2", "/models/model"]
    assert pod["containers"][0]["resources"] == {}
    assert engine_args(spec)[:1] == ["/models/model"] and "--device" in engine_args(spec)
    assert not any(e["name"] == "OMP_NUM_THREADS" for e in init["env"] + pod["containers"][0]["env"])


@pytest.mark.parametrize("cpu, threads", [("8", 8), ("500m", 1), ("2.5", 3), ("1500m", 2)])
def test_a_cpu_limit_sets_the_engine_threads_to_fit_it(cpu, threads):
    c = build_engine_deployment("m", "ns", spec_of(resources={"gpu": 0, "cpu": cpu}))["spec"]["template"]["spec"]
    assert {"name": "OMP_NUM_THREADS", "value": str(threads)} in c["containers"][0]["env"]


def test_a_cpu_that_matches_the_pattern_but_is_no_quantity_is_refused():
    with pytest.raises(ValidationError, match="not a Kubernetes quantity"):
        spec_of(resources={"gpu": 0, "cpu": "1.2.3"})


def test_engine_env_overrides_the_threads_from_the_cpu_limit():
    spec = spec_of(resources={"gpu": 0, "cpu": "4"}, engine={"env": [{"name": "OMP_NUM_THREADS", "value": "2"}]})
    env = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "OMP_NUM_THREADS"] == [{"name": "OMP_NUM_THREADS", "value": "2"}]


def test_s3_source_syncs_in_an_aws_cli_init_container():
    spec = spec_of(model={"name": "m", "source": "s3://bucket/models/llama"},
                   engine={"env": [{"name": "AWS_REGION", "value": "eu-west-1"}]})
    pod = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"] == ["s3", "sync", "s3://bucket/models/llama", "/models/model"]
    assert {"name": "AWS_REGION", "value": "eu-west-1"} in init["env"] and pod["volumes"][0]["emptyDir"] == {}
    assert pod["containers"][0]["args"][0] == "/models/model"


def test_adapters_render_lora_flags_downloads_and_read_only_claims():
    spec = spec_of(adapters=[{"name": "sql", "source": "hf://org/sql-lora", "revision": "v1"},
                             {"name": "org/support", "source": "s3://bucket/adapters/support"},
                             {"name": "legal", "source": "pvc://shared/adapters/legal"},
                             {"name": "baked", "source": "file:///opt/adapters/baked"}],
                   engine={"maxLoras": 3, "maxLoraRank": 64, "env": [{"name": "HF_TOKEN", "value": "t"}]})
    args = engine_args(spec)
    i = args.index("--lora-modules")
    assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "3"
    assert args[i + 1 : i + 5] == ["sql=/adapters/sql", "org/support=/adapters/org--support",
                                   "legal=/adapter-claims/shared/adapters/legal", "baked=/opt/adapters/baked"]
    pod = build_engine_deployment("m", "ns", spec)["spec"]["template"]["spec"]
    model, hf, s3 = pod["initContainers"]
    assert model["name"] == "model-download" and hf["command"][-3:] == ["org/sql-lora", "v1", "/adapters/sql"]
    assert s3["args"] == ["s3", "sync", "s3://bucket/adapters/support", "/adapters/org--support"]
    assert {"name": "HF_TOKEN", "value": "t"} in hf["env"] and {"name": "HF_TOKEN", "value": "t"} in s3["env"]
    assert {"name": "adapter-claim-shared", "persistentVolumeClaim": {"claimName": "shared", "readOnly": True}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in mounts
    assert {"name": "adapter-claim-shared", "mountPath": "/adapter-claims/shared", "readOnly": True} in mounts
    assert "--enable-lora" not in engine_args(spec_of())  # no adapters: no LoRA


@pytest.mark.parametrize("overrides, message", [
    ({"adapters": [{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "hf://o/b"}]}, "each name once"),
    ({"adapters": [{"name": "m", "source": "hf://o/a"}]}, "cannot take the model's own name"),
    ({"adapters": [{"name": "a b", "source": "hf://o/a"}]}, "should match pattern"),
    ({"adapters": [{"name": "a", "source": "ftp://o/a"}]}, "should match pattern"),
    ({"adapters": [{"name": "a", "source": "hf://o/a"}], "engine": {"pipelineParallelSize": 2}}, "not supported yet"),
    ({"engine": {"volumes": [{"name": "adapter-claim-x", "emptyDir": {}}]}}, "adapter-claim-* are the operator's"),
])
def test_adapters_that_cannot_serve_are_refused(overrides, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        spec_of(**overrides)


def test_adapter_names_are_the_engines():
    from pagekube.engine.lora.names import NAME
    from pagekube.operator.spec import ADAPTER_NAME

    assert NAME.pattern == ADAPTER_NAME


def test_autoscaling_decides_who_owns_replicas():
    off = desired_objects("m", "ns", "uid", spec_of(replicas=2))
    on = desired_objects("m", "ns", "uid", spec_of(replicas=2, autoscaling={"enabled": True, "minReplicas": 0}))
    dep_off = next(o for o in off if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-engine")
    dep_on = next(o for o in on if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-engine")
    assert dep_off["spec"]["replicas"] == 2 and "replicas" not in dep_on["spec"]
    assert not any(o["kind"] == "ScaledObject" for o in off)
    so = next(o for o in on if o["kind"] == "ScaledObject")
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["scaleTargetRef"]["name"] == "m-engine"
    trigger = so["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == queue_depth_query("m", "ns", spec_of(autoscaling={"enabled": True, "minReplicas": 0}))
    assert trigger["threshold"] == "4"
    assert 'vllm:num_requests_waiting{namespace="ns",pod=~"m-engine-[a-z0-9]+-[a-z0-9]+"}' in trigger["query"]


def test_scale_to_zero_adds_the_activator_as_nginx_backup_and_its_queue_to_the_query():
    zero = spec_of(autoscaling={"enabled": True, "minReplicas": 0, "activator": {"maxPending": 9, "holdTimeoutSeconds": 30}})
    one = spec_of(autoscaling={"enabled": True, "minReplicas": 1})
    objs = {(o["kind"], o["metadata"]["name"]): o for o in desired_objects("m", "ns", "uid", zero)}
    dep = objs[("Deployment", "m-activator")]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["activator", "--llmdeployment"] and "--max-pending" in args and args[args.index("--max-pending") + 1] == "9"
    assert args[args.index("--upstream") + 1] == "m-engine-pods.ns.svc.cluster.local:8000"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40
    assert objs[("Service", "m-activator")]["spec"]["ports"][0]["port"] == naming.ACTIVATOR_PORT
    conf = objs[("ConfigMap", "m-lb")]["data"]["nginx.conf"]
    assert "server m-activator.ns.svc.cluster.local:8081 resolve backup;" in conf
    query = objs[("ScaledObject", "m-engine")]["spec"]["triggers"][0]["metadata"]["query"]
    assert query.endswith(' + (sum(pagekube:activator_requests_pending{namespace="ns",llmdeployment="m"}) or vector(0))')
    monitored = desired_objects("m", "ns", "uid", zero.model_copy(update={"monitoring": spec_of(
        monitoring={"serviceMonitor": True}).monitoring}))
    sm = next(o for o in monitored if o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == "m-activator")
    assert sm["spec"]["endpoints"][0]["path"] == "/activator/metrics"
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "activator"
    # minReplicas >= 1: an engine is always up, so no activator, no backup, the plain query.
    plain = desired_objects("m", "ns", "uid", one)
    assert not any(o["metadata"]["name"] == "m-activator" for o in plain)
    assert "backup" not in next(o for o in plain if o["kind"] == "ConfigMap")["data"]["nginx.conf"]
    assert "activator" not in queue_depth_query("m", "ns", one)


def test_every_child_is_owned_and_labelled():
    objects = desired_objects("m", "ns", "the-uid", spec_of(monitoring={"serviceMonitor": True, "prometheusRule": True}))
    assert len(objects) == 10
    for obj in objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "the-uid" and ref["controller"] is True and ref["kind"] == "LLMDeployment"
        assert obj["metadata"]["labels"][naming.OWNER_LABEL] == "m"


@pytest.mark.parametrize("bad, field", [
    ({"model": {"name": "m"}}, "source"),
    ({"model": {"name": "m", "source": "ftp://x"}}, "source"),
    ({"model": {"name": "m", "source": "hf://o/r"}, "autoscaling": {"minReplicas": -1}}, "minReplicas"),
    ({"model": {"name": "m", "source": "hf://o/r"}, "engine": {"blockSize": 12}}, "blockSize"),
    ({"model": {"name": "m", "source": "hf://o/r"}, "replicaz": 2}, "replicaz"),
])
def test_spec_model_refuses_what_the_schema_refuses(bad, field):
    with pytest.raises(ValidationError, match=field):
        LLMDeploymentSpec.model_validate(bad)


def test_crd_file_and_chart_copy_are_the_generated_one():
    assert (REPO / "crds/llmdeployment.yaml").read_text() == crd_yaml()
    assert (REPO / "charts/pagekube/crds/llmdeployment.yaml").read_text() == crd_yaml()
    schema = crd()["spec"]["versions"][0]
    assert schema["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    spec = schema["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model"] and spec["properties"]["engine"]["default"]["blockSize"] == 16
    assert "x-kubernetes-validations" in spec and "x-kubernetes-validations" in spec["properties"]["autoscaling"]


def test_contains_is_the_no_write_rule():
    assert contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}, "z": 0}, {"a": 1, "b": {"c": [1, {"d": 2}]}})
    assert not contains({"a": 1}, {"a": 2}) and not contains({"l": [1, 2]}, {"l": [1]})
    assert contains({"x": 1}, {"env": []})  # empty lists read back as absent
    assert contains({"cpu": "500m", "memory": "1Gi"}, {"cpu": "0.5", "memory": "1024Mi"})  # canonical quantities
    assert not contains({"cpu": "500m"}, {"cpu": "1"}) and not contains({"image": "a"}, {"image": "b"})


def test_status_conditions_follow_the_deployment():
    spec = spec_of(replicas=2)
    creating = compute_status("m", "ns", 3, spec, None, [])
    conds = {c["type"]: c for c in creating["conditions"]}
    assert conds["Progressing"]["status"] == "True" and conds["Ready"]["status"] == "False"
    dep = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "availableReplicas": 2, "updatedReplicas": 2}}
    done = compute_status("m", "ns", 3, spec, dep, [])
    conds = {c["type"]: c for c in done["conditions"]}
    assert (conds["Ready"]["status"], conds["Progressing"]["status"], conds["Degraded"]["status"]) == ("True", "False", "False")
    assert done["readyReplicas"] == 2 and done["observedGeneration"] == 3 and done["endpoint"].startswith("http://m-lb.ns")
    bad = compute_status("m", "ns", 3, spec, None, [("SecretNotFound", "Secret ns/k does not exist")], blocked=True)
    conds = {c["type"]: c for c in bad["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "SecretNotFound"
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "False"
    no_keda = compute_status("m", "ns", 3, spec, dep, [("MissingCRD", "install KEDA")])
    conds = {c["type"]: c for c in no_keda["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Ready"]["status"] == "True"  # the engines still serve
    first = merge_transition_times(done, None)
    again = merge_transition_times(compute_status("m", "ns", 3, spec, dep, []), first)
    assert not status_changed(again, first)


def test_the_validators_catch_mistakes():
    """The schema checks above can fail: a typo'd field, a wrong type."""
    so = next(o for o in desired_objects("m", "ns", "u", spec_of(autoscaling={"enabled": True})) if o["kind"] == "ScaledObject")
    so["spec"]["minReplicas"] = 1  # the real field is minReplicaCount
    with pytest.raises(AssertionError):
        validate_custom_resource(so)
    dep = build_engine_deployment("m", "ns", spec_of())
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_the_operator_imports_no_torch():
    code = ("import sys; import pagekube.operator.cli, pagekube.operator.handlers, pagekube.operator.reconciler; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_render_cli_prints_the_objects_offline(example):
    exe = str(Path(sys.executable).parent / "pagekube-operator")
    r = subprocess.run([exe, "render", "-f", str(example)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert list(yaml.safe_load_all(r.stdout)) == rendered(example)


def test_render_cli_explains_a_bad_manifest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: serving.pagekube.io/v1alpha1\nkind: LLMDeployment\nmetadata: {name: x}\n"
                   "spec: {model: {name: m, source: 'ftp://nope'}, replicas: -1}\n")
    r = subprocess.run([str(Path(sys.executable).parent / "pagekube-operator"), "render", "-f", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert "model.source" in r.stderr and "replicas" in r.stderr and "invalid LLMDeployment spec" in r.stderr


def test_disruption_budgets_and_spread_cover_the_engine_and_nginx():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in desired_objects("m", "ns", "uid", spec_of(replicas=3))}
    for name in ("m-engine", "m-lb"):
        pdb = objs[("PodDisruptionBudget", name)]["spec"]
        pod = objs[("Deployment", name)]["spec"]["template"]
        # The budget and the spread select exactly this component's pods, as the Deployment's own selector does.
        assert pdb["selector"] == objs[("Deployment", name)]["spec"]["selector"]
        assert pdb["maxUnavailable"] == 1 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        (spread,) = pod["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
        assert all(pod["metadata"]["labels"][k] == v for k, v in spread["labelSelector"]["matchLabels"].items())
    strict = spec_of(availability={"maxUnavailable": 0, "topologySpread": {"whenUnsatisfiable": "DoNotSchedule",
                                                                           "topologyKey": "topology.kubernetes.io/zone"}})
    engine = build_engine_deployment("m", "ns", strict)["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    assert engine["whenUnsatisfiable"] == "DoNotSchedule" and engine["topologyKey"] == "topology.kubernetes.io/zone"
    assert build_pod_disruption_budget("m", "ns", "engine", strict)["spec"]["maxUnavailable"] == 0
    off = spec_of(availability={"podDisruptionBudget": False, "topologySpread": {"enabled": False}})
    kinds = [o["kind"] for o in desired_objects("m", "ns", "uid", off)]
    assert "PodDisruptionBudget" not in kinds
    assert "topologySpreadConstraints" not in build_engine_deployment("m", "ns", off)["spec"]["template"]["spec"]
    no_lb = desired_objects("m", "ns", "uid", spec_of(loadBalancer={"enabled": False}))
    assert [o["metadata"]["name"] for o in no_lb if o["kind"] == "PodDisruptionBudget"] == ["m-engine"]


def test_engine_pod_overrides_reach_the_pod_and_keep_the_operators_own_fields():
    spec = spec_of(engine={
        "podLabels": {"team": "search", "app.kubernetes.io/component": "mine"},
        "podAnnotations": {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"},
        "serviceAccountName": "llm-reader", "runtimeClassName": "gvisor",
        "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "volumeMounts": [{"name": "certs", "mountPath": "/etc/certs", "readOnly": True}],
        "envFrom": [{"secretRef": {"name": "hf-token"}}], "shmSize": "8Gi",
        "securityContext": {"readOnlyRootFilesystem": True}})
    template = build_engine_deployment("m", "ns", spec)["spec"]["template"]
    pod, (init,), (engine,) = template["spec"], template["spec"]["initContainers"], template["spec"]["containers"]
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"  # the selector's labels stay ours
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert (pod["serviceAccountName"], pod["runtimeClassName"]) == ("llm-reader", "gvisor")
    assert {"name": "certs", "secret": {"secretName": "ca"}} in pod["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert {"name": "certs", "mountPath": "/etc/certs", "readOnly": True} in engine["volumeMounts"]
    assert engine["envFrom"] == init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # merged over the restricted defaults
    plain = build_engine_deployment("m", "ns", spec_of())["spec"]["template"]["spec"]
    assert "serviceAccountName" not in plain and "envFrom" not in plain["containers"][0]
    with pytest.raises(ValueError, match="the operator's"):
        spec_of(engine={"volumes": [{"name": "models", "emptyDir": {}}]})


def test_monitoring_labels_and_keda_fallback():
    spec = spec_of(monitoring={"serviceMonitor": True, "prometheusRule": True, "labels": {"release": "kps"}},
                   autoscaling={"enabled": True, "minReplicas": 0, "fallback": {"replicas": 2}})
    objs = desired_objects("m", "ns", "uid", spec)
    watched = [o for o in objs if o["kind"] in ("ServiceMonitor", "PrometheusRule")]
    assert len(watched) == 3 and all(o["metadata"]["labels"]["release"] == "kps" for o in watched)
    assert all(o["metadata"]["labels"][naming.OWNER_LABEL] == "m" for o in watched)
    scaled = next(o for o in objs if o["kind"] == "ScaledObject")["spec"]
    assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 2, "behavior": "static"}
    plain = next(o for o in desired_objects("m", "ns", "uid", spec_of(autoscaling={"enabled": True}))
                 if o["kind"] == "ScaledObject")
    assert "fallback" not in plain["spec"]


def test_alert_for_replaces_the_pending_period_of_the_alerts_it_names():
    spec = spec_of(monitoring={"prometheusRule": True, "alertFor": {"PagekubeQueueDepthHigh": "20s"}},
                   autoscaling={"enabled": True, "minReplicas": 0})
    rule = next(o for o in desired_objects("m", "ns", "uid", spec) if o["kind"] == "PrometheusRule")
    rules = {r["alert"]: r["for"] for r in rule["spec"]["groups"][0]["rules"]}
    assert set(rules) == set(ALERTS)  # every alert the field may name is rendered (with scale to zero)
    assert rules["PagekubeQueueDepthHigh"] == "20s" and rules["PagekubeEngineDown"] == "2m"
    with pytest.raises(ValidationError, match="no alert named PagekubeQueueDepth "):
        spec_of(monitoring={"alertFor": {"PagekubeQueueDepth": "1m"}})
    with pytest.raises(ValidationError, match="should match pattern"):
        spec_of(monitoring={"alertFor": {"PagekubeEngineDown": "2 minutes"}})


def admitted_by(policy: dict, labels: dict, namespace: str) -> bool:
    """NetworkPolicy semantics (the policy is in namespace "ns"): a peer admits a pod when both its selectors
    match; no namespaceSelector means the policy's namespace, an empty one any namespace."""
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            namespaces = peer.get("namespaceSelector")
            if namespaces is None:
                in_namespace = namespace == "ns"
            else:
                exprs = namespaces.get("matchExpressions")
                in_namespace = not exprs or namespace in exprs[0]["values"]
            pods = (peer.get("podSelector") or {}).get("matchLabels", {})
            if in_namespace and all(labels.get(k) == v for k, v in pods.items()):
                return True
    return False


def test_the_engine_network_policy_admits_only_the_request_path_and_the_scrapers():
    assert "NetworkPolicy" not in [o["kind"] for o in desired_objects("m", "ns", "uid", spec_of())]  # off by default
    objs = desired_objects("m", "ns", "uid", spec_of(networkPolicy={"enabled": True}))
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    del policy["metadata"]["ownerReferences"]
    kubernetes_validate.validate(policy, "1.35.0", strict=True)
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] == "Deployment"}

    def admitted(labels: dict, namespace: str = "ns") -> bool:
        return admitted_by(policy, labels, namespace)

    assert all(labels[k] == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items()
               for labels in [pods["m-engine"]])
    assert admitted(pods["m-lb"]) and admitted({}, "monitoring")
    assert not admitted(pods["m-engine"]) and not admitted({"app": "other"}) and not admitted(pods["m-lb"], "other")
    operator_pod = {"app.kubernetes.io/name": "pagekube-operator", "app.kubernetes.io/instance": "pk"}
    assert not admitted(operator_pod, "pagekube-system")  # it reads the engines only for adapters


def test_with_adapters_the_network_policy_admits_the_operator_to_the_engine_port():
    spec = spec_of(networkPolicy={"enabled": True}, adapters=[{"name": "sql", "source": "hf://o/sql"}])
    (policy,) = [o for o in desired_objects("m", "ns", "uid", spec) if o["kind"] == "NetworkPolicy"]
    del policy["metadata"]["ownerReferences"]
    kubernetes_validate.validate(policy, "1.35.0", strict=True)
    chart_labels = {"app.kubernetes.io/name": "pagekube-operator", "app.kubernetes.io/instance": "pk"}
    assert admitted_by(policy, chart_labels, "pagekube-system")
    assert not admitted_by(policy, {"app.kubernetes.io/name": "other"}, "pagekube-system")
    operator_rule = next(r for r in policy["spec"]["ingress"] if any("podSelector" in p and "namespaceSelector" in p
                                                                      for p in r["from"]))
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": naming.ENGINE_PORT}]
    helpers = (REPO / "charts/pagekube/templates/_helpers.tpl").read_text()
    assert "app.kubernetes.io/name: pagekube-operator" in helpers  # the label the policy selects


def test_the_engines_and_the_request_path_are_placed_by_their_own_fields():
    spec = spec_of(nodeSelector={"gpu": "a100"}, tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
                   priorityClassName="serving", imagePullSecrets=[{"name": "registry"}],
                   autoscaling={"enabled": True, "minReplicas": 0},
                   loadBalancer={"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "edge", "operator": "Exists"}],
                                 "affinity": {"nodeAffinity": {}}})
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in desired_objects("m", "ns", "uid", spec) if o["kind"] == "Deployment"}
    assert pods["m-engine"]["nodeSelector"] == {"gpu": "a100"} and "affinity" not in pods["m-engine"]
    assert pods["m-engine"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    for request_path in ("m-lb", "m-activator"):
        pod = pods[request_path]
        assert pod["nodeSelector"] == {"pool": "cpu"} and pod["affinity"] == {"nodeAffinity": {}}
        assert pod["tolerations"] == [{"key": "edge", "operator": "Exists"}]
    for pod in pods.values():
        assert pod["priorityClassName"] == "serving" and pod["imagePullSecrets"] == [{"name": "registry"}]


def test_model_cache_claim_is_filled_once_and_mounted_by_every_replica():
    spec = spec_of(model={"name": "m", "source": "hf://org/repo", "revision": "v2", "sizeHint": "20Gi",
                          "cache": {"enabled": True, "storageClassName": "nfs"}})
    objs = desired_objects("m", "ns", "uid", spec)
    assert objs[0]["kind"] == "PersistentVolumeClaim"  # applied before the pods that mount it
    claim = objs[0]
    assert claim["metadata"]["name"] == "m-model-cache" and claim["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}, "storageClassName": "nfs"}
    pod = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-engine")["spec"]["template"]["spec"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models == {"name": "models", "persistentVolumeClaim": {"claimName": "m-model-cache"}}
    (init,), (engine,) = pod["initContainers"], pod["containers"]
    assert init["command"][-3:] == ["org/repo", "v2", "/models/v2"]  # a revision's own folder: never overwritten
    assert engine["args"][0] == "/models/v2" and {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert "ephemeral-storage" not in engine["resources"].get("requests", {})  # the claim holds the weights

    plain = build_engine_deployment("m", "ns", spec_of(model={"name": "m", "source": "s3://b/p", "sizeHint": "20Gi"}))
    pod = plain["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "models") == {"name": "models", "emptyDir": {"sizeLimit": "20Gi"}}
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    assert "PersistentVolumeClaim" not in [o["kind"] for o in desired_objects("m", "ns", "uid", spec_of())]
    with pytest.raises(ValueError, match="needs a size"):
        spec_of(model={"name": "m", "source": "hf://org/repo", "cache": {"enabled": True}})


def test_crd_field_paths_tell_an_older_schema_from_a_newer_one():
    from pagekube.operator.crd_upgrade import field_paths

    ours = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    paths = field_paths(ours)
    assert ("spec", "availability", "maxUnavailable") in paths and ("spec", "engine", "volumes", "[]", "name") in paths
    older = copy.deepcopy(ours)
    del older["properties"]["spec"]["properties"]["availability"]
    assert field_paths(older) < paths  # ours covers it: the operator upgrades
    newer = copy.deepcopy(ours)
    newer["properties"]["spec"]["properties"]["future"] = {"type": "string"}
    assert field_paths(newer) - paths == {("spec", "future")}  # a newer one: left as is


def test_the_api_key_secret_is_mounted_so_a_rotation_reaches_running_engines():
    """A mounted Secret is updated in place by the kubelet and the engine re-reads it (--api-key-file); an env var
    from the Secret would keep the old key until a restart."""
    spec = spec_of(auth={"apiKeySecretRef": {"name": "llm-keys", "key": "token"}})
    deployment = build_engine_deployment("m", "ns", spec)
    kubernetes_validate.validate(deployment, "1.35.0", strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert {"name": "api-key", "secret": {"secretName": "llm-keys", "items": [{"key": "token", "path": "api-key"}]}} \
        in pod["volumes"]
    assert {"name": "api-key", "mountPath": "/var/run/secrets/pagekube", "readOnly": True} in engine["volumeMounts"]
    assert engine["args"][engine["args"].index("--api-key-file") + 1] == "/var/run/secrets/pagekube/api-key"
    assert not any(e["name"] == "PAGEKUBE_API_KEY" for e in engine["env"])
    plain = build_engine_deployment("m", "ns", spec_of())["spec"]["template"]["spec"]
    assert "--api-key-file" not in plain["containers"][0]["args"] and all(v["name"] != "api-key" for v in plain["volumes"])
    with pytest.raises(ValidationError, match="api-key"):
        spec_of(engine={"volumes": [{"name": "api-key", "emptyDir": {}}]})
