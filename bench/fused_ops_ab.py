"""One decode step of the bundled model in bf16, with the CPU extension's fused small ops on and off, alternating in
one process (so both halves see the same machine state). Prints the median step time of each, per batch size.

    .venv/bin/python bench/fused_ops_ab.py --batch 1 8 --steps 96
"""

from __future__ import annotations

import argparse
import statistics
import time

import pagekube.engine.model as model
from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.kernels import cpu_ops


def measure(batch: int, steps: int, switch_every: int = 8) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=256 * 1024**2))
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), f"Count slowly from {i}:", params)
    for _ in range(4):  # prefill, warm-up
        engine.step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for s in range(steps):
        mode = "on" if (s // switch_every) % 2 == 0 else "off"
        model.uses_fused_ops = cpu_ops.uses_fused_ops if mode == "on" else (lambda _x: False)
        start = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - start)
    model.uses_fused_ops = cpu_ops.uses_fused_ops
    engine.close()
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=96)
    args = p.parse_args()
    if not cpu_ops.load_cpu_kernels():
        raise SystemExit("the CPU extension is not available here (no AVX512_BF16 or no compiler)")
    for batch in args.batch:
        ms = measure(batch, args.steps)
        print(f"batch {batch}: fused ops on {ms['on']:.1f} ms, off {ms['off']:.1f} ms per decode step")


if __name__ == "__main__":
    main()
