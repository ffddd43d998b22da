"""vLLM's check_logprobs_close rule for greedy outputs, and transformers' greedy reference it is checked against
(tests/test_batch_invariance.py, bench/batch_invariance.py)."""

from __future__ import annotations

import torch


def top5(logprobs: dict) -> set[int]:
    """The 5 most likely token ids of one position's logprobs (an engine output's {token id: logprob})."""
    return set(sorted(logprobs, key=logprobs.get, reverse=True)[:5])


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens after `ids`, and the top 5 token ids at each position."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, pad_token_id=2, output_scores=True, return_dict_in_generate=True)
    return gen.sequences[0, len(ids):].tolist(), [set(score[0].topk(5).indices.tolist()) for score in gen.scores]


def parting(ours, theirs: list[int], their_top5: list[set[int]]) -> tuple[int, int, int] | None:
    """Against vLLM's rule, where an engine output (token_ids, logprobs) parts from a reference: at the first token
    where they differ, each must be in the other's top 5. (position, ours, theirs) where it is not; else None."""
    for i, (a, b) in enumerate(zip(ours.token_ids, theirs)):
        if a != b:
            return None if a in their_top5[i] and b in top5(ours.logprobs[i]) else (i, a, b)
    return None
