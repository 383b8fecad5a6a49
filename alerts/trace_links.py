"""Links from loopwatch's ids to the tracing UI a team already has (Grafana Explore, Tempo,
Jaeger, Langfuse, Phoenix): `LOOPWATCH_TRACE_URL` is a URL template with the placeholders
``{trace_id}``, ``{span_id}`` and ``{run_id}`` (docs/CONTRACTS.md §6-§7). Events, run
summaries, the on-call API and the CLI carry the filled-in link as ``trace_url``.

Only the three placeholders are filled; any other ``{name}`` is an error (a typo would give
a link that never names the trace), while other braces, such as the JSON of a Grafana
Explore URL, stay as written. Values are percent-encoded: a run id may be a conversation id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from detectors.errors import ConfigError

PLACEHOLDERS = ("trace_id", "span_id", "run_id")
_NAME = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
ENV = "LOOPWATCH_TRACE_URL"


@dataclass(frozen=True, slots=True)
class TraceLinks:
    template: str

    @classmethod
    def parse(cls, template: str, source: str = ENV) -> TraceLinks | None:
        """None for an empty template (no links); ConfigError for an unusable one."""
        template = template.strip()
        if not template:
            return None
        names = _NAME.findall(template)
        unknown = sorted({n for n in names if n not in PLACEHOLDERS})
        if unknown:
            raise ConfigError(
                f"{source}: unknown placeholder {{{unknown[0]}}}; "
                f"expected {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
            )
        if not names:
            raise ConfigError(
                f"{source}: no placeholder: the link must name the trace, e.g. "
                "https://tempo.example/trace/{trace_id}"
            )
        if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", template):
            raise ConfigError(f"{source}: expected an absolute URL (https://...), got {template!r}")
        return cls(template)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TraceLinks | None:
        return cls.parse(environ.get(ENV, ""))

    def url(
        self, trace_id: str | None, span_id: str | None = None, run_id: str | None = None
    ) -> str:
        values = {"trace_id": trace_id, "span_id": span_id, "run_id": run_id}
        return _NAME.sub(lambda m: quote(values[m.group(1)] or "", safe=""), self.template)

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """A loop_detected event with its `trace_url` (the triggering span of its trace)."""
        event["trace_url"] = self.url(
            event.get("trace_id"), event.get("trigger_span_id"), event.get("run_id")
        )
        return event

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """A run summary with its `trace_url` (the run's trace)."""
        summary["trace_url"] = self.url(summary.get("trace_id"), None, summary.get("run_id"))
        return summary
