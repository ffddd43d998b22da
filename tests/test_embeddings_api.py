"""/v1/embeddings through the official openai client against real `pagekube serve` processes: the OpenAI shape,
base64 and float, token ids, matryoshka dimensions, truncation, every documented error, metrics and logs."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import openai
import pytest

from tests.embedding_models import TEXTS, minilm_dir, write_tiny_bert
from tests.server_process import ServerProcess, json_log_lines


def start(*args: str) -> ServerProcess:
    return ServerProcess(*args).wait_ready()


@pytest.fixture(scope="module")
def minilm_server():
    srv = start(str(minilm_dir()), "--served-model-name", "all-MiniLM-L6-v2", "--dtype", "float32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(minilm_server):
    return openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="unused", max_retries=0)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_embeddings_match_sentence_transformers_in_the_openai_shape(client, minilm_server):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS)
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the client asks for base64
    assert r.object == "list" and r.model == "all-MiniLM-L6-v2" and [d.index for d in r.data] == list(range(len(TEXTS)))
    ours = vectors(r)
    cos = (ours * reference).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert cos.min() >= 0.9999
    tokens = sum(httpx.post(minilm_server.url + "/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_base64_equals_float_and_token_ids_equal_their_text(client, minilm_server):
    as_float = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float")
    raw = httpx.post(minilm_server.url + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    import base64

    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert np.array_equal(decoded, vectors(as_float))
    ids = [httpx.post(minilm_server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    by_ids = vectors(client.embeddings.create(model="all-MiniLM-L6-v2", input=ids))
    assert np.abs(by_ids - vectors(as_float)).max() < 1e-5
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[1])  # a single list of ids is one input
    assert len(one.data) == 1 and np.abs(vectors(one)[0] - by_ids[1]).max() < 1e-5


def test_concurrent_requests_share_forwards_and_each_gets_its_own_vectors(client):
    alone = [vectors(client.embeddings.create(model="all-MiniLM-L6-v2", input=[t]))[0] for t in TEXTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: vectors(client.embeddings.create(
            model="all-MiniLM-L6-v2", input=[TEXTS[i % len(TEXTS)]] * (1 + i % 3))), range(24)))
    for i, got in enumerate(together):
        assert got.shape[0] == 1 + i % 3
        assert np.abs(got - alone[i % len(TEXTS)]).max() < 1e-5


def bad_request(client, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", **kw)
    assert e.value.status_code == 400 and e.value.body["message"]
    return e.value


def test_every_bad_input_gets_a_400_naming_its_field_and_the_server_keeps_serving(client):
    assert bad_request(client, input=[]).body["param"] == "input"
    too_long = bad_request(client, input="word " * 300)
    assert too_long.body["param"] == "input" and "256" in too_long.body["message"]
    assert bad_request(client, input="x", dimensions=8).body["param"] == "dimensions"
    assert bad_request(client, input=[[1, 2, 10**9]]).body["param"] == "input"
    assert bad_request(client, input="x", extra_body={"truncate_prompt_tokens": 1000}).body["param"] == \
        "truncate_prompt_tokens"
    assert bad_request(client, input=["x"] * 2049).body["param"] == "input"
    assert bad_request(client, input=["x", 1]).body["param"].startswith("input")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    cut = client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 300, extra_body={"truncate_prompt_tokens": 16})
    assert cut.usage.prompt_tokens == 16
    assert len(client.embeddings.create(model="all-MiniLM-L6-v2", input="still serving").data) == 1


def test_a_pooling_model_refuses_completions(client):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model="all-MiniLM-L6-v2", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])


def test_requests_are_counted_under_vllm_names_and_logged_once_each(client, minilm_server):
    def counters() -> dict[str, float]:
        lines = httpx.get(minilm_server.url + "/metrics").text.splitlines()
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
                if ln.startswith(("vllm:prompt_tokens_total", 'vllm:request_success_total{engine="0",finished_reason="stop"'))}

    before = counters()
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=["one two", "three"], user="metrics-test")
    after = counters()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 2  # vLLM counts inputs
    logged = [e for e in json_log_lines(minilm_server.log_path)
              if e.get("event") == "request_finished" and r.id in str(e.get("id"))]
    assert len(logged) == 1 and logged[0]["inputs"] == 2 and "prompt" not in logged[0]


def test_matryoshka_dimensions_through_the_api(tmp_path_factory):
    path = write_tiny_bert(tmp_path_factory.mktemp("bert") / "m", pooling="mean", matryoshka=[16, 32])
    srv = start(str(path), "--dtype", "float32")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        full = vectors(c.embeddings.create(model="m", input="hello"))[0]
        cut = vectors(c.embeddings.create(model="m", input="hello", dimensions=16))[0]
        assert cut.shape == (16,) and np.abs(cut - full[:16] / np.linalg.norm(full[:16])).max() < 1e-5
        e = bad_request_on(c, "m", input="hello", dimensions=20)
        assert e.body["param"] == "dimensions" and "[16, 32]" in e.body["message"]
    finally:
        srv.stop()


def bad_request_on(c, model, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=model, **kw)
    return e.value


def test_a_generation_model_refuses_embeddings(tiny_dir):
    srv = start(str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", str(16 * 1024**2))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        e = bad_request_on(c, None, input="hello")
        assert "generates text" in e.body["message"] and e.body["code"] == "unsupported_model"
        assert c.completions.create(model=c.models.list().data[0].id, prompt="hi", max_tokens=2).choices
    finally:
        srv.stop()
