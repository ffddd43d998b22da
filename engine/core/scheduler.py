"""Iteration-level (continuous) batching with chunked prefill and preemption by recompute.

Each step: running sequences first (decodes and unfinished prefill chunks), then waiting ones, all under one token
budget. When the KV cache runs out, the newest running sequence is preempted: its blocks are freed and it goes back
to the front of the queue, to be recomputed later (its cached blocks may still be hit). A step that preempted
admits nobody new.

A decoding sequence may carry speculative draft tokens (`seq.spec_tokens`): they count against the token budget and
get KV slots like any other token; with no budget or no blocks for them it decodes plainly.

The scheduler is the one owner of a sequence's progress (`num_computed_tokens`): it counts prefix-cache hits at
admission, advances progress from a step's output (`prefill_done`, `append_token`: a token and the progress that
produced it move together) and rolls back what a step did not confirm (`end_step`: rejected drafts, their slots).
A step that raises before its output is applied leaves progress where it was, so the next step recomputes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagekube.engine.core.block_manager import BlockManager
from pagekube.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None):
        """`max_loras`: distinct adapters the running sequences may use (--max-loras; None: no adapters)."""
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.spec_tokens = seq.spec_tokens[: max(0, budget - num_new)]
            if seq.spec_tokens and not bm.allocate_slots(seq, num_new + len(seq.spec_tokens)):
                seq.spec_tokens = []  # no blocks for its drafts: it decodes plainly (or is preempted, below)
            num_new += len(seq.spec_tokens)
            assert num_new >= 1, f"{seq} is running with nothing to compute"
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        seats = len(self.running) + sum(pending_forks(s) for s in self.running)
        adapters = {s.lora_id for s in self.running} - {0}
        w = 0  # a sequence whose adapter has no slot left waits; the ones behind it may go (vLLM's rule)
        while not batch.num_preempted and w < len(self.waiting) and budget > 0:
            seq = self.waiting[w]
            if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= (self.max_loras or 0):
                w += 1
                continue
            if seats + 1 + pending_forks(seq) > self.max_num_seqs:
                break
            cached, hashes = bm.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else ([], [])
            num_new = min(seq.num_tokens - seq.num_computed_tokens - len(cached) * bm.block_size, budget)
            assert num_new >= 1, f"{seq} is admitted with nothing to compute"
            if not bm.allocate_slots(seq, num_new, cached, hashes):
                break
            seq.num_computed_tokens += len(cached) * bm.block_size
            if not seq.admitted:  # cached tokens are the prompt's hits at first admission, not a recompute's
                seq.admitted = True
                seq.num_cached_tokens = min(len(cached) * bm.block_size, seq.num_prompt_tokens)
            del self.waiting[w]
            if seq.lora_id:
                adapters.add(seq.lora_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += 1 + pending_forks(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

        batch.blocks_to_copy = bm.take_pending_copies()
        return batch

    # ---- progress from a step's output ----------------------------------------------------------------------
    def prefill_done(self, batch: ScheduledBatch, sampling: list[int]) -> None:
        """The forward ran: chunks that did not reach their sequence's end are computed (they sample nothing).
        `sampling`: the batch indices that do sample; their progress moves with their token (append_token).
        Full blocks enter the prefix cache in end_step."""
        ends = set(sampling)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if i not in ends:
                seq.num_computed_tokens += n

    def append_token(self, seq: Sequence, token: int) -> None:
        """`token` was sampled after every token `seq` holds: they are all computed now (an accepted draft was fed
        as the real token), and the new one is computed by the next step."""
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(token)

    def end_step(self, batch: ScheduledBatch) -> None:
        """Roll back what the step did not confirm, whether it finished or raised: drafts are forgotten (the
        draft model's KV past the accepted tokens too), slots past a sequence's tokens go back, and blocks that
        became full of computed tokens enter the prefix cache."""
        for seq in batch.seqs:
            if seq.spec_tokens:
                seq.spec_tokens = []
                if not seq.is_finished:
                    self.block_manager.trim(seq)
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A forked sequence joins the running set directly: it shares its parent's blocks, and its seat was
        reserved when the parent was admitted. It forks when the parent's prompt is computed (the step that
        samples the parent's first token), before that token is appended."""
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_tokens
        child.num_cached_tokens, child.admitted = parent.num_cached_tokens, True
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.cache_full_blocks(seq)  # what it computed stays findable after its blocks are freed
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens past `num_tokens` are dropped (a stop string was found before them); progress follows."""
        del seq.token_ids[num_tokens:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.spec_tokens = []
        seq.status = SequenceStatus.WAITING
        seq.request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def pending_forks(seq: Sequence) -> int:
    """Seats a sequence reserves for the n > 1 siblings that will fork from it after its prefill."""
    if seq.index != 0 or seq.num_output_tokens:
        return 0
    return sum(1 for s in seq.request.seqs[1:] if s.status == SequenceStatus.FORK_PENDING)
