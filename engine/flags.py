"""The engine's flags as a machine-readable schema, checked in for the operator (which must not import torch).

    python -m pagekube.engine.flags > operator/engine_flags.json
    python -m pagekube.engine.flags --markdown      # rewrites the flag table in docs/operations.md

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

    from pagekube.engine.model.attention import BACKENDS

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


TABLE_BEGIN, TABLE_END = "<!-- flag table: python -m pagekube.engine.flags --markdown -->", "<!-- end of flag table -->"


def markdown_table() -> str:
    """Every `pagekube serve` flag with its default and meaning, from EngineConfig (docs/operations.md)."""
    from pagekube.engine.cli import SHORT_FLAGS

    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, field in EngineConfig.model_fields.items():
        flag = "`MODEL` (positional)" if name == "model" else ", ".join(
            f"`{f}`" for f in ["--" + name.replace("_", "-"), *SHORT_FLAGS.get(name, ())])
        default = "" if field.default is None else f"`{field.default}`"
        rows.append(f"| {flag} | {default} | {field.description.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def with_table(doc: str) -> str:
    """`doc` with the text between the table markers replaced by the current table."""
    head, rest = doc.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}{TABLE_END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        from pathlib import Path

        doc = Path(__file__).resolve().parent.parent / "docs/operations.md"
        doc.write_text(with_table(doc.read_text()))
    else:
        sys.stdout.write(flag_schema_json())
