"""Worker settings (`loopwatch worker`), read from the environment with defaults.

The detection policy comes from the YAML file (`--config` / ``LOOPWATCH_CONFIG``); these
settings only say where the stream service reads, writes, stores and listens.

========================================  ==========================  =========================
variable                                  default                     meaning
========================================  ==========================  =========================
``LOOPWATCH_BOOTSTRAP``                   ``127.0.0.1:19092``         Kafka bootstrap servers
``LOOPWATCH_INPUT_TOPIC``                 ``otlp_spans``              the collector's topic
``LOOPWATCH_INPUT_ENCODING``              ``otlp_proto``              ``otlp_proto`` | ``otlp_json``
``LOOPWATCH_INPUT_KEYED_BY_RUN``          ``false``                   ``true``: the collector keys
                                                                      records by trace id
                                                                      (``partition_traces_by_id``)
                                                                      and ``run_key`` is ``trace``:
                                                                      detect directly on the input
                                                                      topic, no repartition hop
``LOOPWATCH_PARTITIONS``                  ``4``                       partitions of the topics the
                                                                      worker creates (internal steps
                                                                      topic, outputs, changelogs)
``LOOPWATCH_REPLICATION_FACTOR``          ``1``                       replication of created topics
``LOOPWATCH_STORE``                       ``rocksdb://``              table store; ``memory://`` for
                                                                      tests (state is then rebuilt
                                                                      from the changelogs at start)
``LOOPWATCH_DATA_DIR``                    ``.cache/loopwatch``        table data (rocksdb) directory
``LOOPWATCH_WEB_HOST``                    ``127.0.0.1``               on-call API bind address
``LOOPWATCH_WEB_PORT``                    ``6066``                    on-call API port
``LOOPWATCH_WEB_URL``                     ``http://<host>:<port>``    how the other workers reach
                                                                      this one (``/runs/{id}`` is
                                                                      routed to the key's owner);
                                                                      default from the bind address
                                                                      (the host name for 0.0.0.0)
``LOOPWATCH_METRICS_HOST``                ``0.0.0.0``                 Prometheus ``/metrics`` bind
``LOOPWATCH_METRICS_PORT``                ``9464``                    Prometheus port (0: disabled)
``LOOPWATCH_MAX_ACTIVE_RUNS``             ``200000``                  live runs per worker; above it
                                                                      the oldest idle runs are
                                                                      finalized (evicted)
``LOOPWATCH_RUN_RETENTION_HOURS``         ``168``                     how long a finished run that
                                                                      looped stays open to
                                                                      ``query run`` (0: not kept)
``LOOPWATCH_CLEAN_RUN_RETENTION_HOURS``   ``24``                      the same for a run without
                                                                      loops (its summary only)
``LOOPWATCH_FINISHED_TTL_SECONDS``        ``3600``                    how long a finished run id is
                                                                      remembered (late spans of it
                                                                      are counted, not a new run);
                                                                      on disk only, a sweep pass
                                                                      a minute per partition
``LOOPWATCH_APP_ID``                      ``loopwatch``               consumer group / faust app id
                                                                      (prefix of changelog topics)
``LOOPWATCH_EVENTS_TOPIC``                ``loop_detected``           loop_detected events
``LOOPWATCH_RUNS_TOPIC``                  ``loop_runs``               run summaries
``LOOPWATCH_DEAD_LETTER_TOPIC``           ``loopwatch-dead-letters``  undecodable input records
``LOOPWATCH_STEPS_TOPIC``                 ``loopwatch-steps``         internal: steps by run id
                                                                      (and the worker's timer ticks)
``LOOPWATCH_HOLDS_TOPIC``                 ``loopwatch-holds``         the on-call's holds (compacted,
                                                                      one partition; every worker
                                                                      reads all of it)
``LOOPWATCH_STEPS_GROUPING``              ``partition``               ``partition``: one internal
                                                                      message per destination
                                                                      partition per input record
                                                                      (runs inside, partitioned as
                                                                      their run id would be);
                                                                      ``run``: one message per run
                                                                      per record, keyed by run id
``LOOPWATCH_DLQ_CAPTURE_PAYLOAD``         ``false``                   ``true``: dead letters carry
                                                                      the raw payload (may contain
                                                                      customer data); default: only
                                                                      its SHA-256 digest and length
``LOOPWATCH_API_TOKEN``                   (unset)                     when set, every API view but
                                                                      ``/healthz`` requires
                                                                      ``Authorization: Bearer <token>``
``LOOPWATCH_BATCH_MAX``                   ``1000``                    max messages the detect agent
                                                                      takes per batch
``LOOPWATCH_BATCH_WITHIN_MS``             ``10``                      ... or what arrived within
                                                                      (faust waits this long after
                                                                      every batch, however much is
                                                                      queued: it is idle time in
                                                                      each cycle, docs/PERFORMANCE.md)
``LOOPWATCH_STATE_FLUSH_MS``              ``1000``                    run states are written to
                                                                      the tables (changelog) at
                                                                      most this often, records
                                                                      acknowledged after; ``0``:
                                                                      after every batch
``LOOPWATCH_STATE_CACHE``                 ``10000``                   decoded run states kept in
                                                                      memory (write-through; a
                                                                      run whose root ended with
                                                                      nothing waiting is not kept)
``LOOPWATCH_ARRIVAL_HOLD_MS``             ``2000``                    unkeyed input: a run's
                                                                      arrivals wait in memory for
                                                                      the input clock at most this
                                                                      long, then in its state (one
                                                                      state write instead of two);
                                                                      ``0``: in its state at once
``LOOPWATCH_LINGER_MS``                   ``10``                      producer linger (batching)
``LOOPWATCH_PRODUCER_BATCH_KB``           ``256``                     producer record batch size
                                                                      per partition (faust's
                                                                      default, 16 KiB, holds 9 run
                                                                      states: aiokafka then spent
                                                                      39 us of CPU a 1.8 kB record,
                                                                      13 us at 256 KiB); at most
                                                                      960, under the 1 MB request
                                                                      and broker message limits
``LOOPWATCH_FETCH_PARTITION_MB``          ``16``                      consumer fetch size per
                                                                      partition (faust's default,
                                                                      1 MiB, starved the agents:
                                                                      half the worker's time was
                                                                      spent waiting for records)
``LOOPWATCH_FETCH_MIN_KB``                ``128`` keyed,              a fetch returns once this
                                          ``0`` unkeyed               much is there ...
``LOOPWATCH_FETCH_MAX_WAIT_MS``           ``40``                      ... or after this long
                                                                      (keyed live traffic: one
                                                                      fetch per arriving record
                                                                      cost ~7 us of CPU a span);
                                                                      ``0`` KB: faust's (1 byte,
                                                                      1,500 ms), which unkeyed
                                                                      input keeps (its backlog
                                                                      was slower with the wait)
``LOOPWATCH_TICK_SECONDS``                ``0.25``                    timer period (releases,
                                                                      finalization, cleanup);
                                                                      an input clock advance
                                                                      sends its ticks at once
``LOOPWATCH_INPUT_CLOCK_PROBE_SECONDS``   ``0.1``                     how often the input's end
                                                                      offsets are read (unkeyed:
                                                                      a release waits for the
                                                                      first read after its arrival;
                                                                      a read is one metadata, one
                                                                      list-offsets per partition
                                                                      and one offset-fetch request)
``LOOPWATCH_COMMIT_INTERVAL_SECONDS``     ``0.25`` unkeyed,           how often processed input
                                          ``1.0`` keyed               offsets are committed
                                                                      (unkeyed: the input clock
                                                                      takes other workers'
                                                                      partitions from them; keyed:
                                                                      each commit flushes faust's
                                                                      producer, a pause)
``LOOPWATCH_OUTPUT_RETENTION_HOURS``      ``168``                     retention of created output,
                                                                      dead-letter topics
``LOOPWATCH_SESSION_TIMEOUT_SECONDS``     ``60``                      consumer group session: how
                                                                      long a crashed worker keeps
                                                                      its partitions
``LOOPWATCH_LOG_LEVEL``                   ``warning``                 worker log level
``LOOPWATCH_TRACE_URL``                   (none)                      link template for ``trace_url``
                                                                      (``{trace_id}``, ``{span_id}``,
                                                                      ``{run_id}``;
                                                                      alerts/trace_links.py)
``LOOPWATCH_INPUT_CLOCK``                 ``true``                    unkeyed input: hold run
                                                                      deadlines until the group
                                                                      has processed the input
                                                                      backlog (streams/worker/kafka/input_clock.py);
                                                                      ``false``: wall clock only
``LOOPWATCH_INPUT_CLOCK_MAX_LAG_SECONDS`` ``900``                     the input clock holds run
                                                                      deadlines at most this far
                                                                      behind the wall clock (a
                                                                      partition whose commits
                                                                      stopped must not freeze
                                                                      every run)
``LOOPWATCH_ROCKSDB_WRITE_BUFFER_MB``     ``4``                       rocksdb memtable size per
                                                                      table partition (2 of them at
                                                                      most before a flush)
``LOOPWATCH_ROCKSDB_BLOCK_CACHE_MB``      ``8``                       rocksdb read cache, one for
                                                                      every table partition (index
                                                                      and filter blocks included;
                                                                      run states are cached decoded
                                                                      above it, LOOPWATCH_STATE_CACHE)
``LOOPWATCH_ROCKSDB_MEMTABLES_MB``        ``16``                      every table partition's
                                                                      memtables together (past it
                                                                      the largest is flushed)
``LOOPWATCH_STOP_TIMEOUT_SECONDS``        ``30``                      SIGTERM / Ctrl-C: the worker
                                                                      exits within this long whatever
                                                                      the broker does (undelivered
                                                                      outputs stay uncommitted and
                                                                      are processed again)
``LOOPWATCH_READY_BROKER_SECONDS``        ``30``                      ``/healthz`` turns not ready
                                                                      (HTTP 503) once the broker has
                                                                      been unreachable this long
``LOOPWATCH_READY_MAX_CONSUMER_LAG``      ``1000000``                 ... or a partition's consumer
                                                                      lag is above this (records)
``LOOPWATCH_READY_MAX_INPUT_CLOCK_LAG_SECONDS`` ``900``               ... or the input clock trails
                                                                      the wall clock by more
``LOOPWATCH_BROKER_REMINDER_SECONDS``     ``60``                      while the broker is not
                                                                      connected: one summary line
                                                                      (with counts) this often
========================================  ==========================  =========================

Every value is validated; a bad one is a `ConfigError` naming the variable and what was
expected (the CLI prints it as one line and exits 2).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from alerts.trace_links import TraceLinks
from detectors.errors import ConfigError
from streams.worker.state.retained import Retention

ENCODINGS = ("otlp_proto", "otlp_json")
STORES = ("rocksdb://", "memory://")
GROUPINGS = ("partition", "run")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    bootstrap: str = "127.0.0.1:19092"
    input_topic: str = "otlp_spans"
    input_encoding: str = "otlp_proto"
    input_keyed_by_run: bool = False
    partitions: int = 4
    replication_factor: int = 1
    store: str = "rocksdb://"
    data_dir: str = ".cache/loopwatch"
    web_host: str = "127.0.0.1"
    web_port: int = 6066
    web_url: str = ""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    max_active_runs: int = 200_000
    finished_ttl_seconds: float = 3600.0
    run_retention_hours: float = 168.0
    clean_run_retention_hours: float = 24.0
    app_id: str = "loopwatch"
    events_topic: str = "loop_detected"
    runs_topic: str = "loop_runs"
    dead_letter_topic: str = "loopwatch-dead-letters"
    steps_topic: str = "loopwatch-steps"
    holds_topic: str = "loopwatch-holds"
    steps_grouping: str = "partition"
    dlq_capture_payload: bool = False
    api_token: str | None = None
    batch_max: int = 1000
    batch_within_ms: int = 10
    state_flush_ms: int = 1000
    state_cache_size: int = 10_000
    arrival_hold_ms: int = 2000
    linger_ms: int = 10
    producer_batch_kb: int = 256
    fetch_partition_mb: int = 16
    # a fetch waits for this much data or this long (aiokafka's fetch_min_bytes and
    # fetch_max_wait_ms; faust sets 1 byte and 1,500 ms: one fetch per arriving record)
    fetch_min_kb: int | None = None  # None: 128 keyed, 0 (faust's) unkeyed
    fetch_max_wait_ms: int = 40
    # releases, finalizations and cleanup; an input clock advance sends its ticks at once
    tick_seconds: float = 0.25
    commit_interval_seconds: float | None = None  # None: 0.25 unkeyed, 1.0 keyed
    output_retention_hours: float = 168.0
    session_timeout_seconds: float = 60.0
    log_level: str = "warning"
    trace_links: TraceLinks | None = None
    input_clock: bool = True
    input_clock_max_lag_seconds: float = 900.0
    input_clock_probe_seconds: float = 0.1
    rocksdb_write_buffer_mb: int = 4  # one memtable
    # 8 + 16 against 32 + 32: worker spans/s x1.00 unkeyed, x0.99 keyed (3 alternating pairs
    # each), and RSS no longer grows by the cache filling (docs/PERFORMANCE.md)
    rocksdb_block_cache_mb: int = 8  # one cache for every table partition
    rocksdb_memtables_mb: int = 16  # every table partition's memtables together
    stop_timeout_seconds: float = 30.0
    ready_broker_seconds: float = 30.0
    ready_max_consumer_lag: int = 1_000_000
    ready_max_input_clock_lag_seconds: float = 900.0
    broker_reminder_seconds: float = 60.0

    @property
    def broker_url(self) -> str:
        return ",".join(f"kafka://{host.strip()}" for host in self.bootstrap.split(","))

    @property
    def canonical_url(self) -> str:
        if self.web_url:
            return self.web_url.rstrip("/")
        host = self.web_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"http://{host}:{self.web_port}"

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser().resolve()

    def rocksdb_options(self) -> dict[str, int]:
        """Store options for every table partition. The block cache and the memtables' total
        are not per partition: one cache and one write buffer manager serve them all
        (faust_internals.StoreMemory), so rocksdb's memory is bounded by
        ``rocksdb_block_cache_mb + rocksdb_memtables_mb`` whatever the partitions."""
        mib = 1024 * 1024
        return {
            "write_buffer_size": self.rocksdb_write_buffer_mb * mib,
            "max_write_buffer_number": 2,
            "target_file_size_base": max(self.rocksdb_write_buffer_mb, 8) * mib,
        }

    @property
    def retention(self) -> Retention | None:
        """How long finished runs are kept for `query run`; None: not at all."""
        if not (self.run_retention_hours or self.clean_run_retention_hours):
            return None
        return Retention.hours(self.run_retention_hours, self.clean_run_retention_hours)

    def changelog_topic(self, table: str) -> str:
        """The name faust gives the changelog of `table` (``<app id>-<table>-changelog``)."""
        return f"{self.app_id}-{table}-changelog"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        env = os.environ if environ is None else environ
        reader = _Reader(env)
        d = cls()
        values = {
            "bootstrap": reader.text("LOOPWATCH_BOOTSTRAP", d.bootstrap),
            "input_topic": reader.topic("LOOPWATCH_INPUT_TOPIC", d.input_topic),
            "input_encoding": reader.choice(
                "LOOPWATCH_INPUT_ENCODING", d.input_encoding, ENCODINGS
            ),
            "input_keyed_by_run": reader.flag("LOOPWATCH_INPUT_KEYED_BY_RUN", d.input_keyed_by_run),
            "partitions": reader.integer("LOOPWATCH_PARTITIONS", d.partitions, 1, 10_000),
            "replication_factor": reader.integer(
                "LOOPWATCH_REPLICATION_FACTOR", d.replication_factor, 1, 100
            ),
            "store": reader.choice("LOOPWATCH_STORE", d.store, STORES),
            "data_dir": reader.text("LOOPWATCH_DATA_DIR", d.data_dir),
            "web_host": reader.text("LOOPWATCH_WEB_HOST", d.web_host),
            "web_port": reader.integer("LOOPWATCH_WEB_PORT", d.web_port, 1, 65535),
            "web_url": reader.text("LOOPWATCH_WEB_URL", ""),
            "metrics_host": reader.text("LOOPWATCH_METRICS_HOST", d.metrics_host),
            "metrics_port": reader.integer("LOOPWATCH_METRICS_PORT", d.metrics_port, 0, 65535),
            "max_active_runs": reader.integer(
                "LOOPWATCH_MAX_ACTIVE_RUNS", d.max_active_runs, 1, 100_000_000
            ),
            "run_retention_hours": reader.number(
                "LOOPWATCH_RUN_RETENTION_HOURS", d.run_retention_hours, 0.0
            ),
            "clean_run_retention_hours": reader.number(
                "LOOPWATCH_CLEAN_RUN_RETENTION_HOURS", d.clean_run_retention_hours, 0.0
            ),
            "finished_ttl_seconds": reader.number(
                "LOOPWATCH_FINISHED_TTL_SECONDS", d.finished_ttl_seconds, 1.0
            ),
            "app_id": reader.topic("LOOPWATCH_APP_ID", d.app_id),
            "events_topic": reader.topic("LOOPWATCH_EVENTS_TOPIC", d.events_topic),
            "runs_topic": reader.topic("LOOPWATCH_RUNS_TOPIC", d.runs_topic),
            "dead_letter_topic": reader.topic("LOOPWATCH_DEAD_LETTER_TOPIC", d.dead_letter_topic),
            "steps_topic": reader.topic("LOOPWATCH_STEPS_TOPIC", d.steps_topic),
            "holds_topic": reader.topic("LOOPWATCH_HOLDS_TOPIC", d.holds_topic),
            "steps_grouping": reader.choice(
                "LOOPWATCH_STEPS_GROUPING", d.steps_grouping, GROUPINGS
            ),
            "dlq_capture_payload": reader.flag(
                "LOOPWATCH_DLQ_CAPTURE_PAYLOAD", d.dlq_capture_payload
            ),
            "api_token": env.get("LOOPWATCH_API_TOKEN") or None,
            "batch_max": reader.integer("LOOPWATCH_BATCH_MAX", d.batch_max, 1, 100_000),
            "batch_within_ms": reader.integer(
                "LOOPWATCH_BATCH_WITHIN_MS", d.batch_within_ms, 1, 60_000
            ),
            "state_flush_ms": reader.integer(
                "LOOPWATCH_STATE_FLUSH_MS", d.state_flush_ms, 0, 60_000
            ),
            "state_cache_size": reader.integer(
                "LOOPWATCH_STATE_CACHE", d.state_cache_size, 0, 10_000_000
            ),
            "arrival_hold_ms": reader.integer(
                "LOOPWATCH_ARRIVAL_HOLD_MS", d.arrival_hold_ms, 0, 60_000
            ),
            "linger_ms": reader.integer("LOOPWATCH_LINGER_MS", d.linger_ms, 0, 1000),
            "producer_batch_kb": reader.integer(
                "LOOPWATCH_PRODUCER_BATCH_KB", d.producer_batch_kb, 16, 960
            ),
            "fetch_partition_mb": reader.integer(
                "LOOPWATCH_FETCH_PARTITION_MB", d.fetch_partition_mb, 1, 1024
            ),
            "fetch_min_kb": (
                reader.integer("LOOPWATCH_FETCH_MIN_KB", 0, 0, 16_384)
                if reader.has("LOOPWATCH_FETCH_MIN_KB")
                else None
            ),
            "fetch_max_wait_ms": reader.integer(
                "LOOPWATCH_FETCH_MAX_WAIT_MS", d.fetch_max_wait_ms, 1, 1500
            ),
            "tick_seconds": reader.number("LOOPWATCH_TICK_SECONDS", d.tick_seconds, 0.05),
            "commit_interval_seconds": (
                reader.number("LOOPWATCH_COMMIT_INTERVAL_SECONDS", 1.0, 0.05)
                if reader.has("LOOPWATCH_COMMIT_INTERVAL_SECONDS")
                else None
            ),
            "output_retention_hours": reader.number(
                "LOOPWATCH_OUTPUT_RETENTION_HOURS", d.output_retention_hours, 1.0
            ),
            "session_timeout_seconds": reader.number(
                "LOOPWATCH_SESSION_TIMEOUT_SECONDS", d.session_timeout_seconds, 6.0
            ),
            "log_level": reader.choice("LOOPWATCH_LOG_LEVEL", d.log_level, LOG_LEVELS),
            "trace_links": TraceLinks.parse(reader.text("LOOPWATCH_TRACE_URL", "")),
            "input_clock": reader.flag("LOOPWATCH_INPUT_CLOCK", d.input_clock),
            "input_clock_probe_seconds": reader.number(
                "LOOPWATCH_INPUT_CLOCK_PROBE_SECONDS", d.input_clock_probe_seconds, 0.02
            ),
            "input_clock_max_lag_seconds": reader.number(
                "LOOPWATCH_INPUT_CLOCK_MAX_LAG_SECONDS", d.input_clock_max_lag_seconds, 10.0
            ),
            "rocksdb_write_buffer_mb": reader.integer(
                "LOOPWATCH_ROCKSDB_WRITE_BUFFER_MB", d.rocksdb_write_buffer_mb, 1, 4096
            ),
            "rocksdb_block_cache_mb": reader.integer(
                "LOOPWATCH_ROCKSDB_BLOCK_CACHE_MB", d.rocksdb_block_cache_mb, 1, 65536
            ),
            "rocksdb_memtables_mb": reader.integer(
                "LOOPWATCH_ROCKSDB_MEMTABLES_MB", d.rocksdb_memtables_mb, 1, 65536
            ),
            "stop_timeout_seconds": reader.number(
                "LOOPWATCH_STOP_TIMEOUT_SECONDS", d.stop_timeout_seconds, 1.0
            ),
            "ready_broker_seconds": reader.number(
                "LOOPWATCH_READY_BROKER_SECONDS", d.ready_broker_seconds, 0.0
            ),
            "ready_max_consumer_lag": reader.integer(
                "LOOPWATCH_READY_MAX_CONSUMER_LAG", d.ready_max_consumer_lag, 1, 10**12
            ),
            "ready_max_input_clock_lag_seconds": reader.number(
                "LOOPWATCH_READY_MAX_INPUT_CLOCK_LAG_SECONDS",
                d.ready_max_input_clock_lag_seconds,
                1.0,
            ),
            "broker_reminder_seconds": reader.number(
                "LOOPWATCH_BROKER_REMINDER_SECONDS", d.broker_reminder_seconds, 1.0
            ),
        }
        settings = cls(**values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        if not self.bootstrap.strip() or any(
            not _host_port(h.strip()) for h in self.bootstrap.split(",")
        ):
            raise ConfigError(
                f"LOOPWATCH_BOOTSTRAP={self.bootstrap!r}: expected host:port[,host:port...]"
            )
        names = {
            "LOOPWATCH_INPUT_TOPIC": self.input_topic,
            "LOOPWATCH_EVENTS_TOPIC": self.events_topic,
            "LOOPWATCH_RUNS_TOPIC": self.runs_topic,
            "LOOPWATCH_DEAD_LETTER_TOPIC": self.dead_letter_topic,
            "LOOPWATCH_STEPS_TOPIC": self.steps_topic,
            "LOOPWATCH_HOLDS_TOPIC": self.holds_topic,
        }
        seen: dict[str, str] = {}
        for var, name in names.items():
            if name in seen:
                raise ConfigError(
                    f"{var}={name!r}: the same topic as {seen[name]}; use distinct topics"
                )
            seen[name] = var
        if self.web_url and not re.match(r"^https?://[^/\s]+$", self.web_url.rstrip("/")):
            raise ConfigError(f"LOOPWATCH_WEB_URL={self.web_url!r}: expected http://HOST:PORT")
        if self.metrics_port and self.metrics_port == self.web_port:
            raise ConfigError(
                f"LOOPWATCH_METRICS_PORT={self.metrics_port}: the same port as LOOPWATCH_WEB_PORT"
            )

    def describe(self) -> dict[str, object]:
        """All settings for a startup log line (the API token is masked)."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        if out.get("api_token"):
            out["api_token"] = "***"
        return out


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


