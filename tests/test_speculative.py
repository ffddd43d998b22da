"""Speculative decoding: greedy output identical to plain decoding (n-gram, draft model), sampling distributed as
the target's (chi-square against exact probabilities), drafts that respect the request's processors, and a clear
error for a draft with another vocabulary. The block manager's property test covers the KV rollback (trim)."""

from __future__ import annotations

import pytest
import torch

from pagekube.engine import LLM, SamplingParams
from pagekube.engine.sampling_params import StructuredOutputsParams
from pagekube.engine.spec_decode.speculative import SpeculativeConfig
from tests.conftest import write_tiny_llama

# Outputs that copy from the prompt (where n-gram lookup pays), and one that does not.
PROMPTS = [
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes. List: apples, bananas,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Copy the address: 221B Baker Street, London NW1 6XE, United Kingdom. Address: 221B",
    "Once upon a time, in a small village by the sea, there lived",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # the bundled model's KV per 16-token block in float32


def engine(bundled_dir, spec=None, blocks=None, **kwargs) -> LLM:
    memory = (blocks * BLOCK_BYTES * (2 if spec and "model" in spec else 1)) if blocks else 64 * 1024**2
    return LLM(str(bundled_dir), dtype="float32", kv_cache_memory=memory, speculative_config=spec, **kwargs)


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(bundled_dir):
    return engine(bundled_dir)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return token_ids(plain, PROMPTS)


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_ngram_greedy_equals_plain_decoding(bundled_dir, reference, batched):
    llm = engine(bundled_dir, NGRAM)
    prompts = PROMPTS if batched else PROMPTS[:1]
    assert token_ids(llm, prompts) == reference[: len(prompts)]
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # it speculated, and was sometimes wrong
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]


def test_ngram_greedy_equals_plain_decoding_under_preemption(bundled_dir, reference):
    llm = engine(bundled_dir, NGRAM, blocks=8)  # 4 sequences of 50-70 tokens need ~17 blocks
    assert token_ids(llm, PROMPTS) == reference
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.spec_stats.num_accepted_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every draft slot given back


def test_the_target_as_its_own_draft_accepts_everything(bundled_dir, reference):
    llm = engine(bundled_dir, {"model": str(bundled_dir), "num_speculative_tokens": 3}, blocks=8)
    assert token_ids(llm, PROMPTS) == reference
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0  # the draft's pool is preempted with the target's


def test_a_random_draft_with_the_same_vocabulary_changes_nothing(bundled_dir, reference, tmp_path):
    draft = write_tiny_llama(tmp_path / "draft", bundled_dir)
    llm = engine(bundled_dir, {"model": str(draft), "num_speculative_tokens": 2})
    assert token_ids(llm, PROMPTS) == reference
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_with_another_vocabulary_is_refused_at_startup(bundled_dir, tmp_path):
    draft = write_tiny_llama(tmp_path / "draft", bundled_dir, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 1000 != the target's 49152.*share the target's tokenizer"):
        engine(bundled_dir, {"model": str(draft), "num_speculative_tokens": 2})


def test_processors_stop_strings_and_structured_outputs_see_every_token(bundled_dir, plain):
    """Penalties, logit bias, stop strings, max_tokens and a JSON schema: drafts change none of the outputs."""
    cases = [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, logit_bias={28: -5.0}),
        SamplingParams(temperature=0, max_tokens=40, stop=["dates", "Kingdom"]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"fruit": {"type": "array", "items": {"type": "string"}}},
                  "required": ["fruit"]})),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, n=2),
    ]
    llm = engine(bundled_dir, NGRAM)
    for params in cases[:-1]:
        assert token_ids(llm, PROMPTS, params) == token_ids(plain, PROMPTS, params), params
    outs = llm.generate(PROMPTS, cases[-1])
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 30 for c in o.outputs) for o in outs)


