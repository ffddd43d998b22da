"""Concurrent streaming chat completions with the official openai client, run inside the node's network namespace
(where Service ClusterIPs route). One JSON line per event on stdout: `first` when a stream got its first token,
`result` per stream when it ends (finish reason, tokens counted from the chunks and from usage, or the error).

    python -m e2e.node.stream_client --base-url http://10.96.0.12/v1 --streams 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import openai


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


async def one_stream(client: openai.AsyncOpenAI, i: int, args) -> None:
    chunks, finish, usage = 0, None, None
    try:
        stream = await client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
            max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if chunks == 0:
                        emit(event="first", stream=i)
                    chunks += 1
                finish = choice.finish_reason or finish
        emit(event="result", stream=i, finish_reason=finish, chunks=chunks, completion_tokens=usage)
    except Exception as e:  # a lost stream is what the tests look for: report it, never raise
        response = getattr(e, "response", None)  # an HTTP error's status and Retry-After (the activator's 429)
        emit(event="result", stream=i, error=f"{type(e).__name__}: {e}", chunks=chunks,
             status=getattr(response, "status_code", None),
             retry_after=response.headers.get("retry-after") if response is not None else None)


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    # No retries: a replayed request would hide a stream the cluster lost.
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=600)
    await asyncio.gather(*(one_stream(client, i, args) for i in range(args.streams)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
