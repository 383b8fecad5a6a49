#!/usr/bin/env bash
# `make run`: the whole pipeline on this machine, no Docker.
#
#   1. start the local Kafka broker (scripts/kafka.sh start) unless it is already running
#   2. create the topics (fresh ones: the demo topics of an earlier run and its consumer group
#      are deleted first, set LOOPWATCH_LOCAL_KEEP=1 to keep them)
#   3. start `loopwatch worker --config examples/loopwatch.yaml` in the background
#      (log: .cache/worker.log, or LOOPWATCH_LOCAL_LOG) and wait for its /healthz
#   4. `loopwatch produce examples/`: the example exports, as the collector would send them
#   5. print every loop_detected event as one line until Ctrl-C
#   6. stop the worker, and the broker if this script started it: on Ctrl-C, on SIGTERM, and
#      on SIGHUP (the terminal was closed) alike
#
# The worker reads its settings from the environment (streams/worker/settings.py): LOOPWATCH_*
# variables set here are passed through, e.g. LOOPWATCH_WEB_PORT=7066 make run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
PY="${LOOPWATCH_PYTHON:-$ROOT/.venv/bin/python}"
CONFIG="${LOOPWATCH_CONFIG:-examples/loopwatch.yaml}"
LOG="${LOOPWATCH_LOCAL_LOG:-$ROOT/.cache/worker.log}"
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
SHOWN_LOG="${LOG#"$ROOT"/}"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'run-local: %s\n' "$*" >&2; exit 1; }

[[ -x "$PY" ]] || die "$PY not found: run \`make install\` first"
mkdir -p "$(dirname "$LOG")"

WORKER_PID=""
FOLLOW_PID=""
STARTED_BROKER=0
HUNG_UP=0
cleanup() {
  # Runs once and to the end: a second Ctrl-C or a hang-up must not cut it short (a cleanup
  # cut short leaves the broker running), and a failed write must not stop it either.
  trap '' INT TERM HUP
  trap - EXIT
  set +e
  # the terminal may be gone (writes fail with EIO): after a hang-up only the log is written
  [[ "$HUNG_UP" == 1 ]] && exec >/dev/null 2>&1
  [[ -n "$FOLLOW_PID" ]] && kill -TERM "$FOLLOW_PID" 2>/dev/null
  # one line: what is stopped, how long it took, what is left running; shown as it goes,
  # and kept whole in the worker's log (the only record of it when the terminal closed)
  local said=""
  part() { said+="$1"; printf '%s' "$1"; }
  printf '\033[1m==> '
  if [[ -n "$WORKER_PID" ]] && kill -0 "$WORKER_PID" 2>/dev/null; then
    local t0=$SECONDS
    part "stopping the worker (pid $WORKER_PID)... "
    kill -TERM "$WORKER_PID" 2>/dev/null
    # the worker exits within LOOPWATCH_STOP_TIMEOUT_SECONDS (30) even with the broker down
    for _ in $(seq 1 160); do kill -0 "$WORKER_PID" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$WORKER_PID" 2>/dev/null; then
      kill -KILL "$WORKER_PID" 2>/dev/null
      part "killed: not stopped after $((SECONDS - t0)) s; "
    else
      part "stopped ($((SECONDS - t0)) s); "
    fi
    wait "$WORKER_PID" 2>/dev/null
  elif [[ -n "$WORKER_PID" ]]; then
    part "the worker (pid $WORKER_PID) had stopped on the same signal; "
  fi
  if [[ "$STARTED_BROKER" == 1 ]]; then
    part "stopping the Kafka broker"
  else
    part "the Kafka broker was running before: left running (scripts/kafka.sh stop)"
  fi
  printf '\033[0m\n'
  [[ -n "$WORKER_PID" ]] && printf 'run-local: %s\n' "$said" >>"$LOG"
  [[ "$STARTED_BROKER" == 1 ]] && scripts/kafka.sh stop
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'HUNG_UP=1; exit 129' HUP

# Where setpriv exists, what this script starts gets SIGTERM if the script dies without
# running its trap (SIGKILL): nothing of it outlives it.
DIES_WITH_ME=()
command -v setpriv >/dev/null 2>&1 && DIES_WITH_ME=(setpriv --pdeathsig TERM)
# The Python steps end on Ctrl-C, SIGTERM and SIGHUP with 128+signal, no traceback and no
# "Hangup <program text>" from bash: the trap says what is stopped.
QUIET='import os, signal
for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, lambda n, _f: os._exit(128 + n))
'
py() {  # py <<'EOF' (program) EOF
  local prog
  prog="$(cat)"
  ${DIES_WITH_ME[@]+"${DIES_WITH_ME[@]}"} "$PY" -c "$QUIET$prog"
}

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
  py <<'EOF'
import sys, time
from confluent_kafka import KafkaError, KafkaException
from detectors.errors import LoopwatchError
from streams.worker.kafka.topics import admin_client, topic_specs
from streams.worker.settings import WorkerSettings
try:
    s = WorkerSettings.from_env()
