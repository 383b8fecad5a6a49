"""The policy's JSON Schema (detectors/policy.schema.json) against the loader: the same keys at
every level, the policies the loader accepts are valid, and the ones it rejects for a key,
a type or a value are invalid. Editors use the schema; loopwatch keeps its own errors."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import yaml

from detectors.errors import ConfigError
from detectors.policy import (
    _LIMIT_KEYS,
    _PROGRESS_KEYS,
    _TOOL_KEYS,
    _TOP_KEYS,
    load_policy,
    policy_from_mapping,
)
from detectors.policy_defaults import (
    BUILTIN_PROFILES,
    DEFAULT_CONVENTIONS,
    NORMALIZE_OPS,
    TERMINATION_REASONS,
)
from detectors.profile_compiler import (
    CALL_FORMATS,
    MATCH_KEYS,
    PROFILE_KEYS,
    SOURCE_KEYS,
    TERMINATION_KEYS,
    WHEN_KEYS,
)
from detectors.recognition import FIELDS, KINDS
from tests.paths import REPO

SCHEMA_FILE = REPO / "detectors" / "policy.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_FILE.read_text("utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DEFS = SCHEMA["$defs"]


def keys(node: dict[str, Any]) -> set[str]:
    return set(node["properties"])


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_the_schema_has_the_loaders_keys_at_every_level() -> None:
    tool = DEFS["tool"]
    profile = DEFS["profile"]
    assert keys(SCHEMA) == _TOP_KEYS
    assert keys(DEFS["limits"]) == _LIMIT_KEYS
    assert keys(DEFS["limits"]["properties"]["budgets"]) == {"steps", "tokens", "seconds"}
    assert keys(tool) == _TOOL_KEYS
    assert keys(tool["properties"]["progress"]) == _PROGRESS_KEYS
    assert set(tool["properties"]["normalize"]["additionalProperties"]["items"]["enum"]) == set(
        NORMALIZE_OPS
    )
    assert keys(SCHEMA["properties"]["conventions"]) == set(DEFAULT_CONVENTIONS)
    assert keys(DEFS["termination"]) == set(TERMINATION_KEYS)
    assert DEFS["reason"]["enum"] == list(TERMINATION_REASONS)
    assert keys(profile) == PROFILE_KEYS
    assert keys(profile["properties"]["when"]) == WHEN_KEYS
    assert profile["properties"]["kinds"]["items"]["properties"]["kind"]["enum"] == list(KINDS)
    assert profile["properties"]["fields"]["propertyNames"]["enum"] == list(FIELDS)
    assert keys(DEFS["matcher"]) == MATCH_KEYS
    source = DEFS["source"]["oneOf"][1]
    assert keys(source) == SOURCE_KEYS
    assert source["properties"]["format"]["enum"] == list(CALL_FORMATS)


def test_the_example_policy_names_the_schema_and_is_valid() -> None:
    text = (REPO / "examples" / "loopwatch.yaml").read_text("utf-8")
    assert "# yaml-language-server: $schema=../detectors/policy.schema.json" in text.splitlines()
    assert list(VALIDATOR.iter_errors(yaml.safe_load(text))) == []
    load_policy(REPO / "examples" / "loopwatch.yaml")


def test_the_builtin_profiles_are_valid_profiles() -> None:
    errors = [
        f"{list(e.path)}: {e.message}"
        for e in VALIDATOR.iter_errors({"profiles": BUILTIN_PROFILES})
    ]
    assert errors == []


VALID: list[dict[str, Any]] = [
    {},
    {"run_key": "conversation", "release_on_sequence": True, "max_pending_steps": 5},
    {"task_types": {"attribute": "agent.task", "triage": {"window": 4, "budgets": {"steps": 9}}}},
    {"tools": {"t": None, "u": {"progress": {"state_field": "s", "terminal_states": ["done"]}}}},
    {"termination": {"finish_reasons": {"halt": "loop_guard"}}},
    {"transient_message_patterns": {"(?i)try again": "busy"}},
    {"prices": {"gpt-4o": {"input": 2.5, "output": 10}, "claude-*": {"input": 3, "output": 15}}},
    {
        "profiles": {
            "mine": {
                "when": {"scope_prefix": "acme."},
                "extends": "generic",
                "kinds": [{"kind": "tool", "match": {"any": [{"name": "x"}, {"root": False}]}}],
                "fields": {"tool_name": ["acme.tool", {"name_after": "run "}]},
            }
        }
    },
]

INVALID: list[dict[str, Any]] = [
    {"unknown_key": 1},
    {"defaults": {"window": 1}},
    {"defaults": {"allowed_repeats": "two"}},
    {"defaults": {"token_drop_ratio": 1.5}},
    {"defaults": {"budgets": {"minutes": 3}}},
    {"release_on_sequence": "yes"},
    {"task_types": {"triage": {"window": 4}}},
    {"tools": {"t": {"normalize": {"q": ["uppercase"]}}}},
    {"tools": {"t": {"progress": {"terminal_states": ["done"]}}}},
    {"tools": {"t": {"progress": {"cursor_arg": "c"}}}},
    {"tools": {"t": {"max_polls": 0}}},
    {"termination": {"finish_reasons": {"halt": "stopped"}}},
    {"conventions": {"no_such_convention": ["a"]}},
    {"profiles": {"p": {"kinds": [{"kind": "robot", "match": {"name": "x"}}]}}},
    {"profiles": {"p": {"kinds": [{"kind": "tool", "match": {"nam": "x"}}]}}},
    {"profiles": {"p": {"fields": {"not_a_field": ["a"]}}}},
    {"profiles": {"p": {"fields": {"tool_name": [{"format": "csv"}]}}}},
    {"prices": {"gpt-4o": {"input": 2.5}}},
    {"prices": {"gpt-4o": {"input": -1, "output": 1}}},
    {"prices": {"gpt-4o": {"input": 1, "output": 1, "cached": 0.5}}},
    {"prices": {"*": {"input": 1, "output": 1}}},
]


@pytest.mark.parametrize("policy", VALID, ids=range(len(VALID)))
def test_policies_the_loader_accepts_are_valid(policy: dict[str, Any]) -> None:
    policy_from_mapping(policy)
    assert [e.message for e in VALIDATOR.iter_errors(policy)] == []


@pytest.mark.parametrize("policy", INVALID, ids=range(len(INVALID)))
def test_policies_the_loader_rejects_are_invalid(policy: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        policy_from_mapping(policy)
    assert not VALIDATOR.is_valid(policy)
