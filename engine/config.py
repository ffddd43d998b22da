"""EngineConfig: the single source of every engine and server flag (the CLI is derived from it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagekube.engine.speculative import SpeculativeConfig


class EngineConfig(BaseModel):
    """Every field becomes a `pagekube serve` flag: `max_num_seqs` -> `--max-num-seqs`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(
        None, description="Model directory (config.json + *.safetensors) or a .gguf file; default: bundled SmolLM2-135M-Instruct"
    )
    served_model_name: str | None = Field(None, description="Name the API serves the model under (default: derived from the model path)")
    tokenizer: str | None = Field(None, description="Tokenizer directory, if not the model's own")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype; auto = bfloat16 on GPUs and on CPUs with AVX512_BF16, "
        "float32 on other CPUs"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to run the model")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="Attention implementation; auto = triton on CUDA, torch otherwise"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Devices (processes) one engine shards the model over, Megatron-style (-tp)")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output, in tokens (default: the model's limit)")
    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128, 256] = Field(
        16, description="Tokens per KV-cache block (a power of two; the Triton backend needs at least 16)"
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step (prefill chunks + decodes)")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes")
    kv_cache_memory: int | None = Field(None, ge=1, description="Bytes for the KV-cache pool (default: 512 MiB on CPU; profiled on GPU)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use (GPU only)")
    seed: int = Field(0, description="Seed for requests that bring none")
    host: str = Field("127.0.0.1", description="Address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer KEY' (also env PAGEKUBE_API_KEY)")
    disable_log_requests: bool = Field(False, description="Do not log one line per finished request")
    enable_log_prompts: bool = Field(False, description="Include prompt text in request logs (off: prompts are never logged)")
    max_waiting_requests: int = Field(1024, ge=1, description="Queue length past which new requests get 429 + Retry-After")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest accepted request body")
    enable_auto_tool_choice: bool = Field(False, description='Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description="How tool calls are found in the model's text for tool_choice auto (the model family's format)")
    speculative_config: SpeculativeConfig | None = Field(
        None, description='Speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4} or '
                          '{"model": DRAFT_PATH, "num_speculative_tokens": 4}')
    drain_timeout: float = Field(120.0, ge=0, description="Seconds to finish accepted requests after SIGTERM before aborting them")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        return SpeculativeConfig.parse(value) if value is not None else None
