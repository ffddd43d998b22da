"""Sequence (one stream of tokens with its KV blocks) and Request (a user's request: n sequences)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagekube.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagekube.engine.lora.adapter import LoRAAdapter


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORK_PENDING = "fork_pending"  # n > 1: waits for the first sequence's prefill, then shares its blocks
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request: Request, index: int):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted = False  # scheduled once already (a preempted sequence is re-admitted)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per generated token: {token_id: logprob}
        self.output_text = ""
        self.detok_prefix_offset = self.detok_read_offset = self.num_prompt_tokens
        self.decode_stream = None  # incremental detokenizer state (engine/detokenizer.py)
        # DELTA outputs: how much of the output the caller has been given
        self.sent_tokens = self.sent_text_len = 0
        self.sent_finish = False
        self.grammar = None  # a structured-outputs matcher (engine/structured/) when the request is constrained
        # Speculative decoding (engine/spec_decode/speculative.py): this step's draft tokens (not in token_ids until accepted),
        # how many tokens a draft model's own KV holds, and the recent acceptance that drives the back-off.
        self.spec_tokens: list[int] = []
        self.num_draft_computed = 0
        self.spec_acceptance = 1.0
        self.spec_skipped = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def cache_extra_keys(self) -> tuple:
        """What besides the tokens decides a block's KV: the adapter (two adapters never share a block)."""
        lora = self.request.lora
        return () if lora is None else ("lora", lora.id)

    @property
    def lora_id(self) -> int:
        return 0 if self.request.lora is None else self.request.lora.id

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies, seconds


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, lora: LoRAAdapter | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what max_model_len leaves
        self.lora = lora  # the adapter it runs with (its weights stay alive while it runs, even if unloaded)
        self.metrics = RequestMetrics()
        self.seqs = [Sequence(self, i) for i in range(params.n)]
        for s in self.seqs[1:]:
            s.status = SequenceStatus.FORK_PENDING
        self.num_preemptions = 0

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def finish_reason(self) -> str | None:
        reasons = [s.finish_reason for s in self.seqs]
        return None if None in reasons else reasons[0]
