#!/usr/bin/env bash
# Builds the images the real-node suite runs, with no registry anywhere (once per machine; the project's own images
# again whenever their sources change). Each lands as a docker-archive tarball that `ctr images import` takes.
#   localhost/pause:1               <- e2e/node/pause (a 20-line Go sandbox process)
#   localhost/debian:bookworm       <- debootstrap bookworm minbase + python3/pip/venv + the host's CA certificates
#   localhost/nginx:sid             <- debootstrap sid minbase + nginx (>= 1.27.3: the operator's `server ... resolve`)
#   localhost/coredns:$COREDNS      <- the CoreDNS binary from build.sh
#   localhost/prometheus-operator:$V <- prometheus-operator and its config-reloader from build.sh (one image, both
#                                      binaries at the paths upstream's images use)
#   localhost/prometheus:$V         <- Prometheus (Kubernetes discovery) from build.sh
#   localhost/pagekube-engine:cpu   <- images/engine/Dockerfile, BASE=localhost/debian:bookworm (buildah bud)
#   localhost/pagekube-operator:dev <- images/operator/Dockerfile, its python:3.12-slim served by the bookworm base
# Output (stdout): build.sh's KEY=path lines, then PAGEKUBE_NODE_IMAGES=dir (one NAME.tar per image).
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd ../.. && pwd)
binaries=$(./build.sh)
eval "$binaries"   # PAGEKUBE_NODE_BIN (CoreDNS), PAGEKUBE_KEDA_BIN, PAGEKUBE_MONITORING_BIN
CACHE=${PAGEKUBE_CACHE:-$HOME/.cache/pagekube}
OUT=$CACHE/node/images
STORE=$CACHE/node/buildah   # buildah's own storage (no daemon): the base images the Dockerfiles build FROM
B=(buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs)
PY=python3
log() { echo "[images] $*" >&2; }
mkdir -p "$OUT"
archive() { # ROOTFS NAME TAG ENTRYPOINT-JSON [ENV...]
  local rootfs=$1 name=$2 tag=$3 entry=$4; shift 4
  (cd "$REPO" && $PY -c 'import json, sys; from pathlib import Path; from e2e.node.image_archive import write_image_archive
print(write_image_archive(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:]))' \
    "$rootfs" "$OUT/$name.tar.tmp" "$tag" "$entry" "$@") >/dev/null
  mv "$OUT/$name.tar.tmp" "$OUT/$name.tar"
}
debian_rootfs() { # SUITE DIR PACKAGES
  local suite=$1 dir=$2 packages=$3
  rm -rf "$dir" && mkdir -p "$CACHE/node/debootstrap-cache"
  debootstrap --variant=minbase --include="$packages" --cache-dir="$CACHE/node/debootstrap-cache" \
    "$suite" "$dir" http://deb.debian.org/debian >/dev/null
  # This network intercepts TLS: the image trusts the host's extra CAs too, or pip and apt over https fail.
  cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$dir" update-ca-certificates >/dev/null 2>&1 || true
  chroot "$dir" apt-get clean
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin
  : > "$dir/etc/resolv.conf"
}
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
start=$SECONDS

