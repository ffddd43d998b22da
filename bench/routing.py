"""What prefix-aware routing buys: 3 engine replicas behind the operator's rendered NGINX on loopback, a
multi-tenant chat workload, LeastConnections against PrefixHash.

    .venv/bin/python bench/routing.py            # 24 tenants x 4 turns, concurrency 16 (docs/benchmarks.md)
    .venv/bin/python bench/routing.py --smoke    # tiny sizes: the script still runs (tests/test_bench_smoke.py)

Each tenant has its own long system prompt; each conversation sends `--turns` chat requests, every turn carrying
the history so far (the engine's answers included), as a chat client does. `--concurrency` conversations run at
once, tenants interleaved. Each strategy gets freshly started engines (empty caches) and NGINX with the operator's
config. Reported per strategy: the prefix-cache hit rate (vllm:prefix_cache_hits / queries over the 3 engines),
TTFT p50/p99 (first streamed token, at the client), output tokens/s, the busiest replica's share of prompt tokens,
the most requests one replica held at once (sampled) against the bound, and the requests that found every replica
at its bound (least connections took them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import plotting  # noqa: E402
from e2e.loopback import Nginx, engine_replicas, prefix_cache_counts  # noqa: E402
from pagekube.operator.nginx import max_connections_per_replica  # noqa: E402
from pagekube.operator.spec import LLMDeploymentSpec  # noqa: E402
from tests.server_process import json_log_lines, metric  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "pricing", "outages"]


def system_prompt(tenant: int, words: int) -> str:
    """A tenant's own instructions: distinct from the first characters on, `words` words long."""
    body = " ".join(f"{TOPICS[(tenant + i) % len(TOPICS)]}-rule-{tenant}-{i}" for i in range(words // 2))
    return f"Tenant {tenant} support policy. Follow these rules strictly: {body}. Answer in one short sentence."


def conversation(lb_url: str, tenant: int, turns: int, words: int, max_tokens: int, ttfts: list, outputs: list):
    client = openai.OpenAI(base_url=lb_url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system_prompt(tenant, words)}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} from a customer of tenant {tenant}: "
                                                    f"what about {TOPICS[turn % len(TOPICS)]}?"})
        start, first, text, tokens = time.perf_counter(), None, "", 0
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        ttfts.append((first or time.perf_counter()) - start)
        outputs.append(tokens)
        messages.append({"role": "assistant", "content": text})


def run(strategy: str, kv_cache_mib: int, args, workdir: Path) -> dict:
    spec = LLMDeploymentSpec.model_validate({
        "model": {"name": MODEL, "source": "file:///models/smollm2"},
        "engine": {"maxNumSeqs": args.max_num_seqs},
        "loadBalancer": {"replicas": 1, "strategy": strategy,
                         "prefixHash": {"maxConnectionsPerReplica": args.bound}},
    })
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    engine_args = ["--served-model-name", MODEL, "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32",
                   "--kv-cache-memory", str(kv_cache_mib * 1024**2), "--disable-log-requests"]
    run_dir = workdir / f"{strategy}-{kv_cache_mib}"
    (run_dir / "nginx").mkdir(parents=True)
    with engine_replicas(args.replicas, engine_args, run_dir, env, timeout=600) as engines:
        lb = Nginx(run_dir / "nginx", spec, [f"127.0.0.1:{e.port}" for e in engines])
        try:
            peak, done = [0.0] * len(engines), threading.Event()

            def sample():  # the most requests each replica held at once (running + waiting)
                while not done.wait(0.2):
                    for i, e in enumerate(engines):
                        page = httpx.get(e.url + "/metrics").text
                        held = metric(page, "vllm:num_requests_running") + metric(page, "vllm:num_requests_waiting")
                        peak[i] = max(peak[i], held)

            before = prefix_cache_counts(engines)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            ttfts, outputs = [], []
            # tenants interleaved: a tenant's conversations never run back to back on the same worker
            order = [t for _ in range(args.conversations) for t in range(args.tenants)]
            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                for f in [pool.submit(conversation, lb.url, t, args.turns, args.system_words, args.max_tokens, ttfts,
                                      outputs) for t in order]:
                    f.result()
            seconds = time.perf_counter() - start
            done.set()
            sampler.join()
            after = prefix_cache_counts(engines)
            spilled = sum(e["upstream"].startswith("engine_prefix") for e in json_log_lines(lb.dir / "nginx.out"))
        finally:
            lb.stop()
    queries = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    ttfts.sort()
    return {
        "strategy": strategy, "kv_cache_mib": kv_cache_mib, "requests": len(ttfts), "seconds": round(seconds, 2),
        "hit_rate": round(sum(hits) / sum(queries), 4),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "tokens_per_s": round(sum(outputs) / seconds, 2),
        "busiest_share": round(max(queries) / sum(queries), 3),
        "spilled": spilled, "peak_held": peak, "bound": max_connections_per_replica(spec) if strategy == "PrefixHash" else None,
    }


def plot(results: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for strategy, color in (("LeastConnections", "#888888"), ("PrefixHash", "#2a7ab9")):
        rows = [r for r in results if r["strategy"] == strategy]
        sizes = [r["kv_cache_mib"] for r in rows]
        for ax, key in zip(axes, ["hit_rate", "ttft_p50_ms", "tokens_per_s"]):
            ax.plot(sizes, [r[key] for r in rows], "o-", color=color, label=strategy)
    for ax, title in zip(axes, ["prefix-cache hit rate", "TTFT p50 (ms)", "output tokens/s"]):
        ax.set_title(title)
        ax.set_xlabel("KV cache per replica (MiB)")
    axes[0].legend()
    fig.suptitle("3 replicas, 24 tenants' chats at concurrency 16: LeastConnections vs PrefixHash")
    plotting.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--conversations", type=int, default=3, help="conversations per tenant")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-words", type=int, default=100, help="words in each tenant's system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--bound", type=int, default=8, help="PrefixHash maxConnectionsPerReplica")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, nargs="+", default=[320], help="each engine's KV pool (several: a sweep)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    p.add_argument("--out", type=Path, default=None, help="write JSON + PNG here (docs/bench_routing)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.replicas, args.tenants, args.turns, args.system_words, args.concurrency = 2, 3, 2, 20, 2
        args.max_tokens, args.kv_cache_mib = 2, [64]
    with tempfile.TemporaryDirectory() as d:
        results = [run(s, kv, args, Path(d)) for kv in args.kv_cache_mib for s in ("LeastConnections", "PrefixHash")]
    print(f"{args.replicas} replicas, {args.tenants} tenants x {args.conversations} x {args.turns} turns, "
          f"concurrency {args.concurrency}, system prompts of {args.system_words} words, {args.max_tokens} tokens out")
    print("| KV cache | strategy | hit rate | TTFT p50 | TTFT p99 | tokens/s | busiest replica | peak held / bound | spilled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kv_cache_mib']} MiB | {r['strategy']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
              f"{r['tokens_per_s']:.1f} | {r['busiest_share']:.0%} | {max(r['peak_held']):.0f} / {r['bound'] or '-'} | {r['spilled']} |")
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                             "results": results}, indent=2) + "\n")
        plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
