#!/usr/bin/env bash
# What the tests start for real besides Python: nginx (with njs) and Prometheus/promtool (Debian packages; g++ for the CPU extension), the control
# plane + kubectl/helm + third-party CRDs (built or fetched once into ~/.cache/pagekube by e2e/controlplane/build.sh), and the real
# node: containerd, runc, CNI plugins, buildah, debootstrap (Debian), its binaries and images (e2e/node/images.sh).
# Idempotent and quick once done.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v nginx >/dev/null || missing+=(nginx-light)
[ -f /usr/lib/nginx/modules/ngx_http_js_module.so ] || missing+=(libnginx-mod-http-js)  # njs: PrefixHash's router
command -v promtool >/dev/null || missing+=(prometheus)
command -v g++ >/dev/null || missing+=(g++)  # builds the CPU extension (pagekube/kernels/*.cpp)
# The real node (e2e/node): container runtime, CNI plugins, kube-proxy's tools, and the image builders
for tool in containerd runc iptables conntrack debootstrap buildah; do command -v $tool >/dev/null || missing+=($tool); done
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  echo "[test-deps] apt-get install ${missing[*]}" >&2
  $SUDO apt-get update -qq >/dev/null
  # The tests start their own nginx and Prometheus on free ports: keep the packages from starting services at
  # install (policy-rc.d exit 101 = "not allowed", Debian's way), so nothing else on the machine is stopped.
  had_policy=$([ -e /usr/sbin/policy-rc.d ] && echo 1 || echo 0)
  [ "$had_policy" = 1 ] || printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$had_policy" = 1 ] || $SUDO rm -f /usr/sbin/policy-rc.d
fi
./e2e/controlplane/build.sh >/dev/null
./e2e/node/images.sh >/dev/null   # kubelet, kube-scheduler, kube-proxy, CoreDNS (build.sh) and the node's images
