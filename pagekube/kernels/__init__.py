"""Attention kernels: Triton implementations beside their pure-torch references (same signatures).

Layout shared by all: one KV pool per layer, `k_cache`/`v_cache` of shape [num_blocks, block_size, kv_heads,
head_dim]; `block_tables` [num_seqs, max_blocks] int32; a flattened batch of query tokens `q` [tokens, heads,
head_dim] with `query_start_loc` [num_seqs + 1] and `context_lens` [num_seqs] (tokens in cache after this step,
the new ones included). Queries are the last tokens of their sequence and attend causally.
"""

from pagekube.kernels.reference import lora_shrink_expand_ref, paged_attention_ref, write_kv_cache_ref

__all__ = ["lora_shrink_expand_ref", "paged_attention_ref", "write_kv_cache_ref"]
