"""The quantized Linears of a model as it loads: which they are, their checkpoint tensors, then their weights."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from pagekube.engine.quantization import layouts
from pagekube.engine.quantization.packed import QuantizedWeight, to_device
from pagekube.engine.quantization.schemes import QuantizationError, QuantMethod, WeightScheme

# Tensor names only quantized checkpoints have: one of these that no quantized Linear takes means the config
# does not describe the checkpoint, and loading on would ignore a scale.
QUANTIZATION_SUFFIXES = frozenset(s for req, opt in layouts.TENSORS.values() for s in (*req, *opt)) - {"weight"}


class QuantizedLinears:
    def __init__(self, model: torch.nn.Module, method: QuantMethod | None):
        """`model` is still on the meta device: each quantized Linear drops its `weight`, so none is allocated."""
        from pagekube.engine.model.model import Linear

        self.model = model
        self.schemes: dict[str, WeightScheme] = {}  # checkpoint projection -> its scheme
        self.linears: dict[str, list[str]] = {}  # quantized Linear -> its checkpoint projections
        self.tensors: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        if method is None:
            return
        for name, mod in model.named_modules():
            if not isinstance(mod, Linear):
                continue
            projections = model.projections(name)
            found = [method.scheme_for(p) for p in projections]
            if all(s is None for s in found):
                continue
            if any(s is None for s in found):
                raise QuantizationError(f"{name}: fused from {projections}, of which only some are quantized")
            mod.weight = None
            self.linears[name] = projections
            self.schemes.update(zip(projections, found, strict=True))

    def take(self, name: str, read: Callable[[], torch.Tensor]) -> bool:
        """Keep checkpoint tensor `name` (read by `read()`) if a quantized projection owns it."""
        module, _, suffix = name.rpartition(".")
        if not module.startswith(("model.", "lm_head")):
            module = "model." + module
        if module not in self.schemes or suffix == "bias":
            if suffix in QUANTIZATION_SUFFIXES:
                raise QuantizationError(f"{name}: a quantization tensor of a layer the checkpoint's "
                                        "quantization_config does not quantize")
            return False
        self.tensors[module][suffix] = read()
        return True

    def attach(self, checkpoint_slice: Callable, device: torch.device) -> int:
        """Build each quantized Linear's weight from its tensors (this rank's part of it); returns how many."""
        for linear, projections in self.linears.items():
            parts = []
            for p in projections:
                if p not in self.tensors:
                    raise ValueError(f"checkpoint is missing weights: {p} (quantized)")
                weight = layouts.read(self.schemes[p], self.tensors.pop(p), p)
                part = checkpoint_slice(p + ".weight")
                if isinstance(part, tuple):
                    weight = weight.narrow(*part)
                parts.append(to_device(weight, device))
            mod = self.model.get_submodule(linear)
            mod.quant = QuantizedWeight(parts)
            if mod.quant.shape != (mod.out_features, mod.in_features):
                raise ValueError(f"{linear}: quantized weight {mod.quant.shape} != model "
                                 f"{(mod.out_features, mod.in_features)}")
        return len(self.linears)
