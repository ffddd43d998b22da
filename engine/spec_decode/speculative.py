"""Speculative decoding: who proposes draft tokens, and when a sequence stops asking.

A proposer guesses up to k next tokens per decoding sequence; the target model scores them all in the step's one
forward (k+1 query tokens, like a prefill chunk) and `SpeculativeDecoder.verify` keeps the longest prefix the
target agrees with. Proposals never change what is generated, only how many tokens a step yields.

Methods, named and shaped as vLLM's `--speculative-config`:
- `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n tokens,
  n from prompt_lookup_max down to prompt_lookup_min. No model; pays on outputs that copy from the prompt.
- `draft_model`: a small model with the target's vocabulary (engine/spec_decode/draft_model.py).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagekube.engine.core.sequence import Sequence
from pagekube.engine.json_flag import parse_json_flag

# Back-off: a sequence whose recent acceptance (an exponential average of accepted / proposed) falls below this
# stops proposing, but probes again every BACKOFF_PROBE_STEPS steps, so a copy-heavy stretch later is still found.
BACKOFF_ACCEPTANCE = 0.25
BACKOFF_PROBE_STEPS = 8
ACCEPTANCE_DECAY = 0.7


class SpeculativeConfig(BaseModel):
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` or `{"model": PATH, ...}`."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="ngram (prompt lookup) or draft_model; default: draft_model when model is set, else ngram")
    model: str | None = Field(None, description="Draft model directory or .gguf file (same vocabulary as the target)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="Draft tokens proposed per sequence per step")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest suffix to look up (default: max)")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest suffix to look up (default: 5)")

    @model_validator(mode="after")
    def _resolve(self) -> SpeculativeConfig:
        if self.method is None:
            self.method = "draft_model" if self.model not in (None, "ngram", "[ngram]") else "ngram"
        if self.method == "ngram":
            self.model = None
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                                 f"({self.prompt_lookup_max})")
        elif self.model is None:
            raise ValueError("method draft_model needs model: the draft model's directory or .gguf file")
        return self

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From the CLI's JSON string, the offline API's dict, or a config."""
        return parse_json_flag(cls, value, "--speculative-config")


class NgramProposer:
    """Prompt lookup over the sequence's own prompt + output. Proposers have two calls: plan (before scheduling:
    the drafts, or placeholders for as many) and propose (after: fill placeholders; nothing to do here)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch) -> None:
        pass

    def plan(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.asarray(seq.token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = hits[-1] + n  # the latest occurrence: its continuation is the most recent context
                return tokens[start : start + k].tolist()
        return []


class SpecDecodeStats:
    """Counters behind vLLM's `vllm:spec_decode_*` metrics (read by the server's metrics, as deltas)."""

    def __init__(self, k: int):
        self.num_drafts = 0  # verifications: sequences x steps that carried proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


def wants_proposal(seq: Sequence) -> bool:
    """Back-off: poor recent acceptance skips proposing, except for a probe every few steps."""
    if seq.spec_acceptance >= BACKOFF_ACCEPTANCE:
        return True
    seq.spec_skipped += 1
    if seq.spec_skipped >= BACKOFF_PROBE_STEPS:
        seq.spec_skipped = 0
        return True
    return False


def record_acceptance(seq: Sequence, proposed: int, accepted: int) -> None:
    seq.spec_acceptance = ACCEPTANCE_DECAY * seq.spec_acceptance + (1 - ACCEPTANCE_DECAY) * accepted / proposed


class SpeculativeDecoder:
    """Speculation in an engine step: drafts planned before scheduling (`plan`), filled once the scheduler has
    given them KV slots (`propose`), verified against the target's logits after the forward (`verify`)."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    def plan(self, running: list[Sequence]) -> None:
        """Drafts for each decoding sequence (none past max_tokens or the model length, none while backed off)."""
        k_max = self.config.num_speculative_tokens
        for seq in running:
            seq.spec_tokens = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_output_tokens == 0:
                continue  # prefilling, or about to sample its first token (n > 1 forks from it then)
            k = min(k_max, seq.request.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k > 0 and wants_proposal(seq):
                seq.spec_tokens = self.proposer.plan(seq, k)

    def propose(self, batch) -> None:
        self.proposer.propose(batch)

    def verify(self, logits, speculating: list[tuple[Sequence, int]], sampler, append_token) -> int:
        """Keep each sequence's drafts while the target agrees. The token just appended was sampled, with every
        processor applied, from the row before draft 0; if it equals draft 0, draft 0's KV is valid and the row
        after it samples the next token, and so on; the first disagreement (or the row after the last draft, the
        bonus token) ends the sequence's step. Sampling each row exactly as a plain decode would makes greedy
        output identical, and for sampling it is the rejection rule with a point-mass proposal q: accept draft d
        with probability min(1, p(d) / q(d)) = p(d), else draw from the residual max(0, p - q), i.e. p without d,
        renormalized; the outputs are distributed as the target's. `append_token` (the output processor's) is
        what confirms an accepted draft's KV: progress moves with the token. Returns the tokens generated here."""
        generated, pos = 0, 0
        live = speculating
        accepted = dict.fromkeys((seq.seq_id for seq, _ in speculating), 0)
        while live:
            agreed = [(seq, row) for seq, row in live
                      if not seq.is_finished and seq.token_ids[-1] == seq.spec_tokens[pos]]
            for seq, _ in agreed:
                accepted[seq.seq_id] += 1
            pos += 1
            if not agreed:
                break
            sampled = sampler(logits[[row + pos for _, row in agreed]], [seq for seq, _ in agreed])
            for j, (seq, _) in enumerate(agreed):
                append_token(seq, sampled.token_ids[j], sampled.logprobs[j], sampled.top_logprobs[j])
            generated += len(agreed)
            live = [(seq, row) for seq, row in agreed if pos < len(seq.spec_tokens)]
        for seq, _ in speculating:
            proposed = len(seq.spec_tokens)
            self.stats.record(proposed, accepted[seq.seq_id])
            record_acceptance(seq, proposed, accepted[seq.seq_id])
        return generated
