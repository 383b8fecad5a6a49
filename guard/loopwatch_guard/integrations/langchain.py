"""LangChain 1.x agents (`create_agent`, LangGraph underneath), guarded: a middleware whose
`wrap_tool_call` asks the guard before each tool call and tells it after, and whose
`after_model` reports the model turns.

    from loopwatch_guard.integrations.langchain import LoopGuardMiddleware

    agent = create_agent(model, tools, middleware=[LoopGuardMiddleware(guard)])
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": run_id}})

An enforced `deny` / `reconcile` answers the call with the guard's message as an error
ToolMessage (the model reads it); an enforced `stop` ends the graph the framework's way
(the tool's message and a final AI message naming the loop guard, then a jump to the end
before the model is asked again, as LangChain's own limit middleware does), so `invoke`
returns normally. The run is the invocation's run id, else the current trace's,
else the thread's (`run_key`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, hook_config
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.types import Command

from ..decision import STOP, Decision
from ..guard import Guard, GuardRun
from ..trace import current_ids

FINAL = "Stopped by the loop guard ({shape}): {message}"


def run_key(runtime: Any) -> str | None:
    """The invocation's run id (`invoke(..., {"run_id": ...})`), else the current trace's
    id, else the thread's (a thread holds a conversation: every invocation on it is then
    one run); None: a new run."""
    info = getattr(runtime, "execution_info", None)
    if info is not None and getattr(info, "run_id", None):
        return str(info.run_id)
    ids = current_ids()
    if ids is not None:
        return ids[0]
    thread = getattr(info, "thread_id", None) if info is not None else None
    if not thread:
        config = getattr(runtime, "config", None) or {}
        thread = (config.get("configurable") or {}).get("thread_id")
    return str(thread) if thread else None


class LoopGuardMiddleware(AgentMiddleware):
    def __init__(self, guard: Guard, *, run_id: Callable[[Any], str | None] = run_key) -> None:
        super().__init__()
        self.guard = guard
        self._run_id = run_id

    def _run(self, runtime: Any) -> GuardRun:
        return self.guard.run(self._run_id(runtime))

    # ------------------------------------------------------------------ model turns

    @hook_config(can_jump_to=["end"])
    def before_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """A run the guard stopped ends here, before the model is asked again."""
        if self._run(runtime).stopped is not None:
            return {"jump_to": "end"}
        return None

    @hook_config(can_jump_to=["end"])
    async def abefore_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self.before_model(state, runtime)

    def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        messages = state.get("messages") if isinstance(state, dict) else None
        last = messages[-1] if messages else None
        if isinstance(last, AIMessage):
            usage: dict[str, Any] = dict(last.usage_metadata or {})
            calls = [(c["name"], c.get("args") or {}) for c in last.tool_calls]
            self._run(runtime).after_model(
                usage.get("input_tokens", 0), usage.get("output_tokens", 0), calls
            )
        return None

    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self.after_model(state, runtime)

    # ------------------------------------------------------------------ tool calls

    def _decide(self, request: Any) -> tuple[GuardRun, Decision]:
        call = request.tool_call
        run = self._run(request.runtime)
        return run, run.before_tool(call["name"], call.get("args") or {}, call_id=call.get("id"))

    @staticmethod
    def _blocked(request: Any, decision: Decision) -> ToolMessage | Command[Any]:
        call = request.tool_call
        message = ToolMessage(
            content=decision.message or "Loop guard: not called",
            tool_call_id=call.get("id") or "",
            name=call.get("name"),
            status="error",
        )
        if decision.action != STOP:
            return message
        final = AIMessage(content=FINAL.format(shape=decision.shape, message=decision.message))
        # the graph goes back to the model after its tools: before_model ends it there
        return Command(update={"messages": [message, final]})

    @staticmethod
    def _report(run: GuardRun, decision: Decision, result: Any) -> None:
        if isinstance(result, ToolMessage):
            if result.status == "error":
                run.after_tool(decision.call_id, error="error")
            else:
                run.after_tool(decision.call_id, result=result.content)
        else:  # a Command from the tool: no result to compare
            run.after_tool(decision.call_id, result=None)

    def wrap_tool_call(
        self, request: Any, handler: Callable[[Any], ToolMessage | Command[Any]]
    ) -> ToolMessage | Command[Any]:
        run, decision = self._decide(request)
        if decision.enforced:
            return self._blocked(request, decision)
        try:
            result = handler(request)
        except Exception as exc:
            run.after_tool(decision.call_id, error=exc)
            raise
        self._report(run, decision, result)
        return result

    async def awrap_tool_call(
        self, request: Any, handler: Callable[[Any], Awaitable[ToolMessage | Command[Any]]]
    ) -> ToolMessage | Command[Any]:
        run, decision = self._decide(request)
        if decision.enforced:
            return self._blocked(request, decision)
        try:
            result = await handler(request)
        except Exception as exc:
            run.after_tool(decision.call_id, error=exc)
            raise
        self._report(run, decision, result)
        return result
