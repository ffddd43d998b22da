"""Draft-model proposer: a small model with the target's vocabulary guesses the next k tokens greedily.

Its KV lives in its own paged pool with as many blocks as the target's, indexed by the *same* block tables: the
block manager allocates, shares, copies and frees both at once, and preemption counts them together. The draft
computes lazily: `seq.num_draft_computed` says how many of the sequence's tokens its pool holds, and each step's
first draft forward catches up from there (a whole prompt the first time, then the one or two tokens the target
accepted since). Guesses past the accepted tokens are written over later, like the target's rejected slots.
"""

from __future__ import annotations

import torch

from pagekube.engine.core.scheduler import ScheduledBatch
from pagekube.engine.core.sequence import Sequence
from pagekube.engine.model.model_runner import ModelRunner

PLACEHOLDER = -1  # planned draft slots, filled by propose() once the scheduler has given them KV space


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, max_batched_tokens: int):
        self.runner = runner
        self.max_batched_tokens = max_batched_tokens  # a catch-up forward is bounded as the target's steps are

    def plan(self, seq: Sequence, k: int) -> list[int]:
        return [PLACEHOLDER] * k

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the drafts of this step's speculating sequences: k forwards of the draft, batched across them."""
        self.runner.copy_blocks(batch.blocks_to_copy)  # its pool mirrors the target's copy-on-write copies
        seqs = [s for s in batch.seqs if s.spec_tokens]
        if not seqs:
            return
        guesses = [[tok] for tok in self._catch_up(seqs)]
        for step in range(1, max(len(s.spec_tokens) for s in seqs)):
            live = [j for j, s in enumerate(seqs) if len(s.spec_tokens) > step]
            items = [(seqs[j].block_table, seqs[j].num_tokens + step - 1, [guesses[j][-1]], 1) for j in live]
            for j, tok in zip(live, self.runner.forward(items).argmax(dim=-1).tolist(), strict=True):
                guesses[j].append(tok)
                seqs[j].num_draft_computed += 1
        for s, g in zip(seqs, guesses, strict=True):
            s.spec_tokens = g[: len(s.spec_tokens)]

    def _catch_up(self, seqs: list[Sequence]) -> list[int]:
        """Bring each sequence's draft KV up to its last token (a whole prompt the first time), in forwards of at
        most max_batched_tokens tokens: a long lag is cut into pieces, one per forward, in order. Returns each
        sequence's greedy guess from its last token."""
        guesses: list[int] = [0] * len(seqs)
        items, owners, used = [], [], 0

        def flush():
            nonlocal items, owners, used
            wanted = [j for j in owners if j is not None]
            for j, tok in zip(wanted, self.runner.forward(items).argmax(dim=-1).tolist(), strict=True):
                guesses[j] = tok
            items, owners, used = [], [], 0

        for j, s in enumerate(seqs):
            start, tokens = s.num_draft_computed, s.token_ids[s.num_draft_computed:]
            while tokens:
                if used == self.max_batched_tokens:
                    flush()
                piece, tokens = tokens[: self.max_batched_tokens - used], tokens[self.max_batched_tokens - used:]
                items.append((s.block_table, start, piece, 0 if tokens else 1))
                owners.append(None if tokens else j)
                start += len(piece)
                used += len(piece)
            s.num_draft_computed = s.num_tokens
        flush()
        return guesses
