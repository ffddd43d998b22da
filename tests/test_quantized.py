"""Quantized checkpoints: every on-disk layout read from known integers; refusals that name the scheme; real
checkpoints made by llm-compressor (W4A16 symmetric and asymmetric, W8A16, FP8, GPTQ with act order) giving
transformers' greedy output in float32; AWQ and GPTQ checkpoints holding the same integers giving the same output;
tensor parallelism over packed weights; weights kept packed in memory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagekube.engine import LLM, SamplingParams
from pagekube.engine.quantization import layouts
from pagekube.engine.quantization.packed import IntWeight
from pagekube.engine.quantization.schemes import QuantizationError, WeightScheme, resolve
from tests.conftest import write_tiny_llama
from tests.quantized_checkpoints import (
    SMOLLM_JOBS,
    convert,
    int_weights,
    pack_along_cols,
    pack_along_rows,
    pack_awq,
    quantize,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are",
           "Kubernetes schedules pods by", "1, 1, 2, 3, 5, 8,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=5)



def expected(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """(q - zero) * scale with one zero and scale per `group` columns of each row."""
    return (q.float() - zero.float().repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)


def known(n: int, k: int, bits: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) + 0.01
    return q, zero, scale


# ---- layouts, from known integers ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, None], ids=["group32", "channel"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_compressed_tensors_pack_quantized_reads_known_integers(bits, group, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = 24, 128
    q, zero, scale = known(n, k, bits, group or k)
    offset = 1 << (bits - 1)
    if symmetric:
        zero = torch.full_like(zero, offset)
    tensors = {"weight_packed": pack_to_int32((q.to(torch.int32) - offset).to(torch.int8), bits),
               "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if not symmetric:  # compressed-tensors packs asymmetric zero points along the rows
        tensors["weight_zero_point"] = pack_to_int32((zero.to(torch.int32) - offset).to(torch.int8), bits, 0)
    w = layouts.read(WeightScheme("compressed-int", bits, group, symmetric), tensors, "proj")
    assert w.packed.numel() == n * k * bits // 8  # packed in memory, not widened
    assert torch.equal(w.dequantize(torch.float32), expected(q, zero, scale, group or k))


def test_awq_layout_reads_known_integers_in_its_interleaved_nibble_order():
    n, k, group = 32, 64, 32
    q, zero, scale = known(n, k, 4, group)
    tensors = {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zero.t().contiguous()),
               "scales": scale.t().half()}
    w = layouts.read(WeightScheme("awq", 4, group, False), tensors, "proj")
    assert torch.equal(w.dequantize(torch.float32), expected(q, zero, scale.half().float(), group))
    # one nibble by hand: column 1 of a word sits in bits 16..19 (AutoAWQ's order 0, 2, 4, 6, 1, 3, 5, 7)
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 1] = 5
    assert int(pack_awq(one)[0, 0]) == 5 << 16


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layout_reads_known_integers_with_act_order_and_v1_zeros(bits):
    n, k, group = 16, 128, 32
    q, zero, scale = known(n, k, bits, group)
    zero = zero.clamp(min=1)  # v1 stores zero - 1: a zero of 0 cannot be stored (as in GPTQ)
    g = torch.Generator().manual_seed(1)
    g_idx = torch.randperm(k, generator=g) % (k // group)  # act order: groups not in column order
    tensors = {"qweight": pack_along_rows(q.t().contiguous(), bits),
               "qzeros": pack_along_cols((zero.to(torch.int32) - 1).t().contiguous(), bits),
               "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    w = layouts.read(WeightScheme("gptq", bits, group, False, gptq_v1_zeros=True), tensors, "proj")
    want = (q.float() - zero[:, g_idx].float()) * scale[:, g_idx]
    assert torch.equal(w.dequantize(torch.float32), want)
    # tensor parallel, row-parallel: a rank's input columns keep every group's scale (act order spans them all)
    assert torch.equal(w.narrow(1, 64, 64).dequantize(torch.float32), want[:, 64:])


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_weights_read_with_their_scales(strategy):
    n, k = 256, 256
    w8 = (torch.randn(n, k) * 50).to(torch.float8_e4m3fn)
    scale = {"tensor": torch.tensor([0.02]), "channel": torch.rand(n, 1) + 0.01,
             "block": torch.rand(2, 2) + 0.01}[strategy]
    block = (128, 128) if strategy == "block" else None
    w = layouts.read(WeightScheme("compressed-fp8", 8, block=block), {"weight": w8, "weight_scale": scale}, "p")
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1) if block else scale.reshape(-1, 1)
    assert torch.equal(w.dequantize(torch.float32), w8.float() * full)


def test_a_tensor_parallel_split_inside_a_group_is_refused():
    q, zero, scale = known(8, 128, 4, 64)
    w = IntWeight(layouts.pack_nibbles(q), scale, zero, 4, 64)
    assert torch.equal(w.narrow(1, 64, 64).dequantize(torch.float32), expected(q, zero, scale, 64)[:, 64:])
    with pytest.raises(ValueError, match="cuts a quantization group of 64"):
        w.narrow(1, 32, 96)


def test_a_layout_with_a_missing_scale_or_an_unknown_tensor_is_refused():
    tensors = {"weight_packed": torch.zeros(4, 4, dtype=torch.int32), "weight_shape": torch.tensor([4, 32])}
    with pytest.raises(QuantizationError, match="proj: compressed-int checkpoint is missing weight_scale"):
        layouts.read(WeightScheme("compressed-int", 4, 32), tensors, "proj")
    tensors |= {"weight_scale": torch.ones(4, 1), "weight_global_scale": torch.ones(1)}
    with pytest.raises(QuantizationError, match="weight_global_scale"):
        layouts.read(WeightScheme("compressed-int", 4, 32), tensors, "proj")


# ---- schemes: what is refused, and how it says so -------------------------------------------------------------


def _ct(weights: dict, fmt: str = "pack-quantized", **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **extra}}}


class _Config:
    def __init__(self, qc):
        self.quantization_config = qc


@pytest.mark.parametrize("qc, says", [
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    (_ct(int_weights(8, None), input_activations={"num_bits": 8, "type": "int", "strategy": "token"}),
     "W8A8 (int activations) is not supported"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "nvfp4-pack-quantized"),
     "float4 weights in format 'nvfp4-pack-quantized' are not supported"),
    (_ct(int_weights(2, 64)), "int2 weights in format 'pack-quantized' are not supported"),
    (_ct(int_weights(4, 64)) | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv' layout"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq: 3-bit weights are not supported"),
])
def test_a_scheme_the_engine_does_not_run_is_refused_by_name(qc, says):
    with pytest.raises(QuantizationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        resolve(_Config(qc), None)


def test_the_flag_must_match_the_checkpoint_and_is_refused_on_an_unquantized_one():
    qc = _ct(int_weights(4, 64))
    assert resolve(_Config(qc), "compressed-tensors").name == "compressed-tensors"
    with pytest.raises(QuantizationError, match="--quantization awq does not match the checkpoint's "
                                                "quantization \\(compressed-tensors\\)"):
        resolve(_Config(qc), "awq")
    with pytest.raises(QuantizationError, match="the checkpoint is not quantized"):
        resolve(_Config(None), "fp8")
    method = resolve(_Config(qc), None)
    assert method.scheme_for("lm_head") is None and method.scheme_for("model.layers.0.mlp.up_proj").bits == 4


def test_fp8_weights_without_a_quantization_config_are_refused_not_served_as_garbage(tmp_path, bundled_dir):
    """The bug this issue began with: an FP8 checkpoint whose scales were ignored loaded without a word."""
    model = write_tiny_llama(tmp_path / "m", bundled_dir, shard=None)
    state = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    state[name + "_scale"] = torch.ones(state[name].shape[0], 1)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="up_proj.weight_scale: a quantization tensor of a layer the "
                                                "checkpoint's quantization_config does not quantize"):
        LLM(str(model), dtype="float32", kv_cache_memory=16 * 1024**2)
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="float8_e4m3fn weights in a checkpoint whose config.json"):
        LLM(str(model), dtype="float32", kv_cache_memory=16 * 1024**2)


# ---- real checkpoints --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_checkpoints(bundled_dir):
    return quantize(bundled_dir, SMOLLM_JOBS)


class Greedy:
    """Greedy tokens per prompt and, per position, the top 5 token ids there."""

    def __init__(self, tokens: list[list[int]], top5: list[list[set[int]]]):
        self.tokens, self.top5 = tokens, top5

    def assert_close(self, other: Greedy, eos: int | None = None) -> None:
        """vLLM's check_logprobs_close: equal, or at the first token where they part each is in the other's top 5
        (the CPU kernel and torch's GEMM add in different orders: float rounding may part a near tie)."""
        for p, (a, b) in enumerate(zip(self.tokens, other.tokens, strict=True)):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    assert x in other.top5[p][i] and y in self.top5[p][i], (PROMPTS[p], i, x, y)
                    break
                if x == eos:
                    break
            else:
                assert len(a) == len(b) or eos in (a[-1:] + b[-1:]), (PROMPTS[p], a, b)


def engine_greedy(model, lora_request=None, **kw) -> tuple[Greedy, LLM]:
    llm = LLM(str(model), dtype="float32", kv_cache_memory=64 * 1024**2, **kw)
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, lora_request=lora_request)]
        return Greedy([list(o.token_ids) for o in outs],
                      [[set(sorted(lp, key=lp.get, reverse=True)[:5]) for lp in o.logprobs] for o in outs]), llm
    finally:
        llm.close()


