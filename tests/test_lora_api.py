"""LoRA adapters through a real `pagekube serve` and the official openai client: --lora-modules at start (a bad one
is left out, the rest serve), the request's `model` picking the adapter, /v1/models with `parent`, unknown adapters
404, runtime load (bad adapter 400) and unload (a stream already running finishes), and the LoRA metrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagekube.engine import LLM, LoRARequest, SamplingParams
from tests.conftest import write_tiny_llama
from tests.lora_adapters import ALL, ATTENTION, write_adapter
from tests.server_process import ServerProcess

BASE = "tiny-base"


@pytest.fixture(scope="module")
def files(tmp_path_factory, bundled_dir):
    d = tmp_path_factory.mktemp("lora-api")
    base = write_tiny_llama(d / "base", bundled_dir)
    other = write_tiny_llama(d / "other", bundled_dir, hidden_size=32, intermediate_size=64)
    return {"base": base, "attn": write_adapter(base, d / "attn", ATTENTION, seed=1),
            "all": write_adapter(base, d / "all", ALL, r=8, alpha=8, seed=2),
            "foreign": write_adapter(other, d / "foreign", ATTENTION)}


@pytest.fixture(scope="module")
def server(files):
    srv = ServerProcess(str(files["base"]), "--served-model-name", BASE, "--dtype", "float32", "--enable-lora",
                        "--max-loras", "2", "--lora-modules", f"attn={files['attn']}", f"broken={files['foreign']}",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(files):
    """The same model and adapters offline: what the server must answer."""
    llm = LLM(str(files["base"]), dtype="float32", enable_lora=True)

    def text(adapter: str, prompt: str, max_tokens: int) -> str:
        request = LoRARequest(adapter, 1 + sorted(files).index(adapter), str(files[adapter]))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([prompt], params, lora_request=request)[0].outputs[0].text
    return text


def test_models_lists_each_adapter_with_its_parent_and_not_the_broken_one(client, files, server):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, "attn"}
    assert models["attn"].parent == BASE and models["attn"].root == str(files["attn"])
    assert models[BASE].parent is None
    assert "LoRA adapter not served" in server.log() and "'broken'" in server.log()


def test_the_request_model_picks_the_adapter(client, offline):
    prompt, ignore_eos = "The capital of France is", {"ignore_eos": True}
    out = client.completions.create(model="attn", prompt=prompt, max_tokens=12, temperature=0, extra_body=ignore_eos)
    base = client.completions.create(model=BASE, prompt=prompt, max_tokens=12, temperature=0, extra_body=ignore_eos)
    assert out.model == "attn" and base.model == BASE
    assert out.choices[0].text == offline("attn", prompt, 12) != base.choices[0].text
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "attn" and chat.choices[0].message.content is not None


def test_an_unknown_adapter_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "attn" in e.value.body["message"]


def test_runtime_load_and_unload(client, server, files, offline):
    url = server.url + "/v1"
    bad = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "foreign", "lora_path": str(files["foreign"])})
    assert bad.status_code == 400 and "another base model" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad name", "lora_path": "/x"}).status_code == 400
    ok = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "all", "lora_path": str(files["all"])})
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'all' added successfully."
    again = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "all", "lora_path": str(files["all"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {BASE, "attn", "all"}

    # A stream on the adapter is running when it is unloaded: it finishes, every token; new requests get 404.
    stream = client.completions.create(model="all", prompt="Once upon a time", max_tokens=300, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'all' removed successfully."
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline("all", "Once upon a time", 300)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all", prompt="Hi", max_tokens=2)
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"}).status_code == 404


def test_lora_metrics(client, server):
    client.completions.create(model="attn", prompt="Hello", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert f'pagekube:lora_requests{{adapter="attn",engine="0",model_name="{BASE}",state="running"}} 0.0' in text
    assert f'pagekube:lora_adapter_loaded{{adapter="attn",engine="0",error="",model_name="{BASE}"}} 1.0' in text
    [broken] = [line for line in text.splitlines() if line.startswith('pagekube:lora_adapter_loaded{adapter="broken"')]
    assert broken.endswith(" 0.0") and "another base model" in broken, broken


def test_the_gateway_inference_extensions_metrics_read_as_a_set(client, server):
    """What the Gateway API Inference Extension's model-server protocol reads from a vLLM pod, during a stream to an
    adapter: queue and batch sizes, KV-cache usage, the cache's block size and block count, the LoRA info series."""
    from prometheus_client.parser import text_string_to_metric_families

    stream = client.completions.create(model="attn", prompt="Once upon a time", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    page = httpx.get(server.url + "/metrics").text
    for _ in stream:
        pass
    samples = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    assert samples["vllm:num_requests_running"][0].value >= 1
    assert samples["vllm:num_requests_waiting"][0].value >= 0
    assert 0 < samples["vllm:kv_cache_usage_perc"][0].value <= 1
    cache = samples["vllm:cache_config_info"][0].labels
    assert cache["block_size"] == "16" and int(cache["num_gpu_blocks"]) > 0
    [lora] = samples["vllm:lora_requests_info"]
    assert lora.labels["running_lora_adapters"] == "attn" and lora.labels["max_lora"] == "2"
    assert "waiting_lora_adapters" in lora.labels
    assert abs(lora.value - time.time()) < 60  # the latest update's time: the extension reads the newest series


def test_runtime_updating_is_off_without_vllms_switch(files):
    srv = ServerProcess(str(files["base"]), "--enable-lora", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""})
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(files["attn"])})
        assert r.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
    finally:
        srv.stop()