if [ ! -f "$OUT/pause.tar" ]; then
  log "pause"
  tmp=$(mktemp -d)
  (cd pause && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$tmp/pause" .)
  archive "$tmp" pause localhost/pause:1 '["/pause"]'
  rm -rf "$tmp"
fi

COREDNS_TAG=$(basename "$PAGEKUBE_NODE_BIN" | sed 's/.*coredns-//')
if [ ! -f "$OUT/coredns.tar" ]; then
  log "coredns $COREDNS_TAG"
  tmp=$(mktemp -d) && cp "$PAGEKUBE_NODE_BIN/coredns" "$tmp/"
  archive "$tmp" coredns "localhost/coredns:$COREDNS_TAG" '["/coredns"]'
  rm -rf "$tmp"
fi

PROM_OP_TAG=$PAGEKUBE_PROM_OP_VERSION PROMETHEUS_TAG=$PAGEKUBE_PROMETHEUS_VERSION
MON=$(basename "$PAGEKUBE_MONITORING_BIN")
if [ "$(cat "$OUT/monitoring.src" 2>/dev/null)" != "$MON" ] || [ ! -f "$OUT/prometheus.tar" ]; then
  log "prometheus-operator $PROM_OP_TAG and prometheus $PROMETHEUS_TAG"
  tmp=$(mktemp -d) && mkdir "$tmp/bin"
  cp "$PAGEKUBE_MONITORING_BIN/operator" "$PAGEKUBE_MONITORING_BIN/prometheus-config-reloader" "$tmp/bin/"
  archive "$tmp" prometheus-operator "localhost/prometheus-operator:$PROM_OP_TAG" '["/bin/operator"]'
  rm -rf "$tmp" && tmp=$(mktemp -d) && mkdir "$tmp/bin" "$tmp/prometheus" && chmod 777 "$tmp/prometheus"
  cp "$PAGEKUBE_MONITORING_BIN/prometheus" "$tmp/bin/"
  archive "$tmp" prometheus "localhost/prometheus:$PROMETHEUS_TAG" '["/bin/prometheus"]'
  rm -rf "$tmp"
  echo "$MON" > "$OUT/monitoring.src"
fi

if [ ! -f "$OUT/debian.tar" ]; then
  log "debian bookworm base (debootstrap, about 2 minutes)"
  debian_rootfs bookworm "$CACHE/node/rootfs-bookworm" python3,python3-pip,python3-venv,ca-certificates
  ln -sf python3 "$CACHE/node/rootfs-bookworm/usr/bin/python"
  archive "$CACHE/node/rootfs-bookworm" debian localhost/debian:bookworm '["/bin/bash"]' "$PATH_ENV" \
    PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
  rm -rf "$CACHE/node/rootfs-bookworm"
fi

if [ ! -f "$OUT/nginx.tar" ]; then
  log "nginx from Debian sid (debootstrap)"
  debian_rootfs sid "$CACHE/node/rootfs-nginx" nginx
  # nginx runs as a non-root user with its prefix in /tmp (operator/nginx.py): the default pid/log paths stay unused
  archive "$CACHE/node/rootfs-nginx" nginx localhost/nginx:sid '["nginx"]' "$PATH_ENV"
  rm -rf "$CACHE/node/rootfs-nginx"
fi

# The project's images: rebuilt when what they COPY (or their Dockerfile) changes.
src_hash=$(cd "$REPO" && git ls-files -co --exclude-standard pyproject.toml README.md pagekube engine operator images \
  | sort | xargs sha256sum | sha256sum | cut -c1-16)
build() { # NAME TAG DOCKERFILE [bud args...]
  local name=$1 tag=$2 dockerfile=$3; shift 3
  [ "$(cat "$OUT/$name.src" 2>/dev/null)" = "$src_hash" ] && [ -f "$OUT/$name.tar" ] && return 0
  log "$tag from $dockerfile (buildah bud)"
  local t0=$SECONDS
  "${B[@]}" bud --isolation chroot --pull=never --layers=false -q -t "$tag" -f "$REPO/$dockerfile" "$@" "$REPO" >/dev/null
  rm -f "$OUT/$name.tar"
  "${B[@]}" push -q "$tag" "docker-archive:$OUT/$name.tar:$tag" >/dev/null
  "${B[@]}" rmi -f "$tag" >/dev/null
  echo "$src_hash" > "$OUT/$name.src"
  log "$tag built in $((SECONDS - t0)) s ($(du -h "$OUT/$name.tar" | cut -f1))"
}
if [ ! -f "$STORE/base.stamp" ] || [ "$OUT/debian.tar" -nt "$STORE/base.stamp" ]; then
  "${B[@]}" rmi -a -f >/dev/null 2>&1 || true
  "${B[@]}" pull -q "docker-archive:$OUT/debian.tar" >/dev/null
  "${B[@]}" tag localhost/debian:bookworm docker.io/library/python:3.12-slim
  touch "$STORE/base.stamp"
fi
build operator localhost/pagekube-operator:dev images/operator/Dockerfile
# torch==2.13.0: on PyPI that is the CUDA build (CUDA libraries included; the engine runs it on the CPU).
build engine localhost/pagekube-engine:cpu images/engine/Dockerfile \
  --build-arg BASE=localhost/debian:bookworm --build-arg TORCH=torch==2.13.0

[ $((SECONDS - start)) -gt 5 ] && log "images ready in $((SECONDS - start)) s"
echo "$binaries"
echo "PAGEKUBE_NODE_IMAGES=$OUT"
echo "PAGEKUBE_PROMETHEUS_OPERATOR_IMAGE=localhost/prometheus-operator:$PROM_OP_TAG"
echo "PAGEKUBE_PROMETHEUS_IMAGE=localhost/prometheus:$PROMETHEUS_TAG"
