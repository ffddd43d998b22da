"""Peer benchmark: `pagekube serve` against llama.cpp's `llama-server` and vLLM's CPU build on the same model, one
run, alternating.

    ./bench/build_llama_server.sh                         # once per machine (~11 min on 2 cores), cached
    ./bench/build_vllm_cpu.sh                             # once per machine (its own virtualenv), cached
    .venv/bin/python bench/peer_bench.py --out docs/bench_peer

All serve the bundled SmolLM2-135M-Instruct: llama.cpp its GGUF file, pagekube and vLLM the GGUF's conversion
(vLLM without the Q4_1 blocks file, which is pagekube's own; same dtype as pagekube's, `--dtype` auto here).
Every request is the same 128-token prompt set (token ids, so every server sees exactly the same input), 128
output tokens (ignore_eos; counted from each stream's usage and checked), streaming, through the same client
(bench/serve_bench.py's). At each concurrency the servers take turns (the order rotates per level) and each run
waits for an idle machine first (1-minute load average). Prints the table for docs/benchmarks.md and plots
tokens/s and ITL p99 against concurrency. `--smoke`: tiny sizes, llama-server only if it is already built, no
vLLM (its start compiles for minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot, save  # noqa: E402
from bench.serve_bench import WORDS, run_client  # noqa: E402
from pagekube.engine.model.layers import gguf_linears  # noqa: E402
from pagekube.engine.model.model_files import BUNDLED_NAME, bundled_model_file, resolve_model_dir  # noqa: E402
from tests.server_process import ServerProcess, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def bundled_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def token_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` token ids (the bundled model's tokenizer; both servers share its vocabulary)."""
    tok = bundled_tokenizer()
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        ids = tok.encode(f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(4 * length)))
        prompts.append(ids[:length])
    return prompts


def wait_idle(max_load: float, timeout: float = 120) -> float:
    """Block until the 1-minute load average drops under max_load (or timeout); returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.monotonic() > deadline:
            if load >= max_load:
                print(f"warning: machine not idle (load {load:.2f}); measuring anyway", file=sys.stderr)
            return load
        time.sleep(5)


class PeerProcess:
    """A peer server we started: `proc`, `url` (answering /health with 200 once ready), `log` (its output file)."""

    name = "peer"
    proc: subprocess.Popen
    url: str

    def wait_ready(self, timeout: float = 900):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class LlamaServer(PeerProcess):
    """llama.cpp's server on the bundled GGUF: 2 threads, one slot per concurrent user, continuous batching."""

    name = "llama-server"

    def __init__(self, binary: str, gguf: Path, slots: int, ctx_per_slot: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                                      "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(os.cpu_count()),
                                      "--no-webui"], stdout=self.log, stderr=subprocess.STDOUT)


class VllmServer(PeerProcess):
    """vLLM's CPU build (its own virtualenv, bench/build_vllm_cpu.sh) on the bundled model's conversion. Started
    from a directory outside the checkout and with a model folder of links that leaves out pagekube's Q4_1 file."""

    name = "vLLM"

    def __init__(self, python: str, model_dir: Path, dtype: str, max_num_seqs: int, max_model_len: int):
        import tempfile

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="vllm-peer-"))
        model = self.workdir / "model"
        model.mkdir()
        for f in model_dir.iterdir():
            if f.name != gguf_linears.FILE:  # vLLM would read the blocks as a second checkpoint
                (model / f.name).symlink_to(f.resolve())
        self.log = open(self.workdir / "server.log", "wb")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name",
             BUNDLED_NAME, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
             "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.workdir, env=env)


PEERS = ("llama.cpp", "vLLM CPU")


def measure(name: str, url: str, prompts, max_tokens: int, concurrency: int, max_load: float) -> dict:
    load = wait_idle(max_load)
    row = asyncio.run(run_client(url, BUNDLED_NAME, prompts, max_tokens, concurrency, max_retries=2))
    expected = len(prompts) * max_tokens
    assert row["tokens"] == expected, f"{name}: {row['tokens']} output tokens, expected {expected}"
    row.update(mode=name, load_before=load)
    print(f"{name:10s} C={concurrency:<3d} {row['tok_s']:7.1f} tok/s  ITL p50/p99 {row['itl_p50'] * 1e3:5.0f} / "
          f"{row['itl_p99'] * 1e3:5.0f} ms  TTFT p99 {row['ttft_p99'] * 1e3:6.0f} ms  (load before {load:.2f})",
          flush=True)
    return row


