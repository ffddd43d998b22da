"""Embeddings throughput: sentence-transformers in-process against `pagekube serve` through HTTP.

    python bench/embeddings.py            # 512 texts of 3-180 words on all-MiniLM-L6-v2; writes docs/bench_embeddings.*
    python bench/embeddings.py --smoke    # tiny sizes (CI): every text gets its vector from every side

sentence-transformers encodes with batch 32 (it sorts by length first, so padding is small), in float32 (its
default) and in bfloat16. pagekube serves the same directory at its default dtype (auto: bfloat16 on CPUs with
AVX512_BF16) and in float32, and the official openai client sends 64 texts a request, 4 in flight (the client
shares the machine's cores with the server). Each side encodes everything once to warm up, then is timed on the
whole set; the cosine of each pagekube vector to the
float32 sentence-transformers one is reported (its minimum). The sides take turns for `--repeats` rounds
(median reported), so a noisy minute on a shared machine hits every side alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402
from tests.embedding_models import minilm_dir  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402  (the same launcher the tests use)

WORDS = ("the of and to in is that for it on with as was be by this are or from at an have not which but they "
         "cluster node pod service model token latency queue replica request stream cache block prefix batch "
         "kernel memory scheduler gateway metric alert rollout drain retrieval document search answer vector "
         "embedding similarity question context passage index query ranking relevance").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 180))) for _ in range(n)]


class SentenceTransformersSide:
    def __init__(self, model: str, dtype: str):
        import torch
        from sentence_transformers import SentenceTransformer

        self.st = SentenceTransformer(model, device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})

    def run(self, data: list[str]) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        out = self.st.encode(data, batch_size=32)
        return len(data) / (time.perf_counter() - start), np.asarray(out, dtype=np.float32)

    def close(self) -> None:
        del self.st


class PagekubeSide:
    """`pagekube serve` in its own process; the official openai client sends `per_request` texts a request."""

    def __init__(self, model: str, dtype: str, per_request: int, in_flight: int):
        self.server = ServerProcess(model, "--served-model-name", "bench", "--dtype", dtype,
                                    "--disable-log-requests").wait_ready()
        self.per_request, self.in_flight = per_request, in_flight

    def run(self, data: list[str]) -> tuple[float, np.ndarray]:
        return asyncio.run(over_http(self.server.url, data, self.per_request, self.in_flight))

    def close(self) -> None:
        self.server.stop()


async def over_http(url: str, data: list[str], per_request: int, in_flight: int) -> tuple[float, np.ndarray]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chunks = [data[i:i + per_request] for i in range(0, len(data), per_request)]
    gate = asyncio.Semaphore(in_flight)

    async def one(chunk):
        async with gate:
            r = await client.embeddings.create(model="bench", input=chunk)
            return [d.embedding for d in r.data]

    start = time.perf_counter()
    vectors = [v for part in await asyncio.gather(*(one(c) for c in chunks)) for v in part]
    rate = len(data) / (time.perf_counter() - start)
    await client.close()
    return rate, np.asarray(vectors, dtype=np.float32)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--per-request", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (the median is reported)")
    ap.add_argument("--smoke", action="store_true", help="8 texts, 4 a request, one run; no files written")
    ap.add_argument("--out", default="docs/bench_embeddings")
    args = ap.parse_args()
    if args.smoke:
        args.texts, args.per_request, args.in_flight, args.repeats = 8, 4, 2, 1
    model, data = str(minilm_dir()), texts(args.texts)
    sides = [("sentence-transformers", "float32", lambda: SentenceTransformersSide(model, "float32")),
             ("sentence-transformers", "bfloat16", lambda: SentenceTransformersSide(model, "bfloat16")),
             ("pagekube serve", "auto", lambda: PagekubeSide(model, "auto", args.per_request, args.in_flight)),
             ("pagekube serve", "float32", lambda: PagekubeSide(model, "float32", args.per_request, args.in_flight))]
    loaded = [make() for _, _, make in sides]
    rates: list[list[float]] = [[] for _ in sides]
    vectors: list[np.ndarray] = []
    try:
        for side in loaded:  # warm-up: every side encodes everything once
            vectors.append(side.run(data)[1])
        for _ in range(args.repeats):  # the sides take turns, so a noisy minute hits them alike
            for i, side in enumerate(loaded):
                rates[i].append(side.run(data)[0])
    finally:
        for side in loaded:
            side.close()
    rows = []
    for (name, dtype, _), rate, vecs in zip(sides, rates, vectors):
        assert vecs.shape == (len(data), 384), vecs.shape
        rows.append({"side": name, "dtype": dtype, "texts_per_s": round(float(np.median(rate)), 1),
                     "runs": [round(r, 1) for r in rate],
                     "min_cosine_to_st_float32": round(min_cosine(vecs, vectors[0]), 6)})
    base = rows[0]["texts_per_s"]
    print(f"{len(data)} texts of 3-180 words, all-MiniLM-L6-v2; pagekube: {args.per_request} texts a request, "
          f"{args.in_flight} in flight\n")
    print("| side | dtype | texts/s | vs sentence-transformers float32 | min cosine to it |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['dtype']} | {r['texts_per_s']} | {r['texts_per_s'] / base:.2f}x | "
              f"{r['min_cosine_to_st_float32']} |")
    if args.smoke:
        return
    Path(args.out + ".json").write_text(json.dumps(rows, indent=2) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6.5, 3))
        labels = [f"{r['side']}\n{r['dtype']}" for r in rows]
        ax.barh(labels[::-1], [r["texts_per_s"] for r in rows][::-1], color=["#1f77b4", "#1f77b4", "#aaaaaa", "#aaaaaa"])
        ax.set_xlabel("texts/s (higher is better)")
        ax.set_title("Embeddings, all-MiniLM-L6-v2, 2 CPU cores")
        save(fig, args.out + ".png")


if __name__ == "__main__":
    main()
