"""`loopwatch` command line (docs/CONTRACTS.md §7). Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from detectors.errors import LoopwatchError
from detectors.policy import load_policy
from streams.runtime import tune_gc

EXIT_ERROR = 2


def _config_path(arg: str | None) -> str | None:
    return arg or os.environ.get("LOOPWATCH_CONFIG") or None


def _open_output(target: str | None) -> IO[str]:
    if target in (None, "-"):
        return sys.stdout
    try:
        return open(target, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise LoopwatchError(f"{target}: cannot write output: {exc.strerror}") from None


class Progress:
    """A one-line progress display on a terminal; silent otherwise."""

    def __init__(self, total_bytes: int, stream: IO[str]) -> None:
        self.enabled = stream.isatty() and total_bytes > 1_000_000
        self.stream = stream
        self.total = total_bytes
        self.started = time.monotonic()
        self.last = 0.0

    def update(self, done_bytes: int, spans: int, events: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < 0.2:
            return
        self.last = now
        fraction = min(1.0, done_bytes / self.total) if self.total else 1.0
        bar = "#" * int(fraction * 30)
        rate = spans / max(now - self.started, 1e-9)
        self.stream.write(
            f"\r[{bar:<30}] {fraction:6.1%}  {spans:,} spans  {rate:,.0f} spans/s  {events:,} events"
        )
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\n")


def run_replay(
    paths: Sequence[str],
    config: str | None,
    on_event: Callable[[dict[str, Any]], object],
    on_summary: Callable[[dict[str, Any]], object] | None,
    err: IO[str],
    memory_mb: float | None = None,
) -> Any:
    """Replay export files (streams/replay/runs.py); returns the replay (its `stats`, `order`)."""
    from streams.replay.engine import fingerprinter_from_env
    from streams.replay.files import expand_paths
    from streams.replay.runs import Replay, memory_mb_from_env, replay_files

    policy = load_policy(_config_path(config))
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
    )
    files = expand_paths(paths, lambda exc: report(str(exc)))
    progress = Progress(sum(f.stat().st_size for f in files), err)

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
    progress.update(progress.total, replay.stats.spans, replay.stats.events, force=True)
    progress.done()
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
    for title, counter in (
        ("loops by shape", stats.loops_by_shape),
        ("loops by prompt_version", stats.loops_by_prompt),
        ("loops by tool", stats.loops_by_tool),
    ):
        lines.append("")
        lines.append(f"{title:<32} {'events':>8}")
        lines.append("-" * 41)
        if not counter:
            lines.append("(none)")
        for key, value in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"{key:<32} {value:>8,}")
    return "\n".join(lines)


def cmd_replay(args: argparse.Namespace) -> int:
    tune_gc()
    out = _open_output(args.output)
    runs_out = _open_output(args.runs) if args.runs else None
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


def cmd_gate(args: argparse.Namespace) -> int:
    tune_gc()
    limits: dict[str, int] = {}
    for item in args.max_shape or []:
        shape, _, value = item.partition("=")
        if not shape or not value.isdigit():
            raise LoopwatchError(
                f"--max-shape {item!r}: expected SHAPE=N, e.g. duplicate_side_effect=0"
            )
        limits[shape] = int(value)
    from alerts.events import SHAPES

    unknown = [s for s in limits if s not in SHAPES]
    if unknown:
        raise LoopwatchError(
            f"--max-shape: unknown shape {unknown[0]!r}; shapes: {', '.join(SHAPES)}"
        )
    replay = run_replay(args.paths, args.config, lambda e: None, None, sys.stderr, args.memory_mb)
    stats = replay.stats
    print(format_table(replay))
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
        print(f"note: {incomplete} run(s) incomplete or integrity-failed: not scored as clean")
    if stats.runs_finished == 0:
        breaches.append("no runs in the input: nothing was scored")
    if stats.spans_after_finalize and not args.allow_after_finalize:
        breaches.append(
            f"{stats.spans_after_finalize} spans came after their run ended and were not "
            "scored (see the line above; --allow-after-finalize accepts that)"
        )
    for breach in breaches:
        print(f"gate: FAIL {breach}")
    if not breaches:
        print("gate: PASS")
    return 1 if breaches else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopwatch", description="Production loop alarms for AI agents."
    )
    parser.add_argument(
        "--version", action=_VersionAction, nargs=0, help="print the version and the span path"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="run the detectors over OTLP export files (no broker)")
    p.add_argument("--config", help="policy YAML (default: $LOOPWATCH_CONFIG or built-in defaults)")
    p.add_argument("--output", default="-", help="events JSONL file, - for stdout (default)")
    p.add_argument("--runs", help="write run summaries (JSONL) to this file")
    _memory_option(p)
    p.add_argument(
        "paths", nargs="+", help="files or directories (.json .jsonl .pb .binpb, optionally .gz)"
    )
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("gate", help="CI gate: replay and exit 1 when loop limits are breached")
    p.add_argument("--config")
    p.add_argument(
        "--max-loop-rate", type=float, help="max share of runs with any finding (0.05 = 5%%)"
    )
    p.add_argument("--max-shape", action="append", metavar="SHAPE=N", help="max events of a shape")
    p.add_argument(
        "--allow-after-finalize",
        action="store_true",
        help="pass although spans came after their run ended (a gap past the policy's "
        "finalize_grace_seconds / idle_timeout_seconds) and were not scored",
    )
    _memory_option(p)
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser(
        "inspect",
        help="show, span by span, what loopwatch recognizes in export files (no raw content)",
    )
    p.add_argument("--config")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=_lazy("streams.inspect", "cmd_inspect"))

    p = sub.add_parser("worker", help="run the Kafka stream service")
    p.add_argument("--config")
    p.set_defaults(func=_lazy("streams.worker_cli", "cmd_worker"))

    p = sub.add_parser(
        "produce", help="send export files to Kafka as the collector's kafkaexporter would"
    )
    p.add_argument("--topic", default="otlp_spans")
    p.add_argument(
        "--bootstrap", default=None, help="default: $LOOPWATCH_BOOTSTRAP or 127.0.0.1:19092"
    )
    p.add_argument("--encoding", choices=["otlp_proto", "otlp_json"], default="otlp_proto")
    p.add_argument(
        "--key-by-trace",
        action="store_true",
        help="key records by trace id (partition_traces_by_id)",
    )
    p.add_argument(
        "--compression",
        choices=["none", "gzip", "snappy", "lz4", "zstd"],
        default="none",
        help="producer compression (default: none)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds the broker may take to answer before it counts as unreachable (default 5)",
    )
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=_lazy("streams.produce", "cmd_produce"))

    p = sub.add_parser("query", help="ask the on-call API: runs, loops, run RUN_ID")
    p.add_argument("what", choices=["runs", "loops", "run"])
    p.add_argument("run_id", nargs="?")
    p.add_argument("--by", default="shape,prompt_version,tool_version")
    p.add_argument("--since", default="1h")
    p.add_argument(
        "--url",
        default=None,
        help="API base URL (default: $LOOPWATCH_API or http://127.0.0.1:6066)",
    )
    p.add_argument("--json", action="store_true", help="print raw JSON instead of a table")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the API (default 10)"
    )
    p.set_defaults(func=_lazy("streams.query", "cmd_query"))
    return parser


def _positive_mb(text: str) -> float:
    from streams.replay.runs import parse_memory_mb

    try:
        return parse_memory_mb(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-mb",
        type=_positive_mb,
        default=None,
        help="spans held in memory before they spill to temporary files "
        "(default: $LOOPWATCH_REPLAY_MEMORY_MB or 512)",
    )


def version_line() -> str:
    """'loopwatch 0.1.0, span path: native (loopwatch_native 0.1.0)' (or python, and why)."""
    from importlib.metadata import PackageNotFoundError, version

    from streams.spanpath import native

    try:
        v = version("loopwatch")
    except PackageNotFoundError:
        v = "unknown"
    return f"loopwatch {v}, span path: {native.describe()}"


class _VersionAction(argparse.Action):
    """argparse's own version action wraps the line; this one prints it as is."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(version_line())
        parser.exit()


# the commands that decode spans: they say so, in one line, when the extension is not used
SPAN_COMMANDS = ("replay", "gate", "inspect", "worker")


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                raise LoopwatchError(
                    f"`loopwatch {args.command}` is not available in this build"
                ) from None
            raise
        result: int = getattr(mod, name)(args)
        return result

    return call


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in SPAN_COMMANDS:
        from streams.spanpath import native

        native.warn_if_fallback()
    try:
        return int(args.func(args))
    except LoopwatchError as exc:
        print(f"loopwatch: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
