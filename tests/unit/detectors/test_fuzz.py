"""Fuzzing the three trust boundaries of the pure pipeline (issue "Reliability and security"):

1. the policy loader: arbitrary YAML-like structures and random file bytes raise only
   ConfigError, whose message starts with the source and names a key path; a policy the
   loader accepts can drive the engine;
2. the OTLP decoders: random bytes, mutated valid payloads (bit flips, truncation, splicing),
   random JSON, 10k-deep nesting, huge strings and non-UTF-8 raise only DecodeError naming
   the source;
3. the normalizer + embedded engine: hypothesis-built decoded spans with wrong-typed values
   for every convention key never make `Engine.feed` / `close` raise, and every run that
   had a usable span gets a summary that serializes.
"""

from __future__ import annotations

import json
import math
import random
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from detectors.errors import ConfigError
from detectors.fingerprint import Fingerprinter
from detectors.model import Step
from detectors.policy import (
    _LIMIT_KEYS,
    _PROGRESS_KEYS,
    _TOOL_KEYS,
    _TOP_KEYS,
    Policy,
    load_policy,
    policy_from_mapping,
)
from detectors.policy_defaults import DEFAULT_CONVENTIONS, TERMINATION_REASONS
from detectors.state import RunState
from streams.errors import DecodeError
from streams.replay.engine import Engine
from streams.spanpath.normalize import Normalizer
from streams.spanpath.otlp import decode_json, decode_proto, decode_record, proto_to_json_bytes
from streams.spanpath.spans import SpanEvent, SpanRecord
from tests.otlp_build import encode_request
from tests.spankit import BASE_NS, MS, Run, example_policy

# No shrinking: a failure is reported as found (the explicit tests below keep minimal
# reproducers for every bug found so far), which keeps a failing run inside the CI budget.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
SOURCE = "fuzz/policy.yaml"


# =========================================================================== 1. policy loader

_OTHER_KEYS = {
    "steps",
    "tokens",
    "seconds",
    "attribute",
    "exception_types",
    "message_patterns",
    "finish_reasons",
    *DEFAULT_CONVENTIONS,
}
VALID_KEYS = sorted(_TOP_KEYS | _LIMIT_KEYS | _TOOL_KEYS | _PROGRESS_KEYS | _OTHER_KEYS)
TOOL_NAMES = ["lookup_order", "issue_refund", "get_status", "t"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and infinities included: YAML has .nan / .inf
    st.text(max_size=8),
    st.sampled_from(
        [
            "",
            "trace",
            "conversation",
            "trim",
            "lowercase",
            "sort",
            "shout",
            "turn_limit",
            "final_answer",
            "(?i)x",
            "(",
            "[a-",
            *TOOL_NAMES,
            *TERMINATION_REASONS,
        ]
    ),
    st.binary(max_size=4),  # YAML !!binary
    st.dates(),  # YAML timestamps
)
yaml_like = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(
                st.sampled_from(VALID_KEYS + TOOL_NAMES), st.text(max_size=6), st.integers(0, 3)
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=25,
)


def _policy_shaped() -> st.SearchStrategy[dict[str, Any]]:
    """Mostly-valid skeletons with wrong-typed leaves: reaches the deep validators."""
    limits = st.dictionaries(
        st.sampled_from(sorted(_LIMIT_KEYS)),
        scalars | st.dictionaries(st.sampled_from(["steps", "tokens", "seconds", "x"]), scalars),
        max_size=4,
    )
    progress = st.dictionaries(st.sampled_from(sorted(_PROGRESS_KEYS) + ["x"]), yaml_like)
    tool = st.dictionaries(
        st.sampled_from(sorted(_TOOL_KEYS)),
        st.one_of(
            yaml_like,
            progress,
            st.lists(st.sampled_from(["order_id", "cursor", ""]), max_size=3),
            st.dictionaries(st.text(max_size=4), st.lists(scalars, max_size=2)),
            st.sampled_from(TOOL_NAMES),
        ),
        max_size=5,
    )
    termination = st.dictionaries(
        st.sampled_from(["exception_types", "message_patterns", "finish_reasons", "x"]),
        st.dictionaries(st.text(max_size=6), scalars | st.sampled_from(TERMINATION_REASONS)),
    )
    top_values = st.one_of(
        yaml_like,
        limits,
        st.dictionaries(st.sampled_from(TOOL_NAMES), tool, max_size=3),
        termination,
        st.dictionaries(st.sampled_from(sorted(DEFAULT_CONVENTIONS) + ["x"]), yaml_like),
        st.lists(scalars, max_size=3),
    )
    return st.dictionaries(st.sampled_from(sorted(_TOP_KEYS) + ["x"]), top_values, max_size=6)


