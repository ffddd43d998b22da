#!/usr/bin/env bash
# What the tests start for real besides Python: nginx and Prometheus/promtool (Debian packages), and the control
# plane + kubectl/helm + third-party CRDs (built or fetched once into ~/.cache/pagekube by e2e/controlplane/build.sh).
# Idempotent and quick once done.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v nginx >/dev/null || missing+=(nginx-light)
command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  echo "[test-deps] apt-get install ${missing[*]}" >&2
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian packages start system services; the tests start their own instances on free ports.
  $SUDO systemctl disable --now nginx prometheus >/dev/null 2>&1 || true
  $SUDO pkill -x prometheus 2>/dev/null || true
fi
./e2e/controlplane/build.sh >/dev/null