def test_speculative_config_validation():
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3}').method == "ngram"
    assert SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3}).method == "draft_model"
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)
    for bad in ({"method": "draft_model", "num_speculative_tokens": 2}, {"num_speculative_tokens": 0},
                {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                {"num_speculative_tokens": 2, "typo": 1}):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


# ---- sampling: the output distribution is the target's --------------------------------------------------------
VOCAB, PROMPT, TEMPERATURE, SAMPLES = 16, [1, 5, 9], 0.7, 3000


def exact_marginals(model_dir, steps: int) -> list[torch.Tensor]:
    """P(token at each output position), summed over every path, from Hugging Face's model (the reference)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    marginals, path_probs = [], {(): 1.0}
    with torch.no_grad():
        for _ in range(steps):
            paths = list(path_probs)
            logits = hf(torch.tensor([PROMPT + list(p) for p in paths])).logits[:, -1, :VOCAB]
            probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
            weights = torch.tensor([path_probs[p] for p in paths], dtype=torch.float64)
            marginals.append(weights @ probs)
            path_probs = {p + (t,): w * probs[i, t].item() for i, (p, w) in enumerate(zip(paths, weights.tolist()))
                          for t in range(VOCAB)}
    return marginals


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit, bins with fewer than 5 expected merged into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


@pytest.fixture(scope="module")
def peaked_target(bundled_dir, tmp_path_factory):
    # Large init: peaked next-token distributions, so a wrong acceptance rule moves mass visibly.
    return write_tiny_llama(tmp_path_factory.mktemp("peaked"), bundled_dir, vocab_size=VOCAB, initializer_range=0.5,
                            seed=1)


def p_values_per_position(target) -> tuple[list[float], LLM]:
    # The target is its own (greedy) draft: its guesses are the likeliest tokens, accepted often but far from always
    # at this temperature.
    llm = LLM(str(target), dtype="float32", speculative_config={"model": str(target), "num_speculative_tokens": 2})
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True, seed=s) for s in range(SAMPLES)]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * SAMPLES, params)]
    p_values = []
    for pos, probs in enumerate(exact_marginals(target, 4)):
        counts = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=VOCAB)
        p_values.append(chi_square_p_value(counts, probs))
    return p_values, llm


def test_speculative_sampling_keeps_the_target_distribution(peaked_target):
    p_values, llm = p_values_per_position(peaked_target)
    stats = llm.engine.spec_stats
    assert stats.accepted_per_pos[0] > SAMPLES / 10 and stats.accepted_per_pos[1] > 0  # drafts were accepted
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ... and rejected
    assert min(p_values) > 1e-3, p_values


def test_the_chi_square_check_catches_a_wrong_acceptance_rule(peaked_target, monkeypatch):
    """The same check fails when the engine keeps the first draft whatever the target sampled."""
    from pagekube.engine.spec_decode.speculative import SpeculativeDecoder

    verify = SpeculativeDecoder.verify

    def always_accept_first_draft(self, logits, speculating, *args):
        for seq, _ in speculating:
            seq.token_ids[-1] = seq.spec_tokens[0]
        return verify(self, logits, speculating, *args)

    monkeypatch.setattr(SpeculativeDecoder, "verify", always_accept_first_draft)
    p_values, _ = p_values_per_position(peaked_target)
    assert p_values[0] > 1e-3 and p_values[1] < 1e-6, p_values  # the first token is never speculated


# ---- the server: the flag, the metrics ----------------------------------------------------------------------
def test_server_speculates_with_the_vllm_flag_and_exports_vllm_metrics(bundled_dir, reference):
    import json

    import httpx
    import openai

    from tests.server_process import ServerProcess, metric

    srv = ServerProcess(str(bundled_dir), "--dtype", "float32", "--kv-cache-memory", str(64 * 1024**2),
                        "--speculative-config", json.dumps(NGRAM))
    try:
        client = openai.OpenAI(base_url=srv.wait_ready().url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40, temperature=0, logprobs=0)
        text = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    assert out.choices[0].text == plain_text(bundled_dir, reference[0])
    drafts, proposed = metric(text, "vllm:spec_decode_num_drafts_total"), metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed and sum(per_pos) == accepted
    assert metric(text, "vllm:generation_tokens_total") == 40  # accepted drafts count as generated tokens


def plain_text(bundled_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir).decode(ids)


def test_a_malformed_speculative_config_is_a_clear_startup_error(bundled_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pagekube.engine.server", str(bundled_dir), "--speculative-config",
                          '{"method": "ngram"}'], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "speculative_config" in out.stderr and "num_speculative_tokens" in out.stderr


def test_a_draft_catch_up_is_cut_to_the_token_budget_and_changes_nothing(bundled_dir, tmp_path):
    draft = write_tiny_llama(tmp_path / "draft", bundled_dir)
    plain_small = engine(bundled_dir, max_num_batched_tokens=16)
    llm = engine(bundled_dir, {"model": str(draft), "num_speculative_tokens": 2}, max_num_batched_tokens=16)
    runner = llm.engine.proposer.runner
    sizes, forward = [], runner.forward

    def counted(items, *args):
        sizes.append(sum(len(tokens) for _, _, tokens, _ in items))
        return forward(items, *args)
    runner.forward = counted
    assert token_ids(llm, PROMPTS) == token_ids(plain_small, PROMPTS)
    assert max(sizes) == 16  # prompts of 20+ tokens were caught up in pieces, none past the budget


def test_the_draft_model_is_in_memory_when_the_target_sizes_its_pool(bundled_dir, tmp_path, monkeypatch):
    """On a GPU the pool takes what memory is left after a profile, so the draft's weights must already be
    loaded then. No GPU here: the order is what is checked (load_model and the sizing are spied on)."""
    from pagekube.engine.model import model_runner

    draft = write_tiny_llama(tmp_path / "draft", bundled_dir)
    events, load, size = [], model_runner.load_model, model_runner.ModelRunner._num_kv_blocks
    monkeypatch.setattr(model_runner, "load_model", lambda cfg, path, *a: events.append(f"load {path}") or load(
        cfg, path, *a))
    monkeypatch.setattr(model_runner.ModelRunner, "_num_kv_blocks",
                        lambda self, shared: events.append("size pool") or size(self, shared))
    llm = engine(bundled_dir, {"model": str(draft), "num_speculative_tokens": 2})
    assert events == [f"load {draft}", f"load {bundled_dir}", "size pool"]
    assert llm.engine.proposer.runner.num_blocks == llm.engine.runner.num_blocks
