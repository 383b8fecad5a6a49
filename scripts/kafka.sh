#!/usr/bin/env bash
# Local single-node Apache Kafka (KRaft, combined broker+controller) for dev, tests and CI.
#
#   scripts/kafka.sh start          resolve Kafka from Maven Central (cached), format storage
#                                   once, start in the background, wait until it serves requests
#   scripts/kafka.sh stop [--wipe]  SIGTERM, wait, SIGKILL after a timeout; --wipe deletes data
#   scripts/kafka.sh reset          stop and delete the data dir
#   scripts/kafka.sh restart        stop, then start
#   scripts/kafka.sh status         running? healthy? (exit 0 only when both)
#   scripts/kafka.sh logs [-f] [N]  last N (default 100) lines of the broker log, -f follows
#   scripts/kafka.sh resolve        only download Kafka and its dependencies into the cache
#
# Environment (all optional):
#   KAFKA_PORT                  client (PLAINTEXT) port on 127.0.0.1          [19092]
#   KAFKA_CONTROLLER_PORT       KRaft controller port on 127.0.0.1            [KAFKA_PORT+1]
#   LOOPWATCH_KAFKA_VERSION     org.apache.kafka:kafka_2.13 version           [4.1.2]
#   LOOPWATCH_KAFKA_HOME        download cache (jars per version + maven repo) [<repo>/.cache/kafka]
#   LOOPWATCH_KAFKA_DATA        data dir: config, log dirs, broker log, pid   [<repo>/.cache/kafka-data]
#   LOOPWATCH_KAFKA_HEAP_OPTS   JVM heap flags                                [-Xms256m -Xmx512m]
#   LOOPWATCH_KAFKA_JVM_OPTS    extra JVM flags                               []
#   LOOPWATCH_KAFKA_OVERRIDES   extra server properties, "k=v k=v ..."         []
#   LOOPWATCH_KAFKA_START_TIMEOUT  seconds to wait for readiness              [60]
#   LOOPWATCH_KAFKA_STOP_TIMEOUT   seconds between SIGTERM and SIGKILL        [30]
#   LOOPWATCH_KAFKA_LOG4J_VERSION  log4j-slf4j-impl/log4j-core version        [2.25.3]
#   LOOPWATCH_PYTHON            python with confluent-kafka for the health check [<repo>/.venv/bin/python]
#   JAVA_HOME                   JDK/JRE to use (else `java` on PATH; needs >= 17)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd -P)"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }

KAFKA_VERSION="${LOOPWATCH_KAFKA_VERSION:-4.1.2}"
SCALA_VERSION="2.13"
HOST="127.0.0.1"
PORT="${KAFKA_PORT:-19092}"
CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-$((PORT + 1))}"
KAFKA_HOME="$(abspath "${LOOPWATCH_KAFKA_HOME:-$REPO_ROOT/.cache/kafka}")"
DATA_DIR="$(abspath "${LOOPWATCH_KAFKA_DATA:-$REPO_ROOT/.cache/kafka-data}")"
HEAP_OPTS="${LOOPWATCH_KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"
JVM_OPTS="${LOOPWATCH_KAFKA_JVM_OPTS:-}"
OVERRIDES="${LOOPWATCH_KAFKA_OVERRIDES:-}"
START_TIMEOUT="${LOOPWATCH_KAFKA_START_TIMEOUT:-60}"
STOP_TIMEOUT="${LOOPWATCH_KAFKA_STOP_TIMEOUT:-30}"
PYTHON="${LOOPWATCH_PYTHON:-$REPO_ROOT/.venv/bin/python}"
# log4j2 version paired with the Kafka line (Kafka 4.1.x ships log4j 2.25.x); only the slf4j
# binding is added by us, log4j-core itself comes with kafka_2.13's own dependency tree.
LOG4J_VERSION="${LOOPWATCH_KAFKA_LOG4J_VERSION:-2.25.3}"

