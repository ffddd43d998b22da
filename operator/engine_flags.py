"""The engine's flag contract, read from the schema the engine generates (engine_flags.json; no torch here).

The CRD's engine fields take their defaults and ranges from it, and `engine_args` renders only flags it names.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMA: dict = json.loads(resources.files("pagekube.operator").joinpath("engine_flags.json").read_text())


def _prop(name: str) -> dict:
    if name not in SCHEMA["properties"]:
        raise KeyError(f"the engine has no flag for {name!r} (see operator/engine_flags.json)")
    return SCHEMA["properties"][name]


def default(name: str) -> Any:
    return _prop(name)["default"]


def choices(name: str) -> list:
    prop = _prop(name)
    return next(p["enum"] for p in [prop, *prop.get("anyOf", [])] if "enum" in p)


def bound(name: str, key: str) -> float | None:
    """A numeric bound of the flag (`minimum`, `maximum`, `exclusiveMinimum`, ...), or None."""
    prop = _prop(name)
    return next((p[key] for p in [prop, *prop.get("anyOf", [])] if key in p), None)


BLOCK_SIZES: list[int] = SCHEMA["x-block-sizes-every-backend-runs"]


def to_args(values: dict[str, Any]) -> list[str]:
    """`pagekube serve` arguments for engine config values: `model` positional, booleans as --x / --no-x, lists as
    one flag and its values, None left out. Raises KeyError for a name the engine has no flag for."""
    args = [str(values["model"])] if values.get("model") is not None else []
    for name, value in values.items():
        if name == "model" or value is None:
            continue
        flag = _prop(name)["x-flag"]
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args
