"""Which runner serves a model (vLLM's `--runner`): generation (LLMEngine) or pooling (PoolingEngine)."""

from __future__ import annotations

from typing import Literal

from pagekube.engine.config import EngineConfig


def choose_runner(config: EngineConfig) -> Literal["generate", "pooling"]:
    if config.runner != "auto":
        return config.runner
    from transformers import AutoConfig

    from pagekube.engine.model.model_files import resolve_model_dir
    from pagekube.engine.pooling.pooler_config import is_pooling_model

    model_dir = resolve_model_dir(config.model)
    return "pooling" if is_pooling_model(model_dir, AutoConfig.from_pretrained(model_dir)) else "generate"


def load_engine(config: EngineConfig):
    """The engine the config asks for, loaded: an LLMEngine or a PoolingEngine (both have `runner_type`)."""
    if choose_runner(config) == "pooling":
        if config.enable_lora:
            raise ValueError("--enable-lora: LoRA adapters are served by the generate runner, not pooling")
        from pagekube.engine.pooling.pooling_engine import PoolingEngine

        return PoolingEngine(config)
    from pagekube.engine.llm_engine import LLMEngine

    return LLMEngine(config)
