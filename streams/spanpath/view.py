"""Recognition: a span's field view under its profile, the kind rules, derived field sources,
and the resource's labels (native: normalize/view.rs). `View` is the part of the
`Normalizer` (normalize.py) that reads a span; tool.py and termination.py fill its step
from what it read."""

from __future__ import annotations

from typing import Any, NamedTuple

from detectors.model import OTHER
from detectors.policy import Policy
from detectors.recognition import Profile, Source, SpanFacts
from detectors.toolcall import as_json
from streams.spanpath.runkey import common_fields, run_keys
from streams.spanpath.spans import SpanRecord
from streams.spanpath.values import first, ident, str_or_none

# Attribute key sets remembered by View._plan (instrumentations send a few each).
MAX_PLANS = 1024
MAX_KIND_MEMO = 256  # kinds remembered: a few names and tools per instrumentation

# A span's plan: field -> its attribute keys present, in rank order.
Plan = tuple[tuple[str, tuple[str, ...]], ...]


class Facts(SpanFacts):
    """A span as the recognition matchers see it; the tool name is resolved once, on
    first use (most rules never ask)."""

    __slots__ = ("span", "profile", "_normalizer", "_tool")

    def __init__(
        self, normalizer: View, span: SpanRecord, view: dict[str, Any], profile: Profile
    ) -> None:
        # (SpanFacts.__init__ inlined: one object per span on the hot path)
        self.name = span.name
        self.root = span.parent_span_id is None
        self.attrs = span.attributes
        self.view = view
        self.span = span
        self.profile = profile
        self._normalizer = normalizer
        self._tool: str | None = None

    def tool_name(self) -> str:
        if self._tool is None:
            self._tool = self._normalizer._tool_name_of(self)
        return self._tool


def derive(source: Source, facts: Facts, args: Any) -> Any:
    """The value of one derived field source for this span, or None."""
    if source.when is not None and not source.when(facts):
        return None
    if source.attribute is not None:
        if source.event is None:
            value = facts.attrs.get(source.attribute)
        else:
            value = next(
                (
                    e.attributes.get(source.attribute)
                    for e in facts.span.events
                    if e.name == source.event and source.attribute in e.attributes
                ),
                None,
            )
        if value is None:
            return None
        if source.plain:
            if not isinstance(value, str) or value[:1] in "{[":
                return None
            return value
        for key in source.path:
            value = as_json(value)
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                return None
        return value
    name = facts.name
    if source.name_after is not None:
        return name[len(source.name_after) :] if name.startswith(source.name_after) else None
    if source.name_before is not None:
        return name[: -len(source.name_before)] if name.endswith(source.name_before) else None
    if source.span_name:
        return name
    if source.argument is not None:
        return args.get(source.argument) if isinstance(args, dict) else None
    if source.tool_name_after is not None:
        tool = facts.tool_name()
        prefix = source.tool_name_after
        return tool[len(prefix) :] if tool.startswith(prefix) else None
    return None


class ResourceInfo(NamedTuple):
    """What a span's steps take from its resource (native: `Res`, normalize/mod.rs)."""

    resource: dict[str, Any]
    service: str | None
    prompt_version: str | None
    tool_version: str | None
    task_type: str | None
    run_key: Any


