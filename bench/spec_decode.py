"""Speculative decoding benchmark: n-gram prompt lookup vs plain decoding, offline engine, batch 1 and 8, on a
workload whose outputs copy from the prompt (rewrite, extract) and on free chat.

    .venv/bin/python bench/spec_decode.py --max-tokens 128 --out docs/bench_spec

Greedy, so both sides must produce the same tokens (checked). Prints a markdown table for docs/benchmarks.md and
writes a PNG plot next to --out. --smoke: tiny sizes (the test suite runs it; timings are never asserted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402

PASSAGES = [
    "Kubernetes schedules pods onto nodes. Each pod gets its own IP address, and containers in a pod share it. "
    "Services give a set of pods one stable name, and the kube-proxy routes traffic to whichever pod is ready.",
    "The paged KV cache splits each sequence's keys and values into fixed-size blocks. Blocks are allocated on "
    "demand and shared between sequences with the same prefix, so memory is not reserved for tokens never made.",
    "Our team met on Tuesday, March 4th, in the Berlin office. Anna Schmidt presented the quarterly results, and "
    "Jonas Weber asked about the hiring plan for the platform group, which grows from six to nine engineers.",
    "The recipe needs two cups of flour, one cup of sugar, three eggs and a pinch of salt. Mix the dry parts "
    "first, then add the eggs one at a time, and bake for forty minutes at one hundred and eighty degrees.",
]
COPY_TASKS = ["Rewrite this passage with small changes, keeping most of the wording:\n\n{}",
              "Repeat the following text exactly, word for word:\n\n{}"]
FREE_CHAT = ["Tell me a short story about a dragon who learns to cook.", "What are three tips for learning a new "
             "language?", "Describe your ideal weekend.", "Why is the sky blue? Explain it to a child.",
             "Write a haiku about autumn.", "What would you pack for a trip to the mountains?",
             "Give me an idea for a birthday party.", "How do bees make honey?"]


def workloads() -> dict[str, list[list[dict]]]:
    copy = [[{"role": "user", "content": t.format(p)}] for t in COPY_TASKS for p in PASSAGES]
    free = [[{"role": "user", "content": q}] for q in FREE_CHAT]
    return {"copy-heavy (rewrite, repeat)": copy, "free chat": free}


def run(llm, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    from pagekube.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    stats = llm.engine.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    proposed, accepted = (stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]) if stats else (0, 0)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "tpot_p50_ms": statistics.median(tpot) * 1e3,
            "acceptance": accepted / proposed if proposed else None, "ids": [o.outputs[0].token_ids for o in outs]}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_tok_s"] for r in rows], 0.4, label="plain")
    ax.bar([i + 0.2 for i in x], [r["spec_tok_s"] for r in rows], 0.4, label="n-gram speculation")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup']:.2f}x", (i + 0.2, r["spec_tok_s"]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="output tokens/s", title="Speculative decoding (n-gram) vs plain, greedy, CPU")
    ax.legend()
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--out", default="docs/bench_spec", help="prefix for the .json results and the .png plot")
    args = ap.parse_args()
    from pagekube.engine import LLM

    if args.smoke:
        args.max_tokens, args.batch = 8, [2]
    plain = LLM(args.model, dtype="float32")
    spec = LLM(args.model, dtype="float32", speculative_config=json.loads(args.speculative_config))
    rows = []
    for name, chats in workloads().items():
        prompts = [plain.apply_chat_template(c) for c in chats][: 2 if args.smoke else None]
        for batch in args.batch:
            base, fast = run(plain, prompts, batch, args.max_tokens), run(spec, prompts, batch, args.max_tokens)
            assert base["ids"] == fast["ids"], "greedy output must be identical with speculation"
            rows.append({"workload": name, "batch": batch, "requests": len(prompts), "tokens": base["tokens"],
                         "plain_tok_s": base["tok_s"], "spec_tok_s": fast["tok_s"],
                         "speedup": fast["tok_s"] / base["tok_s"], "acceptance": fast["acceptance"],
                         "plain_tpot_ms": base["tpot_p50_ms"], "spec_tpot_ms": fast["tpot_p50_ms"]})
    print("| workload | batch | output tok/s plain / n-gram | speedup | acceptance | TPOT p50 plain / n-gram (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        print(f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} / {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {acc} | {r['plain_tpot_ms']:.0f} / {r['spec_tpot_ms']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
        plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