class _Reader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def has(self, name: str) -> bool:
        return self._raw(name) is not None

    def _raw(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is None or value.strip() == "":
            return None
        return value.strip()

    def text(self, name: str, default: str) -> str:
        return self._raw(name) or default

    def topic(self, name: str, default: str) -> str:
        value = self.text(name, default)
        if not _TOPIC_RE.match(value) or value in (".", ".."):
            raise ConfigError(
                f"{name}={value!r}: expected a Kafka topic name (letters, digits, '.', '_', '-')"
            )
        return value

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.text(name, default)
        if name == "LOOPWATCH_STORE" and value in ("rocksdb", "memory"):
            value += "://"
        if value.lower() in choices:
            return value.lower()
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")

    def flag(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value is None:
            return default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}={value!r}: expected true or false")

    def integer(self, name: str, default: int, lo: int, hi: int) -> int:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = int(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name}={value!r}: expected an integer") from None
        if not lo <= number <= hi:
            raise ConfigError(f"{name}={value!r}: expected an integer from {lo} to {hi}")
        return number

    def number(self, name: str, default: float, lo: float) -> float:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r}: expected a number") from None
        if not number >= lo or number != number or number == float("inf"):
            raise ConfigError(f"{name}={value!r}: expected a number >= {lo:g}")
        return number