class View:
    """What a policy's profiles read of a span: its view, kind, fields and resource."""

    def __init__(self, policy: Policy) -> None:
        c = policy.conventions
        self._resource_prompt_version = c["resource_prompt_version"]
        self._resource_tool_version = c["resource_tool_version"]
        self._task_attr = policy.task_type_attribute
        self._run_keys = run_keys(policy)
        self._profiles = policy.profiles
        common = common_fields(policy)  # fields every profile reads the same way
        # One pass over a span's attributes finds every field (first key wins), per
        # profile: attribute key -> [(field, rank)].
        self._keymaps: dict[str, dict[str, list[tuple[str, int]]]] = {}
        for profile in self._profiles:
            keymap: dict[str, list[tuple[str, int]]] = {}
            for name, keys in (*profile.keys.items(), *common.items()):
                for rank, key in enumerate(keys):
                    keymap.setdefault(key, []).append((name, rank))
            self._keymaps[profile.name] = keymap
        self._resources: dict[int, ResourceInfo] = {}
        self._plans: dict[tuple[str, tuple[str, ...]], tuple[Profile, Plan]] = {}
        self._kinds: dict[tuple[Any, ...], tuple[str, str | None]] = {}

    def _read(self, span: SpanRecord) -> tuple[Profile, dict[str, Any]]:
        """The span's profile, and field -> value of its first attribute key present and
        not empty (attribute sources only; derived sources are read where needed)."""
        attrs = span.attributes
        cache_key = (span.scope_name, tuple(attrs))
        found = self._plans.get(cache_key)
        if found is None:
            found = self._plan(*cache_key)
        profile, plan = found
        view: dict[str, Any] = {}
        for name, candidates in plan:
            for key in candidates:
                value = attrs[key]
                if value is not None and value != "":
                    view[name] = value
                    break
        return profile, view

    def _plan(self, scope: str, keys: tuple[str, ...]) -> tuple[Profile, Plan]:
        # Spans of one instrumentation share their scope and attribute keys: which profile
        # reads them, which fields they can fill and from which keys in rank order is
        # worked out once per (scope, key set).
        profile = next(p for p in self._profiles if p.applies(scope, keys))
        keymap = self._keymaps[profile.name]
        ranked: dict[str, list[tuple[int, str]]] = {}
        for key in keys:
            for name, rank in keymap.get(key, ()):
                ranked.setdefault(name, []).append((rank, key))
        plan = tuple((name, tuple(key for _, key in sorted(hits))) for name, hits in ranked.items())
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[(scope, keys)] = (profile, plan)
        return profile, plan

    def _resource(self, resource: dict[str, Any]) -> ResourceInfo:
        """What the steps take from the span's resource, cached: every span of one
        ResourceSpans shares its resource dict."""
        cached = self._resources.get(id(resource))
        if cached is not None and cached.resource is resource:
            return cached
        if len(self._resources) > 4096:
            self._resources.clear()
        info = ResourceInfo(
            resource,
            str_or_none(resource.get("service.name")),
            str_or_none(first(resource, self._resource_prompt_version)),
            str_or_none(first(resource, self._resource_tool_version)),
            str_or_none(resource.get(self._task_attr)) if self._task_attr else None,
            first(resource, self._run_keys) if self._run_keys else None,
        )
        self._resources[id(resource)] = info
        return info

    # ------------------------------------------------------------------ classification

    def _classify(self, profile: Profile, facts: Facts) -> tuple[str, str | None]:
        key: tuple[Any, ...] | None = None
        if profile.memoizable:
            view, attrs = facts.view, facts.attrs
            key = (
                profile.name,
                facts.name,
                facts.root,
                *[view.get(f) for f in profile.memo_fields],
                *[attrs.get(a) for a in profile.memo_attributes],
            )
            try:
                found = self._kinds.get(key)
            except TypeError:  # an unhashable value (a list attribute): no memo
                key, found = None, None
            if found is not None:
                return found
        found = (OTHER, None)
        for rule in profile.kinds:
            if rule.match(facts):
                found = (rule.kind, rule.label)
                break
        if key is not None:
            if len(self._kinds) >= MAX_KIND_MEMO:
                self._kinds.clear()
            self._kinds[key] = found
        return found

    def _field(self, profile: Profile, name: str, facts: Facts, args: Any = None) -> Any:
        """A field from its attribute keys, else from its derived sources (in order)."""
        value = facts.view.get(name)
        if value is not None:
            return value
        for source in profile.derived.get(name, ()):
            value = derive(source, facts, args)
            if value is not None and value != "":
                return value
        return None

    def _tool_name_of(self, facts: Facts) -> str:
        name = self._field(facts.profile, "tool_name", facts)
        return ident(name if name is not None else facts.name)
