"""The compiled policy as plain data for the native normalizer (loopwatch_native.SpanPath),
and building it.

`spec(policy)` is the whole hand-over: recognition profiles (kind rules and `when`
conditions in their data form, field sources, termination tables), the convention key
lists, tool contracts, transient message patterns. Whatever the native side does not
implement raises `Unsupported` here (or ValueError in the extension's constructor): that
policy then runs on the Python normalizer, with one warning line saying why. Regular
expressions travel as their pattern text and are compiled by Python's `re` on the native
side, so they match exactly as here.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, TextIO

from detectors.fingerprint import Fingerprinter
from detectors.model import STEP_FIELDS, Step
from detectors.policy import Policy, Similarity, ToolContract
from detectors.recognition import Profile, Source
from streams.spanpath import fallback, native
from streams.spanpath.limits import LIMIT_NAMES
from streams.spanpath.normalize import TOOL_CALL_FINISH_REASONS
from streams.spanpath.otlp.common import OTLP_JSON, OTLP_PROTO
from streams.spanpath.otlp.json_decode import NATIVE_MAX_DEPTH, TRAILING_COMMA_MSGS
from streams.spanpath.runkey import common_fields, run_keys
from streams.spanpath.spans import StepBatch
from streams.spanpath.termination import OUT_OF_STEPS

NATIVE_OPS = frozenset({"trim", "lowercase", "collapse_whitespace"})


class Unsupported(Exception):
    """A part of the policy the native normalizer does not implement."""


def _pattern(p: re.Pattern[str], where: str) -> str:
    if not isinstance(p.pattern, str) or re.compile(p.pattern).flags != p.flags:
        raise Unsupported(f"{where}: pattern {p.pattern!r} was compiled with flags")
    return p.pattern


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A contract default as JSON data; other YAML types (dates, sets, ...) are Python's."""
    if depth > 100:
        raise Unsupported(f"{where}: nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Unsupported(f"{where}: {value!r} is not finite")
        return value
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    raise Unsupported(f"{where}: a {type(value).__name__} value")


def _source(s: Source, where: str) -> dict[str, Any]:
    if s.when is not None and s.when_data is None:
        raise Unsupported(f"{where}: a `when` without its data form")
    path = []
    for key in s.path:
        index = None
        if key.isdigit():
            try:
                index = int(key)
            except ValueError:
                raise Unsupported(f"{where}: path key {key!r}") from None
        path.append([key, index])
    return {
        "attribute": s.attribute,
        "event": s.event,
        "path": path,
        "plain": s.plain,
        "format": s.format,
        "name_after": s.name_after,
        "name_before": s.name_before,
        "span_name": s.span_name,
        "argument": s.argument,
        "tool_name_after": s.tool_name_after,
        "when": s.when_data,
    }


def _profile(p: Profile) -> dict[str, Any]:
    where = f"profiles.{p.name}"
    kinds = []
    for rule in p.kinds:
        if rule.data is None:
            raise Unsupported(f"{where}: rule {rule.label} has no data form")
        kinds.append({"kind": rule.kind, "match": rule.data})
    t = p.termination
    return {
        "name": p.name,
        "scopes": sorted(p.scopes),
        "scope_prefixes": list(p.scope_prefixes),
        "has_attributes": list(p.has_attributes),
        "kinds": kinds,
        "keys": {f: list(k) for f, k in p.keys.items()},
        "derived": {
            f: [_source(s, f"{where}.fields.{f}") for s in sources]
            for f, sources in p.derived.items()
        },
        "termination": {
            "exception_types": dict(t.exception_types),
            "message_patterns": [
                [_pattern(pat, f"{where}.termination"), r] for pat, r in t.message_patterns
            ],
            "finish_reasons": dict(t.finish_reasons),
        },
    }


def _contract(c: ToolContract, similarity: Similarity) -> dict[str, Any]:
    where = f"tools.{c.name}"
    for arg, ops in c.normalize.items():
        for op in ops:
            if op not in NATIVE_OPS:
                raise Unsupported(f"{where}.normalize.{arg}: {op!r} is not native")
    return {
        "identity": list(c.identity) if c.identity is not None else None,
        "defaults": _plain(c.defaults, f"{where}.defaults"),
        "normalize": {arg: list(ops) for arg, ops in c.normalize.items()},
        "version_field": c.version_field,
        "state_field": c.state_field,
        "terminal_states": sorted(c.terminal_states),
        "cursor_arg": c.cursor_arg,
        "new_items_field": c.new_items_field,
        "side_effect": c.side_effect,
        "idempotency_key_arg": c.idempotency_key_arg,
        "business_identity": (
            list(c.business_identity) if c.business_identity is not None else None
        ),
        "similarity": _similarity(similarity),
    }


def _similarity(s: Similarity) -> dict[str, Any]:
    """What the span path reads of near-duplicate settings (sketch.rs `Sim`)."""
    return {
        "enabled": s.enabled,
        "arguments": list(s.arguments) if s.arguments is not None else None,
        "result_items": s.result_items,
    }


def spec(policy: Policy) -> str:
    """The policy as the native normalizer's JSON spec; raises Unsupported."""
    conventions = policy.conventions
    keys = run_keys(policy)
    for name, contract in policy.tools.items():
        if contract.name != name:
            raise Unsupported(f"tools.{name}: contract named {contract.name!r}")
    data = {
        "step_fields": list(STEP_FIELDS),
        "run_keys": list(keys) if keys is not None else None,
        "common_fields": {name: list(k) for name, k in common_fields(policy).items()},
        "resource_prompt_version": list(conventions["resource_prompt_version"]),
        "resource_tool_version": list(conventions["resource_tool_version"]),
        "sequence": list(policy.sequence_attributes),
        "task_attr": policy.task_type_attribute,
        "known_codes": sorted(
            policy.transient_error_codes | policy.missing_data_codes | policy.ambiguous_error_codes
        ),
        "status_codes": sorted(policy.transient_error_codes | policy.missing_data_codes),
        "transient_patterns": [
            [_pattern(p, "transient_message_patterns"), code]
            for p, code in policy.transient_message_patterns
        ],
        "out_of_steps": _pattern(OUT_OF_STEPS, "normalize"),
        "tool_call_finish_reasons": sorted(TOOL_CALL_FINISH_REASONS),
        "profiles": [_profile(p) for p in policy.profiles],
        "fallback": fallback.spec(),
        "limit_names": dict(LIMIT_NAMES),
        "tools": {
            name: _contract(c, policy.similarity_for(name)) for name, c in policy.tools.items()
        },
        "similarity": _similarity(policy.similarity),
        "turn_sketches": policy.similarity.enabled and policy.similarity.model_turns,
    }
    try:
        return json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise Unsupported(f"not plain data: {exc}") from None


_warned: set[str] = set()


def build(policy: Policy, fingerprinter: Fingerprinter, stream: TextIO | None = None) -> Any | None:
    """The native span path for this policy, or None: the extension is not there (the
    fallback warning is native.warn_if_fallback's), or the policy uses something it does
    not implement (one warning line per reason)."""
    if native.EXT is None:
        return None
    try:
        return native.EXT.SpanPath(spec(policy), Step, fingerprinter.key)
    except (Unsupported, ValueError) as exc:
        if str(exc) not in _warned:
            _warned.add(str(exc))
            print(
                f"loopwatch: warning: the native normalizer does not support this policy "
                f"({exc}); using the Python normalizer",
                file=stream or sys.stderr,
            )
        return None


def normalize(span_path: Any, data: Any, encoding: str = OTLP_PROTO) -> StepBatch | None:
    """The native result for one export message `data` in `encoding` (OTLP protobuf or
    OTLP JSON), or None: the Python decoder and normalizer must take this message
    (malformed input, for its exact error; a value only Python decides; a JSON document
    nested deeper than the native decoder decides; a buffer that is not bytes)."""
    if span_path is None or type(data) is not bytes:
        return None
    if encoding == OTLP_PROTO:
        got = span_path.normalize(data)
    elif encoding == OTLP_JSON:
        got = span_path.normalize_json(
            data, NATIVE_MAX_DEPTH, sys.get_int_max_str_digits(), TRAILING_COMMA_MSGS
        )
    else:  # an unknown encoding: decode_record names it
        return None
    return None if got is None else StepBatch(*got)
