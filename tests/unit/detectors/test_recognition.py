"""Recognition profiles as configuration (detectors/recognition.py, profiles.yaml), the
termination evidence decided at finalization, and transient causes found in messages."""

from __future__ import annotations

import pytest

from detectors import pipeline
from detectors.errors import ConfigError
from detectors.fingerprint import Fingerprinter
from detectors.model import AGENT, HANDOFF, LLM, OTHER, TOOL, Step
from detectors.policy import Policy, policy_from_mapping
from detectors.state import RunState
from streams.spanpath.normalize import Normalizer
from streams.spanpath.spans import STATUS_ERROR, SpanEvent, SpanRecord
from streams.worker.state import codec

TRACE = "0af7651916cd43dd8448eb211c80319c"


def span(name, attrs, *, parent="b7ad6b7169203331", scope="", status=0, message="", events=()):
    return SpanRecord(
        TRACE,
        "00f067aa0ba902b7",
        parent,
        name,
        1,
        10,
        20,
        status,
        message,
        attrs,
        {"service.name": "s"},
        list(events),
        scope,
    )


def norm(raw=None):
    return Normalizer(policy_from_mapping(raw or {}, "<p>"), Fingerprinter(b"k"))


# ---------------------------------------------------------------------------- profiles


ACME = {
    "profiles": {
        "acme": {
            "when": {"scope": ["acme.sdk"]},
            "kinds": [
                {"kind": "tool", "match": {"name_prefix": "acme.tool "}},
                {"kind": "handoff", "match": {"name": "acme.transfer"}},
            ],
            "fields": {
                "tool_name": [{"name_after": "acme.tool "}],
                "arguments": ["acme.args"],
                "result": [{"event": "acme.result", "attribute": "body"}],
                "handoff_to": [{"attribute": "acme.route", "path": ["target", "name"]}],
                "prompt_version": [{"attribute": "acme.meta", "path": ["pv"]}],
            },
            "termination": {"exception_types": {"AcmeStepLimit": "turn_limit"}},
        }
    }
}


def test_a_policy_profile_reads_its_scope_and_only_its_scope():
    n = norm(ACME)
    attrs = {"acme.args": '{"q": 1}', "acme.meta": '{"pv": "v7"}'}
    result = SpanEvent("acme.result", 15, {"body": '{"ok": true}'})
    step = n.step(span("acme.tool search", attrs, scope="acme.sdk", events=[result]))
    assert step.kind == TOOL and step.name == "search" and step.prompt_version == "v7"
    assert step.result_fp is not None
    assert n.profile_of(span("acme.tool search", attrs, scope="acme.sdk")).name == "acme"
    # the same span from another scope is read by the generic profile: not a tool there
    other = n.step(span("acme.tool search", attrs, scope="someone.else"))
    assert other.kind == OTHER
    hop = n.step(
        span("acme.transfer", {"acme.route": '{"target": {"name": "billing"}}'}, scope="acme.sdk")
    )
    assert hop.kind == HANDOFF and hop.to_agent == "billing"
    limit = SpanEvent("exception", 5, {"exception.type": "acme.errors.AcmeStepLimit"})
    root = n.step(span("acme.run", {}, parent=None, scope="acme.sdk", status=2, events=[limit]))
    assert root.kind == AGENT and root.termination == "turn_limit"


