#!/usr/bin/env bash
# `make run`: the whole pipeline on this machine, no Docker.
#
#   1. start the local Kafka broker (scripts/kafka.sh start) unless it is already running
#   2. create the topics (fresh ones: the demo topics of an earlier run are deleted first,
#      set LOOPWATCH_LOCAL_KEEP=1 to keep them)
#   3. start `loopwatch worker --config examples/loopwatch.yaml` in the background
#      (log: .cache/worker.log) and wait for its /healthz
#   4. `loopwatch produce examples/`: the example exports, as the collector would send them
#   5. print every loop_detected event as one line until Ctrl-C
#   6. stop the worker, and the broker if this script started it
#
# The worker reads its settings from the environment (streams/worker/settings.py): LOOPWATCH_*
# variables set here are passed through, e.g. LOOPWATCH_WEB_PORT=7066 make run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
PY="${LOOPWATCH_PYTHON:-$ROOT/.venv/bin/python}"
CONFIG="${LOOPWATCH_CONFIG:-examples/loopwatch.yaml}"
LOG="$ROOT/.cache/worker.log"
export LOOPWATCH_BOOTSTRAP="${LOOPWATCH_BOOTSTRAP:-127.0.0.1:19092}"
export LOOPWATCH_APP_ID="${LOOPWATCH_APP_ID:-loopwatch}"
export LOOPWATCH_INPUT_TOPIC="${LOOPWATCH_INPUT_TOPIC:-otlp_spans}"
export LOOPWATCH_EVENTS_TOPIC="${LOOPWATCH_EVENTS_TOPIC:-loop_detected}"
export LOOPWATCH_RUNS_TOPIC="${LOOPWATCH_RUNS_TOPIC:-loop_runs}"
export LOOPWATCH_DEAD_LETTER_TOPIC="${LOOPWATCH_DEAD_LETTER_TOPIC:-loopwatch-dead-letters}"
export LOOPWATCH_STEPS_TOPIC="${LOOPWATCH_STEPS_TOPIC:-loopwatch-steps}"
export LOOPWATCH_DATA_DIR="${LOOPWATCH_DATA_DIR:-$ROOT/.cache/loopwatch}"
export LOOPWATCH_WEB_HOST="${LOOPWATCH_WEB_HOST:-127.0.0.1}"
export LOOPWATCH_WEB_PORT="${LOOPWATCH_WEB_PORT:-6066}"
export LOOPWATCH_LOG_LEVEL="${LOOPWATCH_LOG_LEVEL:-info}"
API="http://$LOOPWATCH_WEB_HOST:$LOOPWATCH_WEB_PORT"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'run-local: %s\n' "$*" >&2; exit 1; }

[[ -x "$PY" ]] || die "$PY not found: run \`make install\` first"
mkdir -p "$ROOT/.cache"

