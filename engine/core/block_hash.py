"""Stable chained hash of a full KV block: never Python's hash(), which is salted per process."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()
