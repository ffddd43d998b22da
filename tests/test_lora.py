"""Multi-LoRA in the engine: each adapter's greedy output equals HF transformers + PEFT's merged model (float32); a
batch mixing adapters and base rows (chunked prefill, prefix caching, preemption) equals each request alone; the
prefix cache never shares blocks between adapters; --max-loras bounds the adapters of a step; bad adapters are
refused with a message naming them and the reason."""

from __future__ import annotations

import json

import pytest
import torch

from pagekube.engine import LLM, LoRARequest, SamplingParams
from pagekube.engine.errors import AdapterError
from pagekube.engine.lora.adapter import read_adapter
from tests.conftest import write_tiny_llama
from tests.lora_adapters import ALL, ATTENTION, MLP, hf_greedy, merged_hf_model, write_adapter

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Kubernetes is"]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def base(tmp_path_factory, bundled_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"), bundled_dir)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, base):
    """Three adapters over `base`: attention only (r 8), every projection with rslora (r 16), the MLP (r 4)."""
    d = tmp_path_factory.mktemp("adapters")
    return {
        "attn": write_adapter(base, d / "attn", ATTENTION, r=8, seed=1),
        "all-rslora": write_adapter(base, d / "all", ALL, r=16, alpha=8, rslora=True, seed=2),
        "mlp": write_adapter(base, d / "mlp", MLP, r=4, alpha=4, seed=3),
    }


@pytest.fixture(scope="module")
def lora_llm(base):
    return LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)


def requests_for(adapters) -> dict[str, LoRARequest | None]:
    out = {"base": None}
    out.update({name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(adapters.items()))})
    return out


@pytest.fixture(scope="module")
def expected(base, adapters, lora_llm):
    """HF + PEFT (merged) greedy tokens per adapter and prompt."""
    ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
    out = {}
    for name in ["base", *sorted(adapters)]:
        model = merged_hf_model(base, adapters.get(name))
        out[name] = [hf_greedy(model, i, MAX_TOKENS) for i in ids]
    return ids, out


def test_each_adapter_greedy_matches_hf_peft_merged(lora_llm, adapters, expected):
    ids, want = expected
    assert len({tuple(t[0]) for t in want.values()}) == 4  # every adapter changes the output
    for name, request in requests_for(adapters).items():
        got = [o.outputs[0].token_ids for o in lora_llm.generate(ids, GREEDY, lora_request=request)]
        assert got == want[name], name


def test_a_mixed_batch_equals_each_request_alone(base, adapters, expected):
    """Every prompt under every adapter and the base model in one generate call: 20 sequences with chunked
    prefill (32-token steps), prefix caching and a KV cache small enough to preempt, so adapter rows, base rows,
    prompt chunks and decodes share steps and interleave."""
    ids, want = expected
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=32,
              block_size=4, kv_cache_memory=40 * 1024)  # 40 blocks of 1 KiB
    reqs = requests_for(adapters)
    prompts, loras, names = [], [], []
    for k, p in enumerate(ids):  # round robin: one adapter's rows are not contiguous in a step
        for name, request in reqs.items():
            prompts.append((k, p))
            loras.append(request)
            names.append(name)
    outs = llm.generate([p for _, p in prompts], GREEDY, lora_request=loras)
    assert llm.engine.scheduler.num_preemptions > 0
    for (k, _), name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == want[name][k], (name, k)


@pytest.mark.parametrize("size", [2, 4], ids=["tp2-split-kv", "tp4-replicated-kv"])
def test_adapters_under_tensor_parallelism_match_hf_peft(base, adapters, expected, size):
    """Each rank holds its slice of each adapter (B's rows of q/k/v and gate/up, A's columns of o and down). Two
    slots for three adapters and the base model in one batch: slots are reloaded mid-run, and every worker loads
    what rank 0 loads."""
    ids, want = expected
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, tensor_parallel_size=size)
    try:
        reqs = requests_for(adapters)
        prompts = [(k, name) for k in range(len(ids)) for name in reqs]
        outs = llm.generate([ids[k] for k, _ in prompts], GREEDY, lora_request=[reqs[name] for _, name in prompts])
        assert [o.outputs[0].token_ids for o in outs] == [want[name][k] for k, name in prompts]
        layer = llm.engine.runner.model.model.layers[0]
        assert layer.self_attn.o_proj.lora.a.shape[-1] == 64 // size  # rank 0's columns of o_proj's A
    finally:
        llm.close()


