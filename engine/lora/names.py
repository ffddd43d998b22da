"""What an adapter may be called: the `model` a request sends, so what the API (and a URL path) can carry."""

from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_adapter_name(name: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"adapter name {name!r}: 1-128 characters, letters, digits and . _ : / @ + -, starting "
                         "with a letter or digit")
    return name
