"""The real server process, driven by the official openai client: completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import pytest

from pagekube.kernels.cpu_ops import cpu_supports_bf16_dot

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_usage_matches_the_tokenizer(client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 8 == len(tokenizer.encode(r.choices[0].text))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.choices[0].finish_reason == "length"


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kw = dict(model=MODEL, prompt="Write a haiku about the sea:", max_tokens=24, temperature=0.9, seed=77)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "Name three fruits."}]
    ckw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=0.8, seed=5)
    chat = client.chat.completions.create(**ckw).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ckw)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens > 0


def test_chat_n2_logprobs_and_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], n=2,
                                       temperature=1.0, seed=3, max_tokens=12, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) >= 1
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0].text
    stop = full.strip().split(",")[2].strip()  # e.g. "7"
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 4 and len(c.choices[0].logprobs.top_logprobs[0]) >= 2


def test_tokenize_detokenize_version_ping(server, tokenizer):
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["tokens"] == tokenizer.encode("Hello world") and t["count"] == len(t["tokens"])
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    version = httpx.get(server.url + "/version").json()
    assert version["version"]
    assert httpx.get(server.url + "/ping").status_code == 200
    # Which kernels run, on /version and as an info metric with the same labels.
    kernels = version["kernels"]
    assert kernels["device"] == "cpu" and kernels["attention"] == "torch"
    if cpu_supports_bf16_dot():  # the default dtype here is bf16, where the compiled CPU kernels run
        assert kernels["dtype"] == "bfloat16" and "linear" in kernels["cpu_kernels"].split(","), kernels
    info = [line for line in httpx.get(server.url + "/metrics").text.splitlines() if line.startswith("pagekube:kernels_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    assert all(f'{k}="{v}"' in info[0] for k, v in kernels.items()), info


def test_echo_and_multiple_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("Hello") and r.choices[1].text.startswith("Goodbye")
    chunks = list(client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0,
                                            echo=True, stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            by_index[choice.index] += choice.text
    assert by_index == {0: r.choices[0].text, 1: r.choices[1].text}