except LoopwatchError as exc:
    sys.exit(f"run-local: {exc}")
app = s.app_id
# every topic the worker creates (its own layout: inputs, outputs, every table changelog),
# and the one faust creates itself
names = [spec.name for spec in topic_specs(s, None)] + [f"{app}-__assignor-__leader"]
admin = admin_client(s.bootstrap)
existing = set(admin.list_topics(timeout=10).topics)
gone = [n for n in names if n in existing]
for name, fut in (admin.delete_topics(gone, operation_timeout=30).items() if gone else []):
    try:
        fut.result(30)
    except KafkaException as exc:
        print(f"run-local: could not delete {name}: {exc}")
for _ in range(100):  # deletion is asynchronous: wait until the metadata agrees
    if not set(gone) & set(admin.list_topics(timeout=10).topics):
        break
    time.sleep(0.2)

# The group's committed offsets belong to the deleted topics. Left in place, the worker's
# consumer resets to the new topics' start but faust drops every record below the old
# offset: nothing is detected. A worker that died without leaving the group (SIGKILL, a
# crash) stays a member until its session times out, and the broker refuses the deletion
# until then: say so once, and delete as soon as it is allowed. Right after the broker
# starts the group coordinator may still be loading: retry quietly for a while.
session = s.session_timeout_seconds
started = time.monotonic()
until = None  # set once a member of the last run is seen
while True:
    try:
        admin.delete_consumer_groups([app], request_timeout=10)[app].result(15)
        break
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        code = err.code() if isinstance(err, KafkaError) else None
        if code == KafkaError.GROUP_ID_NOT_FOUND:
            break
        now = time.monotonic()
        if code == KafkaError.NON_EMPTY_GROUP and until is None:
            until = now + session + 5
            print(f"    a worker of the last run is still registered in consumer group {app!r}: "
                  f"waiting up to {session:.0f} s for its session to expire "
                  "(LOOPWATCH_SESSION_TIMEOUT_SECONDS)", flush=True)
        if (until is not None and now > until) or (until is None and now - started > 60):
            members = ""
            try:
                d = admin.describe_consumer_groups([app], request_timeout=10)[app].result(15)
                members = ", ".join(f"{m.client_id} on {m.host}" for m in d.members)
            except KafkaException:
                pass
            sys.exit(
                f"run-local: cannot delete consumer group {app!r} ({err.str() if err else exc})"
                + (f"; its members: {members}" if members else "")
                + ": stop any worker of it, or set LOOPWATCH_APP_ID to a new name"
            )
        time.sleep(0.5)
EOF
  rm -rf "$LOOPWATCH_DATA_DIR"
fi
say "creating topics"
py <<'EOF'
import sys
from detectors.errors import LoopwatchError
from streams.worker.settings import WorkerSettings
from streams.worker.kafka.topics import ensure_topics
try:
    layout = ensure_topics(WorkerSettings.from_env())
except LoopwatchError as exc:
    sys.exit(f"run-local: {exc}")
print("    created:", ", ".join(layout.created) or "(all existed)")
EOF

# 3. worker ---------------------------------------------------------------------------
say "starting the worker (log: $SHOWN_LOG)"
: >"$LOG"
# A closed terminal sends SIGHUP to the whole process group. Dying of it would leave the
# worker's consumer group member registered for the session timeout (the next run waits
# for it). The worker stops on SIGHUP as on SIGTERM once its handlers are installed; until
# then (its start) it ignores SIGHUP, and the trap stops it with SIGTERM.
(
  trap '' HUP
  exec ${DIES_WITH_ME[@]+"${DIES_WITH_ME[@]}"} "$PY" -m streams.cli worker --config "$CONFIG"
) >>"$LOG" 2>&1 &
WORKER_PID=$!
ready=0
for _ in $(seq 1 240); do
  if ! kill -0 "$WORKER_PID" 2>/dev/null; then
    tail -n 20 "$LOG" >&2
    die "the worker exited (see $SHOWN_LOG)"
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
follow="$(cat <<'EOF'
import json, os
from confluent_kafka import Consumer, TopicPartition, OFFSET_BEGINNING
topic = os.environ["LOOPWATCH_EVENTS_TOPIC"]
c = Consumer({"bootstrap.servers": os.environ["LOOPWATCH_BOOTSTRAP"], "group.id": "run-local-follow",
              "enable.auto.commit": False, "log_level": 0})
parts = c.list_topics(topic, timeout=10).topics[topic].partitions
c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
seen = set()
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
EOF
)"
# in the background: `wait` returns at once on a signal to this script alone (a foreground
# command would delay the trap until it ends, and this one never ends by itself)
${DIES_WITH_ME[@]+"${DIES_WITH_ME[@]}"} "$PY" -c "$QUIET$follow" &
FOLLOW_PID=$!
wait "$FOLLOW_PID" || true
