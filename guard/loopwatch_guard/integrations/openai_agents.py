"""The OpenAI Agents SDK, guarded: its tool input and output guardrails ask the guard before
and tell it after each function tool call; its run hooks report the model turns.

    from loopwatch_guard.integrations.openai_agents import OpenAIAgentsGuard

    guarded = OpenAIAgentsGuard(guard)
    agent = guarded.guard_agent(Agent(name="support", tools=[lookup_order]))
    try:
        result = await Runner.run(agent, question, hooks=guarded.hooks(run_id=trace_id))
    except ToolInputGuardrailTripwireTriggered as stop:   # the guard's enforced stop
        decision = stop.output.output_info                 # a loopwatch_guard Decision

An enforced `deny` / `reconcile` rejects the call with the guard's message as the tool's
output (the model reads it and moves on: the SDK's `reject_content`); an enforced `stop`
is the SDK's own stop, the input guardrail's tripwire, which ends `Runner.run`. The
decision goes on the current OpenTelemetry span: run the agent inside one (most
deployments do) for the platform to read it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    RunHooks,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolOutputGuardrailData,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.tool import (
    resolve_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tracing import get_current_trace

from ..decision import STOP
from ..guard import RUNS_CAP, Guard, GuardRun


class OpenAIAgentsGuard:
    """The guard for the Agents SDK: `guard_agent` adds its guardrails to the tools,
    `hooks` opens one guarded run per `Runner.run`. A run is found again by the SDK's run
    context (its usage record, which every tool context of the run shares)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._runs: OrderedDict[int, GuardRun] = OrderedDict()
        # a failed call's exception, by call id, until its output guardrail reports it (the
        # SDK turns a tool's exception into a text for the model before the guardrail runs)
        self._errors: OrderedDict[str, BaseException] = OrderedDict()

    def hooks(self, run_id: str | None = None, **labels: Any) -> LoopGuardHooks:
        return LoopGuardHooks(self, run_id, **labels)

    def run_of(self, context: Any) -> GuardRun:
        key = id(context.usage)
        run = self._runs.get(key)
        if run is None:
            trace_id = _sdk_trace_id()
            run = self.bind(context, self.guard.run(trace_id or f"agents-{key:x}"))
        return run

    def bind(self, context: Any, run: GuardRun) -> GuardRun:
        self._runs[id(context.usage)] = run
        self._runs.move_to_end(id(context.usage))
        if len(self._runs) > RUNS_CAP:
            self._runs.popitem(last=False)
        return run

    def guardrails(self) -> tuple[Any, Any]:
        """(input guardrail, output guardrail), for a FunctionTool's
        `tool_input_guardrails` / `tool_output_guardrails`."""

        @tool_input_guardrail(name="loopwatch_guard")
        def before(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
            ctx = data.context
            decision = self.run_of(ctx).before_tool(
                ctx.tool_name, ctx.tool_arguments, call_id=ctx.tool_call_id
            )
            if not decision.enforced:
                return ToolGuardrailFunctionOutput.allow(output_info=decision)
            if decision.action == STOP:
                return ToolGuardrailFunctionOutput.raise_exception(output_info=decision)
            return ToolGuardrailFunctionOutput.reject_content(
                decision.message or "Loop guard: not called", output_info=decision
            )

        @tool_output_guardrail(name="loopwatch_guard")
        def after(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
            call_id = data.context.tool_call_id
            error = self._errors.pop(call_id, None)
            run = self.run_of(data.context)
            if error is not None:
                run.after_tool(call_id, error=error)
            else:
                run.after_tool(call_id, result=data.output if data.output is not None else "")
            return ToolGuardrailFunctionOutput.allow()

        return before, after

    def guard_agent(self, agent: Agent[Any]) -> Agent[Any]:
        """Add the guardrails to every function tool of the agent and of the agents it
        hands off to (the tools are changed in place; the agent is returned)."""
        before, after = self.guardrails()
        seen: set[int] = set()
        todo: list[Any] = [agent]
        while todo:
            current = todo.pop()
            if id(current) in seen or not isinstance(current, Agent):
                continue
            seen.add(id(current))
            for tool in current.tools:
                if isinstance(tool, FunctionTool) and not getattr(tool, _MARK, False):
                    tool.tool_input_guardrails = [*(tool.tool_input_guardrails or []), before]
                    tool.tool_output_guardrails = [*(tool.tool_output_guardrails or []), after]
                    self._note_failures(tool)
                    setattr(tool, _MARK, True)
            todo.extend(getattr(h, "agent", h) for h in current.handoffs)
        return agent

    def _note_failures(self, tool: FunctionTool) -> None:
        """Keep the tool's failure formatter (the SDK's default or its own), noting the
        exception first: the guard needs the error's type (a timeout is an ambiguous
        outcome), which the text the model gets no longer carries."""
        formatter = resolve_function_tool_failure_error_function(tool)
        if formatter is None:
            return  # exceptions propagate: nothing reaches the output guardrail

        def noted(ctx: Any, error: Exception) -> Any:
            call_id = getattr(ctx, "tool_call_id", None)
            if call_id is not None:
                self._errors[call_id] = error
                if len(self._errors) > RUNS_CAP:
                    self._errors.popitem(last=False)
            return formatter(ctx, error)

        set_function_tool_failure_error_function(tool, noted)


_MARK = "_loopwatch_guarded"


class LoopGuardHooks(RunHooks[Any]):
    """One per `Runner.run`: opens the guarded run (`run_id`, else the SDK trace's id) and
    reports each model turn (tokens, requested calls) to it."""

    def __init__(self, owner: OpenAIAgentsGuard, run_id: str | None = None, **labels: Any) -> None:
        self.owner = owner
        self.run_id = run_id
        self.labels = labels
        self.run: GuardRun | None = None

    def _run(self, context: Any, agent: Agent[Any]) -> GuardRun:
        if self.run is None:
            labels = {"agent": agent.name, **self.labels}
            self.run = self.owner.guard.run(self.run_id or _sdk_trace_id(), **labels)
        return self.owner.bind(context, self.run)

    async def on_agent_start(self, context: Any, agent: Agent[Any]) -> None:
        self._run(context, agent)

    async def on_llm_end(self, context: Any, agent: Agent[Any], response: Any) -> None:
        calls = [
            (item.name, item.arguments)
            for item in response.output
            if getattr(item, "type", None) == "function_call"
        ]
        usage = response.usage
        self._run(context, agent).after_model(usage.input_tokens, usage.output_tokens, calls)


def _sdk_trace_id() -> str | None:
    trace = get_current_trace()
    trace_id = getattr(trace, "trace_id", None)
    return trace_id if trace_id and trace_id != "no-op" else None
