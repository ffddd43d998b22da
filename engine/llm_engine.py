"""LLMEngine: add requests, then call step() until done. Synchronous; AsyncEngine drives it for the server."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagekube.engine.config import EngineConfig
from pagekube.engine.core.block_manager import BlockManager
from pagekube.engine.core.scheduler import ScheduledBatch, Scheduler
from pagekube.engine.core.sequence import Request, Sequence, SequenceStatus
from pagekube.engine.detokenizer import start_detokenizer
from pagekube.engine.distributed.pipeline_parallel import unsupported as pp_unsupported
from pagekube.engine.distributed.tensor_parallel import unsupported as tp_unsupported
from pagekube.engine.distributed.workers import Workers, join
from pagekube.engine.errors import AdapterError, RequestRejected
from pagekube.engine.kv_events.events import KVEventBatch
from pagekube.engine.lora.manager import LoRAManager
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.model.cuda_graphs import capture_sizes, eager_reason
from pagekube.engine.model.model_files import BUNDLED_NAME, resolve_model_dir
from pagekube.engine.model.model_runner import ModelRunner, kv_bytes_per_block, resolve_device, resolve_dtype
from pagekube.engine.output_processor import OutputProcessor
from pagekube.engine.outputs import RequestOutput
from pagekube.engine.sample.sampler import Sampler
from pagekube.engine.sample.sampler import rows as logit_rows
from pagekube.engine.sampling_params import SamplingParams
from pagekube.engine.spec_decode.speculative import NgramProposer, SpecDecodeStats, SpeculativeDecoder
from pagekube.engine.structured import (
    DEFAULT_GRAMMAR_BACKEND,
    GrammarBackend,
    GrammarError,
    make_grammar_backend,
)

log = logging.getLogger("pagekube.engine")

HEARTBEAT_S = 5.0  # how often an idle engine checks that its worker ranks still answer


class StatListener(Protocol):
    """Receives what the metrics need; called on the engine's thread."""

    def on_iteration(self, engine: LLMEngine, num_tokens: int, num_generated: int, num_preemptions: int) -> None: ...
    def on_first_token(self, request: Request) -> None: ...
    def on_request_finished(self, request: Request) -> None: ...
    def refresh(self, engine: LLMEngine) -> None: ...


