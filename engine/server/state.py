"""What the server's routes share: the config, the engine once loaded, metrics and the drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagekube.engine.config import EngineConfig

if TYPE_CHECKING:
    from pagekube.engine.async_engine import AsyncEngine
    from pagekube.engine.pooling.async_pooling import AsyncPoolingEngine
    from pagekube.engine.server.metrics import EngineMetrics


@dataclass
class ServerState:
    config: EngineConfig
    engine: AsyncEngine | AsyncPoolingEngine | None = None  # the pooling one serves /v1/embeddings
    metrics: EngineMetrics | None = None
    kernels: dict[str, str] | None = None  # which kernels the loaded model runs (/version)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.engine.engine.served_model_name

    @property
    def healthy(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.dead is None
