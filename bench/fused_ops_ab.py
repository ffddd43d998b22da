"""One decode step of the bundled model in bf16, with the CPU extension's fused small ops on and off, alternating in
one process (so both halves see the same machine state). Prints the median step time of each, per batch size.

    .venv/bin/python bench/fused_ops_ab.py --batch 1 8 --steps 96
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.model.model import use_kernels
from pagekube.kernels import cpu_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_ab import alternate  # noqa: E402


def measure(batch: int, steps: int, switch_every: int = 8) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=256 * 1024**2))
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), f"Count slowly from {i}:", params)
    for _ in range(4):  # prefill, warm-up
        engine.step()
    chosen = engine.runner.kernels

    def switch(on: bool) -> None:
        use_kernels(engine.runner.model, dataclasses.replace(chosen, fused=on and chosen.fused))

    ms = alternate(engine, steps, switch, switch_every)
    engine.close()
    return ms


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
