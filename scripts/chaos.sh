#!/usr/bin/env bash
# Reliability and security suite against the local broker, long variants (`make chaos`):
#
#   scripts/chaos.sh                 all five files with LOOPWATCH_CHAOS_LONG=1
#   scripts/chaos.sh -k rebalance    extra pytest arguments are passed through
#
#   tests/integration/test_chaos.py            ~220k spans: 7 SIGKILLs (two crash loops) and
#                                              2 broker restarts; rebalance join/leave
#   tests/integration/test_malformed_stream.py 30k malformed records among ~40k good spans
#   tests/integration/test_canary.py           canaries in every output, API security
#   tests/integration/test_crash_counts.py     7 SIGKILLs between counting and the commit,
#                                              then the API's counts against the replay
#   tests/integration/test_faults.py           a 60 s broker outage under load with the
#                                              default readiness and reminder timings (15 s
#                                              in the suite), SIGTERM during an outage,
#                                              lost, unwritable and full state dirs
#
# Environment: LOOPWATCH_CHAOS_SEED=<int> replays a chaos schedule (the seed in use is
# printed); LOOPWATCH_CHAOS_LONG=0 runs the short CI variants instead. The broker is
# LOOPWATCH_BOOTSTRAP (else 127.0.0.1:$KAFKA_PORT, default 19092) with the data dir
# LOOPWATCH_KAFKA_DATA (scripts/kafka.sh); KAFKA_PORT follows LOOPWATCH_BOOTSTRAP's port.
# The broker is started first and left running (the crash test restarts it).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO_ROOT"
PY="${LOOPWATCH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
export LOOPWATCH_CHAOS_LONG="${LOOPWATCH_CHAOS_LONG:-1}"
export LOOPWATCH_BOOTSTRAP="${LOOPWATCH_BOOTSTRAP:-127.0.0.1:${KAFKA_PORT:-19092}}"
export KAFKA_PORT="${LOOPWATCH_BOOTSTRAP##*:}"  # kafka.sh starts/stops the broker tests use

scripts/kafka.sh start
rc=0
"$PY" -m pytest -p no:cacheprovider -s -ra --durations=0 \
  tests/integration/test_chaos.py \
  tests/integration/test_malformed_stream.py \
  tests/integration/test_canary.py \
  tests/integration/test_crash_counts.py \
  tests/integration/test_faults.py "$@" || rc=$?
scripts/kafka.sh start >/dev/null  # whatever happened, leave the broker running
exit "$rc"
