# Sourced by e2e/controlplane/build.sh and e2e/node/build.sh: the Kubernetes version go.mod pins, and the ldflags
# that stamp it into every binary built from k8s.io/kubernetes (what `--version` and the API server report).
K8S=v1.35.4
k8s_ldflags() {
  local v=${K8S#v}
  echo "-s -w -X k8s.io/component-base/version.gitVersion=$K8S -X k8s.io/component-base/version.gitMajor=${v%%.*}" \
    "-X k8s.io/component-base/version.gitMinor=$(echo "$v" | cut -d. -f2) -X k8s.io/component-base/version.gitTreeState=clean"
}
