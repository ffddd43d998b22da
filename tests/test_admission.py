"""Admission and usage under load, on a real server: a burst is counted from the moment each request is admitted
(429 past --max-waiting-requests, as KEDA's queue metric sees it), and usage stays true when the KV pool is so
small that requests are preempted and recomputed."""

from __future__ import annotations

import asyncio

import httpx

from tests.server_process import ServerProcess, metric

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a careful assistant for a shipping company. Answer in full sentences, cite the policy section you "
          "rely on, and never invent tracking numbers. ") * 6


def serve(bundled_dir, *flags: str) -> ServerProcess:
    return ServerProcess(str(bundled_dir), "--served-model-name", MODEL, *flags).wait_ready()


async def burst(url: str, bodies: list[dict], path: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # slow, loaded CI machines
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def test_a_burst_gets_at_most_max_num_seqs_plus_max_waiting_accepted_and_429_for_the_rest(bundled_dir):
    srv = serve(bundled_dir, "--max-num-seqs", "2", "--max-waiting-requests", "4",
                "--kv-cache-memory", str(64 * 1024**2))
    try:
        body = {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": 64,
                "ignore_eos": True, "temperature": 0}
        replies = asyncio.run(burst(srv.url, [body] * 40, "/v1/completions"))
        codes = [r.status_code for r in replies]
        accepted = [r for r in replies if r.status_code == 200]
        assert set(codes) <= {200, 429}, codes
        assert 2 <= len(accepted) <= 6, codes  # 2 running + 4 waiting, counted from admission
        for r in replies:
            if r.status_code == 429:
                assert r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in accepted)
        assert metric(httpx.get(srv.url + "/metrics").text, "vllm:num_requests_waiting") == 0
    finally:
        srv.stop()


def test_preempted_requests_finish_with_cached_tokens_never_above_their_prompt(bundled_dir):
    # ~40 blocks of 16 tokens: two or three of these requests fit at once, so decodes preempt each other.
    srv = serve(bundled_dir, "--kv-cache-memory", str(15 * 1024**2), "--max-model-len", "512")
    try:
        bodies = [{"model": MODEL, "max_tokens": 48, "ignore_eos": True, "temperature": 0,
                   "messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"Where is parcel number {i}?"}]} for i in range(24)]
        replies = asyncio.run(burst(srv.url, bodies, "/v1/chat/completions"))
        assert [r.status_code for r in replies] == [200] * 24, [r.text for r in replies if r.status_code != 200]
        for r in replies:
            reply = r.json()
            usage = reply["usage"]
            assert reply["choices"][0]["finish_reason"] == "length" and usage["completion_tokens"] == 48
            assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage
        assert any(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies)
        assert metric(httpx.get(srv.url + "/metrics").text, "vllm:num_preemptions_total") > 0
    finally:
        srv.stop()
