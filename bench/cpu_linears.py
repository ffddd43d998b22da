"""The bundled model's linears (all 210, as stored) at a few rows: the Q4_1 blocks through the AVX-512 kernel and
through the AMX one, the bf16 weights through the bf16 kernel, the AMX one and torch's GEMM, taking turns in one
process; its tied lm_head the same ways, over its Q8_0 blocks and over its bf16 weights. Then decode steps of the
engine at 1 and 32 sequences, alternating every 16 steps: batch invariant (AMX where the CPU has it, else the
AVX-512 kernels, at every row count) and not (VLLM_BATCH_INVARIANT=0's dispatch: the AVX-512 kernels up to 8 rows,
torch above); then the lm_head over its Q8_0 blocks and over its bf16 weights. Prints milliseconds per pass over
all the linears, and per step. Without AMX, its columns are left out.

    .venv/bin/python bench/cpu_linears.py --rows 1 2 4 8 16 32 64 256 1024 --steps 128
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pagekube.engine.model.model import use_kernels
from pagekube.engine.model.model_files import resolve_model_dir
from pagekube.kernels import cpu_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_ab import alternate  # noqa: E402


def linears(rows: list[int], reps: int) -> None:
    model_dir = resolve_model_dir(None)
    packed, state = load_file(model_dir / gguf_linears.FILE), load_file(model_dir / "model.safetensors")
    names = sorted(k.removesuffix(".m") for k in packed if k.endswith(".m"))
    q4 = [gguf_linears.Q4Weight(*(packed[f"{n}.{p}"] for p in ("qs", "d", "m"))) for n in names]
    compare(rows, reps, "", q4, [state[n].bfloat16() for n in names])
    head = "model.embed_tokens.weight"
    q8 = gguf_linears.Q8Weight(packed[f"{head}.qs"], packed[f"{head}.d"])
    compare(rows, reps, "lm_head ", [q8], [state[head].bfloat16()], kind="q8_0")


def compare(rows: list[int], reps: int, label: str, blocks: list, bf16: list, kind: str = "q4_1") -> None:
    ways = {f"{kind} kernel": lambda x, i: cpu_ops.gguf_linear(x, blocks[i]),
            f"{kind} amx": lambda x, i: cpu_ops.gguf_linear(x, blocks[i], amx=True),
            "bf16 kernel": lambda x, i: torch.ops.pagekube_cpu.bf16_linear(x, bf16[i], None),
            "bf16 amx": lambda x, i: torch.ops.pagekube_cpu.bf16_amx_linear(x, bf16[i], None),
            "torch bf16": lambda x, i: F.linear(x, bf16[i])}
    if not cpu_ops.cpu_supports_amx():
        ways = {name: run for name, run in ways.items() if "amx" not in name}
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {w.shape[1] for w in bf16}}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(reps):
            for name, run in ways.items():
                start = time.perf_counter()
                for i, w in enumerate(bf16):
                    run(xs[w.shape[1]], i)
                times[name].append(time.perf_counter() - start)
        print(f"{label}{m} rows: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items() if t))


def engine_step(sequences: int, steps: int, switch_every: int = 16) -> None:
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=256 * 1024**2))
    for s in range(sequences):
        engine.add_request(str(s), [1000 + s + i for i in range(128)],
                           SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    for _ in range(4):
        engine.step()
    model, on = engine.runner.model, engine.runner.kernels
    off = dataclasses.replace(on, amx=False, batch_invariant=False)
    ms = alternate(engine, steps, lambda invariant: use_kernels(model, on if invariant else off), switch_every)
    print(f"{sequences} sequences, decode step: batch invariant {ms['on']:.2f} ms, not {ms['off']:.2f} ms")
    embedding = model.model.embed_tokens
    blocks = embedding.blocks
    if blocks is not None:
        ms = alternate(engine, steps, lambda q8: setattr(embedding, "blocks", blocks if q8 else None), switch_every)
        print(f"{sequences} sequences, decode step: lm_head over its Q8_0 blocks {ms['on']:.2f} ms, "
              f"over its bf16 weights {ms['off']:.2f} ms")
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check that the script works)")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.reps, args.steps = [1], 1, 32  # both halves of the switch
    if not cpu_ops.load_cpu_kernels():
        raise SystemExit("the CPU extension is not available here (needs AVX512_BF16 and a C++ compiler)")
    linears(args.rows, args.reps)
    for sequences in (1, 32):
        engine_step(sequences, args.steps)


if __name__ == "__main__":
    main()