class LLMEngine:
    runner_type = "generate"  # (self.runner is its ModelRunner)

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
        self.workers = None  # this node's other ranks (engine/distributed/workers.py)
        self._last_packet = time.monotonic()
        parallel = self._start_workers()
        try:
            self.runner = ModelRunner(config, self.model_dir, self.hf_config, shared_bytes_per_block=draft_bytes,
                                      quantization=config.quantization, **parallel)
        except BaseException:
            self.close()
            raise
        self.max_model_len = config.max_model_len or getattr(self.hf_config, "max_position_embeddings", 2048)
        self.speculator: SpeculativeDecoder | None = None
        if self.speculative:
            from pagekube.engine.spec_decode.draft_model import DraftModelProposer

            if draft_runner is not None:
                draft_runner.allocate_kv_pool(self.runner.num_blocks)
                proposer = DraftModelProposer(draft_runner, config.max_num_batched_tokens)
            else:
                proposer = NgramProposer(self.speculative)
            self.speculator = SpeculativeDecoder(self.speculative, proposer, self.max_model_len)
            log.info("speculative decoding: %s, %d tokens per step", self.speculative.method,
                     self.speculative.num_speculative_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_loras if config.enable_lora else None)
        self.kv_event_publisher = self._start_kv_events()
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids, self.hf_config.vocab_size, self.runner.device, config.seed)
        self.requests: dict[str, Request] = {}
        self._owner: int | None = None  # the thread that steps the engine (claimed by its first step/enqueue)
        self.grammar_backend: GrammarBackend | None = None  # made with the first structured-outputs request
        self.stat_listeners = list(stat_listeners)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler,
                                       self.sampler, self.stat_listeners)
        self.served_model_name = config.served_model_name or (
            self.model_dir.name if config.model else BUNDLED_NAME)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self._start_lora()
        eager = eager_reason(config, self.runner.device, self.runner.backend.name, self.runner.world_size,
                             config.enable_lora)
        if eager is None:
            self.runner.capture_cuda_graphs(capture_sizes(config.cuda_graph_sizes, config.max_num_seqs),
                                            self.max_model_len)
        elif self.runner.device.type == "cuda":
            log.info({"msg": "decode steps run eagerly (no CUDA graphs)", "reason": eager})
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MB), device %s, dtype %s, attention %s",
                 self.runner.num_blocks, config.block_size, self.kv_capacity_tokens,
                 self.runner.num_blocks * self.runner.bytes_per_block / 1e6, self.runner.device,
                 str(self.runner.dtype).removeprefix("torch."), self.runner.backend.name)

    def _start_lora(self) -> None:
        """Adapter slots in the model, and the --lora-modules: one that cannot be served is logged and left out,
        and the engine serves the others (a bad adapter must not take the good ones down)."""
        c = self.config
        self.runner.enable_lora(c.max_loras, c.max_lora_rank)
        self.lora = LoRAManager(self.runner.model, c.max_lora_rank, c.max_cpu_loras or c.max_loras,
                                self.runner.dtype, self.served_model_name)
        for module in c.lora_modules or ():
            try:
                self.lora.add(self.lora.new_request(module.name, module.path))
            except AdapterError as e:
                self.lora.failed[module.name] = str(e)
                log.error({"msg": "LoRA adapter not served", "adapter": module.name, "error": str(e)})

    def _start_workers(self) -> dict:
        """With tensor or pipeline parallelism: start this node's other ranks and join them as rank 0; returns the
        ModelRunner's arguments for this rank's part of the model."""
        c = self.config
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        if tp * pp == 1:
            return {}
        problem = tp_unsupported(self.hf_config, tp) if tp > 1 else None
        if problem:
            raise ValueError(f"--tensor-parallel-size {tp}: the model cannot be split: {problem}")
        problem = pp_unsupported(self.hf_config.num_hidden_layers, pp)
        if problem:
            raise ValueError(f"--pipeline-parallel-size {pp}: the model cannot be split: {problem}")
        self.workers = Workers(c, self.model_dir)
        try:
            shard, stage, control = join(0, c, self.workers.rendezvous, resolve_device(c.device))
        except BaseException:
            self.close()
            raise
        log.info("parallel: %d ranks (tensor %d x pipeline %d) on %d node(s); this process is rank 0",
                 tp * pp, tp, pp, c.nnodes)
        return {"shard": shard, "stage": stage, "control": control}

    def heartbeat(self) -> None:
        """While idle, check every HEARTBEAT_S that every rank still answers (a rank on another node has no
        watchdog here); a lost one raises, and the engine ends."""
        if self.workers is not None and time.monotonic() - self._last_packet > HEARTBEAT_S:
            self.runner.ping_workers()
            self._last_packet = time.monotonic()

    def _start_kv_events(self):
        events = self.config.kv_events_config
        if events is None or not events.publishes:
            return None
        from pagekube.engine.kv_events.publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(events)
        self.block_manager.record_kv_events()
        return publisher

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None and (events := self.block_manager.take_kv_events()):
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        """Stop the KV-event publisher and the worker ranks."""
        if getattr(self, "kv_event_publisher", None) is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
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

    def kernel_report(self) -> dict[str, str]:
        return self.runner.kernel_report()

    def cache_config(self) -> dict:
        """The KV-cache settings, as vLLM's `vllm:cache_config_info` labels them."""
        c = self.config
        return {"block_size": c.block_size, "num_gpu_blocks": self.runner.num_blocks,
                "cache_dtype": str(self.runner.dtype).removeprefix("torch."),
                "enable_prefix_caching": c.enable_prefix_caching,
                "gpu_memory_utilization": c.gpu_memory_utilization}

    @property
    def proposer(self):
        return self.speculator.proposer if self.speculator is not None else None

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        return self.speculator.stats if self.speculator is not None else None

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
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> Request:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        req = self.prepare_request(request_id, prompt, params, lora_request)
        self.enqueue(req)
        return req

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                        lora_request: LoRARequest | None = None) -> Request:
        """Tokenize and validate; touches no engine state, so any thread may call it. `lora_request`: the adapter
        it runs with (its weights are read here the first time)."""
        lora = None
        if lora_request is not None:
            if self.lora is None:
                raise RequestRejected(f"LoRA adapter {lora_request.lora_name!r}: this engine was started without "
                                      "--enable-lora", "model")
            try:
                lora = self.lora.weights(lora_request)
            except AdapterError as e:
                raise RequestRejected(str(e), "model") from e
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
        req = Request(request_id, text, token_ids, params, max_tokens, lora)
        grammar = self._compile_grammar(params) if params.structured_outputs is not None else None
        for seq in req.seqs:
            if self.outputs.inline_text:  # the server makes text on its detokenizer thread (text_outputs.py)
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

    def _check_owner(self, what: str) -> None:
        """Engine state has one owner thread (the server's engine-loop; the caller's, offline): other threads
        go through AsyncEngine's command queue. Claimed by the first call, checked on every later one."""
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif me != self._owner:
            raise RuntimeError(f"LLMEngine.{what} called from thread {threading.current_thread().name!r}; the engine "
                               "belongs to the thread that first stepped it (send commands through AsyncEngine)")

    def enqueue(self, req: Request) -> None:
        self._check_owner("enqueue")
        self.requests[req.request_id] = req
        self.scheduler.add(req.seqs[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self._check_owner("abort_request")
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.outputs.finish_seq(seq, "abort", None)
        self.outputs.finalize(req)
        for listener in self.stat_listeners:
            listener.refresh(self)  # gauges must drop now, even if no step follows
        return self.outputs.make_output(req)

    def finish_by_stop(self, request_id: str, index: int, stop: str, num_output_tokens: int) -> RequestOutput | None:
        """A stop string, found off the engine thread (engine/text_outputs.py), ends choice `index` after
        `num_output_tokens` tokens: tokens computed since are dropped. The request's output when it is done."""
        self._check_owner("finish_by_stop")
        req = self.requests.get(request_id)
        if req is None or req.seqs[index].is_finished:
            return None
        seq = req.seqs[index]
        self.scheduler.truncate(seq, seq.num_prompt_tokens + num_output_tokens)
        del seq.logprobs[num_output_tokens:]
        self.outputs.finish_seq(seq, "stop", stop)
        if not req.is_finished:
            return None
        self.requests.pop(request_id)
        self.outputs.finalize(req)
        return self.outputs.make_output(req)

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
        self._check_owner("step")
        if self.workers is not None:
            self.workers.check()  # a dead rank: fail now, not in the next collective
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            self.heartbeat()  # an idle server steps every 0.5 s: the worker ranks are checked from here
            return []
        try:
            return self._run_step(batch)
        finally:
            self.scheduler.end_step(batch)
            self._publish_kv_events()

    def _run_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        now = self._last_packet = time.monotonic()
        for seq in batch.seqs:
            m = seq.request.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        if self.speculator is not None:
            self.speculator.propose(batch)
        logits, sample_idx, first_rows = self.runner.execute(batch)
        self.scheduler.prefill_done(batch, sample_idx)
        rows, seqs = self._with_pending_forks([batch.seqs[i] for i in sample_idx], first_rows)
        sampled = self.sampler(logit_rows(logits, rows), seqs)
        for seq in seqs:  # n > 1: children fork from the first sequence's prompt, before any token is appended
            if seq.status == SequenceStatus.FORK_PENDING:
                self.scheduler.fork(seq.request.seqs[0], seq)
        touched: dict[str, Request] = {}
        for j, seq in enumerate(seqs):
            self.outputs.append_token(seq, sampled.token_ids[j], sampled.logprobs[j], sampled.top_logprobs[j])
            touched[seq.request.request_id] = seq.request
        speculating = [(seq, row) for seq, row in zip(seqs, rows, strict=True) if seq.spec_tokens]
        if speculating:
            num_generated = len(seqs) + self.speculator.verify(logits, speculating, self.sampler,
                                                               self.outputs.append_token)
        else:
            num_generated = len(seqs)
        for listener in self.stat_listeners:
            listener.on_iteration(self, batch.num_batched_tokens, num_generated, batch.num_preempted)
        outputs = []
        for req in touched.values():
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                self.outputs.finalize(req)
            elif not self.outputs.wants_output(req):
                continue
            outputs.append(self.outputs.make_output(req))
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
