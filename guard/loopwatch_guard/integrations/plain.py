"""A hand-written agent loop, guarded: a decorator for the tools and a context for the run.

    guard = Guard.from_policy("policy.yaml")

    @guarded("lookup_order")
    def lookup_order(order_id: str) -> dict: ...

    with running(guard.run(run_id)):
        try:
            for call in model_calls:                 # your loop
                answer = lookup_order(**call.args)   # a denied call answers with the message
        except LoopGuardStop as stop:                # an enforced stop ends the run
            final = stop.decision.message

A guarded tool runs inside an `execute_tool <name>` span carrying the OpenTelemetry GenAI
attributes loopwatch reads (tool name, call id, arguments and result as JSON text), so the
platform fingerprints exactly what the guard did; the guard's decisions are `loop_guard`
events on the span that was current when the call was proposed (the agent's), which
therefore precede any tool span of the call.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from ..decision import STOP, Decision
from ..guard import GuardRun

F = TypeVar("F", bound=Callable[..., Any])
_CURRENT: contextvars.ContextVar[GuardRun | None] = contextvars.ContextVar(
    "loopwatch_guard_run", default=None
)
_tracer = trace.get_tracer("loopwatch_guard")


class LoopGuardStop(Exception):
    """The guard ended the run (an enforced `stop`). `decision` says why; the exception's
    text is the message for the model (give it a final turn, or answer with it)."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.message or decision.reason or "stopped by the loop guard")
        self.decision = decision


@contextmanager
def running(run: GuardRun) -> Iterator[GuardRun]:
    """Make `run` the one guarded tools report to, for this context (thread or task)."""
    token = _CURRENT.set(run)
    try:
        yield run
    finally:
        _CURRENT.reset(token)


def current_run() -> GuardRun | None:
    return _CURRENT.get()


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _decide(
    run: GuardRun, name: str, arguments: Any, call_id: str | None, tool_version: str | None
) -> Decision:
    decision = run.before_tool(name, arguments, call_id=call_id, tool_version=tool_version)
    if decision.enforced and decision.action == STOP:
        raise LoopGuardStop(decision)
    return decision


def _span_attributes(name: str, decision: Decision, arguments: Any) -> dict[str, str]:
    attrs = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.arguments": _as_text(arguments if arguments is not None else {}),
    }
    if decision.call_id is not None:
        attrs["gen_ai.tool.call.id"] = decision.call_id
    return attrs


def _failed(span: Any, run: GuardRun, decision: Decision, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR))
    span.set_attribute("error.type", type(exc).__qualname__)
    run.after_tool(decision.call_id, error=exc, span_id=_span_hex(span))


def _done(span: Any, run: GuardRun, decision: Decision, result: Any) -> None:
    text = _as_text(result)
    span.set_attribute("gen_ai.tool.call.result", text)
    run.after_tool(decision.call_id, result=text, span_id=_span_hex(span))


def _span(name: str, decision: Decision, arguments: Any) -> Any:
    return _tracer.start_as_current_span(
        f"execute_tool {name}", attributes=_span_attributes(name, decision, arguments)
    )


def _span_hex(span: Any) -> str | None:
    ctx = span.get_span_context()
    return f"{ctx.span_id:016x}" if ctx.is_valid else None


def call(
    run: GuardRun,
    name: str,
    fn: Callable[..., Any],
    arguments: dict[str, Any] | None = None,
    *,
    call_id: str | None = None,
    tool_version: str | None = None,
) -> Any:
    """Call `fn(**arguments)` as the tool `name`, if the guard lets it: a denied call is
    not dispatched and answers with the guard's message (the model reads it as the tool's
    result); an enforced stop raises LoopGuardStop."""
    decision = _decide(run, name, arguments, call_id, tool_version)
    if decision.enforced:
        return decision.message
    with _span(name, decision, arguments) as span:
        try:
            result = fn(**(arguments or {}))
        except Exception as exc:
            _failed(span, run, decision, exc)
            raise
        _done(span, run, decision, result)
        return result


async def acall(
    run: GuardRun,
    name: str,
    fn: Callable[..., Any],
    arguments: dict[str, Any] | None = None,
    *,
    call_id: str | None = None,
    tool_version: str | None = None,
) -> Any:
    """`call` for a coroutine function."""
    decision = _decide(run, name, arguments, call_id, tool_version)
    if decision.enforced:
        return decision.message
    with _span(name, decision, arguments) as span:
        try:
            result = await fn(**(arguments or {}))
        except Exception as exc:
            _failed(span, run, decision, exc)
            raise
        _done(span, run, decision, result)
        return result


def guarded(name: str | None = None, *, tool_version: str | None = None) -> Callable[[F], F]:
    """Decorate a tool (a function or a coroutine function called with keyword arguments)
    so each call asks the current run (`running(...)`) first. Outside a run it is called
    as is."""

    def wrap(fn: F) -> F:
        tool = name or fn.__name__
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def aguarded(**kwargs: Any) -> Any:
                run = _CURRENT.get()
                if run is None:
                    return await fn(**kwargs)
                return await acall(run, tool, fn, kwargs, tool_version=tool_version)

            return aguarded  # type: ignore[return-value]

        @functools.wraps(fn)
        def sguarded(**kwargs: Any) -> Any:
            run = _CURRENT.get()
            if run is None:
                return fn(**kwargs)
            return call(run, tool, fn, kwargs, tool_version=tool_version)

        return sguarded  # type: ignore[return-value]

    return wrap
