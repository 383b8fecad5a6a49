"""The on-call API's query parameters, one contract for both ends: `loopwatch query`
checks them before any request (streams/cli/query.py, `--since`, `--by`) and the worker's API
answers 400 for the same values (streams/worker/api/views.py, `since=`, `by=`).

A `ParamError` message has a `{name}` placeholder for the parameter as the caller spells
it, so each end names it its own way with the same rule behind it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# /loops labels, in the order of the counts' keys
LOOP_LABELS = ("shape", "prompt_version", "tool_name", "tool_version", "service_name", "agent_name")
DEFAULT_LOOP_BY = ("shape", "prompt_version", "tool_version")  # /loops rows without by=
RUN_LABELS = ("prompt_version", "outcome", "termination_reason")  # /runs rows
HOLD_LABELS = ("hold_id", "measure")  # /hold-counts rows (detectors/holds.py HOLD_MEASURES)
DEFAULT_SINCE = "1h"
MAX_SINCE_SECONDS = 366 * 86400
SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SINCE = re.compile(r"([0-9]{1,9})([smhd]?)").fullmatch


class ParamError(ValueError):
    """A malformed parameter; `str(e)` has `{name}` where the parameter's name goes."""

    def named(self, name: str) -> str:
        return str(self).replace("{name}", name)


def checked(parse: Callable[[str], T], text: str, name: str, error: type[Exception]) -> T:
    """`parse(text)`, a ParamError raised as `error` with `name` in its message: the API's
    HTTP 400 (`BadRequest`, `since`) or the command line's one-line error
    (`LoopwatchError`, `--since`). One rule, every caller."""
    try:
        return parse(text)
    except ParamError as exc:
        raise error(exc.named(name)) from None


def parse_since(text: str) -> tuple[str, int]:
    """A look-back window, '90s', '15m', '1h', '7d' or a bare number of seconds, from 1 s to
    366 d -> (its canonical text, seconds)."""
    m = _SINCE(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ParamError(
            f"{{name}} {text!r}: expected a duration like 90s, 30m, 1h, 24h or 7d "
            "(units s, m, h, d; a bare number is seconds)"
        )
    seconds = int(m.group(1)) * SINCE_UNITS[m.group(2)]
    if seconds > MAX_SINCE_SECONDS:
        raise ParamError(f"{{name}} {text!r}: at most 366d")
    return f"{int(m.group(1))}{m.group(2)}", seconds


def duration_text(seconds: int) -> str:
    """Seconds as the shortest exact duration: 86400 -> '24h', 604800 -> '7d'."""
    if seconds % 86400 == 0 and seconds >= 2 * 86400:
        return f"{seconds // 86400}d"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0 and seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


MAX_FILTER_CHARS = 256


def parse_filter(label: str, text: str) -> str:
    """One `label=value` filter of /loops (`--shape`, `--prompt-version`, `--tool`,
    `--tool-version`): a value as the events carry it, `unknown` for none; a shape must be
    one loopwatch detects."""
    from alerts.events import EVENT_SHAPES as SHAPES

    value = text.strip()
    if not value or len(value) > MAX_FILTER_CHARS:
        raise ParamError(
            f"{{name}} {text!r}: expected a value of 1 to {MAX_FILTER_CHARS} characters"
        )
    if label == "shape" and value not in SHAPES:
        raise ParamError(f"{{name}}: unknown shape {value!r}; shapes: {', '.join(SHAPES)}")
    return value


def filter_of(label: str) -> Callable[[str], str]:
    """`parse_filter` of one label, for `checked`."""
    return lambda text: parse_filter(label, text)


def parse_by(text: str, labels: tuple[str, ...] = LOOP_LABELS) -> list[str]:
    """Comma-separated group-by labels, each one of `labels`, none twice."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ParamError(
            f"{{name}} {text!r}: expected comma-separated labels from {', '.join(labels)}"
        )
    for part in parts:
        if part not in labels:
            raise ParamError(f"{{name}}: unknown label {part!r}; labels: {', '.join(labels)}")
    twice = next((part for i, part in enumerate(parts) if part in parts[:i]), None)
    if twice is not None:
        raise ParamError(f"{{name}}: label {twice!r} given twice")
    return parts
