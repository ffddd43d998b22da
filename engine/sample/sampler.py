"""Sampler: one batched pass over a step's logits, on their device.

Order per row (vLLM's): logit bias, min_tokens bans, repetition/presence/frequency penalties, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a random draw. Only the sampled ids and the logprobs that were asked for
go to the host.

Truncated rows (top-k or top-p) sample among their top candidates: `torch.topk` of a few hundred entries instead
of a full-vocabulary sort. A top-p row whose candidates do not reach top_p tries more of them, then a full sort,
so the nucleus is always exact. The draw is the exponential race (argmax of p / Exp(1) noise); a row with a seed draws its
noise from its own generator, sized by the row alone, so a seeded request gives the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekube.engine.core.sequence import Sequence
from pagekube.engine.sample.penalties import PenaltyState

# A top-p row samples among its top 256 tokens when they hold top_p of the mass, else among its top 4096, else it
# sorts the whole vocabulary: each tier is exact, and most rows of a language model stop at the first.
TOP_P_TIERS = (256, 4096)


def rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx], without the copy when idx is every row in order."""
    return t if len(idx) == t.shape[0] and idx == list(range(len(idx))) else t[idx]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob, for rows that asked for logprobs
    top_logprobs: list[dict[int, float] | None]  # sampled token + the top-k, when asked


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int, device: torch.device, seed: int = 0):
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed
        self.penalties = PenaltyState(vocab_size, device)
        self._seeded: dict[int, torch.Generator] = {}
        self.grammar_backend = None  # set by the engine with the first structured-outputs request

    def release(self, seq: Sequence) -> None:
        """The sequence is done: drop its penalty row and generator."""
        self.penalties.release(seq)
        self._seeded.pop(seq.seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample one token per row of `logits` (consumed: processors and temperature work on it in place)."""
        logits = logits.float()
        params = [s.request.params for s in seqs]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[want_lp] if want_lp else None  # a copy: logprobs are of the model's own distribution
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        self._apply_bias_and_bans(logits, seqs)
        self.penalties.apply(logits, penalized, [seqs[i] for i in penalized])
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # last, so nothing after it can lift a token the grammar forbids
            self.grammar_backend.mask_logits(logits, constrained, [seqs[i].grammar for i in constrained])

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) < len(seqs):
            tokens = logits.argmax(dim=-1)
            if random_rows:
                tokens[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        else:
            tokens = self._sample(logits, seqs)
        self.penalties.update(tokens, penalized, [seqs[i] for i in penalized])

        host_lp: list[float | None] = [None] * len(seqs)
        host_top: list[dict[int, float] | None] = [None] * len(seqs)
        if want_lp:
            lp = torch.log_softmax(raw, dim=-1)
            chosen = lp.gather(1, tokens[want_lp, None]).squeeze(1)
            k = max(params[i].logprobs for i in want_lp)
            top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        ids = tokens.tolist()
        for j, i in enumerate(want_lp):
            n = params[i].logprobs
            host_lp[i] = chosen[j]
            host_top[i] = {ids[i]: chosen[j], **dict(zip(top_i[j][:n], top_v[j][:n], strict=True))}
        return SamplerOutput(ids, host_lp, host_top)

    # ---- logits processors -------------------------------------------------------------------------------
    def _apply_bias_and_bans(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Logit bias and min_tokens bans as two scatters over the batch (Python only lists the entries)."""
        vocab = logits.shape[1]
        bias_rows, bias_toks, bias_vals, ban_rows, ban_toks = [], [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.request.params
            for tok, bias in p.logit_bias.items():
                if 0 <= tok < vocab:
                    bias_rows.append(i), bias_toks.append(tok), bias_vals.append(bias)
            if seq.num_output_tokens < p.min_tokens:
                for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids):
                    if 0 <= tok < vocab:
                        ban_rows.append(i), ban_toks.append(tok)
        dev = logits.device
        if bias_rows:
            idx = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_toks, device=dev))
            logits.index_put_(idx, torch.tensor(bias_vals, device=dev), accumulate=True)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_toks, device=dev)] = float("-inf")

    # ---- random draws --------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        params = [s.request.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=dev)
        probs = torch.softmax(logits.div_(temps[:, None]), dim=-1)  # logits are this call's own rows
        tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)

        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        truncated = [i for i, p in enumerate(params) if top_k[i] or p.top_p < 1.0]
        full = sorted(set(range(len(seqs))) - set(truncated))
        for width in (*TOP_P_TIERS, vocab):  # candidates, then more of them, then the whole (sorted) vocabulary
            if not truncated:
                break
            sizes = [top_k[i] or min(width, vocab) for i in truncated]
            if max(sizes) < vocab:
                cand_p, cand_ids = rows(probs, truncated).topk(max(sizes), dim=-1)  # sorted, largest first
            else:
                cand_p, cand_ids = rows(probs, truncated).sort(dim=-1, descending=True)
            cand_p, exact = self._truncate(cand_p, [params[i] for i in truncated], sizes, vocab)
            exact = exact.tolist()
            keep = [j for j, ok in enumerate(exact) if ok]
            if keep:
                picked = self._race(rows(cand_p, keep), [seqs[truncated[j]] for j in keep], [sizes[j] for j in keep])
                tokens[[truncated[j] for j in keep]] = rows(cand_ids, keep).gather(1, picked[:, None]).squeeze(1)
            truncated = [truncated[j] for j, ok in enumerate(exact) if not ok]
        if full:
            probs_full = rows(probs, full)
            if any(params[i].min_p > 0 for i in full):
                min_p = torch.tensor([params[i].min_p for i in full], device=dev)
                probs_full = probs_full.masked_fill(probs_full < min_p[:, None] * probs_full.amax(dim=-1, keepdim=True),
                                                    0.0)
            tokens[full] = self._race(probs_full, [seqs[i] for i in full], [vocab] * len(full))
        return tokens

    @staticmethod
    def _truncate(sorted_p: torch.Tensor, params: list, sizes: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero what top-k, top-p and min-p drop from descending probabilities (top-k first, then top-p over the
        renormalized rest, as vLLM does). Also returns, per row, whether its columns held the whole kept set:
        a top-p row without top-k must reach top_p within them."""
        dev, width = sorted_p.device, sorted_p.shape[1]
        size = torch.tensor(sizes, device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        has_k = torch.tensor([0 < p.top_k <= s for p, s in zip(params, sizes, strict=True)], device=dev)
        p = sorted_p.masked_fill(torch.arange(width, device=dev)[None, :] >= size[:, None], 0.0)
        p = torch.where(has_k[:, None], p / p.sum(dim=-1, keepdim=True), p)
        cum = p.cumsum(dim=-1)
        drop = (cum - p > top_p[:, None]) | (p < min_p[:, None] * p[:, :1])  # smallest set reaching top_p
        exact = has_k | (size >= vocab) | (cum[:, -1] >= top_p)
        return p.masked_fill(drop, 0.0), exact

    def _race(self, probs: torch.Tensor, seqs: list[Sequence], sizes: list[int]) -> torch.Tensor:
        """Column index per row: argmax of p / Exp(1). Seeded rows draw `size` values from their own generator."""
        noise = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 draw would make 0/0 = NaN win argmax
        for j, seq in enumerate(seqs):
            gen = self._generator(seq)
            if gen is not None:
                row = torch.full_like(probs[j], float("inf"))  # columns past the row's own size never win
                row[: sizes[j]].exponential_(1.0, generator=gen).clamp_(min=torch.finfo(row.dtype).tiny)
                noise[j] = row
        return (probs / noise).argmax(dim=-1)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.request.params.seed
        if seed is None:
            return None
        gen = self._seeded.get(seq.seq_id)
        if gen is None:
            gen = self._seeded[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seed + seq.index)
        return gen