def test_extends_keeps_the_parents_rules_after_the_childs():
    raw = {
        "profiles": {
            "mine": {
                "when": {"has_attribute": ["mine.marker"]},
                "extends": "generic",
                "kinds": [{"kind": "llm", "match": {"name": "think"}}],
                "fields": {"tool_name": ["mine.tool"]},
            }
        }
    }
    n = norm(raw)
    assert n.step(span("think", {"mine.marker": 1})).kind == LLM
    tool = n.step(
        span("x", {"mine.marker": 1, "gen_ai.operation.name": "execute_tool", "mine.tool": "t"})
    )
    assert tool.kind == TOOL and tool.name == "t"
    # a listed field replaces the parent's sources: gen_ai.tool.name is not read here
    other = n.step(
        span(
            "x",
            {"mine.marker": 1, "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "g"},
        )
    )
    assert other.name == "x"  # (the generic span-name fallback is the parent's, replaced)


def test_a_builtin_profile_can_be_replaced_by_name():
    raw = {"profiles": {"vercel_ai": {"when": {"scope": ["gen_ai"]}, "kinds": []}}}
    n = norm(raw)
    s = span("execute_tool x", {"gen_ai.operation.name": "execute_tool"}, scope="gen_ai")
    assert n.step(s).kind == OTHER
    assert norm().step(s).kind == TOOL


def test_conventions_still_override_the_generic_key_lists():
    n = norm({"conventions": {"tool_name": ["my.tool"], "summary_name_markers": []}})
    step = n.step(span("t", {"gen_ai.operation.name": "execute_tool", "my.tool": "lookup"}))
    assert step.name == "lookup"
    assert n.step(span("summarize history", {})).kind == OTHER
    assert norm().step(span("summarize history", {})).kind == "summary"


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ({"kinds": [{"kind": "toolz", "match": {"name": "x"}}]}, "kinds[0].kind: expected one of"),
        ({"kinds": [{"kind": "tool", "match": {"nam": "x"}}]}, "match.nam: unknown key"),
        ({"kinds": [{"kind": "tool", "match": {"field": {"tol": "x"}}}]}, "unknown field 'tol'"),
        ({"kinds": [{"kind": "tool"}]}, "kinds[0].match: expected the conditions"),
        ({"fields": {"tool_nme": ["x"]}}, "fields.tool_nme: unknown key"),
        ({"fields": {"tool_name": [{"argument": "a", "name_after": "b"}]}}, "exactly one of"),
        ({"fields": {"requested_calls": ["k"]}}, "expected a format"),
        ({"extends": "nope"}, "extends: expected the name of a profile"),
        ({"termination": {"finish_reasons": {"x": "exploded"}}}, "expected one of final_answer"),
        ({"when": {"scopes": ["a"]}}, "when.scopes: unknown key"),
    ],
)
def test_a_bad_profile_is_a_config_error_naming_the_key(profile, message):
    with pytest.raises(ConfigError) as err:
        policy_from_mapping({"profiles": {"bad": profile}}, "p.yaml")
    assert str(err.value).startswith("p.yaml: profiles.bad")
    assert message in str(err.value)


def test_an_extends_cycle_is_a_config_error():
    raw = {"profiles": {"a": {"extends": "b"}, "b": {"extends": "a"}}}
    with pytest.raises(ConfigError, match="a cycle"):
        policy_from_mapping(raw, "p.yaml")


# ---------------------------------------------------------------------------- transient causes


def _failing_tool(**kw):
    return span("execute_tool check_inventory", {"gen_ai.operation.name": "execute_tool"}, **kw)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("inventory service unavailable: 503 Service Unavailable", "503"),
        ("Rate limit reached for requests", "429"),
        ("upstream: 504 Gateway Timeout", "504"),
        ("read timed out after 30s", "timeout"),
        ("Overloaded", "overloaded"),
        ("ECONNRESET", "connection_error"),
    ],
)
def test_a_transient_cause_in_the_exception_message_is_the_error_code(message, code):
    exc = SpanEvent(
        "exception", 5, {"exception.type": "RuntimeError", "exception.message": message}
    )
    assert norm().step(_failing_tool(status=STATUS_ERROR, events=[exc])).error_code == code
    # only the status message (the Vercel AI SDK, AutoGen): the same
    assert norm().step(_failing_tool(status=STATUS_ERROR, message=message)).error_code == code


def test_a_non_transient_message_keeps_the_exception_type():
    exc = SpanEvent("exception", 5, {"exception.type": "KeyError", "exception.message": "'sku'"})
    assert norm().step(_failing_tool(status=STATUS_ERROR, events=[exc])).error_code == "keyerror"


