#!/usr/bin/env bash
# Make sure the system tools that loopwatch's dev loop, tests and CI use are installed:
#   java (JDK >= 17), mvn                      -> the local Kafka broker (scripts/kafka.sh)
#   prometheus, promtool                        -> Debian package `prometheus`
#   alertmanager, amtool                        -> Debian package `prometheus-alertmanager`
#   docker-compose (config validation only)     -> Debian package `docker-compose`
#   helm (the chart's tests)                    -> built with Go (scripts/install-helm.sh)
#                                                  (Debian names the binary prometheus-alertmanager;
#                                                  an `alertmanager` symlink is added when missing)
# Idempotent and fast (no apt at all) when everything is present. Installs with apt-get,
# non-interactively, `apt-get update` at most once, without recommended packages, and
# without starting or enabling any system service (a temporary policy-rc.d denies starts;
# services the install registered are disabled again; anything it still started is stopped).
#
# Environment: INSTALL_TOOLS_DRY_RUN=1 only prints what is missing (exit 1 if anything is).
set -euo pipefail

SUDO=""
if [[ "$(id -u)" != 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-tools.sh: needs root or sudo" >&2; exit 1; }
  SUDO="sudo"
fi

log() { printf 'install-tools: %s\n' "$*" >&2; }

java_major() {
  local v
  v="$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')" || return 1
  [[ -n "$v" ]] || return 1
  local major="${v%%.*}"
  [[ "$major" == "1" ]] && major="$(cut -d. -f2 <<<"$v")"
  printf '%s\n' "$major"
}

have_jdk17() {
  command -v java >/dev/null 2>&1 || return 1
  local m
  m="$(java_major)" || return 1
  [[ "$m" =~ ^[0-9]+$ && "$m" -ge 17 ]]
}

alertmanager_bin() {
  if command -v alertmanager >/dev/null 2>&1; then command -v alertmanager
  elif command -v prometheus-alertmanager >/dev/null 2>&1; then command -v prometheus-alertmanager
  else return 1
  fi
}

# helm (the chart's tests) is built from the Go module proxy, not a Debian package
"$(dirname "$0")/install-helm.sh"

# package to install -> is it needed?
missing=()
have_jdk17 || missing+=("default-jdk-headless")
command -v mvn >/dev/null 2>&1 || missing+=("maven")
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } \
  || missing+=("prometheus")
{ alertmanager_bin >/dev/null && command -v amtool >/dev/null 2>&1; } \
  || missing+=("prometheus-alertmanager")
# docker-compose (v1, Debian) only validates docker-compose.yml in the tests; no engine runs.
command -v docker-compose >/dev/null 2>&1 || missing+=("docker-compose")

ensure_alertmanager_link() {
  if ! command -v alertmanager >/dev/null 2>&1 && [[ -x /usr/bin/prometheus-alertmanager ]]; then
    $SUDO ln -sf /usr/bin/prometheus-alertmanager /usr/local/bin/alertmanager
    log "linked /usr/local/bin/alertmanager -> /usr/bin/prometheus-alertmanager"
  fi
}

if ((${#missing[@]} == 0)); then
  ensure_alertmanager_link
  log "all present: java $(java_major), $(mvn -v 2>/dev/null | head -n1 | sed 's/\x1b\[[0-9;]*m//g'), $(prometheus --version 2>&1 | head -n1), $("$(alertmanager_bin)" --version 2>&1 | head -n1)"
  exit 0
fi

if [[ "${INSTALL_TOOLS_DRY_RUN:-0}" == 1 ]]; then
  log "missing: ${missing[*]}"
  exit 1
fi

log "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive

# Deny service starts during the install (invoke-rc.d honours policy-rc.d; exit 101 = "action
# forbidden"). Keep an existing policy-rc.d; remove ours afterwards.
POLICY=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e "$POLICY" ]]; then
  printf '#!/bin/sh\n# written by loopwatch scripts/install-tools.sh for the duration of an install\nexit 101\n' \
    | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"
  own_policy=1
fi
cleanup() { if ((own_policy)); then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

# pids of the daemons these packages ship (matched by executable, comm names are truncated)
service_pids() {
  local d exe
  for d in /proc/[0-9]*; do
    exe="$(readlink "$d/exe" 2>/dev/null)" || continue
    case "$exe" in
      /usr/bin/prometheus|/usr/bin/prometheus-alertmanager|/usr/bin/prometheus-node-exporter)
        printf '%s\n' "${d#/proc/}" ;;
    esac
  done
}
# services that were already running before we touched anything are not ours to stop
running_before="$(service_pids)"

apt_opts=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
          --no-install-recommends)
# `apt-get update` once, and only because something is missing
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install "${apt_opts[@]}" "${missing[@]}" >/tmp/loopwatch-install-tools.log 2>&1 || {
  tail -n 30 /tmp/loopwatch-install-tools.log >&2
  log "apt-get install failed (full log: /tmp/loopwatch-install-tools.log)"
  exit 1
}

# Undo the packages' service enablement: nothing here should come up at boot by itself.
for svc in prometheus prometheus-alertmanager; do
  for pkg in "${missing[@]}"; do
    [[ "$pkg" == "$svc" ]] || continue
    if command -v deb-systemd-helper >/dev/null 2>&1; then
      $SUDO deb-systemd-helper disable "$svc.service" >/dev/null 2>&1 || true
    fi
    if [[ -x "/etc/init.d/$svc" ]] && command -v update-rc.d >/dev/null 2>&1; then
      $SUDO update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
  done
done

# If a postinst still started a daemon (e.g. on a host where policy-rc.d was bypassed), stop
# only the processes that appeared during this install.
for pid in $(service_pids); do
  grep -qx "$pid" <<<"$running_before" && continue
  args="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)"
  # a packaged service runs with the package's config (/etc/prometheus/...) or none at all;
  # anything pointed at another config is somebody's test process: leave it alone
  if [[ "$args" != *--config.file* || "$args" == *--config.file*/etc/prometheus/* ]]; then
    log "stopping service process started by the install: pid $pid ($(readlink "/proc/$pid/exe" 2>/dev/null))"
    $SUDO kill -TERM "$pid" 2>/dev/null || true
  fi
done

ensure_alertmanager_link
hash -r
have_jdk17 || { log "java >= 17 still missing after install"; exit 1; }
for t in mvn prometheus promtool amtool alertmanager; do
  command -v "$t" >/dev/null 2>&1 || { log "$t still missing after install"; exit 1; }
done
log "installed: ${missing[*]}"