def test_the_prefix_cache_never_shares_blocks_between_adapters(lora_llm, adapters):
    reqs = requests_for(adapters)
    prompt = list(range(100, 164))  # 4 full blocks
    lora_llm.generate([prompt], GREEDY, lora_request=reqs["attn"])
    again = lora_llm.generate([prompt], GREEDY, lora_request=reqs["attn"])[0]
    other = lora_llm.generate([prompt], GREEDY, lora_request=reqs["mlp"])[0]
    assert again.num_cached_tokens == 48 and other.num_cached_tokens == 0


def test_max_loras_bounds_the_adapters_of_one_step(base, adapters, expected):
    """With one slot, requests for three adapters and the base model all finish, correctly, and no step ever used
    two adapters."""
    ids, want = expected
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    seen = []
    assign = llm.engine.runner.lora.assign

    def spy(adapters_in_step, on_load=None):
        seen.append(len(adapters_in_step))
        return assign(adapters_in_step, on_load)

    llm.engine.runner.lora.assign = spy
    reqs = list(requests_for(adapters).items())
    outs = llm.generate([ids[0]] * len(reqs), GREEDY, lora_request=[r for _, r in reqs])
    assert [o.outputs[0].token_ids for o in outs] == [want[name][0] for name, _ in reqs]
    assert max(seen) == 1


def test_an_adapter_on_the_bundled_model_matches_hf_peft(tmp_path, bundled_dir, llm):
    adapter = write_adapter(bundled_dir, tmp_path / "smol", ["q_proj", "v_proj", "down_proj"], r=8, alpha=16, seed=4)
    lora = LLM(str(bundled_dir), dtype="float32", enable_lora=True, kv_cache_memory=64 * 1024**2)
    hf = merged_hf_model(bundled_dir, adapter)
    ids = [lora.tokenizer.encode(p) for p in PROMPTS[:3]]
    want = [hf_greedy(hf, i, MAX_TOKENS) for i in ids]
    got = lora.generate(ids, GREEDY, lora_request=LoRARequest("smol", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in got] == want
    assert want != [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)]  # the adapter matters


# ---- refusals ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_base(tmp_path_factory, bundled_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("other-base"), bundled_dir, hidden_size=32, intermediate_size=64)


def refusal(lora_llm, path, max_rank=16) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter(LoRARequest("bad", 9, str(path)), lora_llm.engine.runner.model, max_rank, torch.float32)
    assert "'bad'" in str(e.value)
    return str(e.value)


def test_bad_adapters_are_refused_naming_the_reason(tmp_path, lora_llm, adapters, base, other_base):
    assert "another base model" in refusal(lora_llm, write_adapter(other_base, tmp_path / "other", ATTENTION))
    assert "exceeds --max-lora-rank 4" in refusal(lora_llm, adapters["attn"], max_rank=4)
    assert "not a PEFT adapter" in refusal(lora_llm, tmp_path / "missing")
    assert "DoRA" in refusal(lora_llm, write_adapter(base, tmp_path / "dora", ATTENTION, use_dora=True))
    head = write_adapter(base, tmp_path / "head", ["q_proj", "lm_head"])
    assert "lm_head adapters are not supported" in refusal(lora_llm, head)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    assert "unreadable" in refusal(lora_llm, broken)


def test_the_engine_refuses_an_adapter_request_and_keeps_serving(lora_llm, tmp_path):
    from pagekube.engine.errors import RequestRejected

    with pytest.raises(RequestRejected, match="not a PEFT adapter"):
        lora_llm.generate(["Hello"], GREEDY, lora_request=LoRARequest("gone", 99, str(tmp_path / "nothing")))
    assert not lora_llm.engine.has_unfinished_requests()
    assert lora_llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids


def test_lora_flags_parse_as_vllm_and_refuse_what_cannot_run():
    from pagekube.engine.cli import build_parser, config_from_args
    from pagekube.engine.config import EngineConfig

    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                      '{"name": "b", "path": "/y", "base_model_name": "m"}', "--max-loras", "2"])
    config = config_from_args(args)
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_modules] == [("a", "/x", None), ("b", "/y", "m")]
    for bad, message in [({"lora_modules": ["a=/x"]}, "needs --enable-lora"),
                         ({"enable_lora": True, "lora_modules": ["a=/x", "a=/y"]}, "twice"),
                         ({"enable_lora": True, "lora_modules": ["no-path"]}, "name=path"),
                         ({"enable_lora": True, "lora_modules": ["bad name=/x"]}, "adapter name"),
                         ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "at least --max-loras")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