VERSION_DIR="$KAFKA_HOME/$KAFKA_VERSION"
LIBS_DIR="$VERSION_DIR/libs"
LIBS_DONE="$VERSION_DIR/.resolved"
M2_REPO="$KAFKA_HOME/m2"
CONF_DIR="$DATA_DIR/config"
LOG_DIRS="$DATA_DIR/kraft-logs"
APP_LOG_DIR="$DATA_DIR/logs"
SERVER_LOG="$APP_LOG_DIR/server.log"
STDOUT_LOG="$APP_LOG_DIR/stdout.log"
PID_FILE="$DATA_DIR/kafka.pid"
PROPS="$CONF_DIR/server.properties"
LOG4J_CONF="$CONF_DIR/log4j2.properties"
BOOTSTRAP="$HOST:$PORT"

say() { printf '%s\n' "$*"; }
err() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() { err "$*"; exit 1; }

# ---------------------------------------------------------------------------------------------
# java
# ---------------------------------------------------------------------------------------------
java_bin() {
  if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
    printf '%s\n' "$JAVA_HOME/bin/java"
  elif command -v java >/dev/null 2>&1; then
    command -v java
  else
    die "java not found (need a JDK/JRE >= 17): run scripts/install-tools.sh"
  fi
}

check_java() {
  JAVA="$(java_bin)"
  local v major
  v="$("$JAVA" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')"
  major="${v%%.*}"
  [[ "$major" == "1" ]] && major="$(cut -d. -f2 <<<"$v")"
  [[ "$major" =~ ^[0-9]+$ && "$major" -ge 17 ]] \
    || die "Kafka $KAFKA_VERSION needs Java >= 17, found '$v' at $JAVA: run scripts/install-tools.sh"
}