FILE_LEVEL = ("invalid YAML", "policy file is not UTF-8", "cannot read policy file")


def assert_config_message(message: str, source: str = SOURCE, file_level: bool = False) -> None:
    """`<source>: <key path>: ...` where the path is `<top level>` or starts at a top key.
    From a file, the problem may instead be the file itself (not UTF-8, YAML syntax)."""
    assert message.startswith(f"{source}: "), message
    rest = message[len(source) + 2 :]
    if file_level and rest.startswith(FILE_LEVEL):
        return
    path = rest.split(": ", 1)[0]
    if path == "" and rest.startswith(": unknown key"):
        return  # an empty key: see test_empty_key_is_named_in_the_message
    assert path, message
    head = path.split(".", 1)[0].split("[", 1)[0]
    assert path == "<top level>" or head in _TOP_KEYS or "unknown key" in rest, message


def _load(raw: Any) -> Policy | None:
    try:
        return policy_from_mapping(raw, SOURCE)
    except ConfigError as exc:
        assert type(exc) is ConfigError
        assert_config_message(str(exc))
        return None


def _tiny_run(policy: Policy) -> None:
    """An accepted policy must be able to drive the engine through a small looping run."""
    run = Run()
    for _ in range(3):
        run.tool("lookup_order", {"order_id": "A1"}, {"status": "x"})
    run.llm(100, 10)
    run.llm(10, 10)
    run.root()
    summaries: list[dict[str, Any]] = []
    engine = Engine(policy, Fingerprinter(b"k"), lambda e: None, summaries.append)
    engine.feed(run.spans)
    engine.close()
    assert len(summaries) == 1


@FUZZ
@given(yaml_like | _policy_shaped())
def test_policy_from_mapping_raises_only_config_error(raw: Any) -> None:
    _load(raw)


@FUZZ
@given(_policy_shaped())
def test_accepted_policies_drive_the_engine(raw: Any) -> None:
    """Whatever the loader accepts is usable: no late crash in the engine (finite numbers;
    NaN and infinity are covered by test_non_finite_numbers_are_rejected_or_usable)."""

    def finite(x: Any) -> bool:
        if isinstance(x, float):
            return math.isfinite(x)
        if isinstance(x, dict):
            return all(finite(v) for v in x.values())
        if isinstance(x, list):
            return all(finite(v) for v in x)
        return True

    assume(finite(raw))
    policy = _load(raw)
    if policy is not None:
        _tiny_run(policy)


@pytest.mark.parametrize(
    "raw",
    [
        {"idle_timeout_seconds": math.nan},
        {"idle_timeout_seconds": math.inf},
        {"allowed_lateness_seconds": math.nan},
        {"allowed_lateness_seconds": math.inf},
        {"finalize_grace_seconds": math.nan},
        {"finalize_grace_seconds": math.inf},
        {"defaults": {"budgets": {"seconds": math.nan}}},
        {"defaults": {"token_drop_ratio": math.nan}},
    ],
    ids=lambda raw: json.dumps(raw),
)
def test_non_finite_numbers_are_rejected_or_usable(raw: dict[str, Any]) -> None:
    """YAML `.nan` / `.inf` pass `_Reader.number` (NaN < 0 is false); the engine then does
    int(seconds * 1e9) and dies with ValueError/OverflowError at startup or at the first
    span. NaN is never a meaningful setting (a NaN budget silently never fires): it must be
    a ConfigError. Infinity must be refused or work."""
    if "NaN" in json.dumps(raw):
        with pytest.raises(ConfigError) as err:
            policy_from_mapping(raw, SOURCE)
        assert_config_message(str(err.value))
        return
    policy = _load(raw)
    if policy is not None:
        _tiny_run(policy)


