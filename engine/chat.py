"""Chat prompts: a conversation (and any tools) through the tokenizer's chat template, as token ids."""

from __future__ import annotations

from pagekube.engine.tool_calls import template_renders_tools, without_tool_support


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    if template_renders_tools(tokenizer):
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
    else:  # the template knows no tools, tool calls or tool results: render them as plain content
        ids = tokenizer.apply_chat_template(without_tool_support(messages, tools),
                                            add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer transformers return a BatchEncoding
