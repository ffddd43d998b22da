"""The batched sampler against a per-row reference: the same kept sets, the same penalties, seeds independent of
the batch, and draws that follow the truncated distribution."""

from __future__ import annotations

import pytest
import torch

from bench.legacy_sampler import LegacySampler
from pagekube.engine.core.sequence import Request
from pagekube.engine.sample.sampler import TOP_P_TIERS, Sampler
from pagekube.engine.sampling_params import SamplingParams

VOCAB = 4096


def seq_with(params: SamplingParams, history: list[int] = (), prompt: list[int] = (1, 2, 3)):
    seq = Request("r", None, list(prompt), params, 64).seqs[0]
    seq.token_ids += list(history)
    return seq


def peaked(rows: int, seed: int = 0) -> torch.Tensor:
    """Logits whose top few hundred tokens hold nearly all the mass, as a language model's do."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 4


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) <= top_p
    return set(order[keep].tolist())


@pytest.mark.parametrize("logits", [peaked(1), torch.randn(1, VOCAB)], ids=["candidates", "full-sort-fallback"])
def test_top_p_draws_only_from_the_exact_nucleus_with_its_probabilities(logits):
    params = SamplingParams(temperature=1.0, top_p=0.8)
    probs = torch.softmax(logits[0], -1)
    kept = nucleus(probs, 0.8)
    if logits.std() < 2:
        assert len(kept) > TOP_P_TIERS[0]  # this case must exercise the fallback
    sampler = Sampler(set(), VOCAB, torch.device("cpu"), seed=1)
    draws = 4000
    out = sampler(logits.repeat(draws, 1), [seq_with(params) for _ in range(draws)]).token_ids
    assert set(out) <= kept
    top = max(kept, key=lambda t: probs[t].item())
    expected = probs[top].item() / sum(probs[t].item() for t in kept)
    assert out.count(top) / draws == pytest.approx(expected, abs=0.05)


def test_top_k_then_top_p_renormalizes_within_top_k():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0] + [0.0] * (VOCAB - 4)])
    # top_k=2 keeps tokens 0 and 1 (renormalized: 0.73 / 0.27); top_p=0.7 then keeps token 0 alone.
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.7)
    sampler = Sampler(set(), VOCAB, torch.device("cpu"))
    assert set(sampler(logits.repeat(200, 1), [seq_with(params) for _ in range(200)]).token_ids) == {0}


def test_a_seeded_row_gives_the_same_token_whatever_shares_its_batch():
    logits = peaked(6, seed=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    companions = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=7),
                  SamplingParams(temperature=1.0), SamplingParams(temperature=1.2, top_p=0.5, seed=5),
                  SamplingParams(temperature=1.0, min_p=0.1)]

    def draw(rows: list[int], params: list[SamplingParams]) -> list[int]:
        sampler = Sampler(set(), VOCAB, torch.device("cpu"), seed=0)
        seqs = [seq_with(p) for p in params]
        tokens = []
        for _ in range(5):  # the generator advances step by step, independently of the companions
            tokens.append(sampler(logits[rows], seqs).token_ids[params.index(seeded)])
        return tokens

    alone = draw([0], [seeded])
    assert draw([1, 2, 0, 3, 4, 5], [*companions[:2], seeded, *companions[2:]]) == alone
    assert draw([0, 5], [seeded, companions[0]]) == alone


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.8), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=0.4, logit_bias={9: 3.0, 11: -50.0}),
    dict(min_tokens=5, stop_token_ids=[17]),
])
def test_processors_match_the_per_row_reference(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB, generator=g)
    seqs = []
    for i in range(16):
        history = torch.randint(0, 64, (i,), generator=g).tolist()  # short vocabulary: tokens repeat
        prompt = torch.randint(0, 64, (5,), generator=g).tolist()
        seqs.append(seq_with(SamplingParams(temperature=0, **params), history, prompt))
    for s in seqs:  # make the banned and penalized tokens the likely ones, so the processors decide the argmax
        logits[seqs.index(s), s.token_ids] += 3.0
        logits[seqs.index(s), [2, 17]] += 6.0
    new = Sampler({2}, VOCAB, torch.device("cpu"))(logits.clone(), seqs).token_ids
    old = [t for t, _, _ in LegacySampler({2})(logits.clone(), seqs)]
    assert new == old


def test_penalty_counts_follow_the_sampled_tokens_incrementally():
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    seq = seq_with(params)
    sampler = Sampler(set(), VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([10.0, 9.5, 9.0])
    picked = []
    for _ in range(4):
        tok = sampler(logits.clone(), [seq]).token_ids[0]
        seq.token_ids.append(tok)
        picked.append(tok)
    assert picked == [0, 1, 2, 0]  # each pick costs its token 2 logits: 10 | 8 < 9.5 | 7.5 < 9 | 7 < 8
    sampler.release(seq)
    assert not sampler.penalties.rows and sampler.penalties.free_rows


def test_logprobs_are_the_model_distribution_and_top_k_is_sorted():
    logits = peaked(2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0, top_k=5, logprobs=0)]
    out = Sampler(set(), VOCAB, torch.device("cpu"))(logits.clone(), [seq_with(p) for p in params])
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == pytest.approx(lp[0].max().item(), abs=1e-5)
    top = out.top_logprobs[0]
    assert len(top) == 3 and list(top) == lp[0].topk(3).indices.tolist()
    assert out.top_logprobs[1] == {out.token_ids[1]: pytest.approx(lp[1, out.token_ids[1]].item(), abs=1e-5)}
