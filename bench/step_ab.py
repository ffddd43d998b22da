"""Decode steps of one engine with a switch flipped every few steps, in one process, so both settings see the same
machine state (this machine's speed drifts by tens of percent over minutes). Used by fused_ops_ab.py and
cpu_linears.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(engine, steps: int, switch: Callable[[bool], None], switch_every: int) -> dict[str, float]:
    """Median ms per step with the switch on and off; it is left on."""
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for s in range(steps):
            on = (s // switch_every) % 2 == 0
            switch(on)
            start = time.perf_counter()
            engine.step()
            times[on].append(time.perf_counter() - start)
    finally:
        switch(True)
    return {"on": statistics.median(times[True]) * 1e3, "off": statistics.median(times[False]) * 1e3}
