#!/usr/bin/env bash
# The first-GPU check, in one go (under 8 minutes on one GPU): the Triton kernel tests compiled for the device (not
# interpreted), greedy-equals-HF on CUDA in float32 and bfloat16, the kernel benchmarks (attention, quantized
# GEMM), and a short serving sweep of `pagekube serve` on the bundled model at 1 / 32 / 128 concurrent users.
#   bench/gpu_check.sh OUT_DIR        # writes OUT_DIR/gpu_check.json (a summary) and OUT_DIR/gpu_check.log
# Run from the repository root after ./scripts/setup.sh (or with PY=python pointing at an environment that has
# pagekube[dev]). Each step's exit status is recorded; the script goes on after a failure and exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
LOG=$OUT/gpu_check.log
: > "$LOG"
unset TRITON_INTERPRET
declare -A RC SECS
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  RC[$name]=$?
  SECS[$name]=$((SECONDS - start))
  echo "=== $name: rc=${RC[$name]} in ${SECS[$name]} s" | tee -a "$LOG"
}
nvidia-smi >>"$LOG" 2>&1 || echo "no nvidia-smi" >>"$LOG"
step kernel_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda_graphs.py
step parity_float32 90 "$PY" bench/gpu_parity.py --device cuda --dtype float32 --out "$OUT/parity-float32.json"
step parity_bfloat16 90 "$PY" bench/gpu_parity.py --device cuda --dtype bfloat16 --out "$OUT/parity-bfloat16.json"
step gpu_kernels 90 "$PY" bench/gpu_kernels.py
step gpu_quant 60 "$PY" bench/gpu_quant.py
step serve_sweep 150 "$PY" bench/serve_bench.py --requests 128 --max-tokens 64 --concurrency 1 32 128 --out "$OUT/serve"
# The same sweep without CUDA graphs: what replaying decode steps saves (engine/model/cuda_graphs.py).
step serve_eager 150 "$PY" bench/serve_bench.py --requests 128 --max-tokens 64 --concurrency 1 32 128 \
  --server-flag=--enforce-eager --out "$OUT/serve-eager"
STEPS="kernel_tests parity_float32 parity_bfloat16 gpu_kernels gpu_quant serve_sweep serve_eager"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then  # tensor parallelism over NCCL: greedy == 1 GPU, comm cost
  step tp2 120 "$PY" bench/tp_comm.py --tiny --tp 2 --batch 32 --max-tokens 32
  STEPS="$STEPS tp2"
fi
{
  echo "{"
  first=1
  for name in $STEPS; do
    [ $first = 1 ] || echo ","
    first=0
    printf '  "%s": {"rc": %s, "seconds": %s}' "$name" "${RC[$name]}" "${SECS[$name]}"
  done
  echo ""
  echo "}"
} > "$OUT/gpu_check.json"
cat "$OUT/gpu_check.json"
for name in "${!RC[@]}"; do [ "${RC[$name]}" = 0 ] || exit 1; done
