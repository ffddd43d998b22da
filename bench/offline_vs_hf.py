"""Offline engine vs Hugging Face transformers static batching, same model, prompts and outputs, one run.

    .venv/bin/python bench/offline_vs_hf.py --requests 64 --max-output 512 --out docs/bench_offline

Workload (seeded): prompts of 32-512 random tokens, output lengths 16..--max-output, ignore_eos. HF static
batching: batches of 32 in arrival order, left-padded, each batch generating until its longest request is done
(only the requested tokens count as output). pagekube: all requests at once, --max-num-seqs 32. Batch 1: a few
requests one at a time through both. Each mode runs in its own process, so peak RSS is its own. Both run the same
precision: --dtype (default auto, the engine's default on this machine: bf16 on CPUs with AVX512_BF16).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402


def workload(n: int, max_output: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    outputs = [rng.randint(16, max_output) for _ in range(n)]
    return prompts, outputs


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resolved_dtype(name: str):
    import torch

    from pagekube.engine.model.model_runner import resolve_dtype

    return resolve_dtype(name, torch.device("cpu"))


def kv_bytes_for(batch: int, max_len: int, dtype) -> int:
    """A KV pool that holds `batch` sequences of `max_len` tokens, so the engine never preempts: HF's own cache
    grows to that size too (its peak RSS shows it)."""
    from transformers import AutoConfig

    from pagekube.engine.config import EngineConfig
    from pagekube.engine.model.model_files import resolve_model_dir

    c = AutoConfig.from_pretrained(resolve_model_dir(None))
    block = EngineConfig().block_size
    max_len = -(-max_len // block) * block  # whole blocks
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return batch * max_len * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * dtype.itemsize


def run_pagekube(prompts, outputs, batch: int, dtype: str) -> dict:
    from pagekube.engine import LLM, SamplingParams

    kv_bytes = kv_bytes_for(batch, max(len(p) for p in prompts) + max(outputs), resolved_dtype(dtype))
    llm = LLM(None, max_num_seqs=batch, max_num_batched_tokens=4096, kv_cache_memory=kv_bytes, dtype=dtype)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    else:
        outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall}


def run_hf(prompts, outputs, batch: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagekube.engine.model.model_files import resolve_model_dir

    path = resolve_model_dir(None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolved_dtype(dtype)).eval()
    pad = 2
    start = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            group, outs = prompts[i : i + batch], outputs[i : i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            new = max(outs)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, temperature=None, top_p=None, top_k=None)
            tokens += sum(outs)
    return {"tokens": tokens, "wall_s": time.perf_counter() - start}


def child(args) -> None:
    prompts, outputs = workload(args.requests, args.max_output)
    if args.batch == 1:
        prompts, outputs = prompts[: args.single], outputs[: args.single]
    result = (run_hf if args.mode == "hf" else run_pagekube)(prompts, outputs, args.batch, args.dtype)
    result.update(mode=args.mode, batch=args.batch, tok_s=result["tokens"] / result["wall_s"], peak_rss_mb=peak_rss_mb())
    print("RESULT " + json.dumps(result))


def plot(rows, path: Path, dtype: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = [f"batch {b}" for b in sorted({r["batch"] for r in rows})]
    for k, mode in enumerate(("hf", "pagekube")):
        vals = [next(r["tok_s"] for r in rows if r["mode"] == mode and r["batch"] == b)
                for b in sorted({r["batch"] for r in rows})]
        ax.bar([x + k * 0.38 for x in range(len(labels))], vals, 0.38,
               label="HF transformers (static batching)" if mode == "hf" else "pagekube (continuous batching)")
    ax.set_xticks([x + 0.19 for x in range(len(labels))], labels)
    ax.set(ylabel="output tokens/s", title=f"SmolLM2-135M, CPU (2 cores), {dtype}")
    ax.legend()
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--single", type=int, default=4, help="requests for the batch-1 comparison")
    ap.add_argument("--out", default="docs/bench_offline")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="for both (default: the engine's)")
    ap.add_argument("--mode", choices=["hf", "pagekube"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    rows = []
    for batch in (32, 1):
        for mode in ("hf", "pagekube"):
            cmd = [sys.executable, __file__, "--mode", mode, "--batch", str(batch), "--requests", str(args.requests),
                   "--max-output", str(args.max_output), "--single", str(args.single), "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.split("RESULT ", 1)[1]))
            print(rows[-1], flush=True)
    print("\n| batch | mode | output tokens | wall (s) | output tok/s | peak RSS (MB) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {r['peak_rss_mb']:.0f} |")
    for batch in (32, 1):
        hf = next(r for r in rows if r["mode"] == "hf" and r["batch"] == batch)
        pk = next(r for r in rows if r["mode"] == "pagekube" and r["batch"] == batch)
        print(f"batch {batch}: pagekube / HF = {pk['tok_s'] / hf['tok_s']:.2f}x")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    plot(rows, out.with_suffix(".png"), str(resolved_dtype(args.dtype)).removeprefix("torch."))


if __name__ == "__main__":
    main()