def hf_greedy(model) -> Greedy:
    """transformers' greedy output on the checkpoint (compressed-tensors decompresses it, in float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    tokens, top5 = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                          output_scores=True, return_dict_in_generate=True)
        tokens.append(gen.sequences[0, ids.shape[1]:].tolist())
        top5.append([set(score[0].topk(5).indices.tolist()) for score in gen.scores])
    return Greedy(tokens, top5)


@pytest.mark.parametrize("scheme", list(SMOLLM_JOBS))
def test_llmcompressor_checkpoint_of_the_bundled_model_gives_transformers_greedy_output(smollm_checkpoints,
                                                                                         scheme):
    model = smollm_checkpoints[scheme]
    got, llm = engine_greedy(model)
    got.assert_close(hf_greedy(model), eos=llm.engine.tokenizer.eos_token_id)
    linear = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert linear.weight is None and linear.quant is not None  # kept packed: no float copy of the weight


def test_tiny_random_llama_checkpoint_gives_transformers_greedy_output_and_splits_over_two_ranks(tmp_path,
                                                                                                  bundled_dir):
    base = write_tiny_llama(tmp_path / "tiny", bundled_dir, shard=None)
    ckpt = quantize(base, {"w4a16-g32-asym": {"weights": int_weights(4, 32, symmetric=False)}})["w4a16-g32-asym"]
    got, _ = engine_greedy(ckpt)
    got.assert_close(hf_greedy(ckpt))
    split, llm = engine_greedy(ckpt, tensor_parallel_size=2)  # o_proj and down_proj split by whole groups
    split.assert_close(got)
    # act order (g_idx out of column order) under row parallelism: every rank keeps every group's scale
    act_order = convert(ckpt, tmp_path / "gptq-act-order", "gptq-act-order")
    engine_greedy(act_order, tensor_parallel_size=2)[0].assert_close(got)


@pytest.mark.parametrize("layout, source", [("awq", "w4a16-g32-asym"), ("gptq", "w4a16-g64"),
                                            ("gptq-act-order", "w4a16-g64")])
def test_awq_and_gptq_checkpoints_with_the_same_integers_give_the_same_output(smollm_checkpoints, tmp_path,
                                                                              layout, source):
    reference, _ = engine_greedy(smollm_checkpoints[source])
    got, llm = engine_greedy(convert(smollm_checkpoints[source], tmp_path / layout, layout))
    if layout == "gptq-act-order":  # g_idx: the torch path, not the kernel (other sums: vLLM's rule)
        got.assert_close(reference, eos=llm.engine.tokenizer.eos_token_id)
    else:  # the same integers through the same kernel
        assert got.tokens == reference.tokens
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant is not None


def dense_copy(ckpt, out):
    """The checkpoint's weights dequantized by compressed-tensors, saved as an unquantized model."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True))
    out.mkdir()
    tied = hf.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for f in ckpt.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_a_lora_adapter_applies_on_a_quantized_base_as_on_its_dequantized_weights(smollm_checkpoints, bundled_dir,
                                                                                   tmp_path):
    from pagekube.engine import LoRARequest
    from tests.lora_adapters import ALL, write_adapter

    ckpt = smollm_checkpoints["w4a16-g64"]
    adapter = LoRARequest("a", 1, str(write_adapter(bundled_dir, tmp_path / "adapter", ALL)))
    quantized, llm = engine_greedy(ckpt, adapter, enable_lora=True)
    dense, _ = engine_greedy(dense_copy(ckpt, tmp_path / "dense"), adapter, enable_lora=True)
    quantized.assert_close(dense, eos=llm.engine.tokenizer.eos_token_id)
    assert quantized.tokens != engine_greedy(ckpt)[0].tokens  # the adapter changes the output


