"""pagekube serving engine: paged KV cache, continuous batching, Llama-family models."""

from pagekube.engine.config import EngineConfig
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):  # LLM and LLMEngine pull in torch: import them only when asked
    if name == "LLM":
        from pagekube.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagekube.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
