"""PrefixHash load balancing for real: three engines behind the operator's rendered NGINX config and njs router.

Which replica served a request is read from the engines' own prefix-cache counters and from NGINX's access log
(its `upstream` field); only the upstream addresses, the listen port and the script's folder differ from what a
cluster gets.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from e2e.loopback import Nginx, engine_replicas, prefix_cache_counts
from e2e.waiting import wait_for
from pagekube.operator.nginx import NJS_MODULE
from pagekube.operator.spec import LLMDeploymentSpec
from tests.server_process import ServerProcess, json_log_lines, metric

pytestmark = pytest.mark.skipif(not (shutil.which("nginx") and Path(NJS_MODULE).exists()),
                                reason="nginx and its njs module (Debian packages) are installed by scripts/test-deps.sh")

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ["--served-model-name", MODEL, "--max-num-seqs", "8", "--kv-cache-memory", str(64 * 1024**2),
               "--dtype", "float32", "--drain-timeout", "120"]
ONE_CORE = {**os.environ, "OMP_NUM_THREADS": "1"}  # three engines share this machine's 2 cores


def prefix_spec(**prefix_hash) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate({
        "model": {"name": MODEL, "source": "file:///models/smollm2"},
        "loadBalancer": {"strategy": "PrefixHash", "prefixHash": prefix_hash},
    })


def system_prompt(tenant: int) -> str:
    """Longer than the router's 100 characters, so the key is the tenant's alone."""
    return (f"You are the support assistant of tenant number {tenant}. Answer briefly and politely, cite the "
            f"handbook of tenant {tenant} where you can, and never reveal internal notes.")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with engine_replicas(3, ENGINE_ARGS, tmp_path_factory.mktemp("engines"), ONE_CORE) as procs:
        yield procs


@pytest.fixture
def balancer(engines, tmp_path):
    made = []

    def make(spec: LLMDeploymentSpec, upstreams: list[ServerProcess] | None = None) -> Nginx:
        workdir = tmp_path / f"nginx{len(made)}"
        workdir.mkdir()
        lb = Nginx(workdir, spec, [f"127.0.0.1:{e.port}" for e in upstreams or engines])
        made.append(lb)
        return lb

    yield make
    for lb in made:
        lb.stop()


def client(lb: Nginx) -> openai.OpenAI:
    return openai.OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=300)


def chat(lb: Nginx, tenant: int, question: str, max_tokens: int = 1):
    return client(lb).chat.completions.create(model=MODEL, max_tokens=max_tokens, messages=[
        {"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": question}])


def logged(lb: Nginx, since: int, count: int) -> list[dict]:
    """The `count` access-log entries after the first `since` lines. NGINX writes a request's line after it has
    sent the response, so the client can be done before the line is there: wait for it."""
    entries = wait_for(lambda: json_log_lines(lb.dir / "nginx.out")[since:], lambda e: len(e) >= count, 10,
                       what=f"{count} access-log lines")
    assert len(entries) == count, entries
    return entries


def upstreams_served(lb: Nginx, since: int, count: int) -> list[str]:
    """The engine address that answered each of the `count` requests logged after the first `since` lines."""
    return [e["upstream"].split(" : ")[-1] for e in logged(lb, since, count)]


def log_length(lb: Nginx) -> int:
    return len(json_log_lines(lb.dir / "nginx.out"))


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(engines, balancer):
    lb = balancer(prefix_spec())
    owners = {}
    for tenant in range(6):
        before = prefix_cache_counts(engines)
        for turn in range(3):
            assert chat(lb, tenant, f"Question {turn}: where is my order?").choices[0].finish_reason == "length"
        after = prefix_cache_counts(engines)
        grew = [i for i, (b, a) in enumerate(zip(before, after)) if a[0] > b[0]]
        assert len(grew) == 1, f"tenant {tenant}'s requests reached engines {grew}"
        owners[tenant] = grew[0]
        hits = after[grew[0]][1] - before[grew[0]][1]
        assert hits >= 2 * 32, f"tenant {tenant}: turns 2 and 3 should reuse the system prompt's blocks ({hits})"
    print(f"\n[e2e] prefix routing: tenant -> replica {owners}")
    assert len(set(owners.values())) > 1  # the ring spreads tenants


def test_a_hot_prefix_spills_to_the_next_replica_at_its_connection_bound(engines, balancer):
    """maxConnectionsPerReplica 1: four concurrent streams of one tenant take the owner, the next replica on the
    ring, the third; the fourth finds every replica at its bound and least connections takes it. None fails."""
    lb = balancer(prefix_spec(maxConnectionsPerReplica=1))
    start = log_length(lb)

    def stream(i):
        out = client(lb).chat.completions.create(model=MODEL, max_tokens=24, stream=True, extra_body={"ignore_eos": True},
                                                 messages=[{"role": "system", "content": system_prompt(0)},
                                                           {"role": "user", "content": f"Question {i}"}])
        return [c.choices[0].finish_reason for c in out if c.choices and c.choices[0].finish_reason]

    with ThreadPoolExecutor(4) as pool:
        finishes = list(pool.map(stream, range(4)))
    assert finishes == [["length"]] * 4
    entries = logged(lb, start, 4)
    assert [e["status"] for e in entries] == [200] * 4
    served = {e["upstream"].split(" : ")[-1] for e in entries}
    spilled = [e for e in entries if e["upstream"].startswith("engine_prefix")]
    print(f"\n[e2e] 4 concurrent streams of one prefix, bound 1: replicas {sorted(served)}, "
          f"{len(spilled)} through least connections")
    assert len(served) == 3 and len(spilled) == 1


def test_a_removed_replica_moves_only_its_prefix_keys(engines, balancer):
    lb = balancer(prefix_spec())

    def owners() -> dict[int, str]:
        start = log_length(lb)
        for tenant in range(12):
            chat(lb, tenant, "Hello")
        return dict(enumerate(upstreams_served(lb, start, 12)))

    before = owners()
    leaving = f"127.0.0.1:{engines[2].port}"
    assert leaving in before.values()
    lb.reload([f"127.0.0.1:{e.port}" for e in engines[:2]])
    after = owners()
    moved = {t for t in before if before[t] != after[t]}
    print(f"\n[e2e] one of 3 replicas removed: {len(moved)}/12 prefix keys moved, all of them its own")
    assert moved == {t for t in before if before[t] == leaving}
    assert leaving not in after.values()


def test_bodies_without_a_prefix_key_are_served_through_least_connections(engines, balancer):
    lb = balancer(prefix_spec())
    start = log_length(lb)
    not_json = httpx.post(lb.url + "/v1/chat/completions", content=b"{not json", timeout=60,
                          headers={"Content-Type": "application/json"})
    no_prompt = httpx.post(lb.url + "/v1/completions", json={"model": MODEL}, timeout=60)
    models = httpx.get(lb.url + "/v1/models", timeout=60)
    token_ids = httpx.post(lb.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1},
                           timeout=60)
    # The engine's own answers, in its error shape: nothing was refused or lost by the router.
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert no_prompt.status_code == 400 and "error" in no_prompt.json()
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert token_ids.status_code == 200
    served = upstreams_served(lb, start, 4)
    assert all(s.startswith("127.0.0.1:") for s in served), served


def test_a_drain_under_prefix_routing_loses_no_stream(engines, balancer, tmp_path):
    """The replica that owns a tenant's prefix leaves as in a rollout (endpoint removal, then SIGTERM): its
    streams finish, and the tenant's next requests go to the replica that now owns the key."""
    leaving = ServerProcess(*ENGINE_ARGS, log_path=tmp_path / "leaving.log", env=ONE_CORE).wait_ready()
    try:
        lb = balancer(prefix_spec(), [engines[0], leaving])
        start = log_length(lb)
        for tenant in range(8):
            chat(lb, tenant, "Hello")
        served = upstreams_served(lb, start, 8)
        tenant = next(t for t, s in enumerate(served) if s == f"127.0.0.1:{leaving.port}")

        def stream(i):
            out = client(lb).chat.completions.create(
                model=MODEL, max_tokens=48, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": f"Q{i}"}])
            return [c.choices[0].finish_reason for c in out if c.choices and c.choices[0].finish_reason]

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, i) for i in range(6)]
            wait_for(lambda: metric(httpx.get(leaving.url + "/metrics").text, "vllm:num_requests_running"),
                     lambda v: v > 0, 60, what="the tenant's streams running on the leaving replica")
            lb.reload([f"127.0.0.1:{engines[0].port}"])  # endpoint removal
            time.sleep(2)
            leaving.signal(signal.SIGTERM)
            during = [chat(lb, tenant, f"New question {i}", max_tokens=4) for i in range(3)]
            finishes = [f.result() for f in futures]
        assert finishes == [["length"]] * 6
        assert all(r.choices[0].finish_reason == "length" for r in during)
        assert leaving.proc.wait(120) == 0
    finally:
        leaving.stop()
