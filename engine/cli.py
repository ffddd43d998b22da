"""`pagekube serve [MODEL] [--flags]`: every flag is derived from EngineConfig's fields (one source of truth)."""

from __future__ import annotations

import argparse
import os
import sys
import typing

from pydantic import BaseModel

from pagekube.engine.config import EngineConfig

SHORT_FLAGS = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "quantization": ["-q"]}  # vLLM's


def _flag_type(annotation):
    """(type, choices, nargs) for a field: `int | None` -> int; `Literal["a", "b"]` -> str with choices;
    `Literal[8, 16]` -> int with choices; a model -> a JSON string; a list -> one or more strings."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = annotation if typing.get_origin(annotation) is typing.Literal else args[0]
    if typing.get_origin(base) is typing.Literal:
        choices = list(typing.get_args(base))
        return type(choices[0]), choices, None
    if typing.get_origin(base) is list:
        return str, None, "+"  # vLLM's --lora-modules a=PATH b=PATH, parsed by the field's validator
    if isinstance(base, type) and issubclass(base, BaseModel):
        return str, None, None  # a JSON string (vLLM's --speculative-config), parsed by the field's validator
    return base, None, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagekube", description="pagekube LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", nargs="?", default=None, help=EngineConfig.model_fields["model"].description)
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        flags = ["--" + name.replace("_", "-"), *SHORT_FLAGS.get(name, ())]
        typ, choices, nargs = _flag_type(field.annotation)
        if typ is bool:
            serve.add_argument(*flags, action=argparse.BooleanOptionalAction, default=field.default, help=field.description)
        else:
            serve.add_argument(*flags, type=typ, choices=choices, default=field.default, help=field.description,
                               metavar=None if choices else name.upper(), nargs=nargs)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields}
    values["api_key"] = values.get("api_key") or os.environ.get("PAGEKUBE_API_KEY") or None
    return EngineConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from pydantic import ValidationError

        from pagekube.engine.logging_setup import setup_logging
        from pagekube.engine.server.serve import run_server

        try:
            config = config_from_args(args)
        except ValidationError as e:
            print(f"pagekube: invalid flags:\n{e}", file=sys.stderr)
            return 2
        if config.api_key_file and not config.headless:
            from pagekube.engine.server.api_keys import read_keys

            try:
                read_keys(config.api_key_file)
            except (OSError, ValueError) as e:
                print(f"pagekube: --api-key-file: {e}", file=sys.stderr)
                return 2
        setup_logging()
        if config.headless:
            from pagekube.engine.distributed.headless import run_headless

            return run_headless(config)
        return run_server(config)
    return 2



if __name__ == "__main__":
    sys.exit(main())
