"""Which quantization a checkpoint uses, read from its config.json `quantization_config` (vLLM's names).

Every scheme the engine cannot run exactly is refused here, at start, with its name: a checkpoint never loads with
a scale or a zero point left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = ("compressed-tensors", "awq", "gptq", "fp8")  # --quantization values for quantized safetensors


class QuantizationError(ValueError):
    """A checkpoint whose quantization the engine does not run (or that --quantization contradicts)."""


@dataclass(frozen=True)
class WeightScheme:
    """How one Linear's weight is stored. int: w = (q - zero) * scale per group of `group_size` input columns
    (None: one group per output row). fp8: w = e4m3 * scale per tensor, row or `block`."""

    layout: str  # compressed-int, compressed-fp8, awq, gptq, fp8
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    gptq_v1_zeros: bool = False  # GPTQ (v1) stores each zero point minus one
    block: tuple[int, int] | None = None  # fp8 block scales: [rows, columns] per scale

    @property
    def is_int(self) -> bool:
        return self.layout in ("compressed-int", "awq", "gptq")

    def describe(self) -> str:
        if not self.is_int:
            return "FP8 weights" + (f", {self.block[0]}x{self.block[1]} blocks" if self.block else "")
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"W{self.bits}A16 {group} {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class QuantMethod:
    name: str  # vLLM's --quantization name
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme): the first match wins
    ignore: tuple[str, ...] = ()
    substring_ignore: bool = False  # AWQ/GPTQ/FP8 configs name skipped modules by substring, compressed-tensors exactly

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint module `module` (e.g. model.layers.0.mlp.down_proj); None: not quantized."""
        if any((ig in module) if self.substring_ignore else _matches(module, ig) for ig in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(module, t) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        return f"{self.name} ({'; '.join(sorted({s.describe() for _, s in self.groups}))})"


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" matches from the start, "Linear" every linear, else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def resolve(hf_config, flag: str | None) -> QuantMethod | None:
    """The checkpoint's quantization (None: unquantized), checked against --quantization (`flag`) like vLLM."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc:
        if flag not in (None, "gguf"):
            raise QuantizationError(f"--quantization {flag}: the checkpoint is not quantized (its config.json has "
                                    "no quantization_config), and the engine does not quantize weights at load")
        return None
    method = str(qc.get("quant_method", "")).replace("_", "-")
    if flag is not None and flag != method:
        raise QuantizationError(f"--quantization {flag} does not match the checkpoint's quantization ({method})")
    readers = {"compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq, "fp8": _fp8}
    if method not in readers:
        raise QuantizationError(f"quantization method {method!r} is not supported "
                                f"(supported: {', '.join(METHODS)}, and GGUF files)")
    return readers[method](qc)


def _compressed_tensors(qc: dict) -> QuantMethod:
    name = "compressed-tensors"
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise QuantizationError(f"{name}: checkpoints with a {key} are not supported")
    if qc.get("kv_cache_scheme"):
        raise QuantizationError(f"{name}: a quantized KV cache (kv_cache_scheme) is not supported")
    groups = []
    for group_name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        w, act = group.get("weights"), group.get("input_activations")
        where = f"{name} group {group_name!r}"
        if not w:
            raise QuantizationError(f"{where}: activation-only quantization is not supported")
        if group.get("output_activations"):
            raise QuantizationError(f"{where}: output activation quantization is not supported")
        kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if w.get("dynamic"):
            raise QuantizationError(f"{where}: dynamic weight quantization is not supported")
        if kind == "int":
            if fmt != "pack-quantized" or bits not in (4, 8):
                raise QuantizationError(f"{where}: int{bits} weights in format {fmt!r} are not supported "
                                        "(pack-quantized int4/int8 are)")
            if act:
                raise QuantizationError(f"{where}: W{bits}A{act.get('num_bits')} ({act.get('type')} activations) "
                                        "is not supported; weight-only int4/int8 (W4A16, W8A16) is")
            if strategy not in ("group", "channel"):
                raise QuantizationError(f"{where}: int weights with strategy {strategy!r} are not supported "
                                        "(group, channel are)")
            if w.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
                raise QuantizationError(f"{where}: actorder {w.get('actorder')!r} is not supported")
            scheme = WeightScheme("compressed-int", bits, w.get("group_size") if strategy == "group" else None,
                                  bool(w.get("symmetric", True)))
        elif kind == "float":
            if fmt != "float-quantized" or bits != 8:
                raise QuantizationError(f"{where}: float{bits} weights in format {fmt!r} are not supported "
                                        "(float-quantized FP8 is)")
            if strategy not in ("tensor", "channel", "block"):
                raise QuantizationError(f"{where}: FP8 weights with strategy {strategy!r} are not supported")
            if act and act.get("type") != "float":
                raise QuantizationError(f"{where}: FP8 weights with {act.get('type')} activations are not supported")
            block = tuple(w["block_structure"]) if strategy == "block" else None
            scheme = WeightScheme("compressed-fp8", 8, block=block)
        else:
            raise QuantizationError(f"{where}: weights of type {kind!r} are not supported")
        groups.append((tuple(group.get("targets") or ()), scheme))
    if not groups:
        raise QuantizationError(f"{name}: the quantization_config has no config_groups")
    return QuantMethod(name, tuple(groups), tuple(qc.get("ignore") or ()))


def _awq(qc: dict) -> QuantMethod:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise QuantizationError(f"awq: {bits}-bit weights in the {version!r} layout are not supported "
                                "(4-bit GEMM layout is)")
    group = qc.get("group_size", qc.get("q_group_size"))
    scheme = WeightScheme("awq", 4, None if group in (None, -1) else group, not qc.get("zero_point", True))
    return QuantMethod("awq", ((("Linear",), scheme),), tuple(qc.get("modules_to_not_convert") or ()), True)


def _gptq(qc: dict) -> QuantMethod:
    bits, fmt = qc.get("bits"), qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise QuantizationError(f"gptq: {bits}-bit weights are not supported (4 and 8 are)")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are)")
    group = qc.get("group_size")
    scheme = WeightScheme("gptq", bits, None if group in (None, -1) else group, bool(qc.get("sym", True)),
                          gptq_v1_zeros=fmt == "gptq")
    targets = ("re:(?!lm_head)",) if not qc.get("lm_head") else ("Linear",)
    return QuantMethod("gptq", ((targets, scheme),), tuple(qc.get("modules_to_not_convert") or ()), True)


def _fp8(qc: dict) -> QuantMethod:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8: {fmt} weights are not supported (e4m3 are)")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    scheme = WeightScheme("fp8", 8, block=tuple(block) if block else None)
    return QuantMethod("fp8", ((("re:(?!lm_head)",), scheme),), ignore, True)
