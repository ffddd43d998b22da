"""Load a Hugging Face style checkpoint (config.json + *.safetensors, sharded or not) into CausalLM, with progress."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagekube.engine.distributed.pipeline_parallel import PPStage
from pagekube.engine.distributed.tensor_parallel import TPShard
from pagekube.engine.model.layers import gguf_linears
from pagekube.engine.model.model import CausalLM
from pagekube.engine.quantization import schemes
from pagekube.engine.quantization.loading import QuantizedLinears
from pagekube.kernels import cpu_ops

log = logging.getLogger("pagekube.engine")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != gguf_linears.FILE)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def load_model(hf_config, model_dir: Path, dtype: torch.dtype, device: torch.device,
               shard: TPShard = TPShard(), quantization: str | None = None, stage: PPStage = PPStage()) -> CausalLM:
    """With tensor parallelism each rank reads only its slice of each tensor (safetensors slices: no rank ever
    holds the full weights; a quantized projection is read whole, then sliced); with pipeline parallelism, only its
    stage's layers. `quantization`: --quantization, checked against the checkpoint's own quantization_config
    (engine/quantization)."""
    method = schemes.resolve(hf_config, quantization)
    with torch.device("meta"):
        model = CausalLM(hf_config, shard, stage).to(dtype)
    quantized = QuantizedLinears(model, method)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    model.model.rotary = type(model.model.rotary)(hf_config).to(device)  # float32 buffers, computed not loaded
    files = safetensors_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    loaded: set[str] = set()
    covered: dict[str, int] = {}  # elements written per parameter (fused ones are filled from several tensors)
    start = time.monotonic()
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", disable=None) as bar:
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    if not model.holds(name):
                        continue
                    if quantized.take(name, lambda name=name: st.get_tensor(name)):
                        loaded.add(name)
                        continue
                    target = model.checkpoint_target(name, params)
                    if target is None:
                        continue  # e.g. rotary inv_freq, or lm_head when tied
                    param_name, dest = target
                    part = model.checkpoint_slice(name)
                    if part == "zero":
                        tensor = torch.zeros(dest.shape)
                    elif part is None:
                        tensor = st.get_tensor(name)
                    else:
                        dim, first, length = part
                        piece = st.get_slice(name)
                        tensor = piece[first:first + length] if dim == 0 else piece[:, first:first + length]
                        if dim == 0 and length < dest.shape[0]:  # the last rank's vocabulary rows: padding after
                            covered[param_name] = covered.get(param_name, 0) + dest[length:].numel()
                            dest = dest[:length]
                    if tensor.shape != dest.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                    if tensor.element_size() == 1 or (dest.is_floating_point() and not tensor.is_floating_point()):
                        raise schemes.QuantizationError(f"{name}: {tensor.dtype} weights in a checkpoint whose "
                                                        "config.json does not say how they are quantized")
                    with torch.no_grad():
                        dest.copy_(tensor)
                    loaded.add(name)
                    covered[param_name] = covered.get(param_name, 0) + dest.numel()
                    bar.update(tensor.numel() * tensor.element_size())
    missing = {n for n, p in params.items() if covered.get(n, 0) != p.numel()}
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    if quantized.attach(model.checkpoint_slice, device):
        log.info("%d linears quantized: %s", len(quantized.linears), method.describe())
    log.info("loaded %d tensors (%.1f MB) from %d file(s) in %.1f s; weights in memory: %.1f MB", len(loaded),
             total / 1e6, len(files), time.monotonic() - start, weight_bytes(model) / 1e6)
    if dtype == torch.bfloat16 and device.type == "cpu" and cpu_ops.loaded() and not method:
        attached = gguf_linears.attach(model, model_dir)  # only the CPU extension reads them
        if attached:
            log.info("%d linears also read from the GGUF's blocks by the CPU kernels", attached)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights take in memory: its parameters and its Linears' packed quantized weights."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(m.quant.nbytes() for m in model.modules() if getattr(m, "quant", None) is not None)
