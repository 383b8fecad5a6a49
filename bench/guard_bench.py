"""The guard's cost (issue 37): microseconds per decision (`before_tool`, the copy of the
run's state the prediction runs on included) and per outcome (`after_tool`), median and p99
over runs of 50 steps of the example policy's tools (repeats, polls, pagination, side
effects, a model turn every third call), and what a run holds after its 50 steps. In the
agent's process, one core, no I/O."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from loopwatch_guard import Guard

from detectors.policy import load_policy

STEPS = 50


def _call(rng: random.Random) -> tuple[str, dict[str, Any], Any]:
    n = rng.randint(1, 3)
    tool = rng.choice(
        ["lookup_order", "get_export_status", "search_cases", "get_order", "issue_refund"]
    )
    args: dict[str, Any] = {"order_id": f"A{n}"}
    if tool == "search_cases":
        args = {"query": "late delivery", "cursor": rng.choice([None, "c2", "c3"])}
    if tool == "issue_refund":
        args["idempotency_key"] = rng.choice(["k1", "k2"])
    result: Any = rng.choice(
        [
            {"status": rng.choice(["pending", "delivered"]), "version": rng.randint(1, 3)},
            {"case_ids": [f"c{rng.randint(1, 9)}", f"c{rng.randint(1, 9)}"]},
            {"ok": True},
            [],
        ]
    )
    return tool, args, result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _holds(n: int) -> Any:
    """A holds client holding `n` active holds of every kind of scope (none fetched: the
    set is what a refresh would have swapped in), none of which the bench's calls match
    but the last: every decision looks them up."""
    import time as _time

    from loopwatch_guard.holds import HoldsClient

    from detectors.holds import Hold, Scope

    now = _time.time_ns()
    later = now + 3600 * 10**9
    scopes = [
        lambda i: Scope(run=f"held-run-{i}"),
        lambda i: Scope(tool=f"tool-{i % 50}", prompt_version=f"v{i}"),
        lambda i: Scope(prompt_version=f"held-v{i}"),
        lambda i: Scope(side_effects=True, service=f"svc-{i}"),
    ]
    client = HoldsClient("http://127.0.0.1:9")  # never started: no request is made
    client.holds = tuple(
        Hold(f"hold-{i}", scopes[i % 4](i), "bench", "bench", now, later) for i in range(n)
    )
    return client


def run(runs: int, policy_path: str | Path, holds: int = 0) -> dict[str, Any]:
    guard = Guard(
        load_policy(policy_path),
        fingerprint_key=b"bench-key",
        holds=_holds(holds) if holds else None,
    )
    rng = random.Random(37)
    before: list[float] = []
    after: list[float] = []
    sizes: list[int] = []
    decisions = 0
    clock = time.perf_counter_ns
    for r in range(runs):
        guarded = guard.run(f"bench-{r}")
        for i in range(STEPS):
            tool, args, result = _call(rng)
            if i % 3 == 0:
                guarded.after_model(1_000 + 40 * i, 60, [(tool, args)])
            t0 = clock()
            d = guarded.before_tool(tool, args, call_id=f"c{i}")
            t1 = clock()
            guarded.after_tool(d.call_id, result=result)
            t2 = clock()
            before.append((t1 - t0) / 1000)
            after.append((t2 - t1) / 1000)
            decisions += d.action != "allow"
        sizes.append(guarded.state_bytes())
        guard.end(guarded.run_id)
    return {
        "holds": holds,
        "runs": runs,
        "steps_per_run": STEPS,
        "before_tool_us_median": statistics.median(before),
        "before_tool_us_p99": _pct(before, 0.99),
        "after_tool_us_median": statistics.median(after),
        "after_tool_us_p99": _pct(after, 0.99),
        "decisions_not_allow": decisions,
        "run_bytes_mean": statistics.mean(sizes),
        "run_bytes_max": max(sizes),
    }


def rows(result: dict[str, Any], held: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    out = [
        (
            "guard: before_tool (the decision), median / p99",
            f"{result['before_tool_us_median']:,.1f} / {result['before_tool_us_p99']:,.1f} us",
            f"{result['runs']:,} runs of {result['steps_per_run']} steps, 1 core, no I/O; "
            f"{result['decisions_not_allow']:,} decisions other than allow",
        ),
        (
            "guard: after_tool (the outcome), median / p99",
            f"{result['after_tool_us_median']:,.1f} / {result['after_tool_us_p99']:,.1f} us",
            "the result digested and fed to the run's detectors",
        ),
        (
            "guard: what a run holds after 50 steps",
            f"{result['run_bytes_mean']:,.0f} bytes (max {result['run_bytes_max']:,})",
            "its RunState serialized + last outcomes + calls in flight",
        ),
    ]
    if held is not None:
        out.append(
            (
                f"guard: before_tool with {held['holds']:,} active holds, median / p99",
                f"{held['before_tool_us_median']:,.1f} / {held['before_tool_us_p99']:,.1f} us",
                "holds filed by run, tool, prompt version, service or agent when fetched; matched in memory",
            )
        )
    return out


if __name__ == "__main__":
    policy = Path(__file__).resolve().parents[1] / "examples" / "loopwatch.yaml"
    for row in rows(run(400, policy), run(400, policy, holds=1000)):
        print(" | ".join(row))
