"""Repetition, presence and frequency penalties over a batch, with per-sequence state kept on the device.

Each penalized sequence owns a row of two pools: counts of its output tokens and a mask of its prompt tokens. A
row is filled once, from the sequence's tokens, the first time it is sampled (after a fork or a preemption too);
after that each sampled token is one scatter-add. A step gathers its rows instead of rebuilding them from lists.
"""

from __future__ import annotations

import torch

from pagekube.engine.core.sequence import Sequence


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)  # output tokens
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.rows: dict[int, int] = {}  # seq_id -> pool row
        self.free_rows: list[int] = []

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    def apply(self, logits: torch.Tensor, batch_rows: list[int], seqs: list[Sequence]) -> None:
        """Penalize logits[batch_rows] in place (OpenAI's presence/frequency on output tokens; HF's repetition
        on prompt and output tokens)."""
        if not batch_rows:
            return
        dev = logits.device
        pool = torch.tensor([self._row(s) for s in seqs], device=dev)
        idx = torch.tensor(batch_rows, device=dev)
        counts = self.counts[pool]
        x = logits[idx]
        params = [s.request.params for s in seqs]
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        seen = self.in_prompt[pool] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        x -= freq * counts + pres * (counts > 0)
        logits[idx] = x

    def update(self, tokens: torch.Tensor, batch_rows: list[int], seqs: list[Sequence]) -> None:
        """Count each penalized sequence's newly sampled token (tokens: the step's ids, on the device)."""
        if not batch_rows:
            return
        pool = torch.tensor([self.rows[s.seq_id] for s in seqs], device=tokens.device)
        picked = tokens[torch.tensor(batch_rows, device=tokens.device)]
        self.counts.index_put_((pool, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)

    def _row(self, seq: Sequence) -> int:
        row = self.rows.get(seq.seq_id)
        if row is not None:
            return row
        if not self.free_rows:
            self._grow()
        row = self.rows[seq.seq_id] = self.free_rows.pop()
        prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.long, device=self.device)
        self.in_prompt[row] = False
        self.in_prompt[row, prompt] = True
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=self.device)
        self.counts[row] = torch.bincount(out, minlength=self.vocab_size)[: self.vocab_size].to(torch.int32)
        return row

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, old * 2)
        v, dev = self.vocab_size, self.device
        self.counts = torch.cat([self.counts, torch.zeros((new - old, v), dtype=torch.int32, device=dev)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros((new - old, v), dtype=torch.bool, device=dev)])
        self.free_rows.extend(range(new - 1, old - 1, -1))
