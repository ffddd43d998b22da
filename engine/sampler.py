"""Sampler: logits processors (penalties, bias, min_tokens) then greedy or seeded random choice, per sequence.

Random choice uses the exponential race (argmax of p / Exp(1) noise), drawn from the sequence's own generator when
it has a seed, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekube.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None  # sampled token + the top-k, when asked


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed of their own

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        logits = logits.float().cpu()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        return [self._sample_one(logits[i].clone(), raw_logprobs[i], seq) for i, seq in enumerate(seqs)]

    def _sample_one(self, logits: torch.Tensor, raw_logprobs: torch.Tensor, seq: Sequence) -> SampleResult:
        p = seq.request.params
        self._apply_processors(logits, seq)
        if p.greedy:
            token = int(torch.argmax(logits))
        else:
            logits = logits / p.temperature
            if p.top_k > 0:
                kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
                logits[logits < kth] = float("-inf")
            probs = torch.softmax(logits, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
                probs[order[outside]] = 0.0
            if p.min_p > 0.0:
                probs[probs < p.min_p * probs.max()] = 0.0
            noise = torch.empty_like(probs).exponential_(1.0, generator=seq.generator or self.generator)
            token = int(torch.argmax(probs / noise))
        top = None
        if p.logprobs is not None:
            top = {token: float(raw_logprobs[token])}
            if p.logprobs > 0:
                values, ids = torch.topk(raw_logprobs, p.logprobs)
                top.update({int(i): float(v) for i, v in zip(ids, values, strict=True)})
        return SampleResult(token, float(raw_logprobs[token]), top)

    def _apply_processors(self, logits: torch.Tensor, seq: Sequence) -> None:
        p = seq.request.params
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < logits.numel():
                logits[tok] += bias
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            for tok in banned:
                if 0 <= tok < logits.numel():
                    logits[tok] = float("-inf")
        if p.repetition_penalty != 1.0:  # HF/vLLM: over prompt and output tokens
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:  # OpenAI: output tokens only
            out = torch.tensor(seq.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.numel())[: logits.numel()].float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
