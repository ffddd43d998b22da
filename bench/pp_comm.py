"""Pipeline parallelism's communication per step against tensor parallelism's, and what one micro-batch in flight
costs: each stage idles while the other computes.

    .venv/bin/python bench/pp_comm.py --batches 1 32 --max-tokens 16

The model: a random Llama shaped like the bundled SmolLM2-135M (30 layers, hidden 576, vocabulary 49,152) but with
8 query / 2 KV heads, so that TP=2 splits it too (the bundled model's 9 heads split only over 3); --model to use
another. Every run's greedy output is checked against one process's. Counted on rank 0 per engine step: its
collectives (TP), its point-to-point messages (PP: the hidden states + residual to stage 1, the logits back).
Stage 1's busy time is rank 0's wait for the logits (its forward and the two transfers); rank 0's busy time is
the rest of the step. --smoke: tiny sizes (the test suite runs it; timings are never asserted).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dist_tally import StepTimer, Tally  # bench/ is on the path when a script here runs

OPS = ("all_reduce", "all_gather", "broadcast", "gather", "send", "recv")


def measure(model: str, batch: int, max_tokens: int, reference: list, **parallel) -> dict:
    from pagekube.engine import LLM, SamplingParams

    prompts = [f"Request {i}: tell me about node {i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model, dtype="float32", max_num_seqs=max(batch, 1), **parallel)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # also warms up
        assert got == reference, "greedy output with parallelism must equal one process's"
        timer = StepTimer(llm.engine)
        tallies = [Tally(n) for n in OPS]
        try:
            llm.generate(prompts, params)
        finally:
            for t in tallies:
                t.restore()
    finally:
        llm.close()
    steps = timer.steps
    row = {"parallel": " x ".join(f"{k.split('_')[0].upper()[:1]}P={v}" for k, v in parallel.items()) or "one process",
           "batch": batch, "ms_per_step": timer.seconds / steps * 1e3,
           "ops": {t.name: {"per_step": t.calls / steps, "bytes_per_step": t.bytes / steps,
                            "ms_per_step": t.seconds / steps * 1e3} for t in tallies if t.calls}}
    if "recv" in row["ops"]:  # rank 0 waits in recv for stage 1's forward and both transfers
        row["stage1_busy_ms"] = row["ops"]["recv"]["ms_per_step"]
        row["stage0_busy_ms"] = row["ms_per_step"] - row["stage1_busy_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: a random 8-head SmolLM2-shaped Llama)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pagekube.engine import LLM, SamplingParams
    from pagekube.engine.model.model_files import resolve_model_dir

    if args.model is None:
        from tests.conftest import write_tiny_llama  # the tests' checkpoint writer

        shape = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=8,
                     num_key_value_heads=2, tie=True)
        if args.smoke:
            shape.update(num_hidden_layers=3, hidden_size=64, intermediate_size=128)
            args.batches, args.max_tokens = [2], 3
        args.model = str(write_tiny_llama(Path(tempfile.mkdtemp()), resolve_model_dir(None), **shape))
    rows = []
    for batch in args.batches:
        prompts = [f"Request {i}: tell me about node {i}" for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        one = LLM(args.model, dtype="float32")
        try:
            reference = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        finally:
            one.close()
        for parallel in ({}, {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}):
            rows.append(measure(args.model, batch, args.max_tokens, reference, **parallel))
    print("greedy output equals one process's in every run: yes")
    print("| run | batch | ms / step | rank 0's messages / step | MB / step | stage 0 busy | stage 1 busy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        moved = {n: o for n, o in r["ops"].items() if n != "broadcast"}  # the step packet is the same for both
        msgs = ", ".join(f"{o['per_step']:.0f} {n}" for n, o in moved.items()) or "-"
        mb = sum(o["bytes_per_step"] for o in moved.values()) / 1e6
        busy = (f"{r['stage0_busy_ms']:.1f} ms | {r['stage1_busy_ms']:.1f} ms" if "stage1_busy_ms" in r else "- | -")
        print(f"| {r['parallel']} | {r['batch']} | {r['ms_per_step']:.1f} | {msgs} | {mb:.2f} | {busy} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
