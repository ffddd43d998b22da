"""What quantized checkpoints cost and save: decode time per step at 1, 8 and 32 rows, and the weights' size in
memory, for the bundled model unquantized and as llm-compressor makes it W4A16 (group 64), W8A16 (per channel)
and FP8 (per channel).

    .venv/bin/python bench/quantized.py            # the bundled model, dtype auto (float32 on AVX2-only CPUs)
    .venv/bin/python bench/quantized.py --smoke    # tiny sizes: the script still runs

The checkpoints come from tests/quantized_checkpoints.py (llm-compressor in its own cached virtualenv). One engine
per checkpoint, warmed up; then `--reps` rounds, each timing one generate of `rows` prompts x `--output` tokens
(ignore_eos), the checkpoints alternating so drift hits them alike; the best round counts: ms per step =
seconds / output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagekube.engine import LLM, SamplingParams
from pagekube.engine.model.model_files import resolve_model_dir
from pagekube.engine.model.model_loader import weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: tests/ makes the checkpoints
from tests.quantized_checkpoints import SMOLLM_JOBS, quantize  # noqa: E402

JOBS = {name: SMOLLM_JOBS[name] for name in ("w4a16-g64", "w8a16-channel", "fp8-dynamic")}  # the tests' own


def step_ms(llm: LLM, rows: int, prompt_len: int, output: int) -> float:
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(prompt_len)] for i in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - t) / output * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one checkpoint: the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.output, args.reps = [1, 2], 2, 1
    base = resolve_model_dir(None)
    jobs = dict(list(JOBS.items())[:1]) if args.smoke else JOBS
    models = {"unquantized": base, **quantize(base, jobs)}
    engines = {name: LLM(str(path), dtype=args.dtype, kv_cache_memory=256 * 1024**2) for name, path in models.items()}
    for llm in engines.values():
        step_ms(llm, max(args.rows), 16, 2)  # warm-up
    best = {(name, rows): float("inf") for name in engines for rows in args.rows}
    for _ in range(args.reps):
        for rows in args.rows:
            for name, llm in engines.items():
                best[name, rows] = min(best[name, rows], step_ms(llm, rows, 16, args.output))
    dtype = engines["unquantized"].engine.runner.dtype
    print(f"dtype {str(dtype).removeprefix('torch.')}; ms per decode step (best of {args.reps}); weights in memory")
    print("| checkpoint | " + " | ".join(f"{r} rows" for r in args.rows) + " | weights MB |")
    print("|---|" + "---|" * (len(args.rows) + 1))
    for name, llm in engines.items():
        mb = weight_bytes(llm.engine.runner.model) / 1e6
        print(f"| {name} | " + " | ".join(f"{best[name, r]:.1f}" for r in args.rows) + f" | {mb:.0f} |")
    print(json.dumps({f"{n}@{r}": round(v, 2) for (n, r), v in best.items()}))
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
