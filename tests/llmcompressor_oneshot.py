"""Quantize a model with llm-compressor, as a user would: run by tests/quantized_checkpoints.py in llm-compressor's
own virtualenv (it pins transformers and compressed-tensors apart from the project's), never imported by pytest.

    python llmcompressor_oneshot.py BASE_DIR JOBS_JSON     # JOBS_JSON: [{"out": DIR, "weights": {...}} | ...]

A job with "weights" is one config group over every Linear but lm_head (round-to-nearest, no data); with
"scheme", one of llm-compressor's preset schemes (FP8_DYNAMIC); with "gptq", GPTQ on a few sentences (act order).
"""

import json
import shutil
import sys

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

CALIBRATION = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
               "Paris is the capital of France, and Berlin is the capital of Germany.",
               "Once upon a time there was a small robot who wanted to learn to paint."]


def recipe(job: dict):
    if "scheme" in job:
        return QuantizationModifier(targets="Linear", scheme=job["scheme"], ignore=["lm_head"])
    groups = {"group_0": {"targets": ["Linear"], "weights": job.get("weights") or job["gptq"]}}
    if "gptq" in job:
        return GPTQModifier(config_groups=groups, ignore=["lm_head"])
    return QuantizationModifier(config_groups=groups, ignore=["lm_head"])


def main(base: str, jobs: list[dict]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base)
    for job in jobs:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        kwargs = {}
        if "gptq" in job:
            from datasets import Dataset

            kwargs = dict(dataset=Dataset.from_dict(dict(tokenizer(CALIBRATION))), num_calibration_samples=4)
        oneshot(model=model, recipe=recipe(job), **kwargs)
        tmp = job["out"] + ".tmp"
        model.save_pretrained(tmp, save_compressed=True)
        tokenizer.save_pretrained(tmp)
        shutil.move(tmp, job["out"])


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
