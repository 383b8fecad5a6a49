#!/usr/bin/env bash
# Helm for the chart's tests (tests/unit/deploy/test_helm_chart.py): built with the machine's Go from
# the Go module proxy (helm.sh/helm/v4), installed as /usr/local/bin/helm (root) or
# ~/.local/bin/helm. Idempotent: nothing to do when `helm version` answers v4.
set -euo pipefail
HELM_VERSION="${HELM_VERSION:-v4.3.2}"
log() { printf 'install-helm: %s\n' "$*" >&2; }

if command -v helm >/dev/null 2>&1 && helm version --short 2>/dev/null | grep -q '^v4\.'; then
  exit 0
fi
GO="$(command -v go || true)"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
if [[ -z "$GO" ]]; then
  log "cannot install helm: no Go toolchain (go) on PATH or in /usr/local/go; install Go >= 1.24, or put a helm v4 binary on PATH"
  exit 1
fi
if [[ "$(id -u)" == 0 ]]; then dest=/usr/local/bin; else dest="$HOME/.local/bin"; fi
mkdir -p "$dest"
log "building helm $HELM_VERSION with $("$GO" version | awk '{print $3}') (a few minutes, once)"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
if ! GOBIN="$build" GOFLAGS=-mod=mod "$GO" install "helm.sh/helm/v4/cmd/helm@${HELM_VERSION}" \
    >"$build/log" 2>&1; then
  tail -n 20 "$build/log" >&2
  log "cannot build helm $HELM_VERSION from the Go module proxy (log above)"
  exit 1
fi
install -m 0755 "$build/helm" "$dest/helm"
log "installed $("$dest/helm" version --short) as $dest/helm"
