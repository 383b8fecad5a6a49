"""Canary tests for docs/CONTRACTS.md §3: raw argument and result values, status and exception
messages, model output and plan content never leave the process (embedded path).

Every run here carries unique `CANARY-<kind>-<uuid>` strings in the places customer text
lives; the tests replay the runs and scan everything the process emits or keeps: events,
run summaries, RunState.to_dict() after every span, Step.to_list() (the internal wire),
the engine's stats table, every log record at DEBUG, captured stdout/stderr, and the stdout,
stderr and output files of `loopwatch replay` run as a subprocess. Scans are
case-insensitive and also look for the canary's unique part alone (a lowercased or
truncated copy is still a leak).

Also: keyed fingerprints — two LOOPWATCH_FINGERPRINT_KEYs give different fingerprints and
the same event shapes and triggers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from detectors.fingerprint import Fingerprinter
from detectors.policy import Policy, policy_from_mapping
from streams.cli.replay import format_table
from streams.errors import DecodeError
from streams.replay.engine import Engine
from streams.replay.files import write_jsonl, write_pb
from streams.replay.runs import Replay
from streams.runtime import fingerprinter_from_env
from streams.spanpath.normalize import Normalizer
from streams.spanpath.otlp import decode_json, decode_proto, proto_to_json_bytes
from tests.otlp_build import encode_request
from tests.paths import REPO
from tests.spankit import (
    CANARY_DETECTORS,
    CANARY_SHAPES,
    EXAMPLE_POLICY,
    Canaries,
    Run,
    canary_runs,
)

ROOT = REPO


def _policy_raw() -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(json.dumps(EXAMPLE_POLICY))
    raw["defaults"]["budgets"] = {"steps": 8, "tokens": 5000, "seconds": 300}
    # spankit runs of different traces are 1 000 s of event time apart: keep them all open
    raw["idle_timeout_seconds"] = 100_000
    raw["finalize_grace_seconds"] = 100_000
    return raw


def _policy() -> Policy:
    return policy_from_mapping(_policy_raw(), "<privacy policy>")


def replay_scanned(
    runs: list[Run], c: Canaries, key: bytes | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Engine]:
    """Feed one span per batch, scanning every run state after every span."""
    policy = _policy()
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    invalid: list[str] = []
    fp = Fingerprinter(key)
    engine = Engine(policy, fp, events.append, summaries.append, invalid.append)
    normalizer = Normalizer(policy, fp)
    states = {}
    # interleave the runs (round robin), each run's spans in their own order
    spans = [
        run.spans[i]
        for i in range(max(len(r.spans) for r in runs))
        for run in runs
        if i < len(run.spans)
    ]
    for span in spans:
        step = normalizer.step(span)
        c.assert_absent(f"Step.to_list() of span {span.name!r}", json.dumps(step.to_list()))
        engine.feed([span])
        for run_id, state in engine.runs.items():
            states[run_id] = state
            c.assert_absent(
                f"RunState {run_id} after span {span.name!r}", json.dumps(state.to_dict())
            )
    engine.close()
    for run_id, state in states.items():
        c.assert_absent(f"finalized RunState {run_id}", json.dumps(state.to_dict()))
    c.assert_absent("on_invalid messages", "\n".join(invalid))
    assert not invalid
    return events, summaries, engine


def spill_scanned(runs: list[Run], c: Canaries, key: bytes) -> Replay:
    """`loopwatch replay` over the runs with a memory bound so small that it spills every
    held run to disk: the spill files are scanned before they are read back and removed."""
    with tempfile.TemporaryDirectory() as parent:
        replay = Replay(
            _policy(), Fingerprinter(key), lambda e: None, memory_mb=0.01, spill_dir=parent
        )
        for run in runs:
            replay.feed(run.spans)
        assert replay.order.spilled_steps > 0
        files = list(Path(parent).rglob("*.marshal"))
        assert files
        for path in files:
            c.assert_absent(f"spill file {path.name}", path.read_bytes().decode("latin-1"))
        replay.close()
    return replay


def test_no_canary_in_events_summaries_states_steps_or_logs(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    c = Canaries()
    caplog.set_level(logging.DEBUG)
    runs = canary_runs(c)
    events, summaries, engine = replay_scanned(runs, c, b"privacy-key")

    shapes = {e["shape"] for e in events}
    # the runs exercise (almost) every shape: the scan covers their evidence
    assert shapes >= CANARY_SHAPES, shapes
    assert {e["detector"] for e in events} >= CANARY_DETECTORS
    assert len(summaries) == len(runs)
    for event in events:
        c.assert_absent(f"{event['shape']} event", json.dumps(event))
    for summary in summaries:
        c.assert_absent(f"summary of {summary['run_id']}", json.dumps(summary))
    spilled = spill_scanned(runs, c, b"privacy-key")
    c.assert_absent("stats table", format_table(spilled) + repr(spilled.stats))
    c.assert_absent("log records", caplog.text + repr([r.__dict__ for r in caplog.records]))
    out, err = capsys.readouterr()
    c.assert_absent("stdout/stderr", out + err)


def test_canaries_survive_decoding_but_not_the_engine() -> None:
    """Sanity check of the harness: the canaries are really in the decoded spans."""
    c = Canaries()
    runs = canary_runs(c)
    decoded = decode_proto(encode_request(runs[0].spans), "x")
    assert c.find(repr(decoded))


# ------------------------------------------------------------------ error paths


def _doc_with(span_patch: dict[str, Any]) -> bytes:
    run = Run(trace=201)
    run.tool("lookup_order", {"order_id": "A12"}, {"status": "x"})
    doc = json.loads(proto_to_json_bytes(encode_request(run.spans)))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0].update(span_patch)
    return json.dumps(doc).encode()


def _bad_attr(value: dict[str, Any]) -> dict[str, Any]:
    return {"attributes": [{"key": "gen_ai.tool.call.arguments", "value": value}]}


def _error_cases(c: Canaries) -> list[tuple[str, Any, Any]]:
    run = Run(trace=202)
    secret = c("pb-arg")
    run.tool("lookup_order", {"order_id": secret}, {"status": c("pb-result")})
    pb = encode_request(run.spans)
    at = pb.find(secret.encode())
    return [
        ("proto bad utf-8", decode_proto, pb[:at] + b"\xff\xfe" + pb[at + 2 :]),
        ("proto truncated in value", decode_proto, pb[: at + 20]),
        ("proto garbage around", decode_proto, b"\x0a\xff\xff" + secret.encode() + pb),
        ("json broken", decode_json, b'{"resourceSpans": [' + c("json-raw").encode() + b"]}"),
        ("json bad utf-8", decode_json, c("json-utf8").encode() + b"\xff"),
        ("json intValue", decode_json, _doc_with(_bad_attr({"intValue": c("attr-int")}))),
        ("json doubleValue", decode_json, _doc_with(_bad_attr({"doubleValue": c("attr-dbl")}))),
        ("json boolValue", decode_json, _doc_with(_bad_attr({"boolValue": c("attr-bool")}))),
        ("json bytesValue", decode_json, _doc_with(_bad_attr({"bytesValue": c("attr-b64") + "!"}))),
        (
            "json two kinds",
            decode_json,
            _doc_with(_bad_attr({"stringValue": c("attr-str"), "intValue": "1"})),
        ),
        (
            "json nested",
            decode_json,
            _doc_with(_bad_attr({"arrayValue": {"values": [{"intValue": c("attr-nested")}]}})),
        ),
        ("json traceId", decode_json, _doc_with({"traceId": c("trace-id")})),
        ("json status.message", decode_json, _doc_with({"status": {"message": [c("status")]}})),
        ("json name", decode_json, _doc_with({"name": {"n": c("span-name")}})),
    ]


def test_decode_errors_do_not_echo_payload_values() -> None:
    c = Canaries()
    for label, decode, data in _error_cases(c):
        with pytest.raises(DecodeError) as err:
            decode(data, "topic[3]@42")
        message = str(err.value)
        assert message.startswith("topic[3]@42: "), (label, message)
        c.assert_absent(f"DecodeError ({label}): {message!r}", message)


@pytest.mark.parametrize(
    "patch",
    [
        {"kind": "CANARY-kind"},
        {"startTimeUnixNano": "CANARY-start"},
        {"endTimeUnixNano": "CANARY-end"},
        {"status": {"code": "CANARY-status-code"}},
        {"events": [{"name": "e", "timeUnixNano": "CANARY-event-time"}]},
    ],
    ids=["kind", "start", "end", "status.code", "event.time"],
)
def test_decode_errors_do_not_echo_structural_values(patch: dict[str, Any]) -> None:
    """`_show()` quotes up to 37 characters of a wrong structural value (enum names,
    timestamps) in the message: bytes of the payload end up in stderr and worker logs."""
    with pytest.raises(DecodeError) as err:
        decode_json(_doc_with(patch), "topic[3]@42")
    assert "canary" not in str(err.value).lower(), str(err.value)


@pytest.mark.parametrize(
    ("attrs", "result"),
    [
        ({}, {"ok": False, "code": "Order {} for Jane Roe could not be found"}),
        ({"error.type": "Order {} for Jane Roe could not be found"}, None),
    ],
    ids=["result-code", "error.type"],
)
def test_free_text_error_codes_are_not_copied(attrs: dict[str, Any], result: Any) -> None:
    """Error codes are copied into events (evidence.error_code) and run state, lowercased and
    cut at 64 characters. A `code` that is a sentence is customer text, not a code."""
    c = Canaries()
    secret = c("code")
    run = Run(trace=301)
    for i in range(3):
        res = json.loads(json.dumps(result).replace("{}", secret)) if result else None
        span = run.tool("search_orders", {"query": f"q{i}"}, res)
        for key, value in attrs.items():
            span.attributes[key] = value.replace("{}", secret)
    run.root()
    events, summaries, engine = replay_scanned([run], c, b"k")
    assert events, "argument_churn should fire"
    for event in events:
        c.assert_absent(f"{event['shape']} event", json.dumps(event))


# ------------------------------------------------------------------ loopwatch replay (subprocess)


def write_inputs(directory: Path, c: Canaries) -> list[Run]:
    runs = canary_runs(c)
    messages = [encode_request(run.spans) for run in runs]
    # an undecodable record between good ones: corrupt bytes around a canary
    bad = b"\x0a\xff\xff\xff" + c("undecodable-pb").encode() + b"\xff"
    write_pb(directory / "traces.pb", [messages[0], messages[1], bad, *messages[2:]])
    write_jsonl(
        directory / "bad.jsonl",
        [
            b'{"resourceSpans": [' + c("undecodable-json").encode() + b"]}",
            _doc_with(_bad_attr({"intValue": c("undecodable-attr")})),
        ],
    )
    return runs


def run_cli(directory: Path, key: str | None) -> tuple[subprocess.CompletedProcess[str], str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWATCH_")}
    if key is not None:
        env["LOOPWATCH_FINGERPRINT_KEY"] = key
    env["PYTHONPATH"] = str(ROOT)
    config = directory / "policy.yaml"
    if not config.exists():
        config.write_text(json.dumps(_policy_raw()))  # JSON is YAML
    events_file = directory / f"events-{key}.jsonl"
    runs_file = directory / f"runs-{key}.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "streams.cli",
            "replay",
            "--config",
            str(config),
            "--output",
            str(events_file),
            "--runs",
            str(runs_file),
            str(directory / "traces.pb"),
            str(directory / "bad.jsonl"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return (
        proc,
        events_file.read_text() if events_file.exists() else "",
        (runs_file.read_text() if runs_file.exists() else ""),
    )


def test_replay_subprocess_emits_no_canary(tmp_path: Path) -> None:
    c = Canaries()
    runs = write_inputs(tmp_path, c)
    proc, events, summaries = run_cli(tmp_path, "replay-key")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(summaries.splitlines()) == len(runs)
    assert len(events.splitlines()) >= 10
    assert proc.stderr.count("skipped") >= 3, proc.stderr  # the three undecodable records
    for where, text in (
        ("replay stdout", proc.stdout),
        ("replay stderr", proc.stderr),
        ("replay events", events),
        ("replay run summaries", summaries),
    ):
        c.assert_absent(where, text)


# ------------------------------------------------------------------ keyed fingerprints

SHAPE_FIELDS = (
    "shape",
    "severity",
    "detector",
    "tool_name",
    "count",
    "first_sequence",
    "last_sequence",
    "trigger_span_id",
    "span_ids",
    "call_ids",
    "recommended_action",
    "wasted_steps",
    "budget",
)


def _shape_of(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The events' key-independent fields. Near-duplicates are left out: their similarity
    is estimated from keyed sketches (a different key, a different random projection), so a
    pair of calls near a threshold may be judged either way under two keys."""
    return sorted(
        tuple(json.dumps(e[f], sort_keys=True) for f in ("run_id", *SHAPE_FIELDS))
        for e in events
        if e["detector"] not in CANARY_DETECTORS
    )


