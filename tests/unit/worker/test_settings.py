"""Worker settings from the environment, the topic plan, and `loopwatch worker` failing
with one clear line (exit 2) before any faust machinery starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detectors.errors import ConfigError
from streams.worker.kafka.topics import topic_specs
from streams.worker.settings import WorkerSettings
from tests.paths import REPO
from tests.support.worker_proc import free_port

ROOT = REPO


def test_defaults() -> None:
    s = WorkerSettings.from_env({})
    assert s.bootstrap == "127.0.0.1:19092" and s.input_topic == "otlp_spans"
    assert s.input_encoding == "otlp_proto" and s.input_keyed_by_run is False
    assert s.partitions == 4 and s.store == "rocksdb://" and s.web_host == "127.0.0.1"
    assert (s.web_port, s.metrics_port) == (6066, 9464) and s.max_active_runs == 200_000
    assert s.app_id == "loopwatch" and s.steps_topic == "loopwatch-steps"
    assert s.dead_letter_topic == "loopwatch-dead-letters" and s.api_token is None
    assert s.dlq_capture_payload is False
    assert s.broker_url == "kafka://127.0.0.1:19092"
    assert s.changelog_topic("runs") == "loopwatch-runs-changelog"
    assert (s.fetch_min_kb, s.fetch_max_wait_ms) == (None, 40)


def test_overrides() -> None:
    s = WorkerSettings.from_env(
        {
            "LOOPWATCH_BOOTSTRAP": "a:1,b:2",
            "LOOPWATCH_INPUT_ENCODING": "otlp_json",
            "LOOPWATCH_INPUT_KEYED_BY_RUN": "TRUE",
            "LOOPWATCH_STORE": "memory",
            "LOOPWATCH_PARTITIONS": "8",
            "LOOPWATCH_API_TOKEN": "tok",
            "LOOPWATCH_DLQ_CAPTURE_PAYLOAD": "yes",
            "LOOPWATCH_FETCH_MIN_KB": "0",
            "LOOPWATCH_FETCH_MAX_WAIT_MS": "200",
        }
    )
    assert (s.fetch_min_kb, s.fetch_max_wait_ms) == (0, 200)
    assert s.broker_url == "kafka://a:1,kafka://b:2"
    assert s.input_encoding == "otlp_json" and s.input_keyed_by_run and s.store == "memory://"
    assert s.partitions == 8 and s.api_token == "tok" and s.dlq_capture_payload
    assert s.describe()["api_token"] == "***"
    assert s.canonical_url == "http://127.0.0.1:6066"
    url = WorkerSettings.from_env({"LOOPWATCH_WEB_URL": "http://worker-3.internal:6066/"})
    assert url.canonical_url == "http://worker-3.internal:6066"
    bind_all = WorkerSettings.from_env({"LOOPWATCH_WEB_HOST": "0.0.0.0"})
    assert bind_all.canonical_url == f"http://{socket.gethostname()}:6066"


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("LOOPWATCH_PARTITIONS", "four", "LOOPWATCH_PARTITIONS='four': expected an integer"),
        ("LOOPWATCH_PARTITIONS", "0", "from 1 to"),
        ("LOOPWATCH_INPUT_ENCODING", "avro", "expected one of otlp_proto, otlp_json"),
        ("LOOPWATCH_STORE", "redis://", "expected one of"),
        ("LOOPWATCH_INPUT_KEYED_BY_RUN", "maybe", "expected true or false"),
        ("LOOPWATCH_WEB_PORT", "70000", "LOOPWATCH_WEB_PORT"),
        ("LOOPWATCH_BOOTSTRAP", "localhost", "expected host:port"),
        ("LOOPWATCH_EVENTS_TOPIC", "bad topic!", "Kafka topic name"),
        ("LOOPWATCH_RUNS_TOPIC", "loop_detected", "the same topic as LOOPWATCH_EVENTS_TOPIC"),
        ("LOOPWATCH_METRICS_PORT", "6066", "the same port"),
        ("LOOPWATCH_TICK_SECONDS", "nan", "LOOPWATCH_TICK_SECONDS"),
        ("LOOPWATCH_SESSION_TIMEOUT_SECONDS", "1", ">= 6"),
        ("LOOPWATCH_WEB_URL", "worker:6066", "expected http://HOST:PORT"),
        ("LOOPWATCH_STEPS_GROUPING", "trace", "expected one of partition, run"),
        ("LOOPWATCH_FETCH_PARTITION_MB", "0", "LOOPWATCH_FETCH_PARTITION_MB"),
        ("LOOPWATCH_PRODUCER_BATCH_KB", "1024", "from 16 to 960"),
        ("LOOPWATCH_FETCH_MAX_WAIT_MS", "0", "from 1 to 1500"),
        ("LOOPWATCH_FETCH_MIN_KB", "-1", "LOOPWATCH_FETCH_MIN_KB"),
    ],
)
def test_invalid_values_name_the_variable(name: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        WorkerSettings.from_env({name: value})


def test_topic_plan() -> None:
    s = WorkerSettings.from_env({"LOOPWATCH_PARTITIONS": "6"})
    specs = {spec.name: spec for spec in topic_specs(s, input_partitions=3)}
    assert specs["otlp_spans"].partitions == 3  # an existing input topic is left as it is
    assert specs["loopwatch-steps"].partitions == 6  # the hop: tables follow the steps topic
    for table in ("runs", "finished"):
        spec = specs[f"loopwatch-{table}-changelog"]
        assert spec.partitions == 6 and spec.config["cleanup.policy"] == "compact"
    for table in ("loop_counts", "run_counts"):
        assert specs[f"loopwatch-{table}-changelog"].config["cleanup.policy"] == "compact,delete"
    assert specs["loop_detected"].config["cleanup.policy"] == "delete"
    assert specs["loop_runs"].config["cleanup.policy"] == "compact,delete"
    keyed = WorkerSettings.from_env({"LOOPWATCH_INPUT_KEYED_BY_RUN": "true"})
    specs = {spec.name: spec for spec in topic_specs(keyed, input_partitions=12)}
    # no hop: the tables (and the tick topic) are co-partitioned with the input topic
    assert specs["loopwatch-steps"].partitions == 12
    assert specs["loopwatch-runs-changelog"].partitions == 12


def run_worker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "streams.cli", "worker", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_worker_exits_2_with_one_line_when_the_broker_is_unreachable() -> None:
    started = time.monotonic()
    proc = run_worker(
        {
            "LOOPWATCH_BOOTSTRAP": "127.0.0.1:1",
            "LOOPWATCH_WEB_PORT": str(free_port()),
            "LOOPWATCH_METRICS_PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("loopwatch: error: Kafka broker not reachable at 127.0.0.1:1")
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 30


def test_worker_exits_2_when_the_web_port_is_taken() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = run_worker({"LOOPWATCH_WEB_PORT": str(port), "LOOPWATCH_METRICS_PORT": "0"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"loopwatch: error: web port 127.0.0.1:{port} is in use: stop the other process "
        "or set LOOPWATCH_WEB_PORT"
    )


def test_worker_exits_2_with_one_line_on_bad_settings_or_policy(tmp_path: Path) -> None:
    proc = run_worker({"LOOPWATCH_PARTITIONS": "many"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "loopwatch: error: LOOPWATCH_PARTITIONS='many': expected an integer"
    )
    bad = tmp_path / "policy.yaml"
    bad.write_text("policy_version: x\ndefaults: {allowed_repeats: two}\n")
    proc = run_worker({}, "--config", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "allowed_repeats" in lines[0]


def test_commits_come_often_only_where_the_input_clock_needs_them() -> None:
    """Unkeyed input: the input clock advances with the group's commits (0.25 s); keyed
    input has none, and each faust commit flushes the producer first (1 s). The setting
    overrides both."""
    from streams.worker.faust_app import commit_interval

    assert commit_interval(WorkerSettings.from_env({})) == 0.25
    keyed = WorkerSettings.from_env({"LOOPWATCH_INPUT_KEYED_BY_RUN": "true"})
    assert commit_interval(keyed) == 1.0
    chosen = {"LOOPWATCH_INPUT_KEYED_BY_RUN": "true", "LOOPWATCH_COMMIT_INTERVAL_SECONDS": "2"}
    assert commit_interval(WorkerSettings.from_env(chosen)) == 2.0
    with pytest.raises(ConfigError, match="LOOPWATCH_COMMIT_INTERVAL_SECONDS"):
        WorkerSettings.from_env({"LOOPWATCH_COMMIT_INTERVAL_SECONDS": "0"})


def test_fetches_wait_for_data_on_keyed_input_only_unless_set() -> None:
    """Keyed input: a fetch waits for 128 KiB or 40 ms; unkeyed input keeps faust's
    (0: the patch is not applied). The settings override both."""
    from streams.worker.faust_app import fetch_wait

    assert fetch_wait(WorkerSettings.from_env({})) == (0, 40)
    keyed = {"LOOPWATCH_INPUT_KEYED_BY_RUN": "true"}
    assert fetch_wait(WorkerSettings.from_env(keyed)) == (131072, 40)
    chosen = {"LOOPWATCH_FETCH_MIN_KB": "0", **keyed}
    assert fetch_wait(WorkerSettings.from_env(chosen)) == (0, 40)
    unkeyed = {"LOOPWATCH_FETCH_MIN_KB": "64", "LOOPWATCH_FETCH_MAX_WAIT_MS": "10"}
    assert fetch_wait(WorkerSettings.from_env(unkeyed)) == (65536, 10)