@pytest.mark.parametrize(
    "pattern",
    ["a{4294967296}", "x{99999999999999999999}", "(" * 2000 + ")" * 2000, "[a-", "(?P<"],
)
def test_invalid_message_patterns_are_config_errors(pattern: str) -> None:
    """re.compile raises OverflowError ("the repetition number is too large") and
    RecursionError (deep groups), not only re.error: all must become ConfigError."""
    raw = {"termination": {"message_patterns": {pattern: "turn_limit"}}}
    with pytest.raises(ConfigError) as err:
        policy_from_mapping(raw, SOURCE)
    assert_config_message(str(err.value))
    assert "termination.message_patterns" in str(err.value)


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"": 1}, "''"),
        ({"tools": {"t": {"": 1}}}, "tools.t.''"),
        ({"defaults": {"budgets": {"": 1}}}, "defaults.budgets.''"),
    ],
)
def test_empty_key_is_named_in_the_message(raw: dict[str, Any], where: str) -> None:
    """YAML allows `"": 1`; the message must still show which key: today it reads
    `fuzz/policy.yaml: : unknown key; ...` (top level) or `tools.t.: unknown key`."""
    with pytest.raises(ConfigError) as err:
        policy_from_mapping(raw, SOURCE)
    assert str(err.value).startswith(f"{SOURCE}: {where}: unknown key"), str(err.value)


@pytest.mark.parametrize(
    "raw",
    [
        {"idle_timeout_seconds": 10**400},
        {"allowed_lateness_seconds": 1e300},
        {"finalize_grace_seconds": 2**70},
        {"defaults": {"budgets": {"seconds": 10**400}}},
    ],
    ids=["int-10^400", "float-1e300", "int-2^70", "budget-10^400"],
)
def test_huge_numbers_are_rejected_or_usable(raw: dict[str, Any]) -> None:
    """`_Reader.number` does float(value): 10**400 raises OverflowError inside the loader;
    1e300 seconds passes and then int(1e300 * 1e9) overflows in the engine."""
    policy = _load(raw)
    if policy is not None:
        _tiny_run(policy)


def test_yaml_reader_error_is_explained(tmp_path: Path) -> None:
    """A control character makes PyYAML raise ReaderError, which has no `problem`:
    the message today is `<file>: invalid YAML: invalid YAML`."""
    path = _yaml_file(tmp_path, b"policy_version: x\ndefaults:\x00 {}\n")
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    message = str(err.value)
    assert_config_message(message, str(path), file_level=True)
    assert message != f"{path}: invalid YAML: invalid YAML"
    assert "line 2" in message or "character" in message, message


def _yaml_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_bytes(data)
    return path


def _load_file(path: Path) -> None:
    try:
        load_policy(path)
    except ConfigError as exc:
        assert type(exc) is ConfigError
        assert_config_message(str(exc), str(path), file_level=True)


YAML_ALPHABET = "[]{}:-,&*!|>'\"\n #%@`?ax1.~\t"


@FUZZ
@given(
    st.binary(max_size=200)
    | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass"))
    | st.text(alphabet=YAML_ALPHABET, max_size=200).map(str.encode)
)
def test_load_policy_on_random_bytes_raises_only_config_error(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    _load_file(_yaml_file(tmp_path_factory.mktemp("p"), data))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "{a: " * 3000,
        "- " * 3000 + "x",
        "defaults:\n  budgets: " + "[" * 3000,
        "!!python/object:os.system {}",
        "a: &a [*a]",
        "tools: {? [a, b] : c}",
    ],
    ids=[
        "deep-flow-seq",
        "deep-flow-map",
        "deep-block-seq",
        "deep-under-key",
        "tag",
        "alias",
        "key",
    ],
)
def test_load_policy_hostile_yaml(tmp_path: Path, text: str) -> None:
    """PyYAML's composer is recursive: deep nesting raises RecursionError, not YAMLError."""
    _load_file(_yaml_file(tmp_path, text.encode()))


# =========================================================================== 2. decoders


