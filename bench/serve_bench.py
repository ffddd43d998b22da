"""Serving benchmark: throughput, TTFT and ITL at several concurrencies against a real `pagekube serve`, side by
side with the offline engine on the same workload.

    .venv/bin/python bench/serve_bench.py --requests 64 --max-tokens 32 --concurrency 1 8 32 --out docs/bench
    .venv/bin/python bench/serve_bench.py --structured --requests 64 --max-tokens 64 --concurrency 32

--structured measures the cost of structured outputs instead: the same requests, once unconstrained and once
with a JSON-schema response_format, on one server at the top concurrency. Prints a markdown table (paste it into docs/benchmarks.md) and writes a PNG plot next to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402  (the same launcher the tests use)

WORDS = ("cluster node pod service model token latency queue replica request stream cache block prefix batch "
         "kernel memory scheduler gateway metric alert rollout drain").split()


def workload(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))) for i in range(n)]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def offline(model: str | None, prompts: list[str], max_tokens: int, max_num_seqs: int) -> dict:
    from pagekube.engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": "offline LLM.generate", "concurrency": max_num_seqs, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall}


# A record whose document cannot close before max_tokens (minItems), so both sides of --structured decode the same
# number of tokens and tokens/s compares like with like.
RECORD_SCHEMA = {"type": "object", "required": ["title", "tags"], "properties": {
    "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD_SCHEMA}}


async def run_client(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                     response_format: dict | None = None, max_retries: int = 0) -> dict:
    """`max_retries`: connection-level retries (llama-server closes a keep-alive connection after a few requests,
    and a request sent on it as it closes never got an answer)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=max_retries, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttfts, itls, tokens = [], [], 0
    extra = {"ignore_eos": True} | ({"response_format": response_format} if response_format else {})

    async def one(prompt):
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            last = None
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body=extra,
                                                     stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttfts.append(now - t0)
                    else:
                        itls.append(now - last)
                    last = now
                if chunk.usage:
                    tokens += chunk.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()  # before asyncio.run closes this loop
    mode = "server, json_schema response_format" if response_format else "server (openai client, streaming)"
    return {"mode": mode, "concurrency": concurrency, "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall, "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "itl_p50": pct(itls, 50), "itl_p99": pct(itls, 99)}


def table(rows: list[dict]) -> str:
    out = ["| mode | concurrency | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
           "|---|---|---|---|---|"]
    for r in rows:
        ttft = f"{r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f}" if "ttft_p50" in r else "-"
        itl = f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f}" if "itl_p50" in r else "-"
        out.append(f"| {r['mode']} | {r['concurrency']} | {r['tok_s']:.1f} | {ttft} | {itl} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    server = [r for r in rows if "ttft_p50" in r]
    conc = [r["concurrency"] for r in server]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(conc, [r["tok_s"] for r in server], "o-", label="server")
    for r in rows:
        if "ttft_p50" not in r:
            axes[0].axhline(r["tok_s"], color="gray", ls="--", label=f"offline (max_num_seqs={r['concurrency']})")
    axes[0].set(title="output tokens/s", xlabel="concurrency", xscale="log")
    axes[0].legend()
    for ax, key, title in ((axes[1], "ttft", "TTFT (ms)"), (axes[2], "itl", "inter-token latency (ms)")):
        ax.plot(conc, [r[f"{key}_p50"] * 1e3 for r in server], "o-", label="p50")
        ax.plot(conc, [r[f"{key}_p99"] * 1e3 for r in server], "s--", label="p99")
        ax.set(title=title, xlabel="concurrency", xscale="log")
        ax.legend()
    save(fig, path)


def structured_cost(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[dict]:
    """Unconstrained, then JSON-schema constrained, then both again: the second pair is the one reported (the first
    warms the schema's compile cache and the grammar backend)."""
    rows = []
    for _ in range(2):
        rows = [asyncio.run(run_client(url, model, prompts, max_tokens, concurrency, fmt))
                for fmt in (None, JSON_SCHEMA_FORMAT)]
    free, constrained = rows
    assert free["tokens"] == constrained["tokens"], "both sides must decode the same tokens (the schema's minItems)"
    print(table(rows))
    print(f"\njson_schema / unconstrained output tok/s at concurrency {concurrency}: "
          f"{constrained['tok_s'] / free['tok_s']:.2f}x")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--structured", action="store_true", help="measure JSON-schema requests against unconstrained")
    ap.add_argument("--out", default="docs/bench", help="prefix for the .json results and the .png plot")
    ap.add_argument("--server-flag", action="append", default=[],
                    help="a flag for `pagekube serve` (repeat it), e.g. --server-flag=--enforce-eager")
    args = ap.parse_args()
    prompts = workload(args.requests)
    top = max(args.concurrency)
    rows = [] if args.structured else [offline(args.model, prompts, args.max_tokens, top)]
    srv = ServerProcess(*([args.model] if args.model else []), "--max-num-seqs", str(top), "--disable-log-requests",
                        *args.server_flag)
    try:
        srv.wait_ready()
        model = json.loads(__import__("httpx").get(srv.url + "/v1/models").text)["data"][0]["id"]
        asyncio.run(run_client(srv.url, model, prompts[:4], args.max_tokens, 4))  # warm-up
        if args.structured:
            rows = structured_cost(srv.url, model, prompts, args.max_tokens, top)
        else:
            for c in args.concurrency:
                rows.append(asyncio.run(run_client(srv.url, model, prompts, args.max_tokens, c)))
    finally:
        srv.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    if args.structured:
        return
    print(table(rows))
    ratio = rows[-1]["tok_s"] / rows[0]["tok_s"]
    print(f"\nserver at concurrency {top} / offline: {ratio:.2f}x")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
