#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the peer in bench/peer_bench.py) from the llama.cpp sources vendored in
# llama-cpp-python's PyPI sdist, once per machine, into ~/.cache/pagekube/llama-server/<version>/ (about 11 min
# on 2 cores). Prints the binary's path. Nothing here is part of pagekube; it is only what we measure against.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
# Instruction sets from /proc/cpuinfo rather than -march=native, which also turns on AMX where the CPU lists it:
# llama.cpp's AMX kernels (Q4_1 here) die with SIGILL at their first `tilezero` in VMs that list AMX without
# enabling it (seen on this project's Xeon machine), so AMX stays off. The cache is keyed by the set.
ISA=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
for flag in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
    avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if grep -qw "${flag%%:*}" /proc/cpuinfo; then ISA+=("-DGGML_${flag#*:}=ON"); else ISA+=("-DGGML_${flag#*:}=OFF"); fi
done
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}/llama-server/$VERSION-$(echo "${ISA[*]}" | sha256sum | cut -c1-8)
BIN=$CACHE/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
[ -z "${PAGEKUBE_ONLY_IF_BUILT:-}" ] || exit 0   # the smoke test: use it if built, never build it
PIP=${PIP:-$(dirname "$0")/../.venv/bin/pip}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF "${ISA[@]}" >&2
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$CACHE"
cp "$WORK/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
