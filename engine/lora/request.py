"""LoRARequest: which adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1) names the adapter's weights: the prefix cache keys blocks by it, so two adapters (or two
    loads under one name) never share KV. `lora_path`: a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (got {self.lora_int_id}); 0 is the base model")
