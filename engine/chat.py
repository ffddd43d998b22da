"""Chat prompts: a conversation through the tokenizer's chat template, as token ids."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer transformers return a BatchEncoding