def table(rows: list[dict], levels: list[int]) -> str:
    def at(name, c):
        return next(r for r in rows if r["mode"] == name and r["concurrency"] == c)

    lo, hi = levels[0], levels[-1]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    peers = [p for p in PEERS if p in modes] + [m for m in modes if m not in PEERS and m != "pagekube"]
    head = " | ".join(f"C={c}" for c in levels)
    out = [f"| server | {head} | ITL p50 at C={lo} / C={hi} | ITL p99 at C={hi} | TTFT p99 at C={hi} |",
           "|---" * (len(levels) + 4) + "|"]
    for name in (*peers, "pagekube"):
        if name not in modes:
            continue
        tps = " | ".join(f"{at(name, c)['tok_s']:.1f}" for c in levels)
        out.append(f"| {name} | {tps} | {at(name, lo)['itl_p50'] * 1e3:.0f} ms / {at(name, hi)['itl_p50'] * 1e3:.0f} ms"
                   f" | {at(name, hi)['itl_p99'] * 1e3:.0f} ms | {at(name, hi)['ttft_p99']:.1f} s |")
    for peer in peers:
        if "pagekube" in modes:
            ratios = " | ".join(f"{at('pagekube', c)['tok_s'] / at(peer, c)['tok_s']:.2f}x" for c in levels)
            out.append(f"| pagekube / {peer} | {ratios} | | | |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, style in (("llama.cpp", "s--"), ("vLLM CPU", "^:"), ("pagekube", "o-")):
        mine = sorted((r for r in rows if r["mode"] == name), key=lambda r: r["concurrency"])
        if mine:
            conc = [r["concurrency"] for r in mine]
            axes[0].plot(conc, [r["tok_s"] for r in mine], style, label=name)
            axes[1].plot(conc, [r["itl_p99"] * 1e3 for r in mine], style, label=name)
    axes[0].set(title="output tokens/s", xlabel="concurrent users", xscale="log")
    axes[1].set(title="inter-token latency p99 (ms)", xlabel="concurrent users", xscale="log")
    for ax in axes:
        ax.legend()
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-load", type=float, default=0.6, help="wait for a 1-minute load average below this")
    ap.add_argument("--llama-server", default=None, help="binary (default: the one build_llama_server.sh cached)")
    ap.add_argument("--vllm-python", default=None, help="vLLM's python (default: build_vllm_cpu.sh's, if installed)")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's server out")
    ap.add_argument("--pagekube-args", default="", help="extra `pagekube serve` flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                    help="also serve a second pagekube with this environment (an A/B in the same run), as a peer")
    ap.add_argument("--out", default="docs/bench_peer", help="prefix for the .json results and the .png plot")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check that the script works)")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.prompt_tokens, args.max_tokens, args.max_load = [2], 16, 8, 100.0

    binary = args.llama_server
    if binary is None and not args.no_llama_cpp:
        built = subprocess.run([str(REPO / "bench/build_llama_server.sh")], capture_output=True, text=True,
                               env={**os.environ, "PAGEKUBE_ONLY_IF_BUILT": "1" if args.smoke else ""})
        binary = built.stdout.strip() or None
    top = max(args.concurrency)
    flags = ["--max-num-seqs", str(top), "--disable-log-requests", *args.pagekube_args.split()]
    servers = {"pagekube": ServerProcess(*flags)}
    if args.baseline_env:
        env = dict(kv.split("=", 1) for kv in args.baseline_env)
        servers["pagekube " + " ".join(args.baseline_env)] = ServerProcess(*flags, env=env)
    if binary:
        servers["llama.cpp"] = LlamaServer(binary, bundled_model_file(), top, args.prompt_tokens + args.max_tokens + 16)
    else:
        print("llama-server not built: leaving llama.cpp out", file=sys.stderr)
    vllm = None if args.smoke or args.no_vllm else args.vllm_python or subprocess.run(
        [str(REPO / "bench/build_vllm_cpu.sh")], capture_output=True, text=True,
        env={**os.environ, "PAGEKUBE_ONLY_IF_BUILT": "1"}).stdout.strip() or None
    if vllm:
        from pagekube.engine.model.model_runner import resolve_device, resolve_dtype

        dtype = str(resolve_dtype("auto", resolve_device("auto"))).removeprefix("torch.")  # what pagekube runs
        servers["vLLM CPU"] = VllmServer(vllm, resolve_model_dir(None), dtype, top,
                                         args.prompt_tokens + args.max_tokens + 16)
    elif not args.smoke and not args.no_vllm:
        print("vLLM CPU not installed (bench/build_vllm_cpu.sh): leaving it out", file=sys.stderr)
    rows = []
    try:
        for srv in servers.values():
            srv.wait_ready()
        warm_up = token_prompts(2, args.prompt_tokens, seed=99)
        for name, srv in servers.items():  # first requests pay one-time costs on both
            measure(name, srv.url, warm_up, 4, 2, 100.0)
        for i, c in enumerate(args.concurrency):
            prompts = token_prompts(max(8, 2 * c) if not args.smoke else 2, args.prompt_tokens, seed=c)
            names = list(servers)
            order = names[i % len(names):] + names[:i % len(names)]  # who goes first rotates per level
            for name in order:
                rows.append(measure(name, servers[name].url, prompts, args.max_tokens, c, args.max_load))
    finally:
        for srv in servers.values():
            srv.stop()
    print()
    print(table(rows, args.concurrency))
    if not args.smoke:
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
        plot(rows, Path(args.out + ".png"))


if __name__ == "__main__":
    main()
