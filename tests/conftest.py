"""Shared fixtures: the bundled SmolLM2 model (converted once) and tiny random Llama checkpoints."""

from __future__ import annotations

import os
import shutil

# Triton kernels run under the interpreter where there is no GPU. It must be set before anything imports triton
# (torch and transformers may), or triton's own library functions are already compiled-mode JIT functions.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest
import torch

from pagekube.engine.model.model_files import resolve_model_dir


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def llm(bundled_dir):
    from pagekube.engine import LLM

    return LLM(str(bundled_dir), dtype="float32", kv_cache_memory=256 * 1024**2)


BUNDLED_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(bundled_dir):
    """The bundled model behind a real `pagekube serve` process, one per test module (a module may define its own)."""
    from tests.server_process import ServerProcess

    srv = ServerProcess(str(bundled_dir), "--served-model-name", BUNDLED_MODEL, "--kv-cache-memory", str(128 * 1024**2))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on `server`."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def hf_model(bundled_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()


def write_tiny_llama(path: Path, bundled_dir: Path, *, tie: bool = False, seed: int = 0, shard: str | None = "300KB",
                     arch: str = "llama", **overrides) -> Path:
    """A random-initialized Llama-family model (llama, qwen2: q/k/v bias, mistral) with the bundled tokenizer,
    saved as (sharded) safetensors."""
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
    config_cls, model_cls = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")

    torch.manual_seed(seed)
    cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               tie_word_embeddings=tie, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    model = model_cls(config_cls(**cfg))
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (bundled_dir / name).exists():
            shutil.copy(bundled_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, bundled_dir) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_dir)


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_dir):
    """Engines on the tiny model in float32: tests that compare outputs across batch shapes (preemption, forks)
    need exact arithmetic, and bf16 rounding depends on which rows share a GEMM."""
    from pagekube.engine.config import EngineConfig
    from pagekube.engine.llm_engine import LLMEngine

    def make(**kw):
        return LLMEngine(EngineConfig(model=str(tiny_dir), **{"dtype": "float32", **kw}))
    return make
