"""Recorded traces of eight agent frameworks (tests/fixtures/frameworks/<fw>.md), replayed
through the engine under the built-in recognition profiles.

Each fixture has a `.facts.json` written by its recorder from what the run did (the tool
calls and handoffs in start order, with their span ids, and how the run ended). Every
expectation below comes from those facts and the documented detection rules, never from
running the detector:

- identical_repetition fires at the 3rd identical call (allowed_repeats = 2);
- retry_storm fires at the 4th call failing with one transient code (min calls = 4);
- delegation_ping_pong fires when one edge A->B is traversed for the 3rd time
  (handoff_max_traversals = 2), once per pair of agents;
- oscillation fires after 2p+2 steps of a period-p alternation (p = 2: the 6th call).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from detectors.fingerprint import Fingerprinter
from detectors.model import TOOL
from detectors.policy import Policy, policy_from_mapping
from detectors.policy_defaults import BUILTIN_PROFILES
from streams.replay.engine import Engine
from streams.replay.files import iter_payloads
from streams.spanpath.normalize import Normalizer
from streams.spanpath.otlp import decode_record
from streams.spanpath.spans import SpanRecord
from tests.paths import FIXTURES as ALL_FIXTURES
from tests.paths import REPO
from tests.unit.spanpath.test_framework_traces import POLICY as LANGGRAPH_AND_AGENTS_POLICY

FIXTURES = ALL_FIXTURES / "frameworks"
FRAMEWORKS_DOC = REPO / "docs" / "FRAMEWORKS.md"

# the example support agent's contract for lookup_order, as for the first two frameworks
POLICY: dict[str, Any] = LANGGRAPH_AND_AGENTS_POLICY


# fixture -> (termination_reason, termination_evidence), from the facts' `ended_by` and the
# profile's mapping. "default" + final_answer where no span says why the run stopped and
# the run gives no sign either (AutoGen has no model spans; CrewAI's forced final answer
# and Strands' Swarm limit leave nothing): the framework table (docs/FRAMEWORKS.md) says so.
TERMINATION: dict[str, tuple[str, str]] = {
    "autogen__clean": ("final_answer", "default"),
    "autogen__limit_loop": ("final_answer", "default"),
    "autogen__limit_loop__team": ("final_answer", "default"),
    "autogen__transient_retry": ("final_answer", "default"),
    "autogen__handoff_ping_pong": ("final_answer", "default"),
    "crewai__clean": ("final_answer", "default"),
    "crewai__limit_loop": ("final_answer", "default"),
    "crewai__transient_retry": ("final_answer", "default"),
    "crewai__handoff_ping_pong": ("final_answer", "default"),
    "crewai__repeated_call_guard": ("unknown", "none"),  # no root span was exported
    "google_adk__clean": ("final_answer", "default"),
    "google_adk__limit_loop": ("turn_limit", "stated"),  # LlmCallsLimitExceededError
    "google_adk__limit_loop__no_content": ("turn_limit", "stated"),
    "google_adk__limit_loop__schema_v1": ("turn_limit", "stated"),
    "google_adk__transient_retry": ("tool_error", "default"),  # the tool's RuntimeError
    "google_adk__transient_retry__no_plugin": ("tool_error", "default"),
    "google_adk__handoff_ping_pong": ("turn_limit", "stated"),
    "llamaindex__clean": ("final_answer", "default"),
    "llamaindex__limit_loop": ("turn_limit", "stated"),  # "Max iterations of 6 reached!"
    "llamaindex__transient_retry": ("turn_limit", "stated"),
    "llamaindex__handoff_ping_pong": ("turn_limit", "stated"),
    "pydantic_ai__clean": ("final_answer", "default"),
    "pydantic_ai__limit_loop": ("turn_limit", "stated"),  # UsageLimitExceeded
    "pydantic_ai__transient_retry": ("turn_limit", "stated"),  # tool retries exceeded
    "pydantic_ai__handoff_ping_pong": ("turn_limit", "stated"),
    "strands__clean": ("final_answer", "stated"),  # finish_reason end_turn
    "strands__limit_loop": ("turn_limit", "stated"),  # finish_reason limit_turns
    "strands__transient_retry": ("turn_limit", "stated"),
    "strands__handoff_ping_pong": ("final_answer", "default"),
    "vercel_ai__clean": ("final_answer", "stated"),  # finish_reasons ["stop"]
    "vercel_ai__limit_loop": ("turn_limit", "stated"),  # root finish_reasons ["tool-calls"]
    "vercel_ai__limit_loop__no_content": ("turn_limit", "stated"),
    "vercel_ai__limit_loop__legacy": ("turn_limit", "stated"),
    "vercel_ai__transient_retry": ("turn_limit", "stated"),
    "vercel_ai__transient_retry__no_content": ("turn_limit", "stated"),
    "vercel_ai__transient_retry__legacy": ("turn_limit", "stated"),
}

# Frameworks whose handoff span names its source agent (ADK, CrewAI), or whose earlier
# steps do (pydantic-ai: the delegating tool span carries its agent). Elsewhere the source
# is the previous handoff's target; the first hop's source is then unknown ("?") and the
# ping-pong fires one traversal later on that edge.
SOURCE_KNOWN = {"google_adk", "crewai", "pydantic_ai"}

# The transient cause is only in the error message, which these variants do not record.
CAUSE_INVISIBLE = {"vercel_ai__transient_retry__no_content"}


@dataclass(frozen=True)
class Fixture:
    stem: str
    path: Path
    facts: dict[str, Any]

    @property
    def framework(self) -> str:
        return self.stem.split("__")[0]

    @property
    def scenario(self) -> str:
        return self.stem.split("__")[1]

    def tools(self) -> list[str]:
        return [t["span_id"] for t in self.facts["tool_calls"]]


def _fixtures() -> list[Fixture]:
    found = []
    for facts in sorted(FIXTURES.glob("*.facts.json")):
        stem = facts.name[: -len(".facts.json")]
        (path,) = [
            p for p in FIXTURES.glob(stem + ".pb*") if p.name in (stem + ".pb", stem + ".pb.gz")
        ]
        found.append(Fixture(stem, path, json.loads(facts.read_text("utf-8"))))
    return found


ALL = _fixtures()
BY_STEM = {f.stem: f for f in ALL}


def spans_of(fx: Fixture) -> list[SpanRecord]:
    out: list[SpanRecord] = []
    for payload in iter_payloads([fx.path]):
        out.extend(decode_record(payload.data, payload.encoding, fx.path.name))
    return sorted(out, key=lambda s: (s.start_ns, s.end_ns))


def replay(
    spans: list[SpanRecord], pol: Policy | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    invalid: list[str] = []
    engine = Engine(
        pol or policy_from_mapping(POLICY, "<fixtures>"),
        Fingerprinter(b"test-key"),
        events.append,
        summaries.append,
        invalid.append,
    )
    engine.feed(spans)
    engine.close()
    assert invalid == []
    assert len(summaries) == 1, "each fixture holds exactly one run (one trace)"
    return events, summaries[0]


def handoff_span_ids(fx: Fixture, spans: list[SpanRecord]) -> list[str]:
    if fx.framework == "pydantic_ai":
        # delegation nests: each hop is the delegated agent's own run, an `invoke_agent`
        # span inside the delegating tool (the facts list the delegating tool spans)
        return [
            s.span_id
            for s in spans
            if s.parent_span_id is not None
            and s.attributes.get("gen_ai.operation.name") == "invoke_agent"
        ]
    return [h["span_id"] for h in fx.facts["handoffs"]]


def expected_ping_pong(fx: Fixture, ids: list[str]) -> list[tuple[str, str, str]]:
    """(shape, edge, trigger span id) by the documented rule over the recorded hops."""
    hops = fx.facts["handoffs"]
    assert len(ids) == len(hops)
    counts: dict[str, int] = {}
    fired: set[frozenset[str]] = set()  # one episode per pair of agents
    out = []
    for i, (hop, span_id) in enumerate(zip(hops, ids, strict=True)):
        source = hop["from"] if fx.framework in SOURCE_KNOWN else (hops[i - 1]["to"] if i else "?")
        edge = f"{source}->{hop['to']}"
        counts[edge] = counts.get(edge, 0) + 1
        pair = frozenset((source, hop["to"]))
        if counts[edge] == 3 and pair not in fired:
            fired.add(pair)
            out.append(("delegation_ping_pong", edge, span_id))
    return out


def expected_events(fx: Fixture, spans: list[SpanRecord]) -> list[tuple[str, str, str]]:
    tools = fx.tools()
    if fx.scenario == "clean" or fx.stem == "google_adk__transient_retry__no_plugin":
        return []  # one call
    if fx.scenario in ("limit_loop", "repeated_call_guard"):
        return [("identical_repetition", "lookup_order", tools[2])]
    if fx.scenario == "transient_retry":
        if fx.stem in CAUSE_INVISIBLE:  # the same failing call, cause unknown: a repetition
            return [("identical_repetition", "check_inventory", tools[2])]
        return [("retry_storm", "check_inventory", tools[3])]
    assert fx.scenario == "handoff_ping_pong", fx.stem
    out = expected_ping_pong(fx, handoff_span_ids(fx, spans))
    if fx.framework == "pydantic_ai":
        # the delegating tools alternate delegate_to_billing / delegate_to_router (they
        # never return a result until the limit): a period-2 oscillation by the 6th call
        out.append(("oscillation", "delegate_to_router", tools[5]))
    return out


def _label(event: dict[str, Any]) -> tuple[str, str, str]:
    what = event["tool_name"] if event["shape"] != "delegation_ping_pong" else None
    return (event["shape"], what or event["evidence"]["edge"], event["trigger_span_id"])


def test_every_fixture_has_facts_and_an_expectation():
    stems = {f.stem for f in ALL}
    assert stems == set(TERMINATION), stems ^ set(TERMINATION)
    for fx in ALL:
        assert fx.path.stat().st_size < 200_000, fx.path.name
        assert fx.facts["scenario"] == fx.scenario or fx.stem.endswith(fx.facts["scenario"])


@pytest.mark.parametrize("stem", sorted(TERMINATION))
def test_recorded_run_gives_its_expected_shapes_at_the_expected_trigger(stem):
    fx = BY_STEM[stem]
    spans = spans_of(fx)
    events, _ = replay(spans)
    got = sorted(_label(e) for e in events)
    assert got == sorted(expected_events(fx, spans))


@pytest.mark.parametrize("stem", sorted(TERMINATION))
def test_recorded_run_ends_with_its_termination_reason(stem):
    _, summary = replay(spans_of(BY_STEM[stem]))
    assert (summary["termination_reason"], summary["termination_evidence"]) == TERMINATION[stem]


@pytest.mark.parametrize(
    "stem",
    sorted(
        s
        for s in TERMINATION
        if s.split("__")[1] == "transient_retry"
        and s not in CAUSE_INVISIBLE
        and not s.endswith("__no_plugin")  # one call: no storm
    ),
)
def test_native_transient_failures_carry_the_transient_code(stem):
    events, _ = replay(spans_of(BY_STEM[stem]))
    (storm,) = events
    assert storm["evidence"]["error_code"] == "503"


def test_every_tool_call_and_handoff_of_every_fixture_is_recognized():
    from detectors.model import HANDOFF

    for fx in ALL:
        spans = spans_of(fx)
        normalizer = Normalizer(policy_from_mapping(POLICY), Fingerprinter(b"k"))
        steps = {s.span_id: normalizer.step(s) for s in spans}
        hops = set(handoff_span_ids(fx, spans))
        for call in fx.facts["tool_calls"]:
            step = steps[call["span_id"]]
            if call["span_id"] in hops:
                continue
            is_hop = call["span_id"] in {h["span_id"] for h in fx.facts["handoffs"]}
            if is_hop and fx.framework != "pydantic_ai":
                assert step.kind == HANDOFF, (fx.stem, call)
            else:
                assert step.kind == TOOL and step.name == call["tool"], (fx.stem, call)
        for span_id, hop in zip(handoff_span_ids(fx, spans), fx.facts["handoffs"], strict=True):
            step = steps[span_id]
            assert step.kind == HANDOFF and step.to_agent == hop["to"], (fx.stem, hop)


def test_prompt_version_is_read_from_each_framework_metadata_slot():
    # the recorders put a prompt version where each framework lets a user put run metadata
    want = {
        "vercel_ai__limit_loop": "support-v3",  # runtimeContext -> ai.settings.context.*
        "vercel_ai__limit_loop__legacy": "support-v3",
        "pydantic_ai__limit_loop": "support-prompt-v3",  # Agent(metadata=...) on the root
        "strands__limit_loop": "support-prompt-v3",  # Agent(trace_attributes=...)
        "llamaindex__limit_loop": "support-v1",  # OpenInference using_metadata
        "crewai__limit_loop": "support-v1",
    }
    for stem, version in want.items():
        events, summary = replay(spans_of(BY_STEM[stem]))
        assert summary["prompt_version"] == version, stem
        assert [e["prompt_version"] for e in events] == [version], stem


# ---------------------------------------------------------------------------- configuration


def _renamed(spans: list[SpanRecord], old: str, new: str) -> list[SpanRecord]:
    """The same run from an imaginary framework: every attribute key, span name and scope
    spelled with `new` where the original has `old`."""

    def swap(text: str) -> str:
        return new + text[len(old) :] if text.startswith(old) else text

    return [
        replace(
            s,
            name=swap(s.name),
            scope_name=swap(s.scope_name),
            attributes={
                swap(k): (swap(v) if isinstance(v, str) else v) for k, v in s.attributes.items()
            },
        )
        for s in spans
    ]


def _renamed_profile(body: Any, old: str, new: str) -> Any:
    if isinstance(body, str):
        return new + body[len(old) :] if body.startswith(old) else body
    if isinstance(body, list):
        return [_renamed_profile(v, old, new) for v in body]
    if isinstance(body, dict):
        return {
            _renamed_profile(k, old, new): _renamed_profile(v, old, new) for k, v in body.items()
        }
    return body


def test_a_framework_with_a_known_layout_needs_only_a_policy_change():
    original = spans_of(BY_STEM["vercel_ai__limit_loop__legacy"])
    renamed = _renamed(original, "ai", "acme")
    assert {s.scope_name for s in renamed} == {"acme"}
    before, _ = replay(original)
    assert [e["shape"] for e in before] == ["identical_repetition"]

    # no profile reads acme's spans: the generic fallback reads them by their keys
    # (acme.toolCall.name, acme.toolCall.args, ...) and finds the same loop
    unknown, summary = replay(renamed)
    assert summary["tool_calls"] == 5
    assert [(e["shape"], e["trigger_span_id"], e["count"]) for e in unknown] == [
        (e["shape"], e["trigger_span_id"], e["count"]) for e in before
    ]

    profile = _renamed_profile(copy.deepcopy(BUILTIN_PROFILES["vercel_ai_legacy"]), "ai", "acme")
    pol = policy_from_mapping({**POLICY, "profiles": {"acme_agents": profile}}, "<policy>")
    after, summary = replay(renamed, pol)
    assert summary["tool_calls"] == 5
    assert [(e["shape"], e["trigger_span_id"], e["count"]) for e in after] == [
        (e["shape"], e["trigger_span_id"], e["count"]) for e in before
    ]


def test_the_framework_table_lists_each_profile_with_a_fixture():
    section = FRAMEWORKS_DOC.read_text("utf-8")
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| framework")
    ]
    profiles_in_table: dict[str, list[str]] = {}
    for row in rows:
        for name in row[1].replace("`", "").split(","):
            prefixes = [p.strip() for p in row[2].replace("`", "").split(",") if p.strip()]
            profiles_in_table.setdefault(name.strip(), []).extend(prefixes)
    assert set(profiles_in_table) == set(BUILTIN_PROFILES), (
        "every built-in profile has a row in the framework table, and only those"
    )
    fixtures = {p.name for p in FIXTURES.iterdir()}
    for profile, prefixes in profiles_in_table.items():
        assert prefixes, f"profile {profile} has no fixture in the framework table"
        for prefix in prefixes:
            assert any(n.startswith(prefix) and ".pb" in n for n in fixtures), (
                f"docs/FRAMEWORKS.md lists {prefix!r} fixtures for profile {profile} but none exist"
            )
