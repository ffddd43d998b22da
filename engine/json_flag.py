"""Flags whose value is a JSON object (vLLM's --speculative-config, --pooler-config, --kv-events-config): the
CLI's string, the offline API's dict, or the config itself, read into one pydantic model."""

from __future__ import annotations

import json

from pydantic import BaseModel


def parse_json_flag(model: type[BaseModel], value, flag: str):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from e
    return value if isinstance(value, model) else model.model_validate(value)
