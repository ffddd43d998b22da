"""EngineConfig: the single source of every engine and server flag (the CLI is derived from it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagekube.engine.kv_events.config import KVEventsConfig
from pagekube.engine.lora.modules import LoRAModulePath, parse_lora_modules
from pagekube.engine.pooling.pooler_config import PoolerConfig
from pagekube.engine.spec_decode.speculative import SpeculativeConfig


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
    api_key_file: str | None = Field(None, description="Also accept the keys in this file, one per line, re-read when "
                                     "it changes (a mounted Secret: rotation without a restart)")
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
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto", description="What the model serves: generate (completions, chat) or pooling (/v1/embeddings); auto: "
        "pooling for encoders (BERT), base models without an LM head, and sentence-transformers directories")
    pooler_config: PoolerConfig | None = Field(
        None, description='How the pooling runner makes one vector, as JSON: {"pooling_type": "MEAN", "normalize": '
                          'true} (CLS, MEAN or LAST; default: from the model directory)')
    enable_lora: bool = Field(False, description="Serve LoRA adapters over the base model: --lora-modules, the "
                              "request's model naming an adapter, runtime loading")
    lora_modules: list[LoRAModulePath] | None = Field(
        None, description='Adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
                          '"base_model_name": ...}; several, space-separated')
    max_loras: int = Field(1, ge=1, description="Adapters one step may use (slots in every layer)")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters whose weights stay in host memory (LRU; "
                                      "default: max_loras); others are read again when used")
    drain_timeout: float = Field(120.0, ge=0, description="Seconds to finish accepted requests after SIGTERM before aborting them")
    # vLLM flags users paste from vLLM's docs: accepted; where they mean nothing here, one log line says so.
    swap_space: float = Field(4, ge=0, description="vLLM's CPU swap space (GiB); unused: preemption recomputes, as in vLLM v1")
    enable_chunked_prefill: bool = Field(True, description="Chunked prefill; always on here (--no-enable-chunked-prefill is refused)")
    enforce_eager: bool = Field(False, description="No CUDA graphs: every step runs eagerly (on CUDA, decode steps "
                                "otherwise replay graphs captured at start)")
    cuda_graph_sizes: list[int] | None = Field(
        None, description="Decode batch sizes captured as CUDA graphs (vLLM's): one value N: 1, 2, 4, then every 8 "
                          "up to N; several: exactly those; default: up to --max-num-seqs")
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = Field(
        None, description="vLLM's executor for tensor parallelism; workers are always local processes (mp)")
    quantization: Literal["compressed-tensors", "awq", "gptq", "fp8", "gguf"] | None = Field(
        None, description="Weight quantization of the checkpoint (vLLM's -q); default: what its config.json says "
                          "(quantization_config); gguf: a .gguf file")
    kv_events_config: KVEventsConfig | None = Field(
        None, description='Publish prefix-cache changes as vLLM does, as JSON: {"enable_kv_cache_events": true, '
                          '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "topic": ""}')
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the model's layers are split into, one process "
                                        "group of --tensor-parallel-size ranks each (-pp)")
    # Multi-node without Ray, with vLLM's flags: every node runs world / nnodes ranks; node 0 serves the API.
    nnodes: int = Field(1, ge=1, description="Nodes one engine spans (tensor x pipeline ranks split evenly over them)")
    node_rank: int = Field(0, ge=0, description="This node's place among --nnodes (0: the leader, which serves the API)")
    master_addr: str = Field("127.0.0.1", description="The leader's address, where every rank meets (multi-node)")
    master_port: int = Field(29501, ge=1, le=65535, description="The leader's rendezvous port (multi-node)")
    headless: bool = Field(False, description="A worker node: run this node's ranks, no API and no scheduler")

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _positive_graph_sizes(cls, value):
        if value is not None and (not value or min(value) < 1):
            raise ValueError("--cuda-graph-sizes takes batch sizes of at least 1")
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        return SpeculativeConfig.parse(value) if value is not None else None

    @field_validator("pooler_config", mode="before")
    @classmethod
    def _parse_pooler_config(cls, value):
        return PoolerConfig.parse(value) if value is not None else None

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_kv_events_config(cls, value):
        return KVEventsConfig.parse(value) if value is not None else None

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value):
        return parse_lora_modules(value) if value is not None else None

    @model_validator(mode="after")
    def _lora_settings(self) -> EngineConfig:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora with --pipeline-parallel-size > 1 is not supported yet")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        names = [m.name for m in self.lora_modules or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")
        return self

    @field_validator("enable_chunked_prefill")
    @classmethod
    def _chunked_prefill_is_always_on(cls, value: bool) -> bool:
        if not value:
            raise ValueError("the engine always chunks long prompts (its scheduler mixes prefill chunks and decodes "
                             "in every step); drop --no-enable-chunked-prefill")
        return value

    @model_validator(mode="after")
    def _multi_node(self) -> EngineConfig:
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} does not divide the {world} ranks "
                             "(--tensor-parallel-size x --pipeline-parallel-size)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not below --nnodes {self.nnodes}")
        if self.headless != (self.node_rank > 0):
            raise ValueError("--headless runs a node other than the leader: give it with --node-rank > 0 (and "
                             "only there; node 0 serves the API)")
        return self

    @model_validator(mode="after")
    def _gguf_is_a_file(self) -> EngineConfig:
        if self.quantization == "gguf" and self.model is not None and not self.model.endswith(".gguf"):
            raise ValueError("--quantization gguf needs a .gguf model file")
        return self

    def compat_notes(self) -> list[str]:
        """One line per vLLM flag set to something that means nothing here (logged at startup)."""
        notes = []
        if self.swap_space != EngineConfig.model_fields["swap_space"].default:
            notes.append(f"--swap-space {self.swap_space:g} is accepted and unused: a preempted request is "
                         "recomputed, as in vLLM v1")
        if self.distributed_executor_backend not in (None, "mp"):
            notes.append(f"--distributed-executor-backend {self.distributed_executor_backend} is accepted: "
                         "worker ranks are processes the engine starts itself (mp; --nnodes across machines)")
        return notes
