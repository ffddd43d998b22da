"""LLM: the offline batch API, as in vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm import tqdm

from pagekube.engine.chat import chat_prompt_ids
from pagekube.engine.config import EngineConfig
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagekube.engine.runner import load_engine
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`runner="pooling"` (or an embedding model, with the default "auto") makes embeddings: LLM.embed."""
        self.engine = load_engine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _require(self, runner: str, method: str) -> None:
        if self.engine.runner_type != runner:
            what = "an embedding model (runner='pooling')" if runner == "pooling" else "a generation model"
            raise ValueError(f"LLM.{method} needs {what}; this one runs the {self.engine.runner_type} runner")

    def close(self) -> None:
        """Stop tensor-parallel workers, if any (their processes also end with this one)."""
        self.engine.close()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts: strings, token-id lists or {"prompt_token_ids": [...]}.
        `lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model); needs
        LLM(..., enable_lora=True)."""
        self._require("generate", "generate")
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                if isinstance(prompt, dict):
                    prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY}),
                                        lora)
                ids.append(rid)
            with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:  # Ctrl-C, a bad prompt, an engine error: none of this call's requests stay behind
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(self, prompts: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or token ids), in prompt order, as vLLM's LLM.embed."""
        self._require("pooling", "embed")
        self.engine.check_dimensions(dimensions)
        ids = self.engine.prepare_inputs(prompts, truncate_prompt_tokens)
        vectors = self.engine.embed(ids, dimensions)
        return [EmbeddingRequestOutput(str(next(self._ids)), p, EmbeddingOutput(v.tolist())) for p, v in zip(ids, vectors)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt)
