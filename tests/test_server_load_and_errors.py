"""64 concurrent streams and the metrics they leave; bad input of every kind; client disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess, metric

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server(bundled_dir):
    srv = ServerProcess(str(bundled_dir), "--served-model-name", MODEL, "--kv-cache-memory", str(128 * 1024**2),
                        "--max-model-len", "512", "--max-body-bytes", "65536", "--api-key", KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics").text


def wait_idle(server, timeout=30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        if (metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
                and metric(text, "vllm:kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
            return text


def test_64_concurrent_streams_complete_and_metrics_add_up(server):
    before = wait_idle(server)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(i):
        stream = await client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=6 + i % 5,
                                                 temperature=0.7, seed=i, stream=True,
                                                 stream_options={"include_usage": True})
        finish, use = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                use = chunk.usage
        return finish, use

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert all(f in ("stop", "length") for f, _ in results)
    prompt_sum = sum(u.prompt_tokens for _, u in results)
    gen_sum = sum(u.completion_tokens for _, u in results)
    after = wait_idle(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total", model_name=MODEL) == prompt_sum
    assert delta("vllm:generation_tokens_total", model_name=MODEL) == gen_sum
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 64
    assert delta("vllm:e2e_request_latency_seconds_count") == 64
    assert delta("vllm:inter_token_latency_seconds_count") == gen_sum - 64
    assert delta("vllm:request_success_total", finished_reason="length") + \
        delta("vllm:request_success_total", finished_reason="stop") == 64
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count"):
        assert delta(name) == 64
    assert metric(after, "vllm:iteration_tokens_total_count") > 0
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "pagekube:draining", "pagekube:kv_cache_fragmentation_ratio"):
        metric(after, name)  # exported


def post(server, path, body, headers=None, raw=None):
    h = {**auth(), "content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=h, timeout=60)


def assert_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
BAD_BODIES = [
    ("malformed json", None, b'{"model": "x", "prompt": '),
    ("invalid utf-8", None, b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}'),
    ("wrong type", {**GOOD, "max_tokens": "ten"}, None),
    ("missing prompt", {"model": MODEL, "max_tokens": 2}, None),
    ("negative max_tokens", {**GOOD, "max_tokens": -1}, None),
    ("huge max_tokens", {**GOOD, "max_tokens": 10**9}, None),
    ("temperature out of range", {**GOOD, "temperature": 5}, None),
    ("too long prompt", {**GOOD, "prompt": "hello " * 600}, None),
    ("empty prompt list", {**GOOD, "prompt": []}, None),
    ("bad logit_bias", {**GOOD, "logit_bias": {"abc": 1}}, None),
]


@pytest.mark.parametrize("name,body,raw", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_completion_input_gets_400_and_the_next_request_succeeds(server, name, body, raw):
    assert_error(post(server, "/v1/completions", body, raw=raw), 400)
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_bad_chat_input(server):
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "nobody", "content": "x"}]}), 400)
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400)
    ok = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_model_bad_key_and_oversized_body(server):
    err = assert_error(post(server, "/v1/completions", {**GOOD, "model": "gpt-17"}), 404)
    assert err["param"] == "model"
    assert_error(post(server, "/v1/completions", GOOD, headers={"Authorization": "Bearer wrong"}), 401)
    r = httpx.post(server.url + "/v1/completions", json=GOOD)
    assert_error(r, 401)
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert_error(post(server, "/v1/completions", {**GOOD, "prompt": "x" * 70000}), 413)
    assert post(server, "/v1/completions", GOOD).status_code == 200
    chunked = json.dumps({**GOOD, "prompt": "x" * 70000}).encode()
    for body, code in ((chunked, 413), (json.dumps(GOOD).encode(), 200)):  # no Content-Length: counted as it comes
        r = httpx.post(server.url + "/v1/completions", content=iter([body[:1000], body[1000:]]),
                       headers={**auth(), "content-type": "application/json"})
        assert "content-length" not in r.request.headers and r.status_code == code, r.text
        if code == 413:
            assert_error(r, 413)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=6)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "stream",
          "logit_bias", "presence_penalty", "top_k", "min_tokens", "echo", "stop_token_ids", "messages"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6), st.sampled_from(["/v1/completions",
                                                                                         "/v1/chat/completions"]))
def test_fuzzed_bodies_never_get_a_5xx(server, body, path):
    body.setdefault("max_tokens", 2)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # keep the generation short; huge values are covered above
    body["n"] = body["n"] if isinstance(body.get("n"), int) and body["n"] < 3 else 1
    r = post(server, path, body)
    assert r.status_code < 500, (body, r.text)


def test_client_disconnect_mid_stream_frees_blocks_and_counts_abort(server):
    before = wait_idle(server)
    with httpx.stream("POST", server.url + "/v1/completions", headers=auth(), timeout=60,
                      json={"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 400, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        during = metrics(server)
        assert metric(during, "vllm:kv_cache_usage_perc") > 0
    after = wait_idle(server)
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == \
        metric(before, "vllm:request_success_total", finished_reason="abort") + 1


def test_errors_found_when_building_sampling_params_name_the_field(server):
    err = assert_error(post(server, "/v1/completions", {**GOOD, "min_tokens": 5, "max_tokens": 2, "stop": [""]}), 400)
    assert err["param"] == "stop" and "empty" in err["message"]
    err = assert_error(post(server, "/v1/completions", {**GOOD, "logit_bias": {"5": 500}}), 400)
    assert err["param"] == "logit_bias" and "100" in err["message"]
