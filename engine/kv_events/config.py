"""`--kv-events-config`: vLLM's KVEventsConfig fields and defaults. Imports neither zmq nor msgspec (EngineConfig
holds it, and the CLI must start without them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagekube.engine.json_flag import parse_json_flag


class KVEventsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = Field(None, description="default: zmq when events are on, else null")
    endpoint: str = Field("tcp://*:5557", description="PUB socket: bound when it has a wildcard, else connected")
    replay_endpoint: str | None = Field(None, description="ROUTER socket that resends missed batches")
    buffer_steps: int = Field(10_000, ge=1, description="Batches kept for replay")
    hwm: int = Field(100_000, ge=0, description="ZeroMQ high-water mark of the PUB socket")
    max_queue_size: int = Field(100_000, ge=1, description="Batches waiting for the publisher thread")
    topic: str = ""

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"endpoint {self.endpoint!r}: a ZeroMQ address (tcp://*:5557, ipc://PATH)")
        return self

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig) -> KVEventsConfig:
        return parse_json_flag(cls, value, "--kv-events-config")