def test_a_known_code_is_not_overridden_by_the_message():
    attrs = {"gen_ai.operation.name": "execute_tool", "error.type": "404"}
    step = norm().step(span("execute_tool t", attrs, status=STATUS_ERROR, message="timed out"))
    assert step.error_code == "404"


def test_transient_message_patterns_are_configurable():
    n = norm({"transient_message_patterns": {"(?i)try again later": "busy"}})
    step = n.step(_failing_tool(status=STATUS_ERROR, message="Please try again later"))
    assert step.error_code == "busy" and "busy" in n.policy.transient_error_codes
    with pytest.raises(ConfigError, match="invalid regex"):
        policy_from_mapping({"transient_message_patterns": {"(": "x"}}, "p.yaml")


# ---------------------------------------------------------------------------- termination


def _step(kind, start, **kw):
    s = Step(
        TRACE,
        TRACE,
        f"{start:016x}",
        None if kw.get("is_root") else "r" * 16,
        kind,
        start,
        start + 1,
    )
    for key, value in kw.items():
        setattr(s, key, value)
    return s


def _summary(steps):
    policy = Policy()
    state = pipeline.new_state(TRACE)
    for s in steps:
        pipeline.ingest(policy, state, s)
    pipeline.release(policy, state)
    return pipeline.finalize(policy, state)[1]


def test_termination_evidence():
    root = _step(AGENT, 1, is_root=True)
    asks = _step(LLM, 2, wants_tools=True)
    answers = _step(LLM, 4, wants_tools=False)
    tool = _step(TOOL, 3, name="t", action_fp="a" * 16)

    def verdict(*steps):
        s = _summary(steps)
        return s["termination_reason"], s["termination_evidence"]

    assert verdict(root, asks, tool) == ("turn_limit", "inferred")  # cut off after a tool call
    assert verdict(root, asks, tool, answers) == ("final_answer", "default")
    failed = _step(AGENT, 1, is_root=True, status_error=True)
    assert verdict(failed, asks, tool) == ("tool_error", "default")  # a failure is not a limit
    stated = _step(AGENT, 1, is_root=True, termination="deadline")
    assert verdict(stated, asks, tool) == ("deadline", "stated")
    assert verdict(asks, tool) == ("unknown", "none")  # no root


@pytest.mark.parametrize("missing", [1, 2, 3, 4, 5, 6, 7, 8])
def test_states_written_before_the_fields_added_last_still_load(monkeypatch, missing):
    # the fields added after the first states: last_turn_wants_tools, deferred,
    # wasted_steps, wasted_tokens, cost, priced_tokens, limit, llm_turns (and the tail's tool_versions,
    # absent from old states)
    state = RunState(run_id=TRACE, trace_id=TRACE, spans=3)
    old_plain = codec._PLAIN[:-missing]
    monkeypatch.setattr(codec, "_PLAIN", old_plain)
    monkeypatch.setattr(codec, "_get_plain", __import__("operator").attrgetter(*old_plain))
    old_bytes = codec.encode_state(state)
    monkeypatch.undo()
    back = codec.decode_state(old_bytes)
    assert back.last_turn_wants_tools is None and back.deferred == [] and back.spans == 3
    assert back.wasted_steps == 0 and back.wasted_tokens == 0 and back.tool_versions == []
    assert back.cost == 0.0 and back.priced_tokens == 0
    assert back.limit is None and back.llm_turns == 0
    state.last_turn_wants_tools = True
    state.deferred = [["e" * 32, "identical_repetition", "warning", "t", "3", 2, 40]]
    state.wasted_steps, state.wasted_tokens = 4, 900
    state.cost, state.priced_tokens = 0.0123, 4100
    state.limit, state.llm_turns = [10, "llm"], 4
    state.tool_versions = [["t", "3"], ["u", "2024-06-01"]]
    assert codec.decode_state(codec.encode_state(state)) == state
