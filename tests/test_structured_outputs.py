"""Structured outputs on the bundled SmolLM2: every constrained output is in its language (checked independently:
jsonschema, Python's re, the choice list), greedy and sampled, mixed in one batch with unconstrained requests.
The server tests drive the real server with the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from pagekube.engine.errors import RequestRejected
from pagekube.engine.sampling_params import SamplingParams, StructuredOutputsParams

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SUM_GRAMMAR = 'root ::= number (("+" | "-") number){0,3}\nnumber ::= [1-9] [0-9]{0,2}'  # the same language:
SUM_REGEX = r"[1-9][0-9]{0,2}([+-][1-9][0-9]{0,2}){0,3}"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


def so(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def test_every_constraint_holds_greedy_and_sampled_next_to_unconstrained_requests(llm):
    plain = SamplingParams(temperature=0, max_tokens=24)
    cases = [  # (prompt, params, check of one output text)
        ("A user record as JSON:", SamplingParams(temperature=0, max_tokens=80, structured_outputs=so(json=PERSON)),
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("A user record as JSON:", SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=80,
                                                  structured_outputs=so(json=json.dumps(PERSON))),
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("Call me at", SamplingParams(temperature=0.9, seed=1, max_tokens=20, structured_outputs=so(regex=PHONE)),
         lambda t: re.fullmatch(PHONE, t) or pytest.fail(t)),
        ("Is 'I love it' positive or negative?", SamplingParams(temperature=0, max_tokens=10,
                                                                structured_outputs=so(choice=["positive", "negative"])),
         lambda t: t in ("positive", "negative") or pytest.fail(t)),
        ("Add some numbers:", SamplingParams(temperature=1.0, seed=2, max_tokens=30, structured_outputs=so(grammar=SUM_GRAMMAR)),
         lambda t: re.fullmatch(SUM_REGEX, t) or pytest.fail(t)),
        ("Any JSON object:", SamplingParams(temperature=0.7, seed=3, max_tokens=80, structured_outputs=so(json_object=True)),
         lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        ("The capital of France is", plain, None),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    for (_, params, check), out in zip(cases, outs, strict=True):
        assert len(out.outputs) == params.n
        for o in out.outputs:
            if check is not None:
                assert o.finish_reason == "stop", (o.text, o.finish_reason)  # the document completed
                check(o.text)
    # The unconstrained request in that batch is untouched by its neighbours' masks.
    assert outs[-1].outputs[0].text == llm.generate("The capital of France is", plain)[0].outputs[0].text


def test_max_tokens_mid_document_finishes_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=so(json=PERSON))
    out = llm.generate("A user record as JSON:", params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):  # cut off: the caller sees "length" and must not trust the text
        json.loads(out.text)


@pytest.mark.parametrize("kind, field", [({"json": {"type": 12}}, "structured_outputs.json"),
                                         ({"regex": "(unclosed"}, "structured_outputs.regex"),
                                         ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar")])
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(llm, kind, field):
    with pytest.raises(RequestRejected) as e:
        llm.engine.prepare_request("x", "hi", SamplingParams(structured_outputs=so(**kind)))
    assert e.value.param == field and "does not compile" in str(e.value)


def test_exactly_one_kind_of_constraint():
    for bad in ({}, {"json": PERSON, "regex": "a"}, {"choice": []}):
        with pytest.raises(ValueError):
            StructuredOutputsParams(**bad)


# ---- the server, through the official client ---------------------------------------------------------------------
def person_format(strict=True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_chat_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Make up a user of our system."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                       response_format=person_format())
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}],
                                       max_tokens=150, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_vllm_fields_new_and_old(client):
    def text(**extra):
        r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0, extra_body=extra)
        return r.choices[0].text

    assert text(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    assert text(guided_choice=["red", "green", "blue"]) in ("red", "green", "blue")
    assert re.fullmatch(PHONE, text(guided_regex=PHONE))
    assert re.fullmatch(SUM_REGEX, text(guided_grammar=SUM_GRAMMAR))
    jsonschema.validate(json.loads(text(guided_json=PERSON, max_tokens=80)), PERSON)
    r = client.completions.create(model=MODEL, prompt="A user:", max_tokens=80, temperature=0,
                                  extra_body={"response_format": person_format()})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_streamed_chunks_concatenate_to_a_valid_document(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A user, please."}], max_tokens=80, temperature=1.0,
        seed=9, stream=True, response_format=person_format())
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and len([p for p in pieces if p]) > 3
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 12}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": PERSON, "guided_regex": "a"}, None),  # two constraints at once
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_keeps_serving(server, client, extra, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert (err["param"] or "").startswith(param), err
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"guided_choice": ["a", "b"]})
    assert ok.choices[0].text in ("a", "b")
