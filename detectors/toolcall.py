"""One tool call reduced to its Step's digests: the action fingerprint (the tool contract
applied), the result's digest and emptiness, the contract's progress and side-effect fields,
and the similarity sketches. The one implementation the span path (streams/spanpath/
normalize.py, a call read from its span) and the guard (guard/loopwatch_guard, a call seen
before and after its dispatch) share, so both give one call the same fingerprints; the
native span path implements it again in Rust, held equal by the differential test.

Nothing here keeps an argument or a result: they come in parsed, and leave as digests.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Iterable
from typing import Any

from .contract import action_fp, fill_action, fill_outcome
from .fingerprint import Fingerprinter
from .model import Step
from .policy import Policy
from .sketch import Sketcher

MAX_CODE_LEN = 64
_CODE_LIKE = re.compile(rf"[A-Za-z0-9_.:/-]{{1,{MAX_CODE_LEN}}}").fullmatch
_ENVELOPE_FIELDS = frozenset({"ok", "next", "cursor"})


class CallReducer:
    """Reduces tool calls under one policy and one fingerprint key."""

    __slots__ = ("policy", "fp", "sketch")

    def __init__(self, policy: Policy, fp: Fingerprinter) -> None:
        self.policy = policy
        self.fp = fp
        self.sketch = Sketcher(fp.key)

    def reduce(
        self,
        step: Step,
        tool: str,
        args: dict[str, Any],
        *,
        has_result: bool = False,
        result: Any = None,
        raw_result: Any = None,
        code: str | None = None,
    ) -> None:
        """Fill `step`'s digests for a call of `tool`: `action` then `outcome`."""
        self.action(step, tool, args)
        self.outcome(
            step, tool, has_result=has_result, result=result, raw_result=raw_result, code=code
        )

    def action(self, step: Step, tool: str, args: dict[str, Any]) -> None:
        """What the arguments alone say (what a guard knows before dispatch): the action
        fingerprint, the contract's cursor and side-effect fields, the arguments' sketch
        and the call's identity."""
        contract = self.policy.tools.get(tool)
        step.action_fp = action_fp(self.fp, tool, args, contract)
        if contract is not None:
            fill_action(self.fp, step, contract, args)
        similarity = self.policy.similarity_for(tool)
        if similarity.enabled:
            step.action_sketch, step.identity_fp = self.sketch.of_call(args, contract, similarity)

    def outcome(
        self,
        step: Step,
        tool: str,
        *,
        has_result: bool,
        result: Any = None,
        raw_result: Any = None,
        code: str | None = None,
    ) -> None:
        """What the call's result (`raw_result`: its text as the tool sent it, digested as
        sent when it is one) or its error `code` says."""
        fp = self.fp
        step.error_code = code
        if has_result:
            # Results come from tool code (stable serialization): digest the text as sent.
            if isinstance(raw_result, str):
                step.result_fp = fp.of_text("result", raw_result)
            else:
                step.result_fp = fp.of_value("result", result)
            step.empty_result = is_empty(result)
        elif code is not None:
            step.result_fp = fp.of_text("code", code)
        contract = self.policy.tools.get(tool)
        if contract is not None:
            fill_outcome(fp, step, contract, result)
        similarity = self.policy.similarity_for(tool)
        if similarity.enabled and has_result and code is None and not step.empty_result:
            # (a failure or an empty result is never compared: detectors/similarity.py)
            if similarity.result_items:
                step.result_sketch, step.result_items = self.sketch.of_result(result)
            else:
                step.result_sketch = self.sketch.of_value(result)


def short_code(value: Any) -> str | None:
    """An error type or code as a short lower-case code; "error" for anything that reads
    like a sentence (customer text is never copied)."""
    if value is None or isinstance(value, bool):
        return None
    code = str(value).strip()
    if not code:
        return None
    # Exception types arrive fully qualified: keep the class name only.
    if "." in code and " " not in code:
        code = code.rsplit(".", 1)[-1]
    if not _CODE_LIKE(code):
        return "error"  # a sentence is customer text, not a code: never copy it
    return code.lower()


def refine_code(policy: Policy, code: str | None, texts: Iterable[str]) -> str | None:
    """A stated code as the policy knows it. A framework's native failure (a raised
    exception, a JS throw, a retry request) names its exception type, not the cause: its
    messages are matched for a transient cause. Matched, never copied."""
    if code is None or code in policy.known_error_codes:
        return code
    for text in texts:
        for pattern, transient in policy.transient_message_patterns:
            if pattern.search(text):
                return transient
    return code


def result_code(result: Any) -> str | None:
    """The code an `ok: false` result states (its `code`, `error_code` or `error.code`),
    "error" when it states none; None for any other result."""
    if isinstance(result, dict) and result.get("ok") is False:
        inner = result.get("code") or result.get("error_code")
        if inner is None and isinstance(result.get("error"), dict):
            inner = result["error"].get("code")
        return short_code(inner) or "error"
    return None


def is_empty(result: Any) -> bool:
    """None, "", [], {} or an object whose payload fields (all but ok/next/cursor) are
    all such: no results."""
    if isinstance(result, dict):
        if not result:
            return True
        payload = False
        for key, value in result.items():
            if key in _ENVELOPE_FIELDS:
                continue
            if not (value is None or value == "" or value == [] or value == {}):
                return False
            payload = True
        return payload
    return result is None or result == "" or result == []


def as_json(value: Any) -> Any:
    """Parse a JSON string; other values (already structured, or not JSON) are returned as is."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return value.hex()
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in _JSON_STARTS or text in ("null", "true", "false"):
            try:
                return loads(text)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply
                return value
    return value


_JSON_STARTS = frozenset('{["-0123456789')
# The C scanner, when available (typeshed mistypes make_scanner's argument).
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def loads(text: str) -> Any:
    """json.loads of a stripped string, without its per-call Python layers (hot path)."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after JSON")
    return value
