"""LLMEngine: add requests, then call step() until done. Synchronous; AsyncEngine drives it for the server."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagekube.engine.block_manager import BlockManager
from pagekube.engine.config import EngineConfig
from pagekube.engine.detokenizer import (
    detokenize_incrementally,
    find_stop_string,
    start_detokenizer,
    streamable_len,
)
from pagekube.engine.errors import RequestRejected
from pagekube.engine.model_files import BUNDLED_NAME, resolve_model_dir
from pagekube.engine.model_runner import ModelRunner, kv_bytes_per_block, resolve_device, resolve_dtype
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.sampler import Sampler
from pagekube.engine.sampler import rows as logit_rows
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams
from pagekube.engine.scheduler import ScheduledBatch, Scheduler
from pagekube.engine.sequence import Request, Sequence, SequenceStatus
from pagekube.engine.speculative import NgramProposer, SpecDecodeStats, record_acceptance, wants_proposal
from pagekube.engine.structured import (
    DEFAULT_GRAMMAR_BACKEND,
    GrammarBackend,
    GrammarError,
    make_grammar_backend,
)
from pagekube.engine.tensor_parallel import TPShard, unsupported
from pagekube.engine.tp_workers import Workers, init_distributed

log = logging.getLogger("pagekube.engine")


class StatListener(Protocol):
    """Receives what the metrics need; called on the engine's thread."""

    def on_iteration(self, engine: LLMEngine, num_tokens: int, num_generated: int, num_preemptions: int) -> None: ...
    def on_first_token(self, request: Request) -> None: ...
    def on_request_finished(self, request: Request) -> None: ...
    def refresh(self, engine: LLMEngine) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_listeners: list[StatListener] = ()):
        self.config = config
        for note in config.compat_notes():
            log.info(note)
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.speculative = config.speculative_config
        draft_dir, draft_config = self._draft_model() if self.speculative else (None, None)
        draft_bytes = 0
        if draft_config is not None:
            dtype = resolve_dtype(config.dtype, resolve_device(config.device))
            draft_bytes = kv_bytes_per_block(draft_config, config.block_size, dtype)
        # The draft's weights load first, so the target's pool is sized (on a GPU: profiled) with both models in
        # memory; the draft's own pool then takes as many blocks as the target's.
        draft_runner = ModelRunner(config, draft_dir, draft_config, num_blocks=0) if draft_config is not None else None
        self.workers = None  # tensor-parallel ranks 1.. (engine/tp_workers.py)
        shard, control = self._start_tensor_parallel()
        try:
            self.runner = ModelRunner(config, self.model_dir, self.hf_config, shared_bytes_per_block=draft_bytes,
                                      shard=shard, control=control)
        except BaseException:
            self.close()
            raise
        self.proposer = None
        self.spec_stats = None
        if self.speculative:
            from pagekube.engine.draft_model import DraftModelProposer

            if draft_runner is not None:
                draft_runner.allocate_kv_pool(self.runner.num_blocks)
                self.proposer = DraftModelProposer(draft_runner, config.max_num_batched_tokens)
            else:
                self.proposer = NgramProposer(self.speculative)
            self.spec_stats = SpecDecodeStats(self.speculative.num_speculative_tokens)
            log.info("speculative decoding: %s, %d tokens per step", self.speculative.method,
                     self.speculative.num_speculative_tokens)
        self.max_model_len = config.max_model_len or getattr(self.hf_config, "max_position_embeddings", 2048)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids, self.hf_config.vocab_size, self.runner.device, config.seed)
        self.requests: dict[str, Request] = {}
        self.grammar_backend: GrammarBackend | None = None  # made with the first structured-outputs request
        self.stat_listeners = list(stat_listeners)
        self.served_model_name = config.served_model_name or (
            self.model_dir.name if config.model else BUNDLED_NAME)
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MB), device %s, dtype %s, attention %s",
                 self.runner.num_blocks, config.block_size, self.kv_capacity_tokens,
                 self.runner.num_blocks * self.runner.bytes_per_block / 1e6, self.runner.device,
                 str(self.runner.dtype).removeprefix("torch."), self.runner.backend.name)

    def _start_tensor_parallel(self):
        size = self.config.tensor_parallel_size
        if size == 1:
            return TPShard(), None
        problem = unsupported(self.hf_config, size)
        if problem:
            raise ValueError(f"--tensor-parallel-size {size}: the model cannot be split: {problem}")
        self.workers = Workers(size, self.config, self.model_dir)
        try:
            control = init_distributed(0, size, self.workers.port, resolve_device(self.config.device))
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (this process is rank 0)", size)
        return TPShard(0, size), control

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them)."""
        if self.workers is not None:
            self.workers.stop(getattr(self, "runner", None))
            self.workers = None

    def _draft_model(self):
        """The draft model's directory and config, or (None, None) for ngram; a draft whose vocabulary is not
        the target's is refused here, before any weight loads."""
        if self.speculative.method != "draft_model":
            return None, None
        draft_dir = resolve_model_dir(self.speculative.model)
        draft_config = AutoConfig.from_pretrained(draft_dir)
        problem = None
        if draft_config.vocab_size != self.hf_config.vocab_size:
            problem = f"vocab_size {draft_config.vocab_size} != the target's {self.hf_config.vocab_size}"
        elif AutoTokenizer.from_pretrained(draft_dir).get_vocab() != self.tokenizer.get_vocab():
            problem = "its tokenizer's vocabulary differs from the target's"
        if problem:
            raise ValueError(f"speculative_config.model {self.speculative.model}: {problem}; a draft model must "
                             "share the target's tokenizer")
        return draft_dir, draft_config

    def cache_config(self) -> dict:
        """The KV-cache settings, as vLLM's `vllm:cache_config_info` labels them."""
        c = self.config
        return {"block_size": c.block_size, "num_gpu_blocks": self.runner.num_blocks,
                "cache_dtype": str(self.runner.dtype).removeprefix("torch."),
                "enable_prefix_caching": c.enable_prefix_caching,
                "gpu_memory_utilization": c.gpu_memory_utilization}

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update([eos] if isinstance(eos, int) else eos or [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        req = self.prepare_request(request_id, prompt, params)
        self.enqueue(req)
        return req

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """Tokenize and validate; touches no engine state, so any thread may call it."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(f"n={params.n} sequences exceed the {self.config.max_num_seqs} a step may run "
                                  "(max_num_seqs)", "n")
        vocab = self.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", "prompt")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise RequestRejected(f"the prompt has {len(token_ids)} tokens; max model length is {self.max_model_len} "
                                  "(max_model_len), which leaves no room to generate", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise RequestRejected(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the max model "
                                  f"length of {self.max_model_len} tokens (max_model_len)", "max_tokens")
        need = self.block_manager.blocks_needed(len(token_ids) + max_tokens)
        if need > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt + max_tokens needs {need} KV-cache blocks but the cache has only "
                                  f"{self.block_manager.num_blocks} (kv_cache_memory)", "max_tokens")
        req = Request(request_id, text, token_ids, params, max_tokens)
        grammar = self._compile_grammar(params) if params.structured_outputs is not None else None
        for seq in req.seqs:
            start_detokenizer(seq, self.tokenizer)
            seq.grammar = self.grammar_backend.matcher(grammar) if grammar is not None else None
        return req

    def _compile_grammar(self, params: SamplingParams):
        if self.grammar_backend is None:
            self.grammar_backend = make_grammar_backend(DEFAULT_GRAMMAR_BACKEND, self.tokenizer,
                                                        self.hf_config.vocab_size, self.eos_token_ids)
            self.sampler.grammar_backend = self.grammar_backend
        so = params.structured_outputs
        try:
            return self.grammar_backend.compile(so)
        except GrammarError as e:
            raise RequestRejected(f"the {so.kind} for structured outputs does not compile: {e}",
                                  f"structured_outputs.{so.kind}") from e

    def enqueue(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req.seqs[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, "abort", None)
        self._finalize(req)
        for listener in self.stat_listeners:
            listener.refresh(self)  # gauges must drop now, even if no step follows
        return self.make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len({s.request.request_id for s in self.scheduler.waiting})

    def kv_fragmentation(self) -> float:
        return self.block_manager.fragmentation()

    # ---- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, apply the output. Progress moves only with the output (the
        scheduler's prefill_done / append_token), so a step that raises (a sampler error, Ctrl-C) leaves every
        sequence where it was and the next step recomputes it; end_step rolls back unconfirmed drafts either way."""
        if self.workers is not None:
            self.workers.check()  # a dead rank: fail now, not in the next collective
        if self.proposer is not None:
            self._plan_drafts()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            return self._run_step(batch)
        finally:
            self.scheduler.end_step(batch)

    def _run_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        now = time.monotonic()
        for seq in batch.seqs:
            m = seq.request.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        if self.proposer is not None:
            self.proposer.propose(batch)
        logits, sample_idx, first_rows = self.runner.execute(batch)
        self.scheduler.prefill_done(batch, sample_idx)
        rows, seqs = self._with_pending_forks([batch.seqs[i] for i in sample_idx], first_rows)
        sampled = self.sampler(logit_rows(logits, rows), seqs)
        for seq in seqs:  # n > 1: children fork from the first sequence's prompt, before any token is appended
            if seq.status == SequenceStatus.FORK_PENDING:
                self.scheduler.fork(seq.request.seqs[0], seq)
        touched: dict[str, Request] = {}
        for j, seq in enumerate(seqs):
            self._append_token(seq, sampled.token_ids[j], sampled.logprobs[j], sampled.top_logprobs[j])
            touched[seq.request.request_id] = seq.request
        speculating = [(seq, row) for seq, row in zip(seqs, rows, strict=True) if seq.spec_tokens]
        num_generated = len(seqs) + (self._verify(logits, speculating) if speculating else 0)
        for listener in self.stat_listeners:
            listener.on_iteration(self, batch.num_batched_tokens, num_generated, batch.num_preempted)
        outputs = []
        for req in touched.values():
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                self._finalize(req)
            elif req.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self.make_output(req))
        return outputs

    @staticmethod
    def _with_pending_forks(sampled: list[Sequence], first_rows: list[int]) -> tuple[list[int], list[Sequence]]:
        """A request with n > 1 samples all its sequences from the first one's prompt logits: its children join
        the rows to sample, on the first one's row. Returns, per sequence to sample, its row in the logits."""
        rows, seqs = [], []
        for i, seq in zip(first_rows, sampled, strict=True):
            rows.append(i)
            seqs.append(seq)
            if seq.index == 0 and seq.num_output_tokens == 0:
                for child in seq.request.seqs[1:]:
                    if child.status == SequenceStatus.FORK_PENDING:
                        rows.append(i)
                        seqs.append(child)
        return rows, seqs

    # ---- speculative decoding -----------------------------------------------------------------------------
    def _plan_drafts(self) -> None:
        """Drafts for each decoding sequence (none past max_tokens or the model length, none while backed off)."""
        k_max = self.speculative.num_speculative_tokens
        for seq in self.scheduler.running:
            seq.spec_tokens = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_output_tokens == 0:
                continue  # prefilling, or about to sample its first token (n > 1 forks from it then)
            k = min(k_max, seq.request.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k > 0 and wants_proposal(seq):
                seq.spec_tokens = self.proposer.plan(seq, k)

    def _verify(self, logits, speculating: list[tuple[Sequence, int]]) -> int:
        """Keep each sequence's drafts while the target agrees. The token just appended was sampled, with every
        processor applied, from the row before draft 0; if it equals draft 0, draft 0's KV is valid and the row
        after it samples the next token, and so on; the first disagreement (or the row after the last draft, the
        bonus token) ends the sequence's step. Sampling each row exactly as a plain decode would makes greedy
        output identical, and for sampling it is the rejection rule with a point-mass proposal q: accept draft d
        with probability min(1, p(d) / q(d)) = p(d), else draw from the residual max(0, p - q), i.e. p without d,
        renormalized; the outputs are distributed as the target's. Returns the tokens generated here. (Appending
        the next token is what confirms an accepted draft's KV: scheduler.append_token.)"""
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
            sampled = self.sampler(logits[[row + pos for _, row in agreed]], [seq for seq, _ in agreed])
            for j, (seq, _) in enumerate(agreed):
                self._append_token(seq, sampled.token_ids[j], sampled.logprobs[j], sampled.top_logprobs[j])
            generated += len(agreed)
            live = [(seq, row) for seq, row in agreed if pos < len(seq.spec_tokens)]
        for seq, _ in speculating:
            proposed = len(seq.spec_tokens)
            self.spec_stats.record(proposed, accepted[seq.seq_id])
            record_acceptance(seq, proposed, accepted[seq.seq_id])
        return generated

    def _append_token(self, seq: Sequence, tok: int, logprob: float | None, top: dict[int, float] | None) -> None:
        """The token joins the sequence (with the progress that produced it), then its text, grammar and stop
        checks run. An error there is the request's own: it ends (aborted) and the batch goes on."""
        self.scheduler.append_token(seq, tok)
        try:
            self._process_token(seq, tok, logprob, top)
        except Exception:
            log.exception("request %s: processing token %d failed; aborting the request", seq.request.request_id, tok)
            if not seq.is_finished:
                self._finish_seq(seq, "abort", None)

    def _process_token(self, seq: Sequence, tok: int, logprob: float | None, top: dict[int, float] | None) -> None:
        req, p = seq.request, seq.request.params
        now = time.monotonic()
        m = req.metrics
        if seq.index == 0:
            if m.first_token_time is None:
                m.first_token_time = now
                for listener in self.stat_listeners:
                    listener.on_first_token(req)
            else:
                m.token_gaps.append(now - m.last_token_time)
            m.last_token_time = now
        if p.logprobs is not None:
            seq.cumulative_logprob += logprob
            seq.logprobs.append(top)
        delta = detokenize_incrementally(self.tokenizer, seq, p.skip_special_tokens)
        if seq.grammar is not None and not seq.grammar.accept_token(tok):
            # Only when other constraints left no token the grammar allows (e.g. min_tokens banning its stop token).
            log.warning("request %s: token %d is outside its grammar; finishing it", req.request_id, tok)
            self._finish_seq(seq, "abort", None)
        elif seq.grammar is not None and seq.grammar.is_terminated():
            # The grammar's stop token came: ignore_eos cannot go on past a finished document.
            self._finish_seq(seq, "stop", None)
        elif tok in p.stop_token_ids and seq.num_output_tokens >= p.min_tokens:
            self._finish_seq(seq, "stop", tok)
        elif tok in self.eos_token_ids and not p.ignore_eos and seq.num_output_tokens >= p.min_tokens:
            self._finish_seq(seq, "stop", None)
        elif seq.num_output_tokens >= p.min_tokens and (stop := find_stop_string(seq, delta)) is not None:
            self._finish_seq(seq, "stop", stop)
        elif seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish_seq(seq, "length", None)

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self.sampler.release(seq)

    def _finalize(self, req: Request) -> None:
        req.metrics.finished_time = time.monotonic()
        for listener in self.stat_listeners:
            listener.on_request_finished(req)

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output as its params' output_kind asks: everything so far, or (DELTA) only what is new
        since the last one, in O(new) work: the choices with new tokens or a finish not yet reported."""
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for s in req.seqs:
            t0, k0 = (s.sent_text_len, s.sent_tokens) if delta else (0, 0)
            text_end = streamable_len(s)
            k1 = s.num_output_tokens
            if delta:
                if k1 == k0 and text_end == t0 and (s.finish_reason is None or s.sent_finish):
                    continue
                s.sent_text_len, s.sent_tokens, s.sent_finish = text_end, k1, s.finish_reason is not None
            outs.append(CompletionOutput(
                index=s.index,
                text=s.output_text[t0:text_end],
                token_ids=s.token_ids[s.num_prompt_tokens + k0:],
                cumulative_logprob=s.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=s.logprobs[k0:] if req.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            ))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.is_finished,
                             req.seqs[0].num_cached_tokens, req.metrics)