def _assert_keyed(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    assert first and _shape_of(first) == _shape_of(second)
    by_trigger = {(e["run_id"], e["shape"], e["trigger_span_id"]): e for e in second}
    compared = 0
    for event in first:
        if event["detector"] in CANARY_DETECTORS:
            continue
        other = by_trigger[(event["run_id"], event["shape"], event["trigger_span_id"])]
        if event["fingerprint"] is None:
            assert other["fingerprint"] is None
            continue
        compared += 1
        assert event["fingerprint"] != other["fingerprint"], event["shape"]
    assert compared >= 5


def test_fingerprints_are_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Canaries()
    runs = canary_runs(c)
    first, _, _ = replay_scanned(runs, c, b"key-one")
    second, _, _ = replay_scanned(runs, c, b"key-two")
    _assert_keyed(first, second)
    same, _, _ = replay_scanned(runs, c, b"key-one")
    assert [e["fingerprint"] for e in same] == [e["fingerprint"] for e in first]

    # the engine's own source of the key: the environment, warned about once when missing
    warnings: list[str] = []
    monkeypatch.setenv("LOOPWATCH_FINGERPRINT_KEY", "env-key-one")
    one = fingerprinter_from_env(warnings.append)
    monkeypatch.setenv("LOOPWATCH_FINGERPRINT_KEY", "env-key-two")
    two = fingerprinter_from_env(warnings.append)
    assert one.keyed and two.keyed and not warnings
    assert one.of_value("t", {"a": 1}) != two.of_value("t", {"a": 1})
    monkeypatch.delenv("LOOPWATCH_FINGERPRINT_KEY")
    unkeyed = fingerprinter_from_env(warnings.append)
    assert not unkeyed.keyed and len(warnings) == 1


def test_replay_subprocess_fingerprints_follow_the_key(tmp_path: Path) -> None:
    c = Canaries()
    write_inputs(tmp_path, c)
    proc_a, events_a, _ = run_cli(tmp_path, "cli-key-a")
    proc_b, events_b, _ = run_cli(tmp_path, "cli-key-b")
    assert proc_a.returncode == 0 and proc_b.returncode == 0, proc_a.stderr[-2000:]
    assert "LOOPWATCH_FINGERPRINT_KEY is not set" not in proc_a.stderr
    first = [json.loads(line) for line in events_a.splitlines()]
    second = [json.loads(line) for line in events_b.splitlines()]
    _assert_keyed(first, second)
    proc_none, events_none, _ = run_cli(tmp_path, None)
    assert proc_none.stderr.count("LOOPWATCH_FINGERPRINT_KEY is not set") == 1
    third = [json.loads(line) for line in events_none.splitlines()]
    _assert_keyed(first, third)
