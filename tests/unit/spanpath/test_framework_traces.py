"""Traces recorded from REAL agent frameworks (tests/fixtures/frameworks, see its README.md).

The fixtures were produced by LangGraph and the OpenAI Agents SDK driven by scripted models,
instrumented by OpenInference (and OpenLLMetry), encoded by the OpenTelemetry SDK's own OTLP
encoder. This file only reads the committed files and replays them through the engine.

Every expectation below comes from what the recorded run did (the script of its model and
the documented detection rules), never from running the detector: the scripted model asked
for lookup_order(order_id="A12") every turn, the tool returned {"status": "delivered",
"version": 7} every time, and the frameworks stopped the runs at their turn limits.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from detectors.fingerprint import Fingerprinter
from detectors.model import HANDOFF, TOOL, Step
from detectors.policy import Policy, policy_from_mapping
from streams.replay.engine import Engine
from streams.spanpath.normalize import Normalizer
from streams.spanpath.otlp import OTLP_JSON, OTLP_PROTO, decode_record
from streams.spanpath.spans import STATUS_ERROR, SpanRecord
from tests.paths import FIXTURES as ALL_FIXTURES

FIXTURES = ALL_FIXTURES / "frameworks"

LG_LOOP = "langgraph__recursion_loop.pb"
LG_LOOP_JSON = "langgraph__recursion_loop.jsonl"
LG_LOOP_OLL = "langgraph__recursion_loop__openllmetry.pb"
LG_CLEAN = "langgraph__clean.pb"
LG_DIFFERENT = "langgraph__different_orders.pb"
LG_PREBUILT = "langgraph__prebuilt_remaining_steps.pb"
OA_LOOP = "openai_agents__max_turns_loop.pb"
OA_PING_PONG = "openai_agents__handoff_ping_pong.pb"

# The name each instrumentation gives the lookup_order tool span.
TOOL_SPAN_NAME = {
    LG_LOOP: "lookup_order",
    LG_LOOP_OLL: "execute_tool lookup_order",
    LG_CLEAN: "lookup_order",
    LG_DIFFERENT: "lookup_order",
    LG_PREBUILT: "lookup_order",
    OA_LOOP: "lookup_order",
}
LOOPS = (LG_LOOP, LG_LOOP_OLL, OA_LOOP)

# The example support agent's contract for lookup_order (examples/loopwatch.yaml).
POLICY: dict[str, Any] = {
    "policy_version": "framework-fixtures.1",
    "defaults": {"allowed_repeats": 2, "window": 8},
    "tools": {
        "lookup_order": {
            "identity": ["order_id", "include_items"],
            "defaults": {"include_items": False},
            "progress": {"version_field": "version"},
        }
    },
}


def policy(with_contracts: bool = True) -> Policy:
    raw = dict(POLICY)
    if not with_contracts:
        raw.pop("tools")
    return policy_from_mapping(raw, "<framework fixtures policy>")


# ---------------------------------------------------------------------------- reading


def _read_messages(path: Path) -> list[tuple[str, bytes]]:
    """(encoding, payload) per export message; the Collector fileexporter framing."""
    try:
        from streams.replay.files import iter_payloads
    except ImportError:  # streams/replay/files.py not there: read the framing here
        data = path.read_bytes()
        if path.suffix == ".jsonl":
            return [(OTLP_JSON, line) for line in data.splitlines() if line.strip()]
        out, offset = [], 0
        while offset < len(data):
            (n,) = struct.unpack_from(">I", data, offset)
            out.append((OTLP_PROTO, data[offset + 4 : offset + 4 + n]))
            offset += 4 + n
        assert offset == len(data), f"{path}: trailing bytes"
        return out
    return [(p.encoding, p.data) for p in iter_payloads([path])]


def batches(name: str) -> list[list[SpanRecord]]:
    path = FIXTURES / name
    return [
        decode_record(data, enc, f"{name}#{i}")
        for i, (enc, data) in enumerate(_read_messages(path), 1)
    ]


def spans(name: str) -> list[SpanRecord]:
    """All spans of the fixture in start order (the order the run did them)."""
    return sorted(
        (s for batch in batches(name) for s in batch), key=lambda s: (s.start_ns, s.end_ns)
    )


def tool_spans(name: str) -> list[SpanRecord]:
    return [s for s in spans(name) if s.name == TOOL_SPAN_NAME[name]]


def handoff_spans(name: str) -> list[SpanRecord]:
    return [s for s in spans(name) if s.name.startswith("handoff to ")]


def root(name: str) -> SpanRecord:
    (found,) = [s for s in spans(name) if s.parent_span_id is None]
    return found


def replay(
    name: str, pol: Policy | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    invalid: list[str] = []
    engine = Engine(
        pol or policy(), Fingerprinter(b"test-key"), events.append, summaries.append, invalid.append
    )
    for batch in batches(name):
        engine.feed(batch)
    engine.close()
    assert invalid == []
    assert len(summaries) == 1, "each fixture holds exactly one run (one trace)"
    return events, summaries


def steps(name: str, pol: Policy | None = None) -> list[Step]:
    normalizer = Normalizer(pol or policy(), Fingerprinter(b"test-key"))
    return [normalizer.step(s) for s in spans(name)]


def only(events: list[dict[str, Any]], shape: str) -> dict[str, Any]:
    found = [e for e in events if e["shape"] == shape]
    assert len(found) == 1, [e["shape"] for e in events]
    return found[0]


# ---------------------------------------------------------------------------- the files


def test_every_fixture_is_small_and_decodes():
    names = sorted(p.name for p in FIXTURES.iterdir() if p.suffix in (".pb", ".jsonl"))
    here = [LG_LOOP, LG_LOOP_JSON, LG_LOOP_OLL, LG_CLEAN, LG_DIFFERENT, LG_PREBUILT, OA_LOOP]
    here.append(OA_PING_PONG)
    # the other frameworks' recordings come with facts files (test_framework_profiles.py)
    others = [n for n in names if n not in here]
    assert set(here) <= set(names)
    assert all((FIXTURES / (n.split(".")[0] + ".facts.json")).exists() for n in others), others
    for name in here:
        assert (FIXTURES / name).stat().st_size < 200_000
        found = spans(name)
        assert len({s.trace_id for s in found}) == 1
        assert len({s.span_id for s in found}) == len(found)


def test_otlp_json_and_protobuf_of_one_run_decode_to_the_same_spans():
    def key(s: SpanRecord) -> str:
        return s.span_id

    from_pb = sorted(spans(LG_LOOP), key=key)
    from_json = sorted(spans(LG_LOOP_JSON), key=key)
    assert from_pb == from_json


def test_what_the_recorded_runs_did():
    # LangGraph with recursion_limit=8: agent, tools, agent, ... -> 4 tool calls, then raised.
    assert len(tool_spans(LG_LOOP)) == 4
    assert len(tool_spans(LG_LOOP_OLL)) == 4
    assert len(tool_spans(LG_CLEAN)) == 1
    assert len(tool_spans(LG_DIFFERENT)) == 3  # A12, B34, C56
    assert len(tool_spans(LG_PREBUILT)) == 3  # the prebuilt agent stops itself one turn early
    for name in (LG_LOOP, LG_LOOP_OLL):
        top = root(name)
        assert top.status_code == STATUS_ERROR
        assert [e.attributes["exception.type"] for e in top.events if e.name == "exception"] == [
            "langgraph.errors.GraphRecursionError"
        ]
    # Agents SDK with max_turns=6: 6 tool calls / 6 handoffs, then MaxTurnsExceeded.
    assert len(tool_spans(OA_LOOP)) == 6
    hops = [s.name for s in handoff_spans(OA_PING_PONG)]
    assert hops == ["handoff to billing", "handoff to router"] * 3
    for name, agent in ((OA_LOOP, "support"), (OA_PING_PONG, "router")):
        failed = [s for s in spans(name) if s.status_code == STATUS_ERROR]
        assert [s.name for s in failed] == [agent]
        assert failed[0].status_message.startswith("Max turns exceeded")


# ---------------------------------------------------------------------------- LangGraph


@pytest.mark.parametrize("name", [LG_LOOP, LG_LOOP_JSON, LG_LOOP_OLL])
def test_langgraph_recursion_loop_is_identical_repetition_at_the_third_lookup(name):
    tools = tool_spans(LG_LOOP_OLL if name == LG_LOOP_OLL else LG_LOOP)
    events, _ = replay(name)
    event = only(events, "identical_repetition")
    assert [e["shape"] for e in events] == ["identical_repetition"]
    assert event["trigger_span_id"] == tools[2].span_id
    assert event["span_ids"] == [s.span_id for s in tools[:3]]
    assert event["count"] == 3
    assert event["tool_name"] == "lookup_order"


@pytest.mark.parametrize("name", [LG_LOOP, LG_LOOP_OLL])
def test_langgraph_recursion_loop_terminates_by_turn_limit(name):
    _, runs = replay(name)
    assert runs[0]["termination_reason"] == "turn_limit"  # GraphRecursionError on the root
    assert runs[0]["outcome"] == "complete"
    assert runs[0]["tool_calls"] == 4


def test_langgraph_clean_run_is_silent_and_final():
    events, runs = replay(LG_CLEAN)
    assert events == []
    assert runs[0]["termination_reason"] == "final_answer"
    assert runs[0]["outcome"] == "complete"
    assert runs[0]["tool_calls"] == 1
    assert runs[0]["terminal_response"] is True


def test_langgraph_three_different_orders_are_not_a_loop():
    # lookup_order(order_id=) A12, then B34, then C56, then a final answer: three different
    # actions under the contract's identity [order_id, include_items].
    events, runs = replay(LG_DIFFERENT)
    assert events == []
    assert runs[0]["termination_reason"] == "final_answer"
    assert runs[0]["distinct_actions"] == 3


def test_langgraph_prebuilt_agent_loop_is_identical_repetition_at_the_third_lookup():
    tools = tool_spans(LG_PREBUILT)
    events, _ = replay(LG_PREBUILT)
    assert only(events, "identical_repetition")["trigger_span_id"] == tools[2].span_id


def test_langgraph_prebuilt_agent_out_of_steps_is_a_turn_limit():
    # create_react_agent does not raise GraphRecursionError: when remaining_steps runs out it
    # answers "Sorry, need more steps to process this request." and the root span is OK.
    _, runs = replay(LG_PREBUILT)
    assert runs[0]["termination_reason"] == "turn_limit"


# ---------------------------------------------------------------------------- OpenAI Agents SDK


def test_openai_agents_max_turns_loop_is_identical_repetition_at_the_third_lookup():
    tools = tool_spans(OA_LOOP)
    events, _ = replay(OA_LOOP)
    event = only(events, "identical_repetition")
    assert [e["shape"] for e in events] == ["identical_repetition"]
    assert event["trigger_span_id"] == tools[2].span_id
    assert event["span_ids"] == [s.span_id for s in tools[:3]]
    assert event["count"] == 3
    assert event["tool_name"] == "lookup_order"


def test_openai_agents_max_turns_loop_terminates_by_turn_limit():
    # "Max turns exceeded: {'max_turns': 6}" is the status of the `support` AGENT span; the
    # root ("Agent workflow") ends with status OK.
    _, runs = replay(OA_LOOP)
    assert runs[0]["termination_reason"] == "turn_limit"
    assert runs[0]["outcome"] == "complete"
    assert runs[0]["tool_calls"] == 6


def test_openai_agents_loop_event_names_the_agent():
    events, runs = replay(OA_LOOP)
    assert only(events, "identical_repetition")["agent_name"] == "support"


def test_openai_agents_handoff_ping_pong_fires_at_the_third_router_to_billing():
    # router->billing, billing->router, x3: the edge router->billing is traversed for the
    # 3rd time (> handoff_max_traversals = 2) by the 5th handoff. (The 6th handoff is the 3rd
    # billing->router: the same episode, no second event.)
    hops = handoff_spans(OA_PING_PONG)
    events, _ = replay(OA_PING_PONG)
    (event,) = events  # one episode: the reverse edge crossing too does not fire again
    assert event["shape"] == "delegation_ping_pong"
    assert event["evidence"]["edge"] == "router->billing"
    assert event["trigger_span_id"] == hops[4].span_id
    assert event["span_ids"] == [hops[0].span_id, hops[2].span_id, hops[4].span_id]
    assert event["recommended_action"] == "human_handoff"


def test_openai_agents_handoff_ping_pong_terminates_by_turn_limit():
    _, runs = replay(OA_PING_PONG)
    assert runs[0]["termination_reason"] == "turn_limit"
    assert runs[0]["outcome"] == "complete"


def test_openai_agents_handoff_steps_name_both_agents():
    hops = [s for s in steps(OA_PING_PONG) if s.kind == HANDOFF]
    assert [(s.from_agent, s.to_agent) for s in hops] == [
        ("router", "billing"),
        ("billing", "router"),
    ] * 3


# ---------------------------------------------------------------------------- conventions


def _tool_steps(name: str, pol: Policy | None = None) -> list[Step]:
    ids = {s.span_id for s in tool_spans(name)}
    found = [s for s in steps(name, pol) if s.span_id in ids]
    assert found and all(s.kind == TOOL and s.name == "lookup_order" for s in found)
    return found


def test_the_same_call_has_the_same_action_fingerprint_in_every_framework():
    # Every recorded call is lookup_order(order_id="A12") (include_items defaulted).
    fps = {name: {s.action_fp for s in _tool_steps(name)} for name in LOOPS + (LG_CLEAN,)}
    assert all(len(v) == 1 for v in fps.values()), fps
    assert len(set().union(*fps.values())) == 1, fps


@pytest.mark.parametrize("name", LOOPS)
def test_tool_results_are_read_through_the_framework_envelope(name):
    # The tool returned {"status": "delivered", "version": 7} every time: the contract's
    # version_field is readable and the result digest does not change from call to call.
    found = _tool_steps(name)
    assert [s.version for s in found] == [7.0] * len(found)
    assert len({s.result_fp for s in found}) == 1


@pytest.mark.parametrize("name", LOOPS)
def test_loop_is_detected_without_a_tool_contract(name):
    # No contract: only "a changed result is progress" applies, and the result never changed.
    tools = tool_spans(name)
    events, _ = replay(name, policy(with_contracts=False))
    assert only(events, "identical_repetition")["trigger_span_id"] == tools[2].span_id


@pytest.mark.parametrize("name", [LG_LOOP, LG_LOOP_OLL])
def test_langgraph_step_is_the_sequence_of_tool_steps(name):
    assert [s.sequence for s in _tool_steps(name)] == [2, 4, 6, 8]


@pytest.mark.parametrize("name", [LG_LOOP, LG_LOOP_OLL])
def test_langgraph_tool_steps_carry_the_model_call_ids(name):
    assert [s.call_id for s in _tool_steps(name)] == ["call_1", "call_2", "call_3", "call_4"]
