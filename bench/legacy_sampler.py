"""The round-one sampler (a Python loop over rows, logits copied to the host, a full sort per top-p row), kept only
as the baseline of bench/sampler.py. Not used by the engine."""

from __future__ import annotations

import torch


class LegacySampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs) -> list[tuple[int, float, dict | None]]:
        logits = logits.float().cpu()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        return [self._sample_one(logits[i].clone(), raw_logprobs[i], seq) for i, seq in enumerate(seqs)]

    def _sample_one(self, logits, raw_logprobs, seq):
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
                outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p
                probs[order[outside]] = 0.0
            if p.min_p > 0.0:
                probs[probs < p.min_p * probs.max()] = 0.0
            noise = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
            token = int(torch.argmax(probs / noise))
        top = None
        if p.logprobs is not None:
            top = {token: float(raw_logprobs[token])}
            if p.logprobs > 0:
                values, ids = torch.topk(raw_logprobs, p.logprobs)
                top.update({int(i): float(v) for i, v in zip(ids, values, strict=True)})
        return token, float(raw_logprobs[token]), top

    def _apply_processors(self, logits, seq) -> None:
        p = seq.request.params
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < logits.numel():
                logits[tok] += bias
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            for tok in banned:
                if 0 <= tok < logits.numel():
                    logits[tok] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.numel())[: logits.numel()].float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
