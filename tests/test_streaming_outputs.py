"""Delta outputs: the engine hands out only what is new, and the server forwards it as is."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.sampling_params import RequestOutputKind
from tests.server_process import ServerProcess


def outputs(engine: LLMEngine, prompt, params: SamplingParams) -> list:
    engine.add_request("r", prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    return seen


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    return LLMEngine(EngineConfig(model=str(tiny_dir)))


def test_delta_outputs_carry_only_new_tokens_and_add_up_to_the_final_output(tiny_engine):
    kw = dict(temperature=1.0, seed=3, max_tokens=300, ignore_eos=True, logprobs=1, n=2, stop=["zz-never"])
    deltas = outputs(tiny_engine, [5, 6, 7], SamplingParams(output_kind=RequestOutputKind.DELTA, **kw))
    final = outputs(tiny_engine, [5, 6, 7], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kw))
    assert len(final) == 1 and final[0].finished
    for choice in final[0].outputs:
        mine = [o for out in deltas for o in out.outputs if o.index == choice.index]
        assert all(len(o.token_ids) == 1 for o in mine)  # one new token per step, never the history
        assert sum((o.token_ids for o in mine), []) == choice.token_ids
        assert "".join(o.text for o in mine) == choice.text
        assert sum((o.logprobs for o in mine), []) == choice.logprobs
        assert [o.finish_reason for o in mine].count("length") == 1 and mine[-1].finish_reason == "length"


def test_cumulative_outputs_still_hold_everything(tiny_engine):
    outs = outputs(tiny_engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    srv = ServerProcess(str(tiny_dir), "--served-model-name", "tiny")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_a_2000_token_stream_sends_each_token_once_and_matches_the_plain_response(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(model="tiny", prompt="Count with me:", max_tokens=2000, temperature=0.8, seed=11,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, logprobs=0, **kw))
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert sum(per_chunk) == 2000 and set(per_chunk) == {1}
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 2000


def test_stream_usage_counts_every_choice_of_every_prompt(tiny_server):
    body = {"model": "tiny", "prompt": ["a b", "c d e"], "n": 2, "max_tokens": 7, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * 2 * 7
    assert sorted(c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]) == [0, 1, 2, 3]


def test_metrics_have_vllms_request_phase_series_labels_and_no_created_series(tiny_server):
    from tests.server_process import metric

    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 5, "n": 2, "ignore_eos": True},
               timeout=60)
    text = httpx.get(tiny_server.url + "/metrics").text
    assert "_created" not in text
    labels = {"model_name": "tiny", "engine": "0"}
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:request_params_max_tokens", "vllm:request_params_n", "vllm:e2e_request_latency_seconds"):
        assert metric(text, name + "_count", **labels) >= 1, name
    assert metric(text, "vllm:request_params_n_sum", **labels) >= 2
    assert metric(text, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True", **labels) == 1