@pytest.mark.parametrize("scheme", list(SMOLLM_JOBS))
def test_the_gpu_kernel_reads_each_llmcompressor_layout_as_the_torch_path_does(smollm_checkpoints, scheme):
    """The Triton kernel (pagekube/kernels/triton_quant.py, interpreted on the CPU) on a real checkpoint's packed
    Linears of one decoder layer, fused q/k/v and gate/up included, against dequantize-then-matmul."""
    llm = LLM(str(smollm_checkpoints[scheme]), dtype="float32", kv_cache_memory=16 * 1024**2)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        for linear in linears:
            x = torch.randn(3, linear.quant.shape[1], generator=torch.Generator().manual_seed(0))
            ref = torch.nn.functional.linear(x, linear.quant.dequantize(torch.float32))
            out = linear.quant.triton_linear(x)
            assert out is not None and ((out - ref).norm() / ref.norm()).item() < 1e-5
    finally:
        llm.close()


def test_the_flag_is_checked_against_the_checkpoint_at_start(smollm_checkpoints):
    with pytest.raises(QuantizationError, match="--quantization gptq does not match"):
        LLM(str(smollm_checkpoints["w4a16-g64"]), dtype="float32", quantization="gptq")


def test_w4a16_weights_take_well_under_half_the_memory_of_bf16(smollm_checkpoints, bundled_dir):
    from pagekube.engine.model.model_loader import weight_bytes

    sizes = {}
    for name, model in [("bf16", bundled_dir), ("w4a16", smollm_checkpoints["w4a16-g64"])]:
        llm = LLM(str(model), dtype="bfloat16", kv_cache_memory=16 * 1024**2)
        sizes[name] = weight_bytes(llm.engine.runner.model)
        llm.close()
    print(f"weights in memory: bf16 {sizes['bf16'] / 1e6:.1f} MB, W4A16 g64 {sizes['w4a16'] / 1e6:.1f} MB")
    assert sizes["w4a16"] < 0.5 * sizes["bf16"]


