"""The wire types, field for field as vLLM's `vllm/distributed/kv_events.py` (the array-like, tagged msgpack that
llm-d's KV-cache indexer and other subscribers decode): a struct is a msgpack array of its fields in this order,
an event's first element is its class name."""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (whatever the device); "CPU" there means an offload tier


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """A block's hash as vLLM publishes it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): its low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")
