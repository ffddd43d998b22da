#!/usr/bin/env bash
# The test command: lint, then the whole suite. pytest's "no tests collected" (exit 5) counts as failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
