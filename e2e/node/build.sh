#!/usr/bin/env bash
# Builds (once per machine) the node half of a real single-node cluster, next to the control plane's cache:
#   kubelet, kube-scheduler, kube-proxy  <- the same k8s.io/kubernetes wrapper module as e2e/controlplane (go.mod there)
#   CoreDNS                             <- github.com/coredns/coredns (plain `go install`: no replace directives)
#   KEDA operator + metrics adapter     <- github.com/kedacore/keda/v2 (its go.mod has a replace: built inside a copy)
#   LeaderWorkerSet controller          <- sigs.k8s.io/lws (v0.10.0 is not on the proxy; v0.9.0 is the newest there)
#   argocd-health                       <- e2e/argocd: Argo CD's settings + Lua health code (github.com/argoproj/argo-cd/v3)
#   prometheus-operator + config-reloader <- github.com/prometheus-operator/prometheus-operator v0.93.0, with its
#                                          bundle.yaml (CRDs, RBAC, Deployment); its go.mod replaces its pkg/apis and
#                                          pkg/client modules with folders the module zip leaves out: built against
#                                          their published versions (v0.95.x is not on the proxy, nor v0.94.0's
#                                          pkg/client)
#   Prometheus with Kubernetes discovery <- github.com/prometheus/prometheus v0.316.0 (= Prometheus 3.16.0) with the
#                                          build tags that keep kubernetes_sd only (the other clouds' SDKs are most
#                                          of its build time) and no embedded web UI assets (the API is what is used)
# Run by e2e/node/images.sh (and so by scripts/test-deps.sh).
# Output (stdout): KEY=path lines, like e2e/controlplane/build.sh.
set -euo pipefail
cd "$(dirname "$0")/../controlplane"
. ./k8s-version.sh
COREDNS=v1.14.7
KEDA=v2.21.0  # the version whose CRDs e2e/controlplane/build.sh fetches
LWS=v0.9.0    # likewise
PROM_OP=v0.93.0      # the version whose CRDs e2e/controlplane/build.sh fetches
PROMETHEUS=v0.316.0 PROMETHEUS_RELEASE=v3.16.0  # the Go module's versions: v0.3MM.P is release 3.MM.P
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}
BIN=$CACHE/node/k8s-$K8S-coredns-$COREDNS
log() { echo "[node] $*" >&2; }
# A writable copy of a module's source, to build inside (a go.mod with `replace` directives cannot be `go install`ed).
module_copy() { # MODULE@VERSION
  local src tmp
  # `|| return`: errexit does not reach inside the $(...) this runs in, and an empty $src would copy /
  src=$(go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])') || return 1
  [ -d "$src" ] || return 1
  tmp=$(mktemp -d) && cp -r "$src/." "$tmp/" && chmod -R u+w "$tmp" && echo "$tmp"
}

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
KEDA_BIN=$CACHE/node/keda-$KEDA
if [ ! -x "$KEDA_BIN/keda-adapter" ]; then
  log "building the KEDA $KEDA operator and metrics adapter into $KEDA_BIN (about 12 minutes, once)"
  start=$SECONDS
  tmp=$(module_copy "github.com/kedacore/keda/v2@$KEDA")
  mkdir -p "$KEDA_BIN.tmp"
  (cd "$tmp" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' -o "$KEDA_BIN.tmp/keda-operator" ./cmd/operator \
    && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' -o "$KEDA_BIN.tmp/keda-adapter" ./cmd/adapter)
  cp "$tmp"/config/crd/bases/*.yaml "$KEDA_BIN.tmp/"
  rm -rf "$tmp" "$KEDA_BIN" && mv "$KEDA_BIN.tmp" "$KEDA_BIN"
  log "KEDA built in $((SECONDS - start)) s"
fi
LWS_BIN=$CACHE/node/lws-$LWS
if [ ! -f "$LWS_BIN/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ]; then
  log "building the LeaderWorkerSet $LWS controller into $LWS_BIN (a few minutes, once)"
  start=$SECONDS
  tmp=$(module_copy "sigs.k8s.io/lws@$LWS")
  mkdir -p "$LWS_BIN.tmp"
  (cd "$tmp" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' -o "$LWS_BIN.tmp/lws-manager" ./cmd)
  cp "$tmp"/config/crd/bases/*.yaml "$LWS_BIN.tmp/"  # the manager also runs DisaggregatedSet: it needs both CRDs
  rm -rf "$tmp" "$LWS_BIN" && mv "$LWS_BIN.tmp" "$LWS_BIN"
  log "LeaderWorkerSet built in $((SECONDS - start)) s"
fi
# Rebuilt when its source or pinned modules change: the hash of e2e/argocd names the cache folder.
ARGOCD_BIN=$CACHE/node/argocd-health-$(cat ../argocd/go.mod ../argocd/go.sum ../argocd/main.go | sha256sum | cut -c1-12)
if [ ! -x "$ARGOCD_BIN/argocd-health" ]; then
  log "building argocd-health (Argo CD $(awk '$1 == "github.com/argoproj/argo-cd/v3" {print $2}' ../argocd/go.mod)) into $ARGOCD_BIN (a few minutes, once)"
  start=$SECONDS
  (cd ../argocd && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$ARGOCD_BIN.tmp/argocd-health" .)
  rm -rf "$ARGOCD_BIN" && mv "$ARGOCD_BIN.tmp" "$ARGOCD_BIN"
  log "argocd-health built in $((SECONDS - start)) s"
fi
MONITORING_BIN=$CACHE/node/prometheus-operator-$PROM_OP-prometheus-$PROMETHEUS
if [ ! -x "$MONITORING_BIN/prometheus" ]; then
  log "building prometheus-operator $PROM_OP and Prometheus $PROMETHEUS (Kubernetes discovery only) into $MONITORING_BIN (several minutes, once)"
  start=$SECONDS
  mkdir -p "$MONITORING_BIN.tmp"
  tmp=$(module_copy "github.com/prometheus-operator/prometheus-operator@$PROM_OP")
  (cd "$tmp" && go mod edit -dropreplace=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring \
      -dropreplace=github.com/prometheus-operator/prometheus-operator/pkg/client \
    && CGO_ENABLED=0 GOWORK=off GOFLAGS=-buildvcs=false go build -mod=mod -trimpath -ldflags '-s -w' \
      -o "$MONITORING_BIN.tmp/" ./cmd/operator ./cmd/prometheus-config-reloader)
  cp "$tmp/bundle.yaml" "$MONITORING_BIN.tmp/"
  rm -rf "$tmp"
  log "prometheus-operator built in $((SECONDS - start)) s"
  tmp=$(module_copy "github.com/prometheus/prometheus@$PROMETHEUS")
  # GOWORK=off: its go.work names modules the proxy's zip leaves out
  (cd "$tmp" && CGO_ENABLED=0 GOWORK=off GOFLAGS=-buildvcs=false go build -trimpath -ldflags '-s -w' \
    -tags remove_all_sd,enable_kubernetes_sd -o "$MONITORING_BIN.tmp/prometheus" ./cmd/prometheus)
  rm -rf "$tmp" "$MONITORING_BIN" && mv "$MONITORING_BIN.tmp" "$MONITORING_BIN"
  log "prometheus-operator and Prometheus built in $((SECONDS - start)) s"
fi
echo "PAGEKUBE_NODE_BIN=$BIN"
echo "PAGEKUBE_KEDA_BIN=$KEDA_BIN"
echo "PAGEKUBE_LWS_BIN=$LWS_BIN"
echo "PAGEKUBE_MONITORING_BIN=$MONITORING_BIN"
echo "PAGEKUBE_PROM_OP_VERSION=$PROM_OP"
echo "PAGEKUBE_PROMETHEUS_VERSION=$PROMETHEUS_RELEASE"
echo "PAGEKUBE_ARGOCD_HEALTH=$ARGOCD_BIN/argocd-health"
