"""Draft-model proposer: a small model with the target's vocabulary guesses the next k tokens greedily.

Its KV lives in its own paged pool with as many blocks as the target's, indexed by the *same* block tables: the
block manager allocates, shares, copies and frees both at once, and preemption counts them together. The draft
computes lazily: `seq.num_draft_computed` says how many of the sequence's tokens its pool holds, and each step's
first draft forward catches up from there (a whole prompt the first time, then the one or two tokens the target
accepted since). Guesses past the accepted tokens are written over later, like the target's rejected slots.
"""

from __future__ import annotations

import torch

from pagekube.engine.model_runner import ModelRunner
from pagekube.engine.scheduler import ScheduledBatch
from pagekube.engine.sequence import Sequence

PLACEHOLDER = -1  # planned draft slots, filled by propose() once the scheduler has given them KV space


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def plan(self, seq: Sequence, k: int) -> list[int]:
        return [PLACEHOLDER] * k

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the drafts of this step's speculating sequences: k forwards of the draft, batched across them."""
        self.runner.copy_blocks(batch.blocks_to_copy)  # its pool mirrors the target's copy-on-write copies
        seqs = [s for s in batch.seqs if s.spec_tokens]
        if not seqs:
            return
        items = [(s.block_table, s.num_draft_computed, s.token_ids[s.num_draft_computed:], 1) for s in seqs]
        guesses = [[tok] for tok in self.runner.forward(items).argmax(dim=-1).tolist()]
        for s in seqs:
            s.num_draft_computed = s.num_tokens
        for step in range(1, max(len(s.spec_tokens) for s in seqs)):
            live = [j for j, s in enumerate(seqs) if len(s.spec_tokens) > step]
            items = [(seqs[j].block_table, seqs[j].num_tokens + step - 1, [guesses[j][-1]], 1) for j in live]
            for j, tok in zip(live, self.runner.forward(items).argmax(dim=-1).tolist(), strict=True):
                guesses[j].append(tok)
                seqs[j].num_draft_computed += 1
        for s, g in zip(seqs, guesses, strict=True):
            s.spec_tokens = g[: len(s.spec_tokens)]
