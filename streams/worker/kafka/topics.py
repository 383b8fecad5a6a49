"""Kafka topic administration for the worker (confluent-kafka AdminClient).

`ensure_topics(settings)` runs before the faust worker starts:

1. checks the broker answers within a short timeout (`BrokerError`, one clear line);
2. creates every missing topic the worker reads or writes, with partitions, retention and
   ``cleanup.policy`` (``compact`` for table changelogs and the run-summary topic,
   ``compact,delete`` for windowed-table changelogs, ``delete`` for the rest), including the
   table changelogs (faust would otherwise create them itself, with the same settings);
3. checks partition counts: a table changelog must have as many partitions as the topic the
   detect agent reads (faust's co-partitioning), so a mismatch is a `ConfigError` naming the
   topic and the fix, not a worker that silently loses state.

faust subscribes only to topics that exist when it starts (a missing one is seen only after
a metadata refresh, minutes later), which is why the worker creates them first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from detectors.errors import ConfigError
from streams.errors import BrokerError
from streams.worker.settings import WorkerSettings

# Table names (faust changelog topic = "<app id>-<table>-changelog").
RUNS_TABLE = "runs"
FINISHED_TABLE = "finished"
LOOP_COUNTS_TABLE = "loop_counts"
RUN_COUNTS_TABLE = "run_counts"
RETAINED_TABLE = "retained"
EPISODES_TABLE = "episodes"
VERSIONS_TABLE = "versions"  # which version replaced which (detectors/versions.py)
VERSION_COUNTS_TABLE = "version_counts"  # what each version's finished runs did, windowed
HOLD_COUNTS_TABLE = "hold_counts"  # what each on-call hold denied and let run, windowed
# every table, in the order their changelogs are created (one each)
TABLES = (
    RUNS_TABLE,
    FINISHED_TABLE,
    RETAINED_TABLE,
    EPISODES_TABLE,
    LOOP_COUNTS_TABLE,
    RUN_COUNTS_TABLE,
    VERSIONS_TABLE,
    VERSION_COUNTS_TABLE,
    HOLD_COUNTS_TABLE,
)
WINDOW_SECONDS = 60.0
WINDOW_EXPIRES_SECONDS = 24 * 3600.0

_HOUR_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    # partition count that must match exactly (co-partitioned with the detect source)
    copartitioned: bool = False


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """What the worker needs to know about the topics after `ensure_topics`."""

    detect_partitions: int  # partitions of the detect agent's source (= table partitions)
    input_partitions: int
    created: tuple[str, ...] = ()


def admin_client(bootstrap: str) -> AdminClient:
    # log_level 0: no librdkafka "connection refused" chatter while probing
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})


def check_broker(bootstrap: str, timeout: float = 5.0) -> AdminClient:
    """Return an AdminClient once the broker answers a metadata request, else BrokerError."""
    admin = admin_client(bootstrap)
    deadline = time.monotonic() + timeout
    last: str = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            md = admin.list_topics(timeout=max(0.2, min(2.0, left)))
            if md.brokers:
                return admin
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            last = err.str() if isinstance(err, KafkaError) else str(exc)
        time.sleep(0.1)
    detail = f" ({last})" if last else ""
    raise BrokerError(
        f"Kafka broker not reachable at {bootstrap} within {timeout:g} s{detail}: start it "
        "(`scripts/kafka.sh start`) or set LOOPWATCH_BOOTSTRAP"
    )


def topic_specs(settings: WorkerSettings, input_partitions: int | None) -> list[TopicSpec]:
    """Every topic the worker needs. `input_partitions`: of an existing input topic."""
    s = settings
    n_in = input_partitions or s.partitions
    # In keyed mode the detect agent reads the input topic itself, so the tables (and the
    # steps topic that carries the worker's ticks) follow the input topic's partitioning.
    n_detect = n_in if s.input_keyed_by_run else s.partitions
    out_ms = str(int(s.output_retention_hours * _HOUR_MS))
    steps_ms = str(24 * _HOUR_MS)
    window_ms = str(int((WINDOW_EXPIRES_SECONDS + 2 * WINDOW_SECONDS) * 1000))
    keep_hours = max(s.run_retention_hours, s.clean_run_retention_hours)
    retained_ms = str(int((keep_hours + 24) * _HOUR_MS))
    compact = {"cleanup.policy": "compact"}
    windowed = {"cleanup.policy": "compact,delete", "retention.ms": window_ms}
    # records older than the longest retention (and a day) go with their segments, whether
    # or not the sweep reached them
    kept = {"cleanup.policy": "compact,delete", "retention.ms": retained_ms}
    changelogs = {
        RUNS_TABLE: compact,
        FINISHED_TABLE: compact,
        RETAINED_TABLE: kept,
        EPISODES_TABLE: kept,
        LOOP_COUNTS_TABLE: windowed,
        RUN_COUNTS_TABLE: windowed,
        VERSIONS_TABLE: compact,
        VERSION_COUNTS_TABLE: windowed,
        HOLD_COUNTS_TABLE: windowed,
    }
    return [
        TopicSpec(s.input_topic, n_in, {}),
        TopicSpec(s.steps_topic, n_detect, {"retention.ms": steps_ms}, copartitioned=True),
        TopicSpec(
            s.events_topic,
            s.partitions,
            {"cleanup.policy": "delete", "retention.ms": out_ms},
        ),
        TopicSpec(
            s.runs_topic,
            s.partitions,
            {"cleanup.policy": "compact,delete", "retention.ms": out_ms},
        ),
        TopicSpec(
            s.dead_letter_topic,
            s.partitions,
            {"cleanup.policy": "delete", "retention.ms": out_ms},
        ),
        # the on-call's holds: the durable state and the audit trail (streams/worker/state/
        # holds.py); one partition, every worker reads it whole
        TopicSpec(s.holds_topic, 1, dict(compact)),
    ] + [
        TopicSpec(s.changelog_topic(table), n_detect, dict(changelogs[table]), copartitioned=True)
        for table in TABLES
    ]


def ensure_topics(settings: WorkerSettings, timeout: float = 30.0) -> TopicLayout:
    """Create missing topics; verify partition counts. BrokerError / ConfigError on failure."""
    admin = check_broker(settings.bootstrap)
    existing = _partition_counts(admin, timeout)
    specs = topic_specs(settings, existing.get(settings.input_topic))
    missing = [spec for spec in specs if spec.name not in existing]
    if missing:
        new = [
            NewTopic(
                spec.name,
                spec.partitions,
                settings.replication_factor,
                config=spec.config,
            )
            for spec in missing
        ]
        futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        for name, fut in futures.items():
            try:
                fut.result(timeout)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                reason = err.str() if isinstance(err, KafkaError) else str(exc)
                raise BrokerError(f"cannot create topic {name}: {reason}") from None
        _wait_present(admin, [spec.name for spec in missing], timeout)
        existing = _partition_counts(admin, timeout)
    detect = existing[settings.input_topic] if settings.input_keyed_by_run else None
    detect = detect or existing[settings.steps_topic]
    for spec in specs:
        have = existing.get(spec.name)
        if spec.copartitioned and have is not None and have != detect:
            source = settings.input_topic if settings.input_keyed_by_run else settings.steps_topic
            raise ConfigError(
                f"topic {spec.name} has {have} partitions but the detect source {source} has "
                f"{detect}: tables must be co-partitioned with their source; delete {spec.name} "
                "or use a new LOOPWATCH_APP_ID / LOOPWATCH_STEPS_TOPIC"
            )
    return TopicLayout(
        detect_partitions=detect,
        input_partitions=existing[settings.input_topic],
        created=tuple(spec.name for spec in missing),
    )


def _partition_counts(admin: AdminClient, timeout: float) -> dict[str, int]:
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise BrokerError(f"cannot list topics: {exc}") from None
    return {
        name: len(topic.partitions)
        for name, topic in md.topics.items()
        if topic.error is None and topic.partitions
    }


def _wait_present(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Creation completes on the controller first; wait until metadata shows the topics."""
    deadline = time.monotonic() + timeout
    while True:
        counts = _partition_counts(admin, max(0.5, deadline - time.monotonic()))
        if all(name in counts for name in names):
            return
        if time.monotonic() >= deadline:
            absent = [n for n in names if n not in counts]
            raise BrokerError(f"topics not visible {timeout:g} s after creation: {absent}")
        time.sleep(0.1)
