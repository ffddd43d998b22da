"""Sampler benchmark: the batched device sampler against the round-one per-row loop (bench/legacy_sampler.py).

    .venv/bin/python bench/sampler.py --out docs/bench_sampler          # the table in docs/benchmarks.md
    .venv/bin/python bench/sampler.py --smoke                           # CI: tiny sizes, checks it runs

Logits are real next-token distributions of the bundled SmolLM2 (49,152 tokens) on text prompts; the 128k
vocabulary pads each row with tokens at the row's lowest logit (a larger vocabulary whose extra tokens are
unlikely, as in real models). `--flat` uses N(0, 1) logits instead: no token stands out, so top-p needs most of
the vocabulary and the new sampler falls back to a full sort (its worst case).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.legacy_sampler import LegacySampler  # noqa: E402
from bench.plotting import pyplot, save  # noqa: E402
from pagekube.engine.core.sequence import Request  # noqa: E402
from pagekube.engine.sample.sampler import Sampler  # noqa: E402
from pagekube.engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Kubernetes schedules pods onto nodes by", "The three primary colors are", "SELECT name FROM users WHERE"]


def model_logits(rows: int, vocab: int, flat: bool) -> torch.Tensor:
    if flat:
        return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagekube.engine.model.model_files import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    real = []
    with torch.inference_mode():
        for prompt in PROMPTS:  # logits at every position of the prompt and a greedy continuation
            ids = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=rows // len(PROMPTS) + 1,
                                 do_sample=False)
            real.append(model(ids).logits[0].float())
    real = torch.cat(real)[:rows]
    if vocab > real.shape[1]:
        pad = real.amin(dim=1, keepdim=True) - torch.rand(real.shape[0], vocab - real.shape[1])
        real = torch.cat([real, pad], dim=1)
    return real[:, :vocab].contiguous()


def workload(kind: str, batch: int) -> list:
    """Sequences with the sampling params of one row each, with 64 prompt and 32 output tokens of history."""
    mix = [SamplingParams(temperature=0),
           SamplingParams(temperature=0.8, top_p=0.9),
           SamplingParams(temperature=1.0, top_k=50, logprobs=5),
           SamplingParams(temperature=0.7, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                          repetition_penalty=1.1)]
    seqs = []
    for i in range(batch):
        params = SamplingParams(temperature=1.0, top_p=0.9) if kind == "top_p" else mix[i % len(mix)]
        req = Request(f"r{i}", None, [(7 * i + j) % 40000 for j in range(64)], params, 64)
        seq = req.seqs[0]
        seq.token_ids += [(13 * i + j) % 40000 for j in range(32)]
        seqs.append(seq)
    return seqs


def timed(sampler, logits: torch.Tensor, seqs: list, reps: int) -> float:
    """Best of `reps` calls, after a warm-up call (which also fills the penalty rows)."""
    sampler(logits.clone(), seqs)
    best = float("inf")
    for _ in range(reps):
        x = logits.clone()
        t = time.perf_counter()
        sampler(x, seqs)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    ap.add_argument("--kinds", nargs="+", default=["top_p", "mix"])
    ap.add_argument("--flat", action="store_true", help="N(0,1) logits: the full-sort fallback")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep: checks the script works")
    ap.add_argument("--out", type=Path, help="write OUT.json")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.vocabs, args.reps, args.flat = [1, 4], [1024], 1, True
    torch.set_num_threads(torch.get_num_threads())
    results = []
    print("| logits | workload | batch | vocab | old ms | new ms | speedup |\n|---|---|---|---|---|---|---|")
    source = {v: model_logits(max(args.batches), v, args.flat) for v in args.vocabs}
    for vocab in args.vocabs:
        for kind in args.kinds:
            for batch in args.batches:
                logits = source[vocab][torch.arange(batch) % source[vocab].shape[0]].contiguous()
                seqs = workload(kind, batch)
                t_new = timed(Sampler({2}, vocab, torch.device("cpu")), logits, seqs, args.reps)
                t_old = timed(LegacySampler({2}), logits, seqs, 1 if batch >= 128 else args.reps)
                row = dict(logits="flat" if args.flat else "model", kind=kind, batch=batch, vocab=vocab,
                           old_ms=round(t_old * 1e3, 2), new_ms=round(t_new * 1e3, 2), speedup=round(t_old / t_new, 1))
                results.append(row)
                print(f"| {row['logits']} | {kind} | {batch} | {vocab} | {row['old_ms']} | {row['new_ms']} | "
                      f"{row['speedup']}x |", flush=True)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        plot(results, args.out.with_suffix(".png"))
    return 0


def plot(results: list[dict], path: Path) -> None:
    """ms per sampler call against batch size: old and new, per vocabulary and workload (needs pagekube[bench])."""
    plt = pyplot()
    if plt is None:
        return
    vocabs = sorted({r["vocab"] for r in results})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5.5 * len(vocabs), 4), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs, strict=True):
        for kind, style in (("top_p", "-"), ("mix", "--")):
            rs = [r for r in results if r["vocab"] == vocab and r["kind"] == kind]
            if not rs:
                continue
            batch = [r["batch"] for r in rs]
            ax.plot(batch, [r["old_ms"] for r in rs], style, marker="o", color="tab:red", label=f"old, {kind}")
            ax.plot(batch, [r["new_ms"] for r in rs], style, marker="o", color="tab:blue", label=f"new, {kind}")
        ax.set(xscale="log", yscale="log", xlabel="batch (rows sampled per step)", ylabel="ms per step",
               title=f"sampler, vocabulary {vocab:,}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
