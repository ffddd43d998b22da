"""Attention backends: pure torch (CPU, and the reference) and Triton (GPU; also runs under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagekube.engine.model.model import AttentionMetadata
from pagekube.kernels.cpu_ops import NO_KERNELS, CpuKernels
from pagekube.kernels.reference import paged_attention_ref, write_kv_cache_ref

DECODE_GROUP = 8  # decode tokens per batched SDPA call on the CPU (bench/offline_vs_hf.py)


class TorchAttention:
    name = "torch"
    kernels: CpuKernels = NO_KERNELS  # the model's, set when it loads

    @staticmethod
    def unsupported(block_size: int, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run the setting, or None (the torch path runs every block size and dtype)."""
        return None

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.kernels.decode_attention:  # the CPU extension reads K/V in place
            if meta.is_decode_only:
                return torch.ops.pagekube_cpu.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                                     meta.context_lens, scale)
            if "torch_kernel" not in meta.derived:
                meta.derived["torch_kernel"] = self._kernel_plan(meta)
            decodes, prefills = meta.derived["torch_kernel"]
            out = torch.empty_like(q)
            if decodes is not None:
                rows, seqs, lens = decodes
                out[rows] = torch.ops.pagekube_cpu.paged_decode_attention(
                    q[rows], k_cache, v_cache, meta.block_tables[seqs], lens, scale)
            self._prefill(out, q, k_cache, v_cache, meta, prefills, scale)
            return out
        if "torch" not in meta.derived:  # the plan is the same for every layer of a step
            meta.derived["torch"] = self._plan(meta, k_cache.shape[1])
        decode_groups, prefills = meta.derived["torch"]
        out = torch.empty_like(q)
        for rows, tables, mask in decode_groups:
            out[rows] = self._batched_decode(q[rows], k_cache, v_cache, tables, mask, scale)
        self._prefill(out, q, k_cache, v_cache, meta, prefills, scale)
        return out

    @staticmethod
    def _prefill(out, q, k_cache, v_cache, meta: AttentionMetadata, prefills, scale: float) -> None:
        for i, s, e, context in prefills:  # prefill chunks one by one (each its own causal shape)
            out[s:e] = paged_attention_ref(q[s:e], k_cache, v_cache, meta.block_tables[i:i + 1], [0, e - s],
                                           [context], scale)

    @staticmethod
    def _prefill_chunks(meta: AttentionMetadata, starts: list[int]) -> list[tuple[int, int, int, int]]:
        """(sequence, first row, end row, context length at the end row) of every sequence's prompt rows this step."""
        chunks = []
        for i, n in enumerate(meta.query_lens):
            generated = meta.generated_rows(i)
            if n > generated:
                chunks.append((i, starts[i], starts[i + 1] - generated, meta.context_lens_list[i] - generated))
        return chunks

    @staticmethod
    def _kernel_plan(meta: AttentionMetadata):
        """A mixed step: the rows of generated tokens (decodes, a speculative step's drafts) with their sequences
        and causal context lengths, for one decode-kernel call; the prompt rows' chunks, for the prefill path.
        A generated token's attention is then the same computation whether it was decoded alone, in a batch or
        verified with drafts, and a prompt token's whether or not the prefix cache held the rows before it."""
        starts = meta.query_start_loc.tolist()
        rows, seqs, lens = [], [], []
        for i in range(len(meta.query_lens)):
            g, end, context = meta.generated_rows(i), starts[i + 1], meta.context_lens_list[i]
            rows += range(end - g, end)  # row j of the g sees the context up to and including itself
            seqs += [i] * g
            lens += range(context - g + 1, context + 1)
        prefills = TorchAttention._prefill_chunks(meta, starts)
        device = meta.block_tables.device
        decodes = tuple(torch.tensor(v, device=device) for v in (rows, seqs))
        decodes += (torch.tensor(lens, dtype=meta.context_lens.dtype, device=device),)
        return (decodes if rows else None), prefills

    @staticmethod
    def _plan(meta: AttentionMetadata, block_size: int):
        """Split a step into groups of decode tokens (one query each) and prefill chunks. Each group is one SDPA
        call over its K/V gathered to its longest context, padding masked. Groups are the decodes sorted by
        context length, DECODE_GROUP at a time, so a long context pads only its neighbours: fewer ops per layer
        is what counts on the CPU, and so is not reading padding."""
        starts = meta.query_start_loc.tolist()
        lens = meta.context_lens_list
        decodes = sorted((i for i, n in enumerate(meta.query_lens) if n == 1), key=lens.__getitem__)
        prefills = [(i, starts[i], starts[i + 1], lens[i]) for i, n in enumerate(meta.query_lens) if n > 1]
        device = meta.block_tables.device
        groups = []
        for g in range(0, len(decodes), DECODE_GROUP):
            members = decodes[g:g + DECODE_GROUP]
            index = torch.tensor(members, device=device)
            num_blocks = -(-lens[members[-1]] // block_size)  # the longest is last
            pos = torch.arange(num_blocks * block_size, device=device)
            mask = (pos[None, :] < meta.context_lens[index][:, None])[:, None, None, :]
            rows = torch.tensor([starts[i] for i in members], device=device)
            groups.append((rows, meta.block_tables[index, :num_blocks].long().flatten(), mask))
        return groups, prefills

    @staticmethod
    def _batched_decode(q, k_cache, v_cache, tables, mask, scale: float) -> torch.Tensor:
        """Whole blocks are gathered (one contiguous copy each, not one per token), and each KV head's group of
        query heads is one SDPA row block: GQA without repeating K/V."""
        seqs, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        shape = (seqs, -1, kv_heads, dim)  # index_select copies whole rows; cache[tables] goes element by element
        k = k_cache.index_select(0, tables).view(shape).transpose(1, 2)  # [seqs, kv_heads, ctx, dim]
        v = v_cache.index_select(0, tables).view(shape).transpose(1, 2)
        grouped = q.view(seqs, kv_heads, heads // kv_heads, dim)  # HF's GQA: query head h reads KV head h // group
        out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        return out.reshape(seqs, heads, dim)


class TritonAttention:
    name = "triton"
    MIN_BLOCK_SIZE = 16  # the prefill kernel's P @ V is a tl.dot over the block: its K dimension must be >= 16

    @classmethod
    def unsupported(cls, block_size: int, dtype: torch.dtype) -> str | None:
        if block_size < cls.MIN_BLOCK_SIZE or block_size & (block_size - 1):
            return f"its kernels need a power-of-two block size of at least {cls.MIN_BLOCK_SIZE} (tl.dot's K dimension)"
        return None

    def __init__(self):
        from pagekube.kernels import triton_attention  # imported lazily: triton is only needed here

        self.ops = triton_attention

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.ops.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        if "triton" not in meta.derived:  # the same split for every layer of the step
            meta.derived["triton"] = self._plan(meta)
        decodes, prefills = meta.derived["triton"]
        if decodes is None:
            return self.ops.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                                    meta.context_lens, max(meta.query_lens), scale)
        # A mixed step: decode rows go to the decode kernel (split-K over the context, every query head of a KV
        # head in one program), not through the prefill kernel's 16-row tiles for one query row each.
        out = torch.empty_like(q)
        rows, seqs = decodes
        out[rows] = self.ops.paged_decode_attention(q[rows], k_cache, v_cache, meta.block_tables[seqs],
                                                    meta.context_lens[seqs], scale)
        rows, seqs, starts, longest = prefills
        out[rows] = self.ops.paged_prefill_attention(q[rows], k_cache, v_cache, meta.block_tables[seqs], starts,
                                                     meta.context_lens[seqs], longest, scale)
        return out

    @staticmethod
    def _plan(meta: AttentionMetadata):
        """(decode rows, their sequences) or None, and (prefill rows, their sequences, their query_start_loc,
        longest chunk), from the host-side query lengths: no device sync."""
        decode_rows, decode_seqs, prefill_rows, prefill_seqs, starts, at = [], [], [], [], [0], 0
        for i, n in enumerate(meta.query_lens):
            if n == 1:
                decode_rows.append(at)
                decode_seqs.append(i)
            else:
                prefill_rows.extend(range(at, at + n))
                prefill_seqs.append(i)
                starts.append(starts[-1] + n)
            at += n
        if not decode_rows:
            return None, None
        device = meta.block_tables.device

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        return ((tensor(decode_rows), tensor(decode_seqs)),
                (tensor(prefill_rows), tensor(prefill_seqs), tensor(starts, torch.int32), longest))


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}


def backend_class(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return BACKENDS[name]


def make_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype):
    """The attention backend, or a ValueError naming the flags it cannot run (raised before any weight loads)."""
    cls = backend_class(name, device)
    problem = cls.unsupported(block_size, dtype)
    if problem:
        raise ValueError(f"the {cls.name} attention backend cannot run --block-size {block_size} with --dtype "
                         f"{str(dtype).removeprefix('torch.')}: {problem}. Choose another --block-size, or "
                         "--attention-backend torch")
    return cls()