def _valid_run() -> Run:
    run = Run(trace=7, sequenced=True)
    run.tool("lookup_order", {"order_id": "A12", "note": "é✓"}, {"status": "ok", "version": 3})
    run.tool("lookup_order", "A12", [1, 2.5, None, {"k": [True]}], error="not_found")
    run.llm(tool_calls=[("a", {"x": 1}), ("b", {"y": 2})])
    run.plan([{"tool": "lookup_order", "arguments": {"order_id": "A12"}}])
    run.handoff("support", "billing")
    span = run.other("weird", {"bytes": b"\x00\xff", "arr": [1, "a"], "kv": {"a": {"b": 1.5}}})
    span.events.append(SpanEvent("exception", span.end_ns, {"exception.type": "E"}))
    run.root()
    return run


_PAYLOADS: dict[str, bytes] = {}


def valid_pb() -> bytes:
    if "pb" not in _PAYLOADS:
        _PAYLOADS["pb"] = encode_request(_valid_run().spans)
        other = Run(trace=9)
        other.tool("search_orders", {"query": "x" * 40}, {"ids": list(range(20))})
        other.root()
        _PAYLOADS["pb2"] = encode_request(other.spans)
        _PAYLOADS["json"] = proto_to_json_bytes(_PAYLOADS["pb"])
        _PAYLOADS["json2"] = proto_to_json_bytes(_PAYLOADS["pb2"])
    return _PAYLOADS["pb"]


def check_decode(decode: Any, data: Any, source: str = "fuzz#3") -> list[SpanRecord]:
    """Either spans, or exactly DecodeError whose message starts with the source."""
    try:
        out = decode(data, source)
    except DecodeError as exc:
        assert type(exc) is DecodeError
        assert str(exc).startswith(f"{source}: "), str(exc)
        assert len(str(exc)) < 400, str(exc)[:400]
        return []
    assert isinstance(out, list) and all(isinstance(s, SpanRecord) for s in out)
    return out


def drive(spans: list[SpanRecord], policy: Policy | None = None) -> list[dict[str, Any]]:
    """Decoded spans through the engine: must not raise; summaries must serialize."""
    summaries: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    engine = Engine(
        policy or example_policy(), Fingerprinter(b"k"), events.append, summaries.append
    )
    engine.feed(spans)
    engine.close()
    json.dumps(events)
    json.dumps(summaries)
    assert engine.stats.runs_finished == engine.stats.runs_started == len(summaries)
    return summaries


def mutate(data: st.DataObject, buf: bytearray, splice: bytes) -> bytes:
    for _ in range(data.draw(st.integers(1, 6), label="mutations")):
        if not buf:
            break
        op = data.draw(st.sampled_from(["bit", "byte", "truncate", "insert", "delete", "splice"]))
        i = data.draw(st.integers(0, len(buf) - 1))
        if op == "bit":
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "byte":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i : i + data.draw(st.integers(1, 16))]
        else:  # splice: our prefix + a suffix of another valid payload
            j = data.draw(st.integers(0, len(splice)))
            buf[i:] = splice[j:]
    return bytes(buf)


@FUZZ
@given(st.binary(max_size=400))
def test_decoders_on_random_bytes(data: bytes) -> None:
    check_decode(decode_proto, data)
    check_decode(decode_json, data)
    for encoding in ("otlp_proto", "otlp_json"):
        check_decode(lambda d, s, e=encoding: decode_record(d, e, s), data)


@FUZZ
@given(st.data())
def test_mutated_protobuf_payloads(data: st.DataObject) -> None:
    valid_pb()
    mutated = mutate(data, bytearray(_PAYLOADS["pb"]), _PAYLOADS["pb2"])
    spans = check_decode(decode_proto, mutated)
    if spans:
        drive(spans)


@FUZZ
@given(st.data())
def test_mutated_json_payloads(data: st.DataObject) -> None:
    valid_pb()
    mutated = mutate(data, bytearray(_PAYLOADS["json"]), _PAYLOADS["json2"])
    spans = check_decode(decode_json, mutated)
    if spans:
        drive(spans)


json_docs = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "traceId",
                    "spanId",
                    "attributes",
                    "key",
                    "value",
                    "stringValue",
                    "arrayValue",
                    "kvlistValue",
                    "values",
                    "events",
                    "status",
                    "kind",
                    "resource",
                ]
            )
            | st.text(max_size=5),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@FUZZ
