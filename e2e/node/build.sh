#!/usr/bin/env bash
# Builds (once per machine) the node half of a real single-node cluster, next to the control plane's cache:
#   kubelet, kube-scheduler, kube-proxy  <- the same k8s.io/kubernetes wrapper module as e2e/controlplane (go.mod there)
#   CoreDNS                             <- github.com/coredns/coredns (plain `go install`: no replace directives)
# Run by e2e/node/images.sh (and so by scripts/test-deps.sh).
# Output (stdout): KEY=path lines, like e2e/controlplane/build.sh.
set -euo pipefail
cd "$(dirname "$0")/../controlplane"
. ./k8s-version.sh
COREDNS=v1.14.7
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}
BIN=$CACHE/node/k8s-$K8S-coredns-$COREDNS
log() { echo "[node] $*" >&2; }

if [ ! -x "$BIN/coredns" ]; then
  log "building kubelet, kube-scheduler, kube-proxy $K8S and CoreDNS $COREDNS into $BIN (several minutes, once)"
  start=$SECONDS
  mkdir -p "$BIN.tmp"
  CGO_ENABLED=0 go build -trimpath -ldflags "$(k8s_ldflags)" -o "$BIN.tmp/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-proxy
  log "kubelet, kube-scheduler, kube-proxy built in $((SECONDS - start)) s"
  CGO_ENABLED=0 GOBIN="$BIN.tmp" GOFLAGS=-buildvcs=false go install -trimpath -ldflags '-s -w' "github.com/coredns/coredns@$COREDNS"
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
  log "built in $((SECONDS - start)) s"
fi
echo "PAGEKUBE_NODE_BIN=$BIN"
