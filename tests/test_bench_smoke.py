"""The benchmark scripts still run (smoke mode: tiny sizes; timings are never asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.k8s_tools import REPO


def test_sampler_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/sampler.py"), "--smoke"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| flat |")]
    assert len(rows) == 4 and all(line.rstrip().endswith("x |") for line in rows)


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "bench/gpu_check.sh")]).returncode == 0


def test_spec_decode_benchmark_smoke():
    """Also checks, on real prompts, that greedy output is identical with speculation (the script asserts it)."""
    out = subprocess.run([sys.executable, str(REPO / "bench/spec_decode.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| copy-heavy", "| free chat"))]
    assert len(rows) == 2 and all("x |" in line for line in rows)


def test_tensor_parallel_comm_benchmark_smoke():
    """Also checks TP=2 greedy output equals one rank's on the tiny model (the script asserts it)."""
    out = subprocess.run([sys.executable, str(REPO / "bench/tp_comm.py"), "--tiny", "--tp", "2", "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "greedy output equals one rank's: yes" in out.stdout and "| all_reduce |" in out.stdout


def test_pipeline_parallel_comm_benchmark_smoke():
    """PP=2 and TP=2 against one process on a tiny model (the script asserts equal greedy output in every run)."""
    out = subprocess.run([sys.executable, str(REPO / "bench/pp_comm.py"), "--smoke"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "equals one process's in every run: yes" in out.stdout
    assert "| PP=2 | 2 |" in out.stdout and "1 send, 1 recv" in out.stdout and "| TP=2 | 2 |" in out.stdout


def test_peer_benchmark_smoke():
    """pagekube serve (and llama.cpp's llama-server where bench/build_llama_server.sh already built it) on the same
    token-id prompts; the script asserts every stream's exact output token count."""
    out = subprocess.run([sys.executable, str(REPO / "bench/peer_bench.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("| pagekube | ") for line in out.stdout.splitlines()), out.stdout


def test_peer_table_compares_pagekube_with_each_peer():
    sys.path.insert(0, str(REPO))
    from bench.peer_bench import table

    def row(mode, c, tok_s):
        return {"mode": mode, "concurrency": c, "tok_s": tok_s, "itl_p50": 0.01, "itl_p99": 0.1, "ttft_p99": 1.0}

    rows = [row(m, c, t * c) for m, t in (("pagekube", 90), ("llama.cpp", 60), ("vLLM CPU", 30)) for c in (1, 32)]
    lines = table(rows, [1, 32]).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| llama.cpp", "| vLLM CPU", "| pagekube",
                                                            "| pagekube / llama.cpp", "| pagekube / vLLM CPU"]
    assert lines[-1].startswith("| pagekube / vLLM CPU | 3.00x | 3.00x |")


def test_peer_install_scripts_parse():
    for script in ("bench/build_llama_server.sh", "bench/build_vllm_cpu.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / script)]).returncode == 0, script


def test_offline_vs_hf_benchmark_smoke(tmp_path):
    """Both sides produce the requested output tokens, each mode in its own process."""
    out = subprocess.run([sys.executable, str(REPO / "bench/offline_vs_hf.py"), "--requests", "2", "--max-output", "17",
                          "--single", "1", "--out", str(tmp_path / "offline")],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith(("| 32 |", "| 1 |"))]
    tokens = {(r[1].strip(), r[2].strip()): int(r[3]) for r in rows}
    assert len(tokens) == 4 and tokens[("32", "hf")] == tokens[("32", "pagekube")] >= 32
    assert tokens[("1", "hf")] == tokens[("1", "pagekube")] >= 16


def test_fused_ops_benchmark_smoke():
    from pagekube.kernels import cpu_ops

    if not cpu_ops.cpu_supports_bf16_dot():
        pytest.skip("the fused ops need AVX512_BF16")
    out = subprocess.run([sys.executable, str(REPO / "bench/fused_ops_ab.py"), "--batch", "2", "--steps", "16"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("batch 2: fused ops on ") and "off" in out.stdout


def test_cpu_linears_benchmark_smoke():
    from pagekube.kernels import cpu_ops

    if not cpu_ops.cpu_supports_bf16_dot():
        pytest.skip("the kernels need AVX512_BF16")
    out = subprocess.run([sys.executable, str(REPO / "bench/cpu_linears.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "1 rows: q4_1 kernel" in out.stdout and "32 sequences, decode step: batch invariant" in out.stdout
    assert "lm_head 1 rows: q8_0 kernel" in out.stdout
    assert ("q4_1 amx" in out.stdout) == cpu_ops.cpu_supports_amx(), out.stdout


def test_batch_invariance_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/batch_invariance.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| batch of 3 |", "| prefix-cache hit |"))]
    assert len(rows) == 2 and all(line.split("|")[2].strip().isdigit() for line in rows), out.stdout


def test_step_profile_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/step_profile.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 and all(len(line.split("|")) == 10 for line in rows), out.stdout


def test_embeddings_benchmark_smoke():
    """sentence-transformers and pagekube serve both embed every text (the script checks each side's shape)."""
    out = subprocess.run([sys.executable, str(REPO / "bench/embeddings.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| sentence-transformers", "| pagekube"))]
    assert len(rows) == 4 and all(float(r.split("|")[5]) >= 0.999 for r in rows), out.stdout


def test_lora_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/lora.py"), "--smoke"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| --enable-lora")]
    assert len(rows) == 3 and all(line.count("%") == 2 for line in rows)


def test_lora_no_adapter_cost_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/lora.py"), "--smoke", "--paired", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 and all(line.count("%") == 5 for line in rows), out.stdout


def test_quantized_benchmark_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/quantized.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| unquantized", "| w4a16-g64"))]
    assert len(rows) == 2 and all(line.rstrip().endswith("|") for line in rows)


def test_prefix_routing_benchmark_smoke():
    """Both strategies run against real engines behind the rendered NGINX; every request is answered."""
    out = subprocess.run([sys.executable, str(REPO / "bench/routing.py"), "--smoke"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "| LeastConnections |" in line or "| PrefixHash |" in line]
    assert len(rows) == 2, out.stdout


def test_stream_read_probe_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench/stream_read.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "| Q4_1 GGUF" in out.stdout and " ms |" in out.stdout