@given(json_docs)
def test_random_json_documents(doc: Any) -> None:
    text = json.dumps(doc)
    check_decode(decode_json, text.encode())
    check_decode(decode_json, text)  # str input is accepted too


def _nested_json_attr(depth: int, kind: str) -> bytes:
    value = '{"stringValue":"leaf"}'
    for _ in range(depth):
        if kind == "array":
            value = '{"arrayValue":{"values":[' + value + "]}}"
        else:
            value = '{"kvlistValue":{"values":[{"key":"k","value":' + value + "}]}}"
    span = (
        '{"traceId":"' + "ab" * 16 + '","spanId":"' + "cd" * 8 + '","name":"n",'
        '"attributes":[{"key":"deep","value":' + value + "}]}"
    )
    return ('{"resourceSpans":[{"scopeSpans":[{"spans":[' + span + "]}]}]}").encode()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _nested_pb_attr(depth: int) -> bytes:
    value = _ld(1, b"leaf")  # AnyValue.string_value
    for _ in range(depth):
        value = _ld(5, _ld(1, value))  # AnyValue.array_value { values: value }
    kv = _ld(1, b"deep") + _ld(2, value)  # KeyValue
    span = _ld(1, b"\xab" * 16) + _ld(2, b"\xcd" * 8) + _ld(9, kv)  # Span
    return _ld(1, _ld(2, _ld(2, span)))  # ExportTraceServiceRequest.resource_spans.scope_spans


@pytest.mark.parametrize("depth", [65, 1_000, 10_000])
@pytest.mark.parametrize("kind", ["array", "kvlist"])
def test_deeply_nested_json_attribute_values(depth: int, kind: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_json(_nested_json_attr(depth, kind), "deep.jsonl:1")
    assert str(err.value).startswith("deep.jsonl:1: ")


@pytest.mark.parametrize("depth", [50, 1_000, 10_000])
def test_deeply_nested_protobuf_attribute_values(depth: int) -> None:
    spans = check_decode(decode_proto, _nested_pb_attr(depth), "deep.pb#1")
    if spans:
        drive(spans)


def test_deeply_nested_json_documents() -> None:
    for doc in ("[" * 100_000, '{"a":' * 100_000, '{"resourceSpans":' + "[" * 50_000):
        check_decode(decode_json, doc.encode(), "doc.json")


def test_huge_strings_decode_and_normalize() -> None:
    big = "x" * (4 << 20)
    run = Run()
    run.tool("lookup_order", {"order_id": big}, {"blob": big})
    run.other(big[:100_000], {big[:1000]: big})
    run.root()
    pb = encode_request(run.spans)
    spans = check_decode(decode_proto, pb, "big.pb#1")
    assert len(spans) == 3
    assert len(check_decode(decode_json, proto_to_json_bytes(pb), "big.jsonl:1")) == 3
    drive(spans)


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"],
    ids=["ff", "bad-continuation", "encoded-surrogate", "above-max", "lone-continuation"],
)
def test_non_utf8_strings(bad: bytes) -> None:
    pb = valid_pb()
    at = pb.find(b"order_id")  # same length: the protobuf framing stays valid
    check_decode(decode_proto, pb[:at] + bad + pb[at + len(bad) :])
    doc = _PAYLOADS["json"]
    at = doc.find(b"A12")
    check_decode(decode_json, doc[:at] + bad + doc[at:])


def test_decode_record_edge_inputs() -> None:
    pb = valid_pb()
    for value, encoding in [
        (None, "otlp_proto"),
        (pb, "otlp_yaml"),
        (pb, ["otlp_proto"]),
        ("text", "otlp_proto"),
        (12, "otlp_json"),
        (memoryview(pb), "otlp_proto"),
        (bytearray(_PAYLOADS["json"]), "otlp_json"),
        (b"", "otlp_proto"),
        (b"", "otlp_json"),
    ]:
        check_decode(lambda d, s, e=encoding: decode_record(d, e, s), value, "topic[0]@5")


# =========================================================================== 3. normalizer + engine

