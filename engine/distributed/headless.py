"""`pagekube serve --headless`: a worker node of a multi-node engine. It runs this node's ranks and waits; the
leader (node 0) serves the API, schedules, and stops them when it stops."""

from __future__ import annotations

import logging
import signal

from pagekube.engine.config import EngineConfig
from pagekube.engine.distributed.workers import Workers, ranks_per_node
from pagekube.engine.model.model_files import resolve_model_dir

log = logging.getLogger("pagekube.engine")


def run_headless(config: EngineConfig) -> int:
    """0 when the leader stopped this node's ranks; 1 when one failed or the leader was lost."""
    workers = Workers(config, resolve_model_dir(config.model))

    def on_sigterm(signum, frame):
        # The group goes together: the leader drains its requests, then stops every rank (this node's included).
        log.info("SIGTERM: this node's ranks stop when the leader stops them (or when it is gone)")

    signal.signal(signal.SIGTERM, on_sigterm)
    log.info({"msg": "headless node started", "node_rank": config.node_rank, "ranks": workers.ranks,
              "ranks_per_node": ranks_per_node(config), "leader": f"{config.master_addr}:{config.master_port}"})
    code = workers.wait()
    log.info({"msg": "headless node stopping", "exit_code": code})
    return code
