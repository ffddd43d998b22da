"""The pooling runner against its references, offline (LLM.embed): sentence-transformers on all-MiniLM-L6-v2,
Hugging Face transformers on tiny random BERT and Llama base models; float32, cosine >= 0.9999 for every input,
batched with mixed lengths and one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagekube.engine import LLM
from tests.embedding_models import TEXTS, minilm_dir, write_tiny_bert, write_tiny_llama_base


def cosines(ours, reference) -> torch.Tensor:
    ours = torch.tensor([o.outputs.embedding for o in ours])
    return F.cosine_similarity(ours, torch.as_tensor(reference, dtype=torch.float32), dim=-1)


@pytest.fixture(scope="module")
def minilm():
    return LLM(str(minilm_dir()), dtype="float32")


def test_minilm_matches_sentence_transformers_batched_and_one_at_a_time(minilm):
    from sentence_transformers import SentenceTransformer

    texts = [*TEXTS, "word " * 400]  # the last is cut to the model's 256 tokens, as sentence-transformers does
    reference = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts)
    assert minilm.engine.runner_type == "pooling" and minilm.engine.max_model_len == 256
    batched = minilm.embed(texts, truncate_prompt_tokens=-1)
    assert cosines(batched, reference).min() >= 0.9999
    one_by_one = [minilm.embed(t, truncate_prompt_tokens=-1)[0] for t in texts]
    assert cosines(one_by_one, reference).min() >= 0.9999
    assert all(abs(sum(x * x for x in o.outputs.embedding) - 1) < 1e-4 for o in batched)  # its Normalize module


def test_token_ids_embed_as_their_text(minilm):
    ids = minilm.tokenizer(TEXTS)["input_ids"]
    by_text, by_ids = minilm.embed(TEXTS), minilm.embed(ids)
    assert [o.prompt_token_ids for o in by_text] == ids
    assert cosines(by_ids, [o.outputs.embedding for o in by_text]).min() >= 0.99999


def test_minilm_in_bfloat16_stays_close_to_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS)
    llm = LLM(str(minilm_dir()), dtype="bfloat16")
    assert cosines(llm.embed(TEXTS), reference).min() >= 0.999  # 0.9999 measured


@pytest.mark.parametrize("pooling", [None, "mean", "cls"])
def test_tiny_bert_matches_transformers(tmp_path, pooling):
    from transformers import AutoModel, AutoTokenizer

    path = write_tiny_bert(tmp_path / "bert", pooling=pooling)
    llm = LLM(str(path), dtype="float32")
    tok, hf = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
    pooled = torch.stack([s.mean(0) if pooling == "mean" else s[0] for s in states])  # no modules.json: CLS
    reference = F.normalize(pooled, dim=-1)
    assert cosines(llm.embed(TEXTS), reference).min() >= 0.9999
    assert cosines([llm.embed(t)[0] for t in TEXTS], reference).min() >= 0.9999


def test_tiny_llama_base_model_pools_its_last_token_as_transformers(tmp_path, bundled_dir):
    from transformers import AutoModel, AutoTokenizer

    path = write_tiny_llama_base(tmp_path / "llama", bundled_dir)
    llm = LLM(str(path), dtype="float32")  # runner auto: LlamaModel has no LM head, so it embeds
    assert llm.engine.runner_type == "pooling" and llm.engine.pooler.pooling_type == "LAST"
    tok, hf = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        last = torch.stack([hf(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS])
    reference = F.normalize(last, dim=-1)
    assert cosines(llm.embed(TEXTS), reference).min() >= 0.9999
    assert cosines([llm.embed(t)[0] for t in TEXTS], reference).min() >= 0.9999


def test_pooler_config_overrides_the_model_directory(tmp_path):
    path = write_tiny_bert(tmp_path / "bert", pooling="cls")
    llm = LLM(str(path), dtype="float32", pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    cls = LLM(str(path), dtype="float32")
    mean, first = llm.embed(TEXTS[1])[0].outputs.embedding, cls.embed(TEXTS[1])[0].outputs.embedding
    assert abs(sum(x * x for x in mean) - 1) > 1e-3  # not normalized
    assert F.cosine_similarity(torch.tensor(mean), torch.tensor(first), dim=0) < 0.999


def test_matryoshka_dimensions_cut_then_normalize(tmp_path):
    path = write_tiny_bert(tmp_path / "bert", matryoshka=[16, 32])
    llm = LLM(str(path), dtype="float32")
    full = torch.tensor(llm.embed(TEXTS[1])[0].outputs.embedding)
    cut = torch.tensor(llm.embed(TEXTS[1], dimensions=16)[0].outputs.embedding)
    assert cut.shape == (16,) and torch.allclose(cut, F.normalize(full[:16], dim=0), atol=1e-5)
    with pytest.raises(ValueError, match="matryoshka dimensions"):
        llm.embed("x", dimensions=20)


def test_a_generation_model_refuses_embed_and_a_pooling_model_refuses_generate(minilm, tiny_dir):
    with pytest.raises(ValueError, match="LLM.generate needs a generation model"):
        minilm.generate("hello")
    with pytest.raises(ValueError, match="LLM.embed needs an embedding model"):
        LLM(str(tiny_dir), dtype="float32", kv_cache_memory=16 * 1024**2).embed("hello")


def test_bad_pooling_settings_are_refused_with_their_name(tmp_path):
    from pagekube.engine.config import EngineConfig

    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(pooler_config='{"pooling_type": "MAX"}')
    path = write_tiny_bert(tmp_path / "bert", pooling="mean")
    config = path / "1_Pooling/config.json"
    config.write_text(config.read_text().replace("mean_tokens", "max_tokens"))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        LLM(str(path), dtype="float32")
