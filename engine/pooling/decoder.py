"""A Llama-family decoder's final hidden states over packed sequences, for last-token (or mean) pooling:
the generation model's own layers and loader, causal attention within each sequence, no KV cache kept."""

from __future__ import annotations

import copy

import torch

from pagekube.engine.model.model import use_kernels
from pagekube.engine.model.model_loader import load_model
from pagekube.engine.pooling.packed_attention import PackedCausalAttention, packed_metadata
from pagekube.kernels.cpu_ops import CpuKernels


class DecoderForPooling:
    def __init__(self, hf_config, model_dir, dtype: torch.dtype, device: torch.device):
        config = copy.deepcopy(hf_config)
        config.tie_word_embeddings = True  # no LM head: embedding checkpoints (MistralModel, ...) have none
        self.causal_lm = load_model(config, model_dir, dtype, device)
        attn = self.causal_lm.model.layers[0].self_attn
        use_kernels(self.causal_lm, CpuKernels.for_model(device, dtype, attn.head_dim))
        self.kv_shape = (attn.num_kv_heads, attn.head_dim)
        self.num_layers = len(self.causal_lm.model.layers)
        self.backend = PackedCausalAttention()
        self.dtype, self.device = dtype, device

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        # One scratch K/V buffer serves every layer: each layer writes its K/V, then attends, before the next.
        scratch = torch.empty(1, bounds[-1], *self.kv_shape, dtype=self.dtype, device=self.device)
        kv = (scratch, torch.empty_like(scratch))
        return self.causal_lm(input_ids, positions, [kv] * self.num_layers, packed_metadata(bounds, self.device),
                              self.backend)
