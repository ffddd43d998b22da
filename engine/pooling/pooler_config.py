"""How token states become one embedding: the pooling type, normalization and matryoshka dimensions.

Read from the model directory as vLLM and sentence-transformers do (`modules.json`, `1_Pooling/config.json`, a
`Normalize` module, `max_seq_length`); `--pooler-config` overrides. Imports no torch (EngineConfig holds it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from pagekube.engine.json_flag import parse_json_flag

PoolingType = Literal["CLS", "MEAN", "LAST"]
ENCODER_MODEL_TYPES = ("bert",)
# sentence-transformers' Pooling config flag -> our pooling type; the others are refused by name
ST_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_lasttoken": "LAST"}


class PoolerConfig(BaseModel):
    """vLLM's `--pooler-config` fields that apply to embeddings; what is not given comes from the model."""

    model_config = ConfigDict(extra="forbid")

    pooling_type: PoolingType | None = None
    normalize: bool | None = None

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig) -> PoolerConfig:
        return parse_json_flag(cls, value, "--pooler-config")


@dataclass(frozen=True)
class Pooler:
    """What the pooling runner does with one sequence's hidden states."""

    pooling_type: PoolingType
    normalize: bool
    matryoshka_dimensions: tuple[int, ...] | None  # requestable output sizes; None: `dimensions` is refused
    max_seq_length: int | None  # sentence-transformers' limit, when the directory declares one

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> str | None:
        """Why a request's `dimensions` cannot be served, or None."""
        if dimensions is None:
            return None
        if self.matryoshka_dimensions is None:
            return "this model does not support matryoshka representations; drop dimensions"
        allowed = self.matryoshka_dimensions  # empty: any size up to the hidden size
        if (allowed and dimensions not in allowed) or not 1 <= dimensions <= hidden_size:
            return (f"dimensions {dimensions} is not one of this model's matryoshka dimensions "
                    f"{list(allowed) or f'1..{hidden_size}'}")
        return None


def is_pooling_model(model_dir: Path, hf_config) -> bool:
    """What `--runner auto` serves as embeddings: encoders, base models without an LM head (MistralModel, as
    e5-mistral ships), and directories that sentence-transformers describes."""
    archs = getattr(hf_config, "architectures", None) or []
    return (hf_config.model_type in ENCODER_MODEL_TYPES or (model_dir / "modules.json").exists()
            or (bool(archs) and all(a.endswith("Model") for a in archs)))


def resolve_pooler(model_dir: Path, hf_config, override: PoolerConfig | None) -> Pooler:
    pooling_type, normalize = _sentence_transformers_pooling(model_dir)
    if pooling_type is None:  # vLLM's defaults for embedding models: CLS for encoders, the last token for decoders
        pooling_type = "CLS" if hf_config.model_type in ENCODER_MODEL_TYPES else "LAST"
    if normalize is None:
        normalize = True
    if override is not None:
        pooling_type = override.pooling_type or pooling_type
        normalize = normalize if override.normalize is None else override.normalize
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = tuple(dims) if dims else (() if getattr(hf_config, "is_matryoshka", False) else None)
    st_config = model_dir / "sentence_bert_config.json"
    max_seq = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
    return Pooler(pooling_type, normalize, matryoshka, max_seq)


def _sentence_transformers_pooling(model_dir: Path) -> tuple[PoolingType | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers `modules.json`; (None, None) without one."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return None, None
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None, normalize
    config = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    chosen = [mode for flag, mode in ST_POOLING_MODES.items() if config.get(flag)]
    other = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in ST_POOLING_MODES]
    if other or len(chosen) != 1:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {other or chosen or 'none'} is not supported "
                         "(CLS, MEAN and last-token pooling are); set --pooler-config to choose one")
    return chosen[0], normalize
