"""--lora-modules, as vLLM takes it: `name=path` or a JSON object {"name", "path", "base_model_name"}."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, field_validator

from pagekube.engine.lora.names import check_adapter_name


class LoRAModulePath(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    base_model_name: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_adapter_name(value)


def parse_lora_modules(value) -> list:
    """Strings (the CLI's) become LoRAModulePath; objects and dicts pass through to pydantic."""
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if item.startswith("{"):
                item = json.loads(item)
            elif "=" in item:
                name, path = item.split("=", 1)
                item = {"name": name, "path": path}
            else:
                raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
        out.append(item)
    return out
