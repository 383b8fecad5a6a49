#!/usr/bin/env bash
# The rebalance and crash tests of the chaos suite, N times in a row (not in CI):
#
#   scripts/chaos-loop.sh            30 runs of tests/integration/test_chaos.py
#   scripts/chaos-loop.sh 5          5 runs
#   scripts/chaos-loop.sh 10 -x -k rebalance   extra pytest arguments are passed through
#
# Stops at the first failure and keeps its logs: each run's pytest output is
# <logs>/run-NNN.log and its temporary directory (the workers' logs, policy files) is
# <logs>/run-NNN/, deleted when the run passed. <logs> is $LOOPWATCH_CHAOS_LOGS, else
# .cache/chaos-loop/<UTC time>/; the seed of every run is in its log (replay one with
# LOOPWATCH_CHAOS_SEED=<int>). A summary line per run goes to <logs>/summary.txt.
#
# Environment: as scripts/chaos.sh (LOOPWATCH_BOOTSTRAP or KAFKA_PORT for the broker,
# LOOPWATCH_CHAOS_SEED), except that LOOPWATCH_CHAOS_LONG defaults to 0 here: the CI-sized
# variants (about 85 s a run); LOOPWATCH_CHAOS_LONG=1 runs the long ones.
#
# Use a broker port below the kernel's ephemeral range (net.ipv4.ip_local_port_range, often
# 32768-60999): while the crash test restarts the broker, the clients reconnecting to
# 127.0.0.1:<port> can be given <port> itself as their source port and connect to
# themselves (TCP simultaneous open), and the restarted broker then fails with "Address
# already in use". Seen with port 49092 (a 127.0.0.1:49092 <-> 127.0.0.1:49092 socket).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO_ROOT"
PY="${LOOPWATCH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
RUNS="${1:-30}"
shift || true
case "$RUNS" in '' | *[!0-9]*) echo "chaos-loop: runs must be a number, got '$RUNS'" >&2; exit 2 ;; esac
export LOOPWATCH_CHAOS_LONG="${LOOPWATCH_CHAOS_LONG:-0}"
export LOOPWATCH_BOOTSTRAP="${LOOPWATCH_BOOTSTRAP:-127.0.0.1:${KAFKA_PORT:-19092}}"
export KAFKA_PORT="${LOOPWATCH_BOOTSTRAP##*:}"
if read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null &&
  [ "$KAFKA_PORT" -ge "$lo" ] && [ "$KAFKA_PORT" -le "$hi" ]; then
  echo "chaos-loop: warning: broker port $KAFKA_PORT is in the ephemeral range $lo-$hi;" \
    "a broker restart may fail to bind (see the header)" >&2
fi
LOGS="${LOOPWATCH_CHAOS_LOGS:-$REPO_ROOT/.cache/chaos-loop/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$LOGS"

scripts/kafka.sh start >/dev/null
echo "chaos-loop: $RUNS run(s), logs in $LOGS"
for ((i = 1; i <= RUNS; i++)); do
  n="$(printf '%03d' "$i")"
  started=$(date +%s)
  rc=0
  "$PY" -m pytest -p no:cacheprovider -s -ra --basetemp="$LOGS/run-$n" \
    tests/integration/test_chaos.py "$@" >"$LOGS/run-$n.log" 2>&1 || rc=$?
  took=$(($(date +%s) - started))
  seed="$(grep -o 'seed[^0-9]*[0-9]\+' "$LOGS/run-$n.log" | head -1 || true)"
  if [ "$rc" -eq 0 ]; then
    rm -rf "$LOGS/run-$n"
    echo "run $n: passed in ${took} s ($seed)" | tee -a "$LOGS/summary.txt"
  else
    echo "run $n: FAILED (exit $rc) in ${took} s ($seed): $LOGS/run-$n.log" | tee -a "$LOGS/summary.txt"
    tail -n 30 "$LOGS/run-$n.log" >&2
    scripts/kafka.sh start >/dev/null || true  # leave the broker running
    exit "$rc"
  fi
done
scripts/kafka.sh start >/dev/null || true
echo "chaos-loop: $RUNS run(s) in a row passed"
