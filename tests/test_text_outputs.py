"""Text made off the engine thread (engine/text_outputs.py): token deltas become the output kind a request asked
for, stop strings cut the text and drop later tokens, and in the server detokenization never runs on the engine
thread."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from pagekube.engine.async_engine import AsyncEngine
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams
from pagekube.engine.server.app import ServerState, create_app
from pagekube.engine.text_outputs import RequestText

TEXT = "Hello world. Goodbye, cruel world! Ünïcödé 🙂 at the end."


@pytest.fixture(scope="module")
def tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir)


def deltas(tokenizer, text=TEXT, per=2):
    """The engine's view: token deltas of `per` tokens, the last one with finish_reason length."""
    ids = tokenizer.encode(text)
    chunks = [ids[i:i + per] for i in range(0, len(ids), per)]
    return [RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", chunk, None, None,
                                                               "length" if i == len(chunks) - 1 else None)],
                          i == len(chunks) - 1) for i, chunk in enumerate(chunks)]


def feed(text: RequestText, outs):
    shown, stops = [], []
    for out in outs:
        o, s = text.apply(out)
        stops += s
        if o is not None:
            shown.append(o)
        if o is not None and o.finished:
            break
    return shown, stops


def test_delta_outputs_add_up_to_the_decoded_text(tokenizer):
    text = RequestText(tokenizer, [1, 2], SamplingParams(output_kind=RequestOutputKind.DELTA))
    shown, stops = feed(text, deltas(tokenizer))
    assert not stops and shown[-1].finished and shown[-1].outputs[-1].finish_reason == "length"
    assert "".join(c.text for o in shown for c in o.outputs) == tokenizer.decode(tokenizer.encode(TEXT))
    assert all("\ufffd" not in c.text for o in shown for c in o.outputs)


def test_a_stop_string_cuts_the_text_drops_later_tokens_and_tells_the_engine(tokenizer):
    params = SamplingParams(stop=["Goodbye"], output_kind=RequestOutputKind.FINAL_ONLY)
    text = RequestText(tokenizer, [1, 2], params)
    shown, stops = feed(text, deltas(tokenizer))
    assert len(shown) == 1 and shown[0].finished  # FINAL_ONLY: one output, once the choice ended
    out = shown[0].outputs[0]
    assert out.text == "Hello world. " and (out.finish_reason, out.stop_reason) == ("stop", "Goodbye")
    assert tokenizer.decode(out.token_ids).endswith("Goodbye") or "Good" in tokenizer.decode(out.token_ids[-2:])
    assert [(s.index, s.stop, s.num_output_tokens) for s in stops] == [(0, "Goodbye", len(out.token_ids))]


def test_streams_hold_back_what_could_still_become_a_stop_string(tokenizer):
    params = SamplingParams(stop=["cruel world?"], output_kind=RequestOutputKind.DELTA)
    text = RequestText(tokenizer, [1, 2], params)
    shown, held_back = "", False
    for out in deltas(tokenizer, per=1):
        o, stops = text.apply(out)
        assert not stops  # "cruel world!" is not the stop string
        shown += "".join(c.text for c in o.outputs) if o else ""
        if text.choices[0].text.endswith("cruel world"):  # "?" could still follow: none of it may be out
            held_back = True
            assert "cruel" not in shown
    assert held_back and shown == tokenizer.decode(tokenizer.encode(TEXT))


def test_the_engine_finishes_a_sequence_a_stop_string_ended_keeping_its_tokens(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.outputs.inline_text = False
    req = engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(6):
        engine.step()
    out = engine.finish_by_stop("r", 0, "stop!", 3)
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "stop!"
    assert req.seqs[0].num_output_tokens == 3  # the tokens computed past the stop string are dropped
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0.0


def test_in_the_server_text_is_made_on_the_detokenizer_thread_only(tiny_dir, monkeypatch):
    from pagekube.engine import output_processor, text_outputs

    threads = []
    apply = text_outputs.RequestText.apply
    monkeypatch.setattr(text_outputs.RequestText, "apply",
                        lambda self, out: threads.append(threading.current_thread().name) or apply(self, out))
    monkeypatch.setattr(output_processor, "detokenize_incrementally",
                        lambda *a: pytest.fail("detokenized on the engine thread"))
    state = ServerState(EngineConfig(model=str(tiny_dir)))
    state.engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_dir))))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://a") as c:
            plain = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True})
            streamed = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True, "n": 2})
            return plain, streamed
    try:
        plain, streamed = asyncio.run(ask())
    finally:
        state.engine.shutdown()
    assert plain.json()["usage"]["completion_tokens"] == 6 and plain.json()["choices"][0]["finish_reason"] == "length"
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    finishes = {c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]}
    assert streamed.text.rstrip().endswith("data: [DONE]") and finishes == {0: "length", 1: "length"}
    assert threads and set(threads) == {"detokenizer_0"}, set(threads)
