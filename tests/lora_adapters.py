"""Random PEFT LoRA adapters for the tests (written with the `peft` library itself), and HF + PEFT's merged model."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "v_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(base_dir: Path, out: Path, targets: list[str], r: int = 8, alpha: int = 16, seed: int = 0,
                  rslora: bool = False, **extra) -> Path:
    """A LoRA adapter with random A and B (init_lora_weights=False: B is not zero, so it changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=rslora, **extra)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to move the greedy tokens of a random model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5 if "lora_B" in name else 1.0)
    model.save_pretrained(out)
    return out


def merged_hf_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights by PEFT (the reference); the base without."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.eval()


def hf_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, pad_token_id=2)
    return out[0, len(ids):].tolist()
