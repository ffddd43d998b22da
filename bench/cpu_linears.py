"""The bundled model's linears (all 210, as stored) at a few rows: the Q4_1 kernel, the bf16 kernel and torch's
bf16 GEMM, taking turns in one process; then one decode step of the engine with the Q4_1 blocks on and off,
alternating every 16 steps. Prints milliseconds per pass over all the linears, and per step.

    .venv/bin/python bench/cpu_linears.py --rows 1 2 4 8 --steps 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.model.layers import gguf_linears
from pagekube.engine.model.model_files import resolve_model_dir
from pagekube.kernels import cpu_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_ab import alternate  # noqa: E402


def linears(rows: list[int], reps: int) -> None:
    model_dir = resolve_model_dir(None)
    packed, state = load_file(model_dir / gguf_linears.FILE), load_file(model_dir / "model.safetensors")
    names = sorted(k.removesuffix(".qs") for k in packed if k.endswith(".qs"))
    q4 = [gguf_linears.Q4Weight(*(packed[f"{n}.{p}"] for p in ("qs", "d", "m"))) for n in names]
    bf16 = [state[n].bfloat16() for n in names]
    ways = {"q4_1 kernel": lambda x, i: cpu_ops.q4_linear(x, q4[i]),
            "bf16 kernel": lambda x, i: torch.ops.pagekube_cpu.bf16_linear(x, bf16[i], None),
            "torch bf16": lambda x, i: F.linear(x, bf16[i])}
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {w.shape[1] for w in bf16}}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(reps):
            for name, run in ways.items():
                start = time.perf_counter()
                for i, w in enumerate(bf16):
                    run(xs[w.shape[1]], i)
                times[name].append(time.perf_counter() - start)
        print(f"{m} rows: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()))


def engine_step(steps: int, switch_every: int = 16) -> None:
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=128 * 1024**2))
    engine.add_request("0", [1000 + i for i in range(128)], SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    for _ in range(4):
        engine.step()
    limit = cpu_ops.Q4_MAX_ROWS
    ms = alternate(engine, steps, lambda on: setattr(cpu_ops, "Q4_MAX_ROWS", limit if on else 0), switch_every)
    engine.close()
    print(f"one sequence, decode step: q4_1 on {ms['on']:.2f} ms, q4_1 off {ms['off']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check that the script works)")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.reps, args.steps = [1], 1, 32  # both halves of the switch
    if not cpu_ops.load_cpu_kernels():
        raise SystemExit("the CPU extension is not available here (needs AVX512_BF16 and a C++ compiler)")
    linears(args.rows, args.reps)
    engine_step(args.steps)


if __name__ == "__main__":
    main()