WORKER_PID=""
STARTED_BROKER=0
cleanup() {
  trap - INT TERM EXIT
  if [[ -n "$WORKER_PID" ]] && kill -0 "$WORKER_PID" 2>/dev/null; then
    say "stopping the worker (pid $WORKER_PID)"
    kill -TERM "$WORKER_PID" 2>/dev/null || true
    # the worker exits within LOOPWATCH_STOP_TIMEOUT_SECONDS (30) even with the broker down
    for _ in $(seq 1 80); do kill -0 "$WORKER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$WORKER_PID" 2>/dev/null && kill -KILL "$WORKER_PID" 2>/dev/null || true
  fi
  if [[ "$STARTED_BROKER" == 1 ]]; then
    say "stopping the Kafka broker"
    scripts/kafka.sh stop || true
  else
    say "the Kafka broker was already running before: left running (scripts/kafka.sh stop)"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. broker ---------------------------------------------------------------------------
if scripts/kafka.sh status >/dev/null 2>&1; then
  say "Kafka broker already running on $LOOPWATCH_BOOTSTRAP"
else
  say "starting the Kafka broker"
  STARTED_BROKER=1
  scripts/kafka.sh start
fi

# 2. topics ---------------------------------------------------------------------------
if [[ "${LOOPWATCH_LOCAL_KEEP:-0}" != 1 ]]; then
  say "deleting the demo topics of an earlier run (LOOPWATCH_LOCAL_KEEP=1 keeps them)"
  "$PY" - <<'EOF'
import os
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
e = os.environ
app = e["LOOPWATCH_APP_ID"]
names = [e[k] for k in ("LOOPWATCH_INPUT_TOPIC", "LOOPWATCH_EVENTS_TOPIC", "LOOPWATCH_RUNS_TOPIC",
                        "LOOPWATCH_DEAD_LETTER_TOPIC", "LOOPWATCH_STEPS_TOPIC")]
names += [f"{app}-{t}-changelog" for t in ("runs", "finished", "loop_counts", "run_counts")]
names.append(f"{app}-__assignor-__leader")
admin = AdminClient({"bootstrap.servers": e["LOOPWATCH_BOOTSTRAP"], "log_level": 0})
existing = set(admin.list_topics(timeout=10).topics)
gone = [n for n in names if n in existing]
for name, fut in (admin.delete_topics(gone, operation_timeout=30).items() if gone else []):
    try:
        fut.result(30)
    except KafkaException as exc:
        print(f"run-local: could not delete {name}: {exc}")
import time
for _ in range(100):  # deletion is asynchronous: wait until the metadata agrees
    if not set(gone) & set(admin.list_topics(timeout=10).topics):
        break
    time.sleep(0.2)
# The group's committed offsets belong to the deleted topics. Left in place, the worker's
# consumer resets to the new topics' start but faust drops every record below the old
# offset: nothing is detected. Right after the broker starts, the group coordinator may
# still be loading (NOT_COORDINATOR): retry; a group that does not exist is fine.
from confluent_kafka import KafkaError
deadline = time.monotonic() + 60
while True:
    try:
        admin.delete_consumer_groups([app], request_timeout=10)[app].result(15)
        break
    except KafkaException as exc:
        code = exc.args[0].code() if exc.args else None
        if code == KafkaError.GROUP_ID_NOT_FOUND:
            break
        if time.monotonic() > deadline:
            raise SystemExit(
                f"run-local: cannot delete consumer group {app!r} ({exc}); stop any worker "
                "of it, or set LOOPWATCH_APP_ID to a new name"
            )
        time.sleep(1)
EOF
  rm -rf "$LOOPWATCH_DATA_DIR"
fi
say "creating topics"
"$PY" -c '
import sys
from detectors.errors import LoopwatchError
from streams.worker.settings import WorkerSettings
from streams.worker.kafka.topics import ensure_topics
try:
    layout = ensure_topics(WorkerSettings.from_env())
except LoopwatchError as exc:
    sys.exit(f"run-local: {exc}")
print("    created:", ", ".join(layout.created) or "(all existed)")
'

# 3. worker ---------------------------------------------------------------------------
say "starting the worker (log: .cache/worker.log)"
: >"$LOG"
"$PY" -m streams.cli worker --config "$CONFIG" >>"$LOG" 2>&1 &
WORKER_PID=$!
ready=0
for _ in $(seq 1 240); do
  if ! kill -0 "$WORKER_PID" 2>/dev/null; then
    tail -n 20 "$LOG" >&2
    die "the worker exited (see .cache/worker.log)"
  fi
  if "$PY" -c "import json,sys,urllib.request; sys.exit(0 if json.load(urllib.request.urlopen('$API/healthz', timeout=2)).get('ready') else 1)" 2>/dev/null; then
    ready=1
    break
  fi
  sleep 0.5
done
[[ "$ready" == 1 ]] || { tail -n 20 "$LOG" >&2; die "the worker did not become ready within 2 minutes"; }
say "worker ready: $API/healthz  (on-call API: loopwatch query loops | runs | run RUN_ID)"

# 4. produce --------------------------------------------------------------------------
say "producing the example exports to $LOOPWATCH_INPUT_TOPIC"
"$PY" -m streams.cli produce --topic "$LOOPWATCH_INPUT_TOPIC" examples/

# 5. follow ---------------------------------------------------------------------------
say "loop_detected events (Ctrl-C stops everything):"
"$PY" - <<'EOF' || true
import json, os, signal, sys
from confluent_kafka import Consumer, TopicPartition, OFFSET_BEGINNING
signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
topic = os.environ["LOOPWATCH_EVENTS_TOPIC"]
c = Consumer({"bootstrap.servers": os.environ["LOOPWATCH_BOOTSTRAP"], "group.id": "run-local-follow",
              "enable.auto.commit": False, "log_level": 0})
parts = c.list_topics(topic, timeout=10).topics[topic].partitions
c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
seen = set()
try:
    while True:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        e = json.loads(m.value())
        if e["event_id"] in seen:  # at-least-once: a redelivered event has the same id
            continue
        seen.add(e["event_id"])
        tool = e.get("tool_name") or "-"
        if e.get("tool_version"):
            tool += f"@{e['tool_version']}"
        print(f"{e['detected_at'][11:19]}  {e['shape']:<25} {e['severity']:<8} "
              f"prompt={e.get('prompt_version') or '-':<13} tool={tool:<22} "
              f"run={e['run_id'][:12]}  trigger={e['trigger_span_id']}  "
              f"-> {e['recommended_action']}", flush=True)
finally:
    c.close()
EOF
