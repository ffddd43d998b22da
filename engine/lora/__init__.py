"""Multi-LoRA serving: PEFT adapters over one base model, several in one batch (see docs/architecture.md)."""

from pagekube.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
