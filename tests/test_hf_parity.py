"""The engine's greedy output equals transformers' greedy generate, token for token; logits match within 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.model.attention import TorchAttention
from pagekube.engine.model.model import AttentionMetadata
from pagekube.engine.model.model_loader import load_model
from tests.conftest import write_tiny_llama

LONG = ("Kubernetes is an open-source system for automating deployment, scaling, and management of containerized "
        "applications. It groups containers that make up an application into logical units for easy management "
        "and discovery. Kubernetes builds upon fifteen years of experience of running production workloads at "
        "Google, combined with best-of-breed ideas and practices from the community. Summarize this in one line:")
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    LONG,
    "Bonjour, je m'appelle Marie et je",
    "Der schnellste Weg nach Berlin ist",
    "日本の首都は",
    "1, 2, 3, 4, 5,",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a primary color."}],
]
MAX_TOKENS = 24


def hf_greedy(hf_model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                temperature=None, top_p=None, top_k=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ids += [llm.apply_chat_template(c) for c in CHATS]
    return ids


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompt_ids):
    return [hf_greedy(hf_model, ids) for ids in prompt_ids]


def test_greedy_matches_hf_one_at_a_time(llm, prompt_ids, hf_tokens):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for ids, expected in zip(prompt_ids, hf_tokens, strict=True):
        got = llm.generate([ids], params)[0].outputs[0].token_ids
        assert got == expected, llm.tokenizer.decode(ids)


def test_greedy_matches_hf_all_in_one_batch(llm, prompt_ids, hf_tokens):
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens


def test_text_is_the_tokenizer_decode_of_the_tokens(llm, prompt_ids):
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def _prefill_logits(model, ids: list[int], chunks: list[int], block_size: int = 16) -> torch.Tensor:
    """Run `ids` through the paged model in prefill chunks; returns logits for every position."""
    attn = model.model.layers[0].self_attn
    num_blocks = -(-len(ids) // block_size) + 1
    caches = [(torch.zeros(num_blocks, block_size, attn.num_kv_heads, attn.head_dim),
               torch.zeros(num_blocks, block_size, attn.num_kv_heads, attn.head_dim)) for _ in model.model.layers]
    table = list(range(num_blocks))[::-1]  # non-trivial logical -> physical mapping
    out, start = [], 0
    for n in chunks:
        pos = list(range(start, start + n))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos]),
            block_tables=torch.tensor([table], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([start + n], dtype=torch.int32),
            query_lens=[n], context_lens_list=[start + n])
        with torch.no_grad():
            hidden = model(torch.tensor(ids[start:start + n]), torch.tensor(pos), caches, meta, TorchAttention())
            out.append(model.compute_logits(hidden))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen2", False), ("mistral", False)])
def test_tiny_sharded_checkpoint_logits_match_hf(tmp_path, bundled_dir, arch, tie):
    path = write_tiny_llama(tmp_path / "tiny", bundled_dir, tie=tie, seed=3, arch=arch)
    assert len(list(path.glob("*.safetensors"))) > 1, "the checkpoint should be sharded"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(hf.config, path, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    whole = _prefill_logits(ours, ids, [40])
    chunked = _prefill_logits(ours, ids, [7, 16, 1, 16])  # chunked prefill + a decode-like single token
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


def test_engine_config_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        EngineConfig(dtype="int3")