# ---------------------------------------------------------------------------------------------
# resolve: kafka_2.13 and all runtime dependencies from Maven Central into $LIBS_DIR (once)
# ---------------------------------------------------------------------------------------------
resolve() {
  [[ -f "$LIBS_DONE" ]] && return 0
  mkdir -p "$VERSION_DIR"
  exec 8>"$VERSION_DIR/.resolve.lock"
  flock -w 600 8 || die "timed out waiting for another resolve of Kafka $KAFKA_VERSION"
  if [[ -f "$LIBS_DONE" ]]; then exec 8>&-; return 0; fi
  command -v mvn >/dev/null 2>&1 || die "mvn not found: run scripts/install-tools.sh"

  err "resolving Apache Kafka $KAFKA_VERSION (kafka_$SCALA_VERSION) from Maven Central into $VERSION_DIR ..."
  local t0=$SECONDS
  cat >"$VERSION_DIR/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- generated by scripts/kafka.sh: the runtime classpath of a local Kafka broker -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>loopwatch.local</groupId>
  <artifactId>kafka-broker-runtime</artifactId>
  <version>$KAFKA_VERSION</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_$SCALA_VERSION</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <!-- slf4j 1.x -> log4j2 binding: kafka_2.13's pom brings log4j-api/core but no binding -->
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
  rm -rf "$LIBS_DIR.tmp"
  if ! mvn -B -q -f "$VERSION_DIR/pom.xml" -Dmaven.repo.local="$M2_REPO" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$LIBS_DIR.tmp" \
      >"$VERSION_DIR/resolve.log" 2>&1; then
    tail -n 40 "$VERSION_DIR/resolve.log" >&2
    die "could not resolve Kafka $KAFKA_VERSION from Maven Central (full log: $VERSION_DIR/resolve.log)"
  fi
  [[ -f "$LIBS_DIR.tmp/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ]] \
    || die "resolve finished but kafka_$SCALA_VERSION-$KAFKA_VERSION.jar is missing"
  rm -rf "$LIBS_DIR"
  mv "$LIBS_DIR.tmp" "$LIBS_DIR"
  date -u +%FT%TZ >"$LIBS_DONE"
  err "resolved $(find "$LIBS_DIR" -name '*.jar' | wc -l) jars in $((SECONDS - t0)) s"
  exec 8>&-
}

# ---------------------------------------------------------------------------------------------
# process helpers
# ---------------------------------------------------------------------------------------------
# the pid in the pid file, if that process is alive and really is our broker
broker_pid() {
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(tr -dc '0-9' <"$PID_FILE")"
  [[ -n "$pid" ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $PROPS" || return 1
  printf '%s\n' "$pid"
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$HOST/$1" 2>/dev/null; }

port_owner() {
  command -v ss >/dev/null 2>&1 || return 0
  ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2
}

print_log_tail() {
  local n="${1:-40}"
  for f in "$SERVER_LOG" "$STDOUT_LOG"; do
    if [[ -s "$f" ]]; then
      err "---- last $n lines of $f ----"
      tail -n "$n" "$f" >&2
    fi
  done
}

# Wait until the broker answers a metadata request listing itself. Exit codes: 0 ready,
# 2 timed out, 3 the process died. Uses confluent-kafka from the venv when available.
wait_ready() {
  local timeout="$1" pid="${2:-0}"
  if [[ -x "$PYTHON" ]] && "$PYTHON" -c 'import confluent_kafka' 2>/dev/null; then
    "$PYTHON" - "$BOOTSTRAP" "$timeout" "$pid" <<'PY'
import os, sys, time
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

bootstrap, timeout, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + timeout
admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0,
                     "socket.connection.setup.timeout.ms": 2000})
while True:
    if pid:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(3)
    left = deadline - time.monotonic()
    if left <= 0:
        sys.exit(2)
    try:
        md = admin.list_topics(timeout=max(0.5, min(3.0, left)))
        if md.brokers:
            sys.exit(0)
    except KafkaException:
        pass
    time.sleep(0.25)
PY
  else
    # no venv yet: port open and the server announced itself started
    local deadline=$((SECONDS + ${timeout%.*}))
    while ((SECONDS < deadline)); do
      if [[ "$pid" != 0 ]] && ! kill -0 "$pid" 2>/dev/null; then return 3; fi
      if port_open "$PORT" && grep -q 'Kafka Server started' "$SERVER_LOG" 2>/dev/null; then
        return 0
      fi
      sleep 0.5
    done
    return 2
  fi
}

# ---------------------------------------------------------------------------------------------
# config, format, start, stop
# ---------------------------------------------------------------------------------------------
write_config() {
  mkdir -p "$CONF_DIR" "$LOG_DIRS" "$APP_LOG_DIR"
  cat >"$PROPS.tmp" <<EOF
# generated by scripts/kafka.sh on every start: edit LOOPWATCH_KAFKA_OVERRIDES, not this file
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$LOG_DIRS

# a one-node test broker
num.partitions=4
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0

# small machine: few threads, bounded retention
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=24
log.segment.bytes=67108864
log.retention.check.interval.ms=60000
EOF
  local kv
  for kv in $OVERRIDES; do
    [[ "$kv" == *=* ]] || die "LOOPWATCH_KAFKA_OVERRIDES: '$kv' is not key=value"
    printf '%s\n' "$kv" >>"$PROPS.tmp"
  done
  mv "$PROPS.tmp" "$PROPS"

  cat >"$LOG4J_CONF" <<'EOF'
# generated by scripts/kafka.sh: broker logs go to files in the data dir, never the terminal
status = warn
name = loopwatch-kafka
property.dir = ${sys:kafka.logs.dir}
property.pattern = [%d] %p %m (%c)%n

appender.server.type = RollingFile
appender.server.name = SERVER
appender.server.fileName = ${dir}/server.log
appender.server.filePattern = ${dir}/server.log.%i
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = ${pattern}
appender.server.policies.type = Policies
appender.server.policies.size.type = SizeBasedTriggeringPolicy
appender.server.policies.size.size = 20MB
appender.server.strategy.type = DefaultRolloverStrategy
appender.server.strategy.max = 3

appender.controller.type = RollingFile
appender.controller.name = CONTROLLER
appender.controller.fileName = ${dir}/controller.log
appender.controller.filePattern = ${dir}/controller.log.%i
appender.controller.layout.type = PatternLayout
appender.controller.layout.pattern = ${pattern}
appender.controller.policies.type = Policies
appender.controller.policies.size.type = SizeBasedTriggeringPolicy
appender.controller.policies.size.size = 20MB
appender.controller.strategy.type = DefaultRolloverStrategy
appender.controller.strategy.max = 2

rootLogger.level = INFO
rootLogger.appenderRef.server.ref = SERVER

logger.controller.name = org.apache.kafka.controller
logger.controller.level = INFO
logger.controller.additivity = false
logger.controller.appenderRef.controller.ref = CONTROLLER

logger.kafkacontroller.name = kafka.controller
logger.kafkacontroller.level = INFO
logger.kafkacontroller.additivity = false
logger.kafkacontroller.appenderRef.controller.ref = CONTROLLER

logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
EOF
}

classpath() { printf '%s/*' "$LIBS_DIR"; }

log4j_sysprops() {
  printf '%s\n' "-Dlog4j2.configurationFile=$LOG4J_CONF" "-Dkafka.logs.dir=$APP_LOG_DIR"
}

format_storage() {
  [[ -f "$LOG_DIRS/meta.properties" ]] && return 0
  local cluster_id
  # base64url of 16 random bytes; one starting with '-' reads as an option to the tool's
  # argument parser ("--cluster-id: expected one argument"): 1 format in 64 failed on it
  cluster_id="-"
  while [[ "$cluster_id" == -* ]]; do
    cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
  done
  # the tool logs through the same log4j2 config: keep its lines out of the broker's server.log
  local l4j=("-Dlog4j2.configurationFile=$LOG4J_CONF" "-Dkafka.logs.dir=$APP_LOG_DIR/format")
  if ! "$JAVA" -Xmx256m "${l4j[@]}" -cp "$(classpath)" kafka.tools.StorageTool \
      format --cluster-id "$cluster_id" --config "$PROPS" --ignore-formatted \
      >"$APP_LOG_DIR/format.log" 2>&1; then
    cat "$APP_LOG_DIR/format.log" >&2
    die "formatting KRaft storage in $LOG_DIRS failed"
  fi
  err "formatted KRaft storage in $LOG_DIRS (cluster id $cluster_id)"
}

cmd_start() {
  mkdir -p "$DATA_DIR"
  exec 9>"$DATA_DIR/.kafka.lock"
  flock -w $((START_TIMEOUT + STOP_TIMEOUT + 600)) 9 || die "timed out waiting for another kafka.sh"

  local pid rc
  if pid="$(broker_pid)"; then
    say "kafka already running (pid $pid)"
    rc=0; wait_ready "$START_TIMEOUT" "$pid" || rc=$?
    if ((rc == 0)); then say "kafka ready on $BOOTSTRAP"; return 0; fi
    print_log_tail 40
    die "kafka (pid $pid) is running but not answering on $BOOTSTRAP (try: scripts/kafka.sh stop && scripts/kafka.sh start)"
  fi
  if [[ -f "$PID_FILE" ]]; then
    err "removing stale pid file $PID_FILE"
    rm -f "$PID_FILE"
  fi
  local p owner
  for p in "$PORT" "$CONTROLLER_PORT"; do
    if port_open "$p"; then
      owner="$(port_owner "$p")"
      die "port $HOST:$p is already in use${owner:+ by pid $owner} (not the broker of $DATA_DIR); set KAFKA_PORT/KAFKA_CONTROLLER_PORT or stop it"
    fi
  done

  check_java
  resolve
  write_config
  format_storage

  mapfile -t l4j < <(log4j_sysprops)
  # shellcheck disable=SC2206
  local jvm=($HEAP_OPTS -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
             -Djava.awt.headless=true "${l4j[@]}" $JVM_OPTS)
  : >"$STDOUT_LOG"
  # own session (survives the caller's Ctrl-C / job control); the inner shell writes its own
  # pid and then becomes java, so the pid file always names the JVM
  setsid bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$PID_FILE" \
    "$JAVA" "${jvm[@]}" -cp "$(classpath)" kafka.Kafka "$PROPS" \
    </dev/null >>"$STDOUT_LOG" 2>&1 8>&- 9>&- &
  local t0=$SECONDS
  for _ in $(seq 50); do [[ -s "$PID_FILE" ]] && break; sleep 0.1; done
  pid="$(tr -dc '0-9' <"$PID_FILE" 2>/dev/null || true)"
  [[ -n "$pid" ]] || die "broker did not start (no pid file)"

  rc=0; wait_ready "$START_TIMEOUT" "$pid" || rc=$?
  if ((rc == 0)); then
    say "kafka ready on $BOOTSTRAP"
    return 0
  fi
  if ((rc == 3)); then
    err "kafka exited during startup after $((SECONDS - t0)) s"
    rm -f "$PID_FILE"
  else
    err "kafka (pid $pid) not ready on $BOOTSTRAP after ${START_TIMEOUT} s; it is left running (scripts/kafka.sh stop)"
  fi
  print_log_tail 40
  exit 1
}

cmd_stop() {
  local wipe=0 a
  for a in "$@"; do
    case "$a" in
      --wipe) wipe=1 ;;
      *) die "stop: unknown option '$a'" ;;
    esac
  done
  if [[ ! -d "$DATA_DIR" ]]; then
    say "kafka not running"
    return 0
  fi
  exec 9>"$DATA_DIR/.kafka.lock"
  flock -w $((START_TIMEOUT + STOP_TIMEOUT + 600)) 9 || die "timed out waiting for another kafka.sh"
  local pid
  if pid="$(broker_pid)"; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      err "kafka (pid $pid) did not stop within ${STOP_TIMEOUT} s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    say "kafka stopped (pid $pid)"
  else
    say "kafka not running"
  fi
  rm -f "$PID_FILE"
  if ((wipe)); then
    rm -rf "$DATA_DIR"
    say "kafka data wiped ($DATA_DIR)"
  fi
}

cmd_status() {
  local pid
  if ! pid="$(broker_pid)"; then
    say "kafka not running (data: $DATA_DIR)"
    [[ -f "$PID_FILE" ]] && say "stale pid file: $PID_FILE"
    return 1
  fi
  local rc=0
  wait_ready 5 "$pid" || rc=$?
  if ((rc == 0)); then
    say "kafka running (pid $pid), ready on $BOOTSTRAP, version $KAFKA_VERSION, data $DATA_DIR"
    return 0
  fi
  say "kafka running (pid $pid) but not answering on $BOOTSTRAP"
  return 2
}

cmd_logs() {
  local follow=0 n=100 a
  for a in "$@"; do
    case "$a" in
      -f|--follow) follow=1 ;;
      ''|*[!0-9]*) die "logs: usage: logs [-f] [LINES]" ;;
      *) n="$a" ;;
    esac
  done
  [[ -f "$SERVER_LOG" ]] || die "no broker log yet ($SERVER_LOG)"
  if ((follow)); then exec tail -n "$n" -F "$SERVER_LOG"; fi
  tail -n "$n" "$SERVER_LOG"
}

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; }

main() {
  local cmd="${1:-}"
  [[ $# -gt 0 ]] && shift
  case "$cmd" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    reset) cmd_stop --wipe ;;
    restart) cmd_stop; cmd_start ;;
    status) cmd_status ;;
    logs) cmd_logs "$@" ;;
    resolve) check_java; resolve; say "kafka $KAFKA_VERSION jars in $LIBS_DIR" ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 64 ;;
  esac
}

main "$@"
