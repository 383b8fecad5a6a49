"""Policy loading: the example file loads; every mistake names file, key and expectation."""

from __future__ import annotations

import pytest

from detectors.errors import ConfigError
from detectors.policy import load_policy, policy_from_mapping
from tests.paths import REPO

ROOT = REPO


def test_example_policy_loads_with_its_contracts():
    policy = load_policy(ROOT / "examples" / "loopwatch.yaml")
    assert policy.policy_version == "2026-11-29.1"
    assert policy.defaults.allowed_repeats == 2 and policy.defaults.window == 8
    assert policy.limits_for("support").budgets.steps == 20
    assert policy.limits_for("support").budgets.tokens == 200000  # inherited from defaults
    assert policy.limits_for("unknown-type") is policy.defaults
    lookup = policy.tools["lookup_order"]
    assert lookup.identity == ("order_id", "include_items")
    assert lookup.defaults == {"include_items": False}
    assert lookup.version_field == "version"
    assert policy.tools["get_export_status"].terminal_states == frozenset({"complete", "failed"})
    assert policy.tools["issue_refund"].side_effect is True
    assert policy.reconcile_tools == frozenset({"get_refund_status"})


def test_defaults_without_a_file():
    policy = load_policy(None)
    assert policy.run_key == "trace" and policy.tools == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"polcy_version": "x"}, "<p>: polcy_version: unknown key; expected one of"),
        (
            {"defaults": {"allowed_repeats": "two"}},
            "<p>: defaults.allowed_repeats: expected an integer >= 1, got string 'two'",
        ),
        (
            {"defaults": {"allowed_repeats": True}},
            "<p>: defaults.allowed_repeats: expected an integer >= 1, got boolean True",
        ),
        (
            {"defaults": {"window": 1}},
            "<p>: defaults.window: expected an integer >= 2, got number 1",
        ),
        (
            {"defaults": {"budgets": {"steps": 10, "dollars": 3}}},
            "<p>: defaults.budgets.dollars: unknown key",
        ),
        (
            {"tools": {"t": {"identity": "order_id"}}},
            "<p>: tools.t.identity: expected a list of strings, got string 'order_id'",
        ),
        ({"tools": {"t": {"progres": {}}}}, "<p>: tools.t.progres: unknown key"),
        (
            {"tools": {"t": {"progress": {"terminal_states": ["done"]}}}},
            "<p>: tools.t.progress.terminal_states: needs progress.state_field",
        ),
        (
            {"tools": {"t": {"progress": {"cursor_arg": "c"}}}},
            "<p>: tools.t.progress: cursor_arg needs new_items_field",
        ),
        (
            {"similarity": {"seen_items": 1.5}},
            "<p>: similarity.seen_items: expected a number between 0 and 1",
        ),
        (
            {"similarity": {"arguments": ["q"]}},
            "<p>: similarity.arguments: unknown key",
        ),
        (
            {"tools": {"t": {"similarity": {"model_turns": False}}}},
            "<p>: tools.t.similarity.model_turns: unknown key",
        ),
        (
            {"tools": {"t": {"similarity": {"min_calls": 1}}}},
            "<p>: tools.t.similarity.min_calls: expected",
        ),
        (
            {"tools": {"t": {"normalize": {"q": ["upper"]}}}},
            "<p>: tools.t.normalize.q: unknown normalization 'upper'",
        ),
        (
            {"tools": {"t": {"side_effect": "yes"}}},
            "<p>: tools.t.side_effect: expected true or false, got string 'yes'",
        ),
        (
            {"tools": {"t": {"idempotency_key_arg": "k"}}},
            "<p>: tools.t.idempotency_key_arg: only meaningful with side_effect: true",
        ),
        (
            {"tools": {"t": {"side_effect": True, "reconcile_tool": "nope"}}},
            "<p>: tools.t.reconcile_tool: unknown tool 'nope'",
        ),
        (
            {"task_types": {"support": {"allowed_repeats": 1}}},
            "<p>: task_types.attribute: expected the attribute that selects the task type",
        ),
        (
            {"task_types": {"attribute": "a", "support": {"allowd_repeats": 1}}},
            "<p>: task_types.support.allowd_repeats: unknown key",
        ),
        (
            {"termination": {"exception_types": {"Boom": "exploded"}}},
            "<p>: termination.exception_types.Boom: expected one of final_answer",
        ),
        (
            {"termination": {"message_patterns": {"(": "deadline"}}},
            "<p>: termination.message_patterns: invalid regex '('",
        ),
        ({"conventions": {"tool_nme": ["x"]}}, "<p>: conventions.tool_nme: unknown key"),
        ([1, 2], "<p>: <top level>: expected a mapping, got a list"),
    ],
)
def test_config_errors_name_key_and_expectation(raw, message):
    with pytest.raises(ConfigError) as info:
        policy_from_mapping(raw, "<p>")
    assert str(info.value).startswith(message), str(info.value)


def test_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read policy file"):
        load_policy(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("defaults:\n  allowed_repeats: [1,\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: invalid YAML at line \d+ column \d+"):
        load_policy(broken)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("tools:\n  lookup_order:\n    identity: order_id\n")
    with pytest.raises(
        ConfigError, match=r"wrong\.yaml: tools\.lookup_order\.identity: expected a list of strings"
    ):
        load_policy(wrong)
