"""Every sampling parameter, on the bundled model; seeded sampling is reproducible across batch compositions."""

from __future__ import annotations

from collections import Counter

import pytest

from pagekube.engine import SamplingParams
from pagekube.engine.core.sequence import Request
from pagekube.engine.detokenizer import detokenize_incrementally, start_detokenizer

PROMPT = "Once upon a time, in a small village,"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.7, seed=9, max_tokens=5)]
    batched = llm.generate(["Hello there", PROMPT, "Tell me a joke"], [others[0], params, others[1]])
    assert alone == again == batched[1].outputs[0].token_ids
    other_seed = gen(llm, temperature=1.0, seed=4321, max_tokens=24)[0].token_ids
    assert other_seed != alone


def test_top_k_one_top_p_tiny_and_min_p_one_are_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16)[0].token_ids
    assert gen(llm, temperature=1.0, top_k=1, seed=1, max_tokens=16)[0].token_ids == greedy
    assert gen(llm, temperature=1.0, top_p=1e-6, seed=2, max_tokens=16)[0].token_ids == greedy
    assert gen(llm, temperature=1.0, min_p=1.0, seed=3, max_tokens=16)[0].token_ids == greedy


def test_high_temperature_differs_from_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16)[0].token_ids
    assert gen(llm, temperature=1.5, seed=5, max_tokens=16)[0].token_ids != greedy


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                     dict(repetition_penalty=2.0)])
def test_penalties_reduce_repetition(llm, penalty):
    prompt = "one one one one one one one one"
    plain = gen(llm, prompt, temperature=0, max_tokens=32, ignore_eos=True)[0].token_ids
    penalized = gen(llm, prompt, temperature=0, max_tokens=32, ignore_eos=True, **penalty)[0].token_ids
    assert Counter(penalized).most_common(1)[0][1] < Counter(plain).most_common(1)[0][1]


def test_stop_string_ends_generation_and_is_not_leaked(llm):
    full = gen(llm, temperature=0, max_tokens=32)[0].text
    stop = full[10:14]
    out = gen(llm, temperature=0, max_tokens=32, stop=[stop, "zzzz-never"])[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = gen(llm, temperature=0, max_tokens=32, stop=[stop], include_stop_str_in_output=True)[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    tokens = gen(llm, temperature=0, max_tokens=16)[0].token_ids
    out = gen(llm, temperature=0, max_tokens=16, stop_token_ids=[tokens[3]])[0]
    assert out.token_ids == tokens[: tokens.index(tokens[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[3]


def test_eos_ignore_eos_min_tokens_and_max_tokens(llm):
    prompt = llm.apply_chat_template(CHAT)
    natural = gen(llm, prompt, temperature=0, max_tokens=64)[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in llm.engine.eos_token_ids
    n = len(natural.token_ids)
    ignored = gen(llm, prompt, temperature=0, max_tokens=n + 10, ignore_eos=True)[0]
    assert len(ignored.token_ids) == n + 10 and ignored.finish_reason == "length"
    at_least = gen(llm, prompt, temperature=0, max_tokens=64, min_tokens=n + 5)[0]
    assert len(at_least.token_ids) >= n + 5
    assert not set(at_least.token_ids[: n + 4]) & llm.engine.eos_token_ids
    short = gen(llm, prompt, temperature=0, max_tokens=3)[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_n_samples_share_the_prompt_and_differ(llm):
    outs = gen(llm, temperature=1.0, n=3, seed=11, max_tokens=16)
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert outs[0].token_ids == gen(llm, temperature=1.0, n=3, seed=11, max_tokens=16)[0].token_ids
    assert llm.engine.block_manager.usage == 0.0


def test_n_greedy_samples_are_identical_even_after_copy_on_write(llm):
    outs = gen(llm, temperature=0, n=2, max_tokens=20)
    single = gen(llm, temperature=0, max_tokens=20)[0]
    assert outs[0].token_ids == outs[1].token_ids == single.token_ids


def test_logprobs(llm):
    out = gen(llm, temperature=0, max_tokens=8, logprobs=3)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert len(lp) >= 3 and all(v <= 0 for v in lp.values())
        assert lp[tok] == max(lp.values())  # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)), abs=1e-4)


def test_logit_bias_forces_a_token(llm):
    tok = llm.tokenizer.encode(" banana")[0]
    out = gen(llm, temperature=0, max_tokens=5, logit_bias={tok: 100.0})[0]
    assert out.token_ids == [tok] * 5


@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "offsets"])
def test_incremental_detokenization_never_emits_broken_utf8(llm, decode_stream):
    text = "日本の首都は東京です。🙂 Ça va? Grüße!"
    ids = llm.tokenizer.encode(text)
    req = Request("u", None, [1], SamplingParams(), 64)
    seq = req.seqs[0]
    start_detokenizer(seq, llm.tokenizer)
    assert seq.decode_stream is not None  # the fast tokenizer's DecodeStream
    if not decode_stream:
        seq.decode_stream = None  # the fallback for tokenizers without a Rust backend
    deltas = []
    for t in ids:
        seq.token_ids.append(t)
        deltas.append(detokenize_incrementally(llm.tokenizer, seq))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == llm.tokenizer.decode(ids)
    assert any(d == "" for d in deltas), "multi-byte characters should have been held back at least once"


def test_invalid_sampling_params_are_rejected():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0), dict(stop=[""]),
                dict(min_tokens=5, max_tokens=2), dict(logit_bias={1: 1000.0})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
