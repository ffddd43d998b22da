"""BERT-family encoder (all-MiniLM, bge, e5 are BERT) over packed sequences: absolute positions, token type 0,
bidirectional attention within each sequence. Checkpoint names are Hugging Face's BertModel's (a `bert.` prefix,
as BertForMaskedLM saves, is dropped); q, k and v load into one fused projection."""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn
from transformers.activations import ACT2FN

from pagekube.engine.pooling.packed_attention import packed_attention

# Checkpoint names inside `encoder.layer.N.` -> ours; q/k/v are fused into `qkv` (in that row order).
LAYER_NAMES = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
               "intermediate.dense": "ffn_in", "output.dense": "ffn_out", "output.LayerNorm": "ffn_norm"}
QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
GELU_ALGORITHMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF's name -> oneDNN's


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.ffn_in = nn.Linear(h, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=eps)
        self.act = ACT2FN[config.hidden_act]
        self.gelu_algorithm = GELU_ALGORITHMS.get(config.hidden_act)
        self.fuse_gelu = False  # set at load: bf16 on a CPU with oneDNN

    def forward(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, h // self.heads).unbind(1)
        attn = packed_attention(q, k, v, bounds, (h // self.heads) ** -0.5, causal=False)
        x = self.attn_norm(x + self.attn_out(attn.reshape(t, h)))
        if self.fuse_gelu:  # oneDNN applies GELU as the GEMM writes its output: 3.6 ms instead of 12.6 (4096 rows)
            inner = torch.ops.mkldnn._linear_pointwise(x, self.ffn_in.weight, self.ffn_in.bias, "gelu", [],
                                                       self.gelu_algorithm)
        else:
            inner = self.act(self.ffn_in(x))
        return self.ffn_norm(x + self.ffn_out(inner))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported "
                             "(absolute is)")
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Hidden states [tokens, hidden] of packed sequences (sequence i is rows bounds[i]:bounds[i+1])."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, bounds)
        return x


def checkpoint_state(files, num_layers: int) -> dict[str, torch.Tensor]:
    """Our state dict from Hugging Face BertModel tensors (the pooler head and position_ids are not used)."""
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                raw[name.removeprefix("bert.")] = st.get_tensor(name)
    state = {f"{ours}.{kind}": raw[f"embeddings.{theirs}.{kind}"] for ours, theirs, kinds in (
        ("word_embeddings", "word_embeddings", ["weight"]), ("position_embeddings", "position_embeddings", ["weight"]),
        ("token_type_embeddings", "token_type_embeddings", ["weight"]), ("embed_norm", "LayerNorm", ["weight", "bias"]),
    ) for kind in kinds if f"embeddings.{theirs}.{kind}" in raw}
    for i in range(num_layers):
        prefix = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            parts = [raw.get(f"{prefix}{name}.{kind}") for name in QKV]
            if all(p is not None for p in parts):
                state[f"layers.{i}.qkv.{kind}"] = torch.cat(parts)
            for theirs, ours in LAYER_NAMES.items():
                if f"{prefix}{theirs}.{kind}" in raw:
                    state[f"layers.{i}.{ours}.{kind}"] = raw[f"{prefix}{theirs}.{kind}"]
    return state


def load_bert(hf_config, files, dtype: torch.dtype, device: torch.device) -> BertEncoder:
    with torch.device("meta"):
        model = BertEncoder(hf_config)
    state = checkpoint_state(files, hf_config.num_hidden_layers)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state, strict=True, assign=True)
    # The op torch's own compiler fuses with; oneDNN has bf16 GEMMs only from AVX-512 on (an AVX2 CPU refuses it).
    fuse = (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    for layer in model.layers:
        layer.fuse_gelu = fuse and layer.gelu_algorithm is not None
    return model.to(device=device, dtype=dtype).eval()

