"""Tensor parallelism's communication per step: bytes and time of rank 0's collectives at batch 32 decode.

    .venv/bin/python bench/tp_comm.py --tp 2 --batch 32 --max-tokens 32

On a CPU (gloo over loopback) TP buys no speed: the ranks share the same cores. What this measures is what TP
costs per step, the number that matters on GPUs with NCCL. Rank 0's time in a collective includes waiting for the
slowest rank. The run's greedy output is checked against one rank's. --tiny: a random Llama with 4 query / 2 KV
heads (the bundled model's 9 heads split only over 3). --smoke: tiny sizes (the test suite runs it; timings are
never asserted).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dist_tally import StepTimer, Tally  # bench/ is on the path when a script here runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="a random 4-head Llama instead of --model")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.max_tokens = 2, 3
    from pagekube.engine import LLM, SamplingParams
    from pagekube.engine.model.model_files import resolve_model_dir

    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.conftest import write_tiny_llama  # the same checkpoint the tests use

        args.model = str(write_tiny_llama(Path(tempfile.mkdtemp()), resolve_model_dir(None)))
    prompts = [f"Request {i}: tell me about node {i}" for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(args.model, dtype="float32").generate(prompts, params)]
    llm = LLM(args.model, dtype="float32", tensor_parallel_size=args.tp, max_num_seqs=args.batch)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # also warms up
        assert got == reference, "greedy output with tensor parallelism must equal one rank's"
        timer = StepTimer(llm.engine)
        tallies = [Tally(n) for n in ("all_reduce", "all_gather", "broadcast", "gather")]
        llm.generate(prompts, params)
    finally:
        llm.close()
    steps, step_time = timer.steps, timer.seconds
    print(f"greedy output equals one rank's: yes\nTP={args.tp}, batch {args.batch}, {args.max_tokens} output tokens each: {steps} steps, "
          f"{step_time / steps * 1e3:.1f} ms per step")
    print("| collective (rank 0) | calls / step | bytes / step | ms / step | share of the step |")
    print("|---|---|---|---|---|")
    for t in tallies:
        print(f"| {t.name} | {t.calls / steps:.1f} | {t.bytes / steps / 1e6:.2f} MB | {t.seconds / steps * 1e3:.2f} | "
              f"{t.seconds / step_time:.0%} |")


if __name__ == "__main__":
    main()
