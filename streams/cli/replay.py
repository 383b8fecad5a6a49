"""`loopwatch replay` and `loopwatch gate`: export files through the replay
(streams/replay/runs.py), events and run summaries out, a summary table, and the gate's
limits."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from alerts.trace_links import TraceLinks
from detectors.compare import TOO_FEW, WORSE, Row, Side, compare
from detectors.compare import document as comparison_document
from detectors.errors import LoopwatchError
from detectors.policy import load_policy
from streams.cli.common import config_path, open_output
from streams.cli.comparison import comparison_blocks
from streams.cli.render import Block, ReplayProgress, table, to_text
from streams.runtime import tune_gc


def run_replay(
    paths: Sequence[str],
    config: str | None,
    on_event: Callable[[dict[str, Any]], object],
    on_summary: Callable[[dict[str, Any]], object] | None,
    err: IO[str],
    memory_mb: float | None = None,
) -> Any:
    """Replay export files (streams/replay/runs.py); returns the replay (its `stats`, `order`)."""
    from streams.replay.files import expand_paths
    from streams.replay.runs import Replay, memory_mb_from_env, replay_files
    from streams.runtime import fingerprinter_from_env

    policy = load_policy(config_path(config))
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise LoopwatchError(f"{missing[0]}: no such file or directory")
    fp = fingerprinter_from_env(lambda m: print(m, file=err))

    def report(message: str) -> None:
        print(f"loopwatch: skipped: {message}", file=err)

    replay = Replay(
        policy,
        fp,
        on_event,
        on_summary,
        on_invalid=report,
        memory_mb=memory_mb if memory_mb is not None else memory_mb_from_env(),
        links=TraceLinks.from_env(os.environ),
    )
    files = expand_paths(paths, lambda exc: report(str(exc)))
    progress = ReplayProgress(sum(f.stat().st_size for f in files), err)

    def on_decode_error(exc: Exception) -> None:
        replay.stats.decode_errors += 1
        report(str(exc))

    replay_files(
        replay,
        files,
        on_decode_error,
        lambda done: progress.update(done, replay.stats.spans, replay.stats.events),
    )
    replay.close()
    progress.done(replay.stats.spans, replay.stats.events)
    if replay.stats.spans_after_finalize:
        print(after_finalize_line(replay), file=err)
    return replay


def _seconds(ns: int) -> str:
    return f"{ns / 1e9:,.1f} s"


def after_finalize_line(replay: Any) -> str:
    """One line for spans the replay counted but did not detect on: they came after a gap
    in their run that the worker's finalization does not wait for."""
    stats, order, policy = replay.stats, replay.order, replay.policy
    setting = order.gap_setting
    now = getattr(policy, setting) if setting else 0
    return (
        f"loopwatch: {stats.spans_after_finalize:,} spans of {order.split_runs:,} runs came "
        f"after their run ended (a gap of up to {_seconds(order.largest_gap_ns)} between "
        f"span ends, past {setting}={now:g}; the input was out of time order by up to "
        f"{_seconds(order.disorder_ns)}, which does not matter): counted, not detected on, "
        f"as the worker would; {setting} >= {order.largest_gap_ns / 1e9:,.0f} would hold them"
    )


def format_table(replay: Any) -> str:
    stats, order = replay.stats, replay.order
    held = f"held {order.held_steps_peak:,} steps at most"
    if order.spilled_steps:
        held += f", spilled {order.spilled_steps:,} ({order.spill_bytes / 2**20:,.1f} MiB on disk)"
    lines = [
        f"runs finished   {stats.runs_finished:>10,}   looping {stats.looping_runs:,}"
        f" ({(stats.looping_runs / stats.runs_finished if stats.runs_finished else 0):.1%})",
        f"spans           {stats.spans:>10,}   duplicates {stats.duplicate_spans:,}  late {stats.late_spans:,}"
        f"  after-finalize {stats.spans_after_finalize:,}",
        f"loop events     {stats.events:>10,}   decode errors {stats.decode_errors:,}"
        f"  invalid spans {stats.invalid_spans:,}",
        "outcomes        "
        + ("  ".join(f"{k} {v:,}" for k, v in sorted(stats.runs_by_outcome.items())) or "-"),
        f"input order     out of time order by up to {_seconds(order.disorder_ns)}  {held}",
    ]
    blocks: list[Block] = list(lines)
    for title, counter in (
        ("loops by shape", stats.loops_by_shape),
        ("loops by prompt_version", stats.loops_by_prompt),
        ("loops by tool", stats.loops_by_tool),
    ):
        blocks.append("")
        rows = [
            [key, f"{value:,}"]
            for key, value in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
        ]
        blocks.append(table([title, "events"], rows, {1}) if rows else f"{title}: none")
    return to_text(blocks)


def cmd_replay(args: argparse.Namespace) -> int:
    tune_gc()
    out = open_output(args.output)
    runs_out = open_output(args.runs) if args.runs else None
    try:
        replay = run_replay(
            args.paths,
            args.config,
            lambda e: out.write(json.dumps(e, separators=(",", ":")) + "\n"),
            (lambda s: runs_out.write(json.dumps(s, separators=(",", ":")) + "\n"))
            if runs_out
            else None,
            sys.stderr,
            args.memory_mb,
        )
    finally:
        if out is not sys.stdout:
            out.close()
        if runs_out is not None and runs_out is not sys.stdout:
            runs_out.close()
    table_stream = sys.stderr if out is sys.stdout else sys.stdout
    print(format_table(replay), file=table_stream)
    return 0


