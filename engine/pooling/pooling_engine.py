"""PoolingEngine: token ids in, one embedding per input out. Synchronous; the server drives it from its engine
thread (engine/pooling/async_pooling.py), the offline API (LLM.embed) directly.

Inputs are packed end to end into forwards of at most `max_num_batched_tokens` tokens (never padded), each
forward runs the encoder or decoder once over the pack, and each input's states are pooled into one vector.
No KV cache is kept: a pooling request is one forward and done.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer

from pagekube.engine.config import EngineConfig
from pagekube.engine.errors import RequestRejected
from pagekube.engine.model.model_files import BUNDLED_NAME, resolve_model_dir
from pagekube.engine.model.model_loader import safetensors_files
from pagekube.engine.model.model_runner import resolve_device, resolve_dtype
from pagekube.engine.pooling.pooler_config import ENCODER_MODEL_TYPES, Pooler, resolve_pooler

log = logging.getLogger("pagekube.engine")

Inputs = str | list[str] | list[int] | list[list[int]]


class PoolingEngine:
    runner_type = "pooling"
    workers = None  # no tensor-parallel workers: the server's shutdown path asks

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.pooler: Pooler = resolve_pooler(self.model_dir, self.hf_config, config.pooler_config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.tensor_parallel_size * config.pipeline_parallel_size != 1:
            raise ValueError("--tensor-parallel-size, --pipeline-parallel-size: the pooling runner runs on one device")
        self.model = self._load_model()
        limit = min(x for x in (self.hf_config.max_position_embeddings, self.pooler.max_seq_length) if x)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds this model's limit of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self.hidden_size = self.hf_config.hidden_size
        self.served_model_name = config.served_model_name or (self.model_dir.name if config.model else BUNDLED_NAME)
        self.stat_listeners: list = []
        log.info({"msg": "pooling runner", "model": str(self.model_dir), "pooling": self.pooler.pooling_type,
                  "normalize": self.pooler.normalize, "max_model_len": self.max_model_len, "device": str(self.device),
                  "dtype": str(self.dtype).removeprefix("torch.")})

    def kernel_report(self) -> dict[str, str]:
        """As ModelRunner.kernel_report: attention is torch's SDPA over packed sequences; no CPU extension."""
        return {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."), "attention": "sdpa",
                "cpu_kernels": "none"}

    def _load_model(self):
        if self.hf_config.model_type in ENCODER_MODEL_TYPES:
            from pagekube.engine.pooling.bert import load_bert

            return load_bert(self.hf_config, safetensors_files(self.model_dir), self.dtype, self.device)
        from pagekube.engine.pooling.decoder import DecoderForPooling

        return DecoderForPooling(self.hf_config, self.model_dir, self.dtype, self.device)

    # ---- inputs (any thread: touches no engine state) ------------------------------------------------------
    def prepare_inputs(self, inputs: Inputs, truncate_prompt_tokens: int | None = None,
                       add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids for each input (strings are tokenized in one batch); RequestRejected names what is wrong.
        `truncate_prompt_tokens` (vLLM's field; -1: the model's limit) cuts each input on the tokenizer's side,
        as sentence-transformers does (special tokens kept); without it an over-long input is refused."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise RequestRejected("input is empty: give a string, a list of strings, or token ids", "input")
        limit = self.max_model_len
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens > limit:
                raise RequestRejected(f"truncate_prompt_tokens {truncate_prompt_tokens} exceeds the max model length "
                                      f"of {limit} tokens", "truncate_prompt_tokens")
            limit = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        ids: list[list[int] | None] = [None if isinstance(x, str) else list(x) for x in inputs]
        if texts:
            cut = dict(truncation=True, max_length=limit) if truncate_prompt_tokens is not None else {}
            encoded = self.tokenizer([inputs[i] for i in texts], add_special_tokens=add_special_tokens, **cut)
            for i, tokens in zip(texts, encoded["input_ids"]):
                ids[i] = tokens
        vocab = self.hf_config.vocab_size
        for i, tokens in enumerate(ids):
            where = "input" if len(ids) == 1 else f"input[{i}]"
            if not tokens:
                raise RequestRejected(f"{where} is empty", "input")
            if any(not 0 <= t < vocab for t in tokens):
                raise RequestRejected(f"{where}: token ids must be in [0, {vocab})", "input")
            if len(tokens) > limit:
                if truncate_prompt_tokens is None:
                    raise RequestRejected(f"{where} has {len(tokens)} tokens; this model takes at most {limit} "
                                          "(set truncate_prompt_tokens to cut it)", "input")
                ids[i] = tokens[:limit] if self.tokenizer.truncation_side == "right" else tokens[-limit:]
        return ids

    def check_dimensions(self, dimensions: int | None) -> None:
        problem = self.pooler.check_dimensions(dimensions, self.hidden_size)
        if problem:
            raise RequestRejected(problem, "dimensions")

    # ---- the forward (the engine thread) -------------------------------------------------------------------
    @torch.inference_mode()
    def embed_batch(self, prompts: Sequence[list[int]]) -> torch.Tensor:
        """Pooled states [inputs, hidden] in float32, not yet normalized, of prompts that fit one forward."""
        lens = [len(p) for p in prompts]
        bounds = [0, *itertools.accumulate(lens)]
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        hidden = self.model(ids, positions, bounds)
        starts = torch.tensor(bounds[:-1], device=self.device)
        counts = torch.tensor(lens, device=self.device)
        kind = self.pooler.pooling_type
        if kind == "CLS":
            return hidden[starts].float()
        if kind == "LAST":
            return hidden[starts + counts - 1].float()
        segment = torch.repeat_interleave(torch.arange(len(lens), device=self.device), counts)
        sums = torch.zeros(len(lens), hidden.shape[1], device=self.device).index_add_(0, segment, hidden.float())
        return sums / counts[:, None].float()

    def batches(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        """Indices of `prompts` grouped into forwards of at most max_num_batched_tokens tokens, in order."""
        groups: list[list[int]] = [[]]
        tokens = 0
        for i, p in enumerate(prompts):
            if groups[-1] and tokens + len(p) > self.max_num_batched_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += len(p)
        return groups

    def finish(self, pooled: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
        """One pooled vector as served: cut to `dimensions` (matryoshka), then normalized if the model says so."""
        if dimensions is not None:
            pooled = pooled[..., :dimensions]
        return F.normalize(pooled, dim=-1) if self.pooler.normalize else pooled

    def embed(self, prompts: Sequence[list[int]], dimensions: int | None = None) -> list[torch.Tensor]:
        """Every prompt's embedding, in order (the offline path)."""
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for group in self.batches(prompts):
            for i, row in zip(group, self.embed_batch([prompts[i] for i in group])):
                out[i] = self.finish(row, dimensions)
        return out

    def close(self) -> None:
        pass
