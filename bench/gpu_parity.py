"""Greedy output of the engine vs Hugging Face transformers on one device and dtype (the GPU check's parity step).

    python bench/gpu_parity.py --device cuda --dtype float32 --out parity-float32.json

float32 must match token for token (exit 1 otherwise). bfloat16 reports how many prompts match and where the first
divergence is: two correct bf16 implementations may round differently and then pick another near-tied token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekube.engine import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Kubernetes schedules pods onto nodes by", "The three primary colors are", "1, 2, 3, 4,"]
MAX_TOKENS = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(device=args.device, dtype=args.dtype)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=dtype).to(args.device).eval()
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = [o.outputs[0].token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    rows = []
    for prompt, p_ids, got in zip(PROMPTS, ids, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p_ids], device=args.device), max_new_tokens=MAX_TOKENS, do_sample=False,
                              temperature=None, top_p=None, top_k=None, pad_token_id=2)
        want = out[0, len(p_ids):].tolist()
        diverge = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        rows.append({"prompt": prompt, "equal": got == want, "first_divergence": diverge})
    result = {"device": args.device, "dtype": args.dtype, "matched": sum(r["equal"] for r in rows),
              "prompts": len(rows), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["matched"] == len(rows) or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