def shape_limits(items: list[str] | None) -> dict[str, int]:
    from alerts.events import EVENT_SHAPES as SHAPES

    limits: dict[str, int] = {}
    for item in items or []:
        shape, _, value = item.partition("=")
        if not shape or not value.isdigit():
            raise LoopwatchError(
                f"--max-shape {item!r}: expected SHAPE=N, e.g. duplicate_side_effect=0"
            )
        limits[shape] = int(value)
    unknown = [s for s in limits if s not in SHAPES]
    if unknown:
        raise LoopwatchError(
            f"--max-shape: unknown shape {unknown[0]!r}; shapes: {', '.join(SHAPES)}"
        )
    return limits


def replay_side(paths: Sequence[str], args: argparse.Namespace) -> tuple[Any, Side]:
    """Replay `paths`; its stats and the runs as a comparison side."""
    side = Side()
    replay = run_replay(
        paths,
        args.config,
        side.add_event,
        side.add_summary,
        sys.stderr,
        args.memory_mb,
    )
    return replay, side


def limit_breaches(
    replay: Any, limits: dict[str, int], args: argparse.Namespace, out: IO[str]
) -> list[str]:
    """The fixed limits (--max-loop-rate, --max-shape) and what was not scored."""
    stats = replay.stats
    breaches = []
    rate = stats.looping_runs / stats.runs_finished if stats.runs_finished else 0.0
    if args.max_loop_rate is not None and rate > args.max_loop_rate:
        breaches.append(f"loop rate {rate:.2%} > {args.max_loop_rate:.2%}")
    for shape, limit in sorted(limits.items()):
        if stats.loops_by_shape[shape] > limit:
            breaches.append(f"{shape}: {stats.loops_by_shape[shape]} events > {limit}")
    incomplete = (
        stats.runs_by_outcome["incomplete_trace"] + stats.runs_by_outcome["integrity_error"]
    )
    if incomplete:
        print(
            f"note: {incomplete} run(s) incomplete or integrity-failed: not scored as clean",
            file=out,
        )
    if stats.runs_finished == 0:
        breaches.append("no runs in the input: nothing was scored")
    if stats.spans_after_finalize and not args.allow_after_finalize:
        breaches.append(
            f"{stats.spans_after_finalize} spans came after their run ended and were not "
            "scored (see the line above; --allow-after-finalize accepts that)"
        )
    return breaches


def cmd_gate(args: argparse.Namespace) -> int:
    tune_gc()
    limits = shape_limits(args.max_shape)
    if args.baseline:
        from streams.replay.files import expand_paths

        def same(paths: Sequence[str]) -> set[Path]:
            return {f.resolve() for f in expand_paths(paths, lambda exc: None)}

        if same(args.baseline) == same(args.paths):
            raise LoopwatchError(
                "--baseline and the candidate are the same files: nothing to compare"
            )
    replay, candidate = replay_side(args.paths, args)
    notes = sys.stderr if args.json else sys.stdout
    breaches = limit_breaches(replay, limits, args, notes)
    document: dict[str, Any] = {}
    if args.baseline:
        base_replay, baseline = replay_side(args.baseline, args)
        if base_replay.stats.runs_finished == 0:
            raise LoopwatchError(
                f"--baseline {' '.join(args.baseline)}: no runs: nothing to compare with"
            )
        rows = compare(baseline, candidate, alpha=args.alpha, min_runs=args.min_runs)
        breaches += comparison_breaches(rows, candidate, args.fail_on_too_few)
        document = comparison_document(
            rows, baseline, candidate, alpha=args.alpha, min_runs=args.min_runs
        )
        if not args.json:
            print(to_text(comparison_blocks(document)))
    elif not args.json:
        print(format_table(replay))
    if args.json:
        document.update(passed=not breaches, failures=breaches)
        print(json.dumps(document, indent=2))
        return 1 if breaches else 0
    for breach in breaches:
        print(f"gate: FAIL {breach}")
    if not breaches:
        print("gate: PASS")
    return 1 if breaches else 0


def comparison_breaches(rows: list[Row], candidate: Side, fail_on_too_few: bool) -> list[str]:
    out = []
    for row in rows:
        if row.verdict == WORSE:
            out.append(
                f"the candidate loops more: {row.shape} {row.candidate[0]}/{row.candidate[1]} "
                f"runs against {row.baseline[0]}/{row.baseline[1]} (p={row.p_value:.2g})"
            )
    if candidate.duplicate_side_effects:
        out.append(f"the candidate has {candidate.duplicate_side_effects} duplicate side effect(s)")
    if fail_on_too_few and rows[0].verdict == TOO_FEW:
        out.append(
            f"not enough runs to tell (--fail-on-too-few): {rows[0].baseline[1]} and {rows[0].candidate[1]}"
        )
    return out