# The keys the normalizer reads, every one of them a target for a wrong-typed value.
CONVENTION_KEYS = sorted(
    {key for keys in DEFAULT_CONVENTIONS.values() for key in keys}
    | {
        "agent.step.sequence",
        "gen_ai.step.sequence",
        "langgraph_step",
        "traceloop.association.properties.langgraph_step",
        "traceloop.entity.input",
        "traceloop.entity.output",
        "agent.task_type",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.name",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments",
        "llm.output_messages.0.message.tool_calls.1.tool_call.function.name",
        "exception.type",
        "exception.message",
        "loop_guard.reason",
    }
)
OPERATIONS = [
    "execute_tool",
    "chat",
    "plan",
    "handoff",
    "invoke_agent",
    "summarize",
    "create_agent",
    "text_completion",
]
DEEP_ARRAY = "[" * 10_000 + "]" * 10_000
DEEP_OBJECT = '{"a":' * 10_000 + "1" + "}" * 10_000
NASTY_STRINGS = [
    "",
    " ",
    "null",
    "true",
    "-",
    "-0",
    "1e999",
    "-1e999",
    "NaN",
    "9" * 5000,
    "9" * 400,
    "-" + "9" * 400,
    "١٢",  # non-ASCII digits
    "{bad json",
    "[1,",
    '"just a string"',
    '{"ok": false, "code": ["x"]}',
    '{"ok": false, "error": {"code": {"a": 1}}}',
    '{"inputs": [1, 2]}',
    '{"input_str": "{\'order_id\': 1}"}',
    '{"type": "tool", "data": {"content": {"x": 1}, "tool_call_id": 5}}',
    '{"output": {"lc": 1, "id": ["ToolMessage"], "kwargs": {"content": null}}}',
    '{"messages": [{"data": {"content": 5}}]}',
    '[{"parts": [{"type": "tool_call", "name": null, "arguments": "[["}]}]',
    '[{"tool": {"x": 1}, "args": [1]}, 5, null]',
    '{"agent.step.sequence": "x", "langgraph_step": 2.5}',
    DEEP_ARRAY,
    DEEP_OBJECT,
    "x" * 70_000,
    "execute_tool",
    "TOOL",
    "LLM",
    "AGENT",
    "handoff to ",
    "a.b.c",
    "transfer_to_",
]

