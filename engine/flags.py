"""The engine's flags as a machine-readable schema, checked in for the operator (which must not import torch).

    python -m pagekube.engine.flags > operator/engine_flags.json

It is EngineConfig's JSON schema (so types, defaults, enums and ranges are the CLI's own), each property with the
flag that sets it (`x-flag`), plus the block sizes every attention backend can run. A test keeps the checked-in
copy current, as it does for the CRD.
"""

from __future__ import annotations

import json
import sys

from pagekube.engine.config import EngineConfig


def flag_schema() -> dict:
    import torch

    from pagekube.engine.attention import BACKENDS

    schema = EngineConfig.model_json_schema()
    for name, prop in schema["properties"].items():
        prop["x-flag"] = None if name == "model" else "--" + name.replace("_", "-")  # model: the positional argument
    sizes = schema["properties"]["block_size"]["enum"]
    runnable = [bs for bs in sizes if all(b.unsupported(bs, dt) is None for b in BACKENDS.values()
                                          for dt in (torch.float32, torch.bfloat16, torch.float16))]
    schema["x-block-sizes-every-backend-runs"] = runnable
    return schema


def flag_schema_json() -> str:
    return json.dumps(flag_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(flag_schema_json())
