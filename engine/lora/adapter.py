"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) against the base model's shapes.

An adapter adds `scale * B @ A` to some of q/k/v/o and gate/up/down (scale = lora_alpha / r, or / sqrt(r) with
rslora). The engine fuses q/k/v and gate/up into one Linear each, so an adapter's parts for one fused Linear are
packed side by side: `a` [parts * r, in] (the shrink) and `b` [out, parts * r] (the expand, scale folded in), each
part's B at its projection's rows. Under tensor parallelism each rank reads the whole adapter, checks it against
the whole model's shapes and keeps its own slice (`shard`). Everything an adapter could get wrong is refused here,
naming the adapter and the reason, before any request uses it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagekube.engine.errors import AdapterError
from pagekube.engine.lora.request import LoRARequest

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"(?:^|\.)(model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


@dataclass
class LinearLoRA:
    a: torch.Tensor  # [parts * r, in]
    b: torch.Tensor  # [out, parts * r], scale included


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    weights: dict[str, LinearLoRA] = field(default_factory=dict)  # by the engine's Linear name

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def id(self) -> int:
        return self.request.lora_int_id


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of the whole (unsharded) model: what an adapter for it must fit."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def shard(module: str, a: torch.Tensor, b: torch.Tensor, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of one projection's A and B, cut as its weight is: a column-parallel
    projection (q/k/v, gate/up) keeps its rows of B (A is whole), a row-parallel one (o, down) its columns of A (B is
    whole, and the all-reduce after the projection sums the ranks' LoRA terms with their base outputs)."""
    part = model.checkpoint_slice(f"{module}.weight")
    if part is None:
        return a, b
    dim, start, length = part
    return (a, b[start : start + length]) if dim == 0 else (a[:, start : start + length], b)


def lora_linear_name(module: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """A checkpoint projection (model.layers.0.self_attn.q_proj) -> (the engine's Linear, its part index)."""
    prefix, leaf = module.rsplit(".", 1)
    fused, part = stacked.get(leaf, (leaf, 0))
    return f"{prefix}.{fused}", part


def read_adapter(request: LoRARequest, model: torch.nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    name = request.lora_name
    path = Path(request.lora_path)

    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {reason}")

    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError as e:
        raise refuse(f"no {CONFIG}: not a PEFT adapter directory") from e
    except (OSError, ValueError) as e:
        raise refuse(f"{CONFIG} is unreadable: {e}") from e
    for key, allowed, what in [("peft_type", (None, "LORA"), "only LoRA adapters are served"),
                               ("use_dora", (None, False), "DoRA adapters are not supported"),
                               ("bias", (None, "none"), "adapters that train biases are not supported"),
                               ("fan_in_fan_out", (None, False), "fan_in_fan_out (Conv1D) adapters are not supported")]:
        if config.get(key) not in allowed:
            raise refuse(f"{key}={config[key]!r}: {what}")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(key):
            raise refuse(f"{key} is set: only one rank and alpha over whole projections are supported")
    if not (path / WEIGHTS).exists():
        other = "adapter_model.bin (a pickle, which is never loaded)" if (path / "adapter_model.bin").exists() else ""
        raise refuse(f"no {WEIGHTS}" + (f"; found {other}" if other else ""))
    try:
        from safetensors.torch import load_file

        tensors = load_file(path / WEIGHTS)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: the message says which adapter
        raise refuse(f"{WEIGHTS} is unreadable: {e}") from e

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight of {'/'.join(PROJECTIONS)} (embedding and "
                         "lm_head adapters are not supported)")
        pairs.setdefault(m.group(1), {})[m.group(3)] = t
    if not pairs:
        raise refuse(f"{WEIGHTS} holds no LoRA weights")

    r = int(config.get("r", 0))
    alpha = float(config.get("lora_alpha", r))
    if not 1 <= r <= max_rank:
        raise refuse(f"rank {r} exceeds --max-lora-rank {max_rank}" if r > max_rank else f"rank r={r} is invalid")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    shapes = projection_shapes(model.config)
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"{module} has lora_{'A' if 'A' in ab else 'B'} without its lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        target, part = lora_linear_name(module, model.stacked_params)
        try:
            model.get_submodule(target)
        except AttributeError:
            raise refuse(f"{module}: the base model has no such layer (an adapter for another model?)") from None
        d_in, d_out = shapes[module.rsplit(".", 1)[1]]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise refuse(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                         f"model's projection ({d_in} -> {d_out}) at rank {r}: an adapter for another base model?")
        parts.setdefault(target, []).append((part, *shard(module, a, b, model)))

    adapter = LoRAAdapter(request, r)
    for target, items in parts.items():
        linear = model.get_submodule(target)
        sizes = getattr(linear, "output_sizes", [linear.out_features])
        a = torch.cat([a for _, a, _ in items]).to(dtype)
        b = torch.zeros(linear.out_features, len(items) * r, dtype=torch.float32)
        for i, (part, _, b_part) in enumerate(items):
            start = sum(sizes[:part])
            b[start : start + sizes[part], i * r : (i + 1) * r] = b_part.float() * scale
        adapter.weights[target] = LinearLoRA(a.contiguous(), b.to(dtype))
    return adapter