leaf_values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(OPERATIONS),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 2**63 - 1, -(2**63)]),
    st.floats(),
    st.binary(max_size=8),
)
attr_values = st.recursive(
    leaf_values,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
attr_dicts = st.dictionaries(
    st.sampled_from(CONVENTION_KEYS) | st.text(max_size=8), attr_values, max_size=10
)
TRACE_POOL = ["ab" * 16, "cd" * 16, "0" * 31 + "1"]
odd_ids = st.one_of(
    st.text(alphabet="0123456789abcdef", max_size=40),
    st.text(alphabet=string.printable, max_size=20),
)
span_names = st.one_of(
    st.sampled_from(
        [
            "execute_tool lookup_order",
            "execute_tool ",
            "lookup_order.tool",
            ".tool",
            "handoff to billing",
            "handoff to ",
            "transfer_to_x.tool",
            "plan",
            "summarize_history",
            "chat gpt",
            "invoke_agent support",
            "",
        ]
    ),
    st.text(max_size=10),
)
times = st.one_of(
    st.integers(0, 2**64 - 1),
    st.integers(BASE_NS, BASE_NS + 60_000 * MS),
)
events = st.lists(
    st.builds(
        SpanEvent,
        st.sampled_from(["exception", "loop_guard"]) | st.text(max_size=6),
        times,
        attr_dicts,
    ),
    max_size=3,
)


@st.composite
def span_records(draw: st.DrawFn) -> SpanRecord:
    trace_id = draw(st.sampled_from(TRACE_POOL) | odd_ids)
    span_id = draw(st.sampled_from(["00000000000000a1", "00000000000000a2"]) | odd_ids)
    parent = draw(st.none() | st.sampled_from(["00000000000000a1", "00000000000000ff"]) | odd_ids)
    attrs = draw(attr_dicts)
    op = draw(st.none() | st.sampled_from(OPERATIONS))
    if op is not None:
        attrs.setdefault("gen_ai.operation.name", op)
    return SpanRecord(
        trace_id,
        span_id,
        parent,
        draw(span_names),
        draw(st.integers(0, 5)),
        draw(times),
        draw(times),
        draw(st.integers(0, 2)),
        draw(st.text(max_size=20) | st.sampled_from(["Max turns exceeded", "429 rate limit"])),
        attrs,
        draw(
            st.dictionaries(
                st.sampled_from(
                    [
                        "service.name",
                        "prompt.version",
                        "tool.version",
                        "agent.task_type",
                        "session.id",
                    ]
                )
                | st.text(max_size=4),
                attr_values,
                max_size=4,
            )
        ),
        draw(events),
        draw(st.text(max_size=5)),
    )


def _policies() -> list[Policy]:
    return [
        example_policy(),
        example_policy(run_key="conversation", sequence_attributes=["agent.step.sequence"]),
        example_policy(run_key="gen_ai.tool.name", max_pending_steps=2, allowed_lateness_seconds=0),
    ]


POLICIES = _policies()


def _feed_checked(policy: Policy, batches: list[list[SpanRecord]]) -> None:
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    invalid: list[str] = []
    fp = Fingerprinter(b"fuzz-key")
    engine = Engine(policy, fp, events.append, summaries.append, invalid.append)
    normalizer = Normalizer(policy, fp)
    for batch in batches:
        engine.feed(batch)
        for state in engine.runs.values():
            data = json.loads(json.dumps(state.to_dict()))
            RunState.from_dict(data)
        for span in batch:
            try:
                step = normalizer.step(span)
            except Exception:  # noqa: BLE001 - the engine's own handling is what is tested
                continue
            wire = json.loads(json.dumps(step.to_list()))
            assert Step.from_list(wire).span_id == step.span_id
    engine.close()
    assert not engine.runs
    assert engine.stats.runs_finished == engine.stats.runs_started == len(summaries)
    assert engine.stats.invalid_spans == len(invalid)
    if engine.stats.spans > engine.stats.invalid_spans:
        assert summaries, "usable spans but no run summary"
    json.dumps(events)
    json.dumps(summaries)
    for message in invalid:  # names ids and an exception type, nothing else
        assert message.startswith("span ") and len(message) < 300


@settings(FUZZ, max_examples=70)
@given(
    st.sampled_from(range(len(POLICIES))),
    st.lists(st.lists(span_records(), min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_engine_never_raises_on_arbitrary_decoded_spans(
    policy_index: int, batches: list[list[SpanRecord]]
) -> None:
    _feed_checked(POLICIES[policy_index], batches)


def _tool_span(n: int, **attrs: Any) -> SpanRecord:
    start = BASE_NS + n * 100 * MS
    base = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup_order"}
    base.update(attrs)
    return SpanRecord(
        "ab" * 16,
        f"{n + 1:016x}",
        "f" * 16,
        "execute_tool",
        1,
        start,
        start + 50 * MS,
        0,
        "",
        base,
        {},
    )


@pytest.mark.parametrize(
    ("kind", "attrs"),
    [
        ("tool", {"gen_ai.tool.call.arguments": DEEP_ARRAY}),
        ("tool", {"input.value": DEEP_OBJECT}),
        ("tool", {"gen_ai.tool.call.result": DEEP_OBJECT}),
        ("tool", {"output.value": '{"output": ' + DEEP_ARRAY + "}"}),
        ("tool", {"metadata": DEEP_OBJECT}),
        ("plan", {"gen_ai.operation.name": "plan", "gen_ai.plan.steps": DEEP_ARRAY}),
        ("llm", {"gen_ai.operation.name": "chat", "gen_ai.output.messages": DEEP_ARRAY}),
        (
            "llm",
            {
                "gen_ai.operation.name": "chat",
                "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "a",
                "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": DEEP_ARRAY,
                "llm.output_messages.0.message.tool_calls.1.tool_call.function.name": "b",
            },
        ),
        (
            "root",
            {
                "gen_ai.operation.name": "invoke_agent",
                "output.value": '{"messages": ' + DEEP_ARRAY + "}",
            },
        ),
    ],
    ids=[
        "arguments",
        "input.value",
        "result",
        "output.value",
        "metadata",
        "plan-steps",
        "output-messages",
        "openinference-tool-call-args",
        "root-output",
    ],
)
def test_deeply_nested_json_strings_in_attributes(kind: str, attrs: dict[str, Any]) -> None:
    """A 20 kB string attribute holding 10k-deep JSON: json.loads raises RecursionError,
    which `_as_json` does not catch (only ValueError) and Engine.feed does not catch either."""
    span = _tool_span(0, **attrs)
    if kind == "root":
        span.parent_span_id = None
    _feed_checked(example_policy(), [[span]])


def test_json_nested_just_below_the_parser_limit() -> None:
    """Near the interpreter's recursion limit json.loads in `_as_json` still succeeds and the
    digest a few frames deeper (canonical -> json.dumps, then the repr fallback) raises
    RecursionError; which depths do so depends on the caller's stack (pytest, the replay
    CLI, the faust worker), so a window of depths is fed, as arguments and as results."""
    spans = []
    for n, depth in enumerate(range(900, 1_000)):
        key = "gen_ai.tool.call.arguments" if n % 2 else "gen_ai.tool.call.result"
        spans.append(_tool_span(n, **{key: "[" * depth + "]" * depth}))
    for span in spans:
        _feed_checked(example_policy(), [[span]])


@pytest.mark.parametrize(
    "tokens",
    ["9" * 400, "9" * 4299, 2**63 - 1, -(2**63), "-" + "9" * 400],
    ids=["400-digit-string", "4299-digit-string", "int64-max", "int64-min", "negative-400-digits"],
)
def test_hostile_token_counts(tokens: Any) -> None:
    """Token attributes arrive as strings too (`_as_int` parses up to 4300 digits). Two LLM
    spans with 10**400 tokens make `previous * (1 - token_drop_ratio)` overflow a float
    (OverflowError out of detectors/context.py via Engine.feed); sums past 4300 digits
    would also break json.dumps of the summary and of RunState."""
    spans = []
    for n in range(25):
        span = _tool_span(
            n, **{"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": tokens}
        )
        span.name = "chat"
        spans.append(span)
    _feed_checked(example_policy(), [spans[:5], spans[5:]])
    summaries = drive(spans)
    assert 0 <= summaries[0]["tokens"] < 10**30, "token counts are not clamped to a sane range"


def test_fuzz_corpus_of_wrong_types_for_every_convention_key() -> None:
    """Deterministic sweep: every convention key × a set of wrong-typed values, on tool,
    LLM, plan, handoff and root spans (what the hypothesis test samples, exhaustively)."""
    rng = random.Random(1234)
    wrong: list[Any] = [
        5,
        -7,
        2.5,
        math.nan,
        math.inf,
        True,
        b"\xff\x00",
        [1, "a", None],
        {"a": [1, {"b": 2}]},
        [],
        {},
        "",
        "{bad",
        "[1,",
        "9" * 5000,
        "x" * 10_000,
    ]
    spans = []
    n = 0
    for key in CONVENTION_KEYS:
        for value in wrong:
            op = rng.choice(OPERATIONS)
            span = _tool_span(n, **{"gen_ai.operation.name": op, key: value})
            span.name = rng.choice(["execute_tool x", "handoff to b", "plan", "chat", "y.tool"])
            if n % 17 == 0:
                span.parent_span_id = None
            span.events = [
                SpanEvent("exception", span.end_ns, {key: value, "exception.type": value})
            ]
            span.status_code = n % 3
            spans.append(span)
            n += 1
    for policy in POLICIES:
        _feed_checked(policy, [spans[i : i + 50] for i in range(0, len(spans), 50)])


@FUZZ
@example(
    b"\xff\xfe",
)
@given(st.binary(max_size=64))
def test_bytes_attribute_values_everywhere(raw: bytes) -> None:
    spans = [
        _tool_span(0, **{"gen_ai.tool.call.arguments": raw, "gen_ai.tool.call.result": raw}),
        _tool_span(1, **{"gen_ai.tool.name": raw, "gen_ai.tool.call.id": raw}),
        _tool_span(2, **{"agent.step.sequence": raw, "gen_ai.usage.input_tokens": raw}),
    ]
    _feed_checked(example_policy(), [spans])