def test_a_quantized_model_serves_through_the_openai_api(smollm_checkpoints):
    import openai
    from transformers import AutoTokenizer

    from tests.server_process import ServerProcess

    model = smollm_checkpoints["w4a16-g64"]
    reference = engine_greedy(model)[0].tokens
    srv = ServerProcess(str(model), "--dtype", "float32", "-q", "compressed-tensors", "--served-model-name", "q")
    try:
        client = openai.OpenAI(base_url=srv.wait_ready().url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="q", prompt=PROMPTS[0], max_tokens=16, temperature=0)
        assert out.choices[0].text == AutoTokenizer.from_pretrained(model).decode(reference[0],
                                                                                  skip_special_tokens=True)
    finally:
        srv.stop()


def test_a_mismatched_flag_stops_the_server_with_the_reason(smollm_checkpoints):
    from tests.server_process import ServerProcess

    srv = ServerProcess(str(smollm_checkpoints["fp8-dynamic"]), "-q", "awq")
    try:
        assert srv.proc.wait(timeout=120) == 1
        assert "--quantization awq does not match the checkpoint's quantization (compressed-tensors)" in srv.log()
    finally:
        srv.stop()



@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 16), (4, 128), (8, 32), (8, None)],
                         ids=["int4-g32", "int4-g64", "int4-g16", "int4-g128", "int8-g32", "int8-channel"])
