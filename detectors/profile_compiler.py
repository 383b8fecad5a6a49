"""Compiling recognition profiles (detectors/recognition.py): the YAML of the built-ins
(detectors/profiles.yaml) and of a policy's `profiles:` validated (every error names the
file, the key path and what was expected), `extends` resolved, and each rule and field
source compiled into a small matcher tree."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .config_reader import ConfigReader
from .errors import ConfigError
from .recognition import (
    FIELDS,
    KINDS,
    KindRule,
    Matcher,
    Profile,
    Refs,
    Source,
    SpanFacts,
    Termination,
)

# How a structured attribute lists the tool calls one model turn requested.
CALL_FORMATS = ("genai_messages", "call_list", "openinference_flat")

MATCH_KEYS = {
    "field",
    "has",
    "attribute",
    "name",
    "name_prefix",
    "name_suffix",
    "name_contains",
    "tool_name",
    "tool_name_prefix",
    "root",
    "any",
    "all",
    "not",
}
WHEN_KEYS = {"scope", "scope_prefix", "has_attribute"}
SOURCE_KEYS = {
    "attribute",
    "event",
    "path",
    "plain",
    "format",
    "name_after",
    "name_before",
    "span_name",
    "argument",
    "tool_name_after",
    "when",
}
PROFILE_KEYS = {"when", "extends", "kinds", "fields", "termination", "description"}
TERMINATION_KEYS = ("exception_types", "message_patterns", "finish_reasons")


@dataclass(slots=True)
class RawProfile:
    """A profile as read, before `extends` is resolved and it is compiled."""

    name: str
    path: str  # key path for error messages
    body: dict[str, Any]


class _Compiler:
    def __init__(self, source: str) -> None:
        self.source = source
        self.r = ConfigReader(source)

    def fail(self, path: str, expected: str, got: Any = None) -> ConfigError:
        return self.r.fail(path, expected, got, show_got=got is not None)

    def mapping(self, value: Any, path: str, allowed: set[str] | None) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, "a mapping", value)
        return self.r.mapping(value, path, allowed)

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        return self.r.string_or_strings(value, path)

    # -------------------------------------------------------------- matchers

    def matcher(self, raw: Any, path: str, refs: Refs) -> Matcher:
        m = self.mapping(raw, path, MATCH_KEYS)
        if not m:
            raise self.fail(path, "at least one condition")
        tests = [self._condition(key, value, f"{path}.{key}", refs) for key, value in m.items()]
        return _all_of(tests)

    def _condition(self, key: str, value: Any, path: str, refs: Refs) -> Matcher:
        if key in ("any", "all"):
            if not isinstance(value, list) or not value:
                raise self.fail(path, "a non-empty list of conditions", value)
            parts = [self.matcher(v, f"{path}[{i}]", refs) for i, v in enumerate(value)]
            return _any_of(parts) if key == "any" else _all_of(parts)
        if key == "not":
            inner = self.matcher(value, path, refs)
            return lambda f: not inner(f)
        if key == "root":
            if not isinstance(value, bool):
                raise self.fail(path, "true or false", value)
            return lambda f: f.root is value
        if key == "has":
            fields = self.strings(value, path)
            for n in fields:
                self._field_name(n, path)
            refs.fields.update(fields)
            return _any_of([_has(n) for n in fields])
        if key in ("field", "attribute"):
            tests = self.mapping(value, path, None)
            if not tests:
                raise self.fail(path, "a mapping of name: value(s)")
            checks = []
            for name, wanted in tests.items():
                values = frozenset(self.strings(wanted, f"{path}.{name}"))
                if key == "field":
                    self._field_name(name, path)
                    refs.fields.add(name)
                    checks.append(_field_in(name, values))
                else:
                    refs.attributes.add(name)
                    checks.append(_attribute_in(name, values))
            return _all_of(checks)
        texts = self.strings(value, path)
        if key == "name":
            names = frozenset(texts)
            return lambda f: f.name in names
        if key == "name_prefix":
            return lambda f: f.name.startswith(texts)
        if key == "name_suffix":
            return lambda f: f.name.endswith(texts)
        if key == "name_contains":
            lowered = tuple(t.lower() for t in texts)
            return _any_of([_name_contains(t) for t in lowered])
        refs.tool = True
        if key == "tool_name":
            tools = frozenset(texts)
            return lambda f: f.tool_name() in tools
        if key == "tool_name_prefix":
            return lambda f: f.tool_name().startswith(texts)
        raise AssertionError(key)  # MATCH_KEYS is exhaustive

    def matcher_data(self, raw: Any) -> Any:
        """A validated matcher (see `matcher`) as plain data: {"all"|"any": [...]},
        {"not": m}, {"root": bool}, {"has": [fields]}, {"field"|"attribute": [name, [values]]},
        {"name"|"name_prefix"|"name_suffix"|"tool_name"|"tool_name_prefix": [texts]},
        {"name_contains": [lowered texts]}. The closures and this are compiled from the
        same validated mapping; the native normalizer reads this form."""
        parts = [self._condition_data(key, value) for key, value in raw.items()]
        return parts[0] if len(parts) == 1 else {"all": parts}

    def _condition_data(self, key: str, value: Any) -> Any:
        if key in ("any", "all"):
            return {key: [self.matcher_data(v) for v in value]}
        if key == "not":
            return {"not": self.matcher_data(value)}
        if key == "root":
            return {"root": value}
        if key in ("field", "attribute"):
            checks = [
                {key: [name, list(self.strings(wanted, key))]} for name, wanted in value.items()
            ]
            return checks[0] if len(checks) == 1 else {"all": checks}
        texts = list(self.strings(value, key))
        if key == "name_contains":
            texts = [t.lower() for t in texts]
        return {key: texts}

    def _field_name(self, name: str, path: str) -> None:
        if name not in FIELDS:
            raise ConfigError(
                f"{self.source}: {path}: unknown field {name!r}; expected one of "
                + ", ".join(FIELDS)
            )

    # -------------------------------------------------------------- sources

    def field_source(self, raw: Any, path: str, field_name: str) -> str | Source:
        if isinstance(raw, str):
            if not raw:
                raise self.fail(path, "an attribute key", raw)
            if field_name == "requested_calls":
                raise self.fail(
                    path, "a format (" + ", ".join(CALL_FORMATS) + ") with its attribute", raw
                )
            return raw
        m = self.mapping(raw, path, SOURCE_KEYS)
        kinds = [
            k
            for k in (
                "attribute",
                "name_after",
                "name_before",
                "span_name",
                "argument",
                "tool_name_after",
            )
            if k in m
        ]
        if len(kinds) != 1:
            raise self.fail(
                path,
                "exactly one of attribute, name_after, name_before, span_name, argument, "
                "tool_name_after",
                raw,
            )
        kw: dict[str, Any] = {}
        if "event" in m and "attribute" not in m:
            raise self.fail(f"{path}.event", "together with attribute (the event attribute)")
        for key in (
            "attribute",
            "event",
            "name_after",
            "name_before",
            "argument",
            "tool_name_after",
        ):
            if key in m:
                value = m[key]
                if not isinstance(value, str) or not value:
                    raise self.fail(f"{path}.{key}", "a non-empty string", value)
                kw[key] = value
        for key in ("span_name", "plain"):
            if key in m:
                if not isinstance(m[key], bool):
                    raise self.fail(f"{path}.{key}", "true or false", m[key])
                kw[key] = m[key]
        if "path" in m:
            if "attribute" not in m:
                raise self.fail(f"{path}.path", "only together with attribute")
            kw["path"] = self.strings(m["path"], f"{path}.path")
        if "format" in m:
            if field_name != "requested_calls":
                raise self.fail(f"{path}.format", "only under requested_calls")
            if m["format"] not in CALL_FORMATS:
                raise self.fail(f"{path}.format", "one of " + ", ".join(CALL_FORMATS), m["format"])
            kw["format"] = m["format"]
        elif field_name == "requested_calls":
            raise self.fail(path, "a format (" + ", ".join(CALL_FORMATS) + ")", raw)
        if "when" in m:
            kw["when"] = self.matcher(m["when"], f"{path}.when", Refs())
            kw["when_data"] = self.matcher_data(m["when"])
        src = Source(**kw)
        if field_name == "requested_calls" and src.attribute is None:
            raise self.fail(
                path, "an attribute (the key, or the key prefix for openinference_flat)"
            )
        if src.attribute is not None and not (
            src.event or src.path or src.plain or src.format or src.when
        ):
            return src.attribute  # a plain attribute key after all
        return src

    # -------------------------------------------------------------- profiles

    def termination(
        self, raw: Any, path: str, check: Callable[[str, str], str]
    ) -> dict[str, dict[str, str]]:
        t = self.mapping(raw, path, set(TERMINATION_KEYS))
        out: dict[str, dict[str, str]] = {}
        for key in TERMINATION_KEYS:
            table = self.mapping(t.get(key, {}), f"{path}.{key}", None)
            out[key] = {k: check(v, f"{path}.{key}.{k}") for k, v in table.items()}
        return out

    def compile(
        self,
        raws: dict[str, RawProfile],
        order: list[str],
        check_reason: Callable[[str, str], str],
        base_termination: Termination,
        overrides: Mapping[str, tuple[str, ...]],
    ) -> tuple[Profile, ...]:
        resolved: dict[str, dict[str, Any]] = {}

        def resolve(name: str, chain: tuple[str, ...]) -> dict[str, Any]:
            if name in resolved:
                return resolved[name]
            raw = raws[name]
            if name in chain:
                raise ConfigError(
                    f"{self.source}: {raw.path}.extends: a cycle ({' -> '.join(chain + (name,))})"
                )
            body = self.mapping(raw.body, raw.path, PROFILE_KEYS)
            out = self._profile_parts(raw, body, check_reason)
            parent_name = body.get("extends")
            if parent_name is not None:
                if not isinstance(parent_name, str) or parent_name not in raws:
                    raise self.fail(
                        f"{raw.path}.extends",
                        "the name of a profile (" + ", ".join(raws) + ")",
                        parent_name,
                    )
                parent = resolve(parent_name, chain + (name,))
                out["kinds"] = out["kinds"] + parent["kinds"]
                mine, theirs = out["refs"], parent["refs"]
                out["refs"] = Refs(
                    mine.fields | theirs.fields,
                    mine.attributes | theirs.attributes,
                    mine.tool or theirs.tool,
                )
                for f in FIELDS:  # a field the child lists replaces the parent's sources
                    if f not in out["keys"]:
                        out["keys"][f] = parent["keys"].get(f, ())
                        out["derived"][f] = parent["derived"].get(f, ())
                for key in TERMINATION_KEYS:
                    out["termination"][key] = _first_then(
                        out["termination"][key], parent["termination"][key]
                    )
            resolved[name] = out
            return out

        profiles = []
        for name in order:
            parts = resolve(name, ())
            keys = {f: k for f, k in parts["keys"].items() if k}
            if name == "generic":
                for f, k in overrides.items():
                    keys[f] = k
            term = parts["termination"]
            refs: Refs = parts["refs"]
            derived = {f: d for f, d in parts["derived"].items() if d}
            # the tool name is in the memo key as its inputs: its attribute keys and the
            # span name; a tool name derived from anything else cannot be memoized
            by_name = all(
                (src.name_after or src.name_before or src.span_name) and src.when is None
                for src in derived.get("tool_name", ())
            )
            profiles.append(
                Profile(
                    name=name,
                    scopes=frozenset(parts["scopes"]),
                    scope_prefixes=tuple(parts["scope_prefixes"]),
                    has_attributes=tuple(parts["has_attributes"]),
                    kinds=tuple(parts["kinds"]),
                    keys=keys,
                    derived=derived,
                    memo_fields=tuple(
                        sorted(refs.fields | ({"tool_name"} if refs.tool else set()))
                    ),
                    memo_attributes=tuple(sorted(refs.attributes)),
                    memoizable=by_name or not refs.tool,
                    termination=Termination(
                        exception_types=_first_then(
                            term["exception_types"], base_termination.exception_types
                        ),
                        message_patterns=tuple(
                            (self.r.regex(p, f"profiles.{name}.termination.message_patterns"), r)
                            for p, r in term["message_patterns"].items()
                        )
                        + base_termination.message_patterns,
                        finish_reasons=_first_then(
                            {k.lower(): v for k, v in term["finish_reasons"].items()},
                            base_termination.finish_reasons,
                        ),
                    ),
                )
            )
        return tuple(profiles)

    def _profile_parts(
        self, raw: RawProfile, body: dict[str, Any], check_reason: Callable[[str, str], str]
    ) -> dict[str, Any]:
        path = raw.path
        parts: dict[str, Any] = {
            "scopes": (),
            "scope_prefixes": (),
            "has_attributes": (),
            "kinds": [],
            "keys": {},
            "derived": {},
            "termination": {k: {} for k in TERMINATION_KEYS},
            "refs": Refs(),
        }
        if "when" in body:
            when = self.mapping(body["when"], f"{path}.when", WHEN_KEYS)
            if not when:
                raise self.fail(f"{path}.when", "at least one of " + ", ".join(sorted(WHEN_KEYS)))
            parts["scopes"] = self.strings(when.get("scope", []), f"{path}.when.scope")
            parts["scope_prefixes"] = self.strings(
                when.get("scope_prefix", []), f"{path}.when.scope_prefix"
            )
            parts["has_attributes"] = self.strings(
                when.get("has_attribute", []), f"{path}.when.has_attribute"
            )
        kinds = body.get("kinds", [])
        if not isinstance(kinds, list):
            raise self.fail(f"{path}.kinds", "a list of {kind, match} rules", kinds)
        for i, rule in enumerate(kinds):
            rp = f"{path}.kinds[{i}]"
            r = self.mapping(rule, rp, {"kind", "match", "id"})
            kind = r.get("kind")
            if kind not in KINDS:
                raise self.fail(f"{rp}.kind", "one of " + ", ".join(KINDS), kind)
            if "match" not in r:
                raise self.fail(f"{rp}.match", "the conditions of the rule")
            matcher = self.matcher(r["match"], f"{rp}.match", parts["refs"])
            label = r.get("id", f"{raw.name}#{i}")
            if not isinstance(label, str):
                raise self.fail(f"{rp}.id", "a string", label)
            parts["kinds"].append(KindRule(kind, matcher, label, self.matcher_data(r["match"])))
        fields = self.mapping(body.get("fields", {}), f"{path}.fields", set(FIELDS))
        for name, sources in fields.items():
            fp = f"{path}.fields.{name}"
            if isinstance(sources, str | dict):
                sources = [sources]
            if not isinstance(sources, list):
                raise self.fail(fp, "a list of attribute keys or sources", sources)
            keys: list[str] = []
            derived: list[Source] = []
            for i, s in enumerate(sources):
                compiled = self.field_source(s, f"{fp}[{i}]", name)
                if isinstance(compiled, str):
                    keys.append(compiled)
                else:
                    derived.append(compiled)
            parts["keys"][name] = tuple(keys)
            parts["derived"][name] = tuple(derived)
        if "termination" in body:
            parts["termination"] = self.termination(
                body["termination"], f"{path}.termination", check_reason
            )
        return parts


def compile_profiles(
    builtin: Mapping[str, Any],
    user: Mapping[str, Any] | None,
    *,
    builtin_source: str,
    source: str,
    check_reason: Callable[[str, str], str],
    base_termination: Termination,
    overrides: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[Profile, ...]:
    """The ordered profiles: user-defined ones (file order) first, then the built-ins
    (a user profile with a built-in's name replaces it in place); the profiles that read
    every span go last (in that order), so a specific profile always gets its spans."""
    raws: dict[str, RawProfile] = {}
    builtin_c = _Compiler(builtin_source)
    bodies = builtin_c.mapping(builtin, "profiles", None)
    for name, body in bodies.items():
        raws[name] = RawProfile(name, f"profiles.{name}", body)
    order = list(bodies)
    compiler = builtin_c
    if user:
        compiler = _Compiler(source)
        user_map = compiler.mapping(user, "profiles", None)
        new = []
        for name, body in user_map.items():
            raws[name] = RawProfile(name, f"profiles.{name}", body)
            if name not in order:
                new.append(name)
        order = new + order
    profiles = compiler.compile(raws, order, check_reason, base_termination, dict(overrides or {}))
    return tuple(p for p in profiles if not p.reads_everything) + tuple(
        p for p in profiles if p.reads_everything
    )


def _first_then(own: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """A table with `own`'s entries first (they win, and patterns are tried in order),
    then `inherited`'s other entries."""
    return {**own, **{k: v for k, v in inherited.items() if k not in own}}


# Matchers run for every span: plain closures, no generators (3-4x faster than all()/any()
# over a generator for the two or three parts a rule has).
def _all_of(parts: list[Matcher]) -> Matcher:
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        a, b = parts
        return lambda f: a(f) and b(f)
    first, rest = parts[0], _all_of(parts[1:])
    return lambda f: first(f) and rest(f)


def _any_of(parts: list[Matcher]) -> Matcher:
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        a, b = parts
        return lambda f: a(f) or b(f)
    first, rest = parts[0], _any_of(parts[1:])
    return lambda f: first(f) or rest(f)


def _has(name: str) -> Matcher:
    return lambda f: name in f.view


def _field_in(name: str, values: frozenset[str]) -> Matcher:
    def test(f: SpanFacts) -> bool:
        value = f.view.get(name)
        return value is not None and (value if value.__class__ is str else str(value)) in values

    return test


def _attribute_in(name: str, values: frozenset[str]) -> Matcher:
    def test(f: SpanFacts) -> bool:
        value = f.attrs.get(name)
        return value is not None and (value if value.__class__ is str else str(value)) in values

    return test


def _name_contains(text: str) -> Matcher:
    return lambda f: text in f.name.lower()