@pytest.mark.parametrize("n", [41, 42, 43, 44])  # the kernel's last block of weight rows: 1, 2, 3 or 4 of them
def test_the_cpu_int_kernel_computes_the_dequantized_matmul_for_any_row_count(bits, group, n):
    from pagekube.engine.quantization.packed import QuantizedWeight
    from pagekube.kernels.cpu_ops import load_int_kernels

    if not load_int_kernels():
        pytest.skip("no AVX2 or no C++ compiler: the torch path runs")
    k = 256
    q, zero, scale = known(n, k, bits, group or k, seed=3)
    part = IntWeight(layouts.pack_nibbles(q) if bits == 4 else q, scale, zero, bits, group or k)
    weight = QuantizedWeight([part, part])  # fused: two parts side by side
    x = torch.randn(70, k)
    reference = x @ weight.dequantize(torch.float32).t()
    bias = torch.randn(2 * n)
    for rows in (1, 2, 3, 4, 8, 9, 17, 64):  # 1-3: dequantized in registers; more: through a buffer
        got = weight.linear(x[:rows], bias, kernel=True)
        torch.testing.assert_close(got, reference[:rows] + bias, rtol=1e-4, atol=1e-3)  # sums reach ~1e3
        alone = torch.cat([weight.linear(x[r:r + 1], bias, kernel=True) for r in range(rows)])
        assert torch.equal(got, alone)  # each row's result as when it is alone: batch invariant
    torch.testing.assert_close(weight.linear(x[:4].bfloat16(), None, kernel=True).float(),
                               x[:4].bfloat16().float() @ weight.dequantize(torch.float32).t(), rtol=2e-2, atol=0.3)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_the_cpu_fp8_kernel_computes_the_dequantized_matmul(strategy):
    from pagekube.engine.quantization.packed import Fp8Weight, QuantizedWeight
    from pagekube.kernels.cpu_ops import load_int_kernels

    if not load_int_kernels():
        pytest.skip("no AVX2 or no C++ compiler: the torch path runs")
    n, k = 256, 384
    every_value = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every_value = every_value[every_value.isfinite()]  # all 254 finite e4m3 values, subnormals included
    w8 = every_value[torch.randint(0, every_value.numel(), (n, k))].to(torch.float8_e4m3fn)
    scale = {"tensor": torch.tensor([[0.02]]), "channel": torch.rand(n, 1) + 0.01,
             "block": torch.rand(2, 3) + 0.01}[strategy]
    weight = QuantizedWeight([Fp8Weight(w8, scale, (128, 128) if strategy == "block" else None)])
    x = torch.randn(9, k)
    reference = x @ weight.dequantize(torch.float32).t()
    assert weight.kernel_args is None
    torch.testing.assert_close(weight.linear(x, None, kernel=True), reference, rtol=1e-4, atol=1e-3)
    assert weight.kernel_args[0][0] == torch.ops.pagekube_int.fp8_linear  # the kernel ran, not the fallback
    one_hot = torch.eye(k)[:8]  # each weight exactly, as the kernel dequantizes it
    assert torch.equal(weight.linear(one_hot, None, kernel=True), weight.dequantize(torch.float32)[:, :8].t())
