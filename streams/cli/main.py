"""`loopwatch` command line (docs/CONTRACTS.md §7). Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from detectors.errors import LoopwatchError

EXIT_ERROR = 2


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
    p.set_defaults(func=_lazy("streams.cli.replay", "cmd_replay"))

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
    p.add_argument(
        "--baseline",
        nargs="+",
        metavar="BASELINE_PATH",
        help="canary: compare the candidate (the paths after --) with these runs; fail when "
        "the candidate loops significantly more or has a duplicate side effect",
    )
    p.add_argument(
        "--alpha", type=_fraction, default=0.05, help="significance level (default 0.05)"
    )
    p.add_argument(
        "--min-runs",
        type=_positive_int,
        default=30,
        help="finished runs a side needs before a verdict (default 30)",
    )
    p.add_argument(
        "--fail-on-too-few",
        action="store_true",
        help="fail when a side has fewer than --min-runs runs (default: say so and pass)",
    )
    p.add_argument("--json", action="store_true", help="the comparison as JSON on stdout")
    _memory_option(p)
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.set_defaults(func=_lazy("streams.cli.replay", "cmd_gate"))

    p = sub.add_parser(
        "inspect",
        help="show, span by span, what loopwatch recognizes in export files (no raw content)",
    )
    p.add_argument("--config")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument(
        "--suggest-profile",
        action="store_true",
        help="print a starter recognition profile (YAML) for the spans no profile recognized",
    )
    p.add_argument("paths", nargs="+")
    p.set_defaults(func=_lazy("streams.cli.inspect", "cmd_inspect"))

    p = sub.add_parser("worker", help="run the Kafka stream service")
    p.add_argument("--config")
    p.set_defaults(func=_lazy("streams.cli.worker", "cmd_worker"))

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
    p.set_defaults(func=_lazy("streams.cli.produce", "cmd_produce"))

    p = sub.add_parser(
        "query", help="ask the on-call API: runs, loops, run RUN_ID, versions, compare, holds"
    )
    p.add_argument("what", choices=["runs", "loops", "run", "versions", "compare", "holds"])
    p.add_argument("run_id", nargs="?", help="run: a run id or its first 8+ hex characters")
    p.add_argument("--by", default="shape,prompt_version,tool_version")
    for flag, label in (
        ("--shape", "shape"),
        ("--prompt-version", "prompt_version"),
        ("--tool", "tool_name"),
        ("--tool-version", "tool_version"),
        ("--service", "service_name"),
        ("--agent", "agent_name"),
    ):
        p.add_argument(
            flag,
            dest=f"where_{label}",
            metavar="VALUE",
            help=f"loops, versions: only {label}; compare: the candidate's {label}",
        )
    p.add_argument(
        "--baseline",
        metavar="VERSION",
        help="compare: the version to compare with (default: the one the candidate replaced)",
    )
    p.add_argument(
        "--alpha",
        type=_fraction,
        default=None,
        help="compare: significance level (default 0.05)",
    )
    p.add_argument(
        "--min-runs",
        type=_positive_int,
        default=None,
        help="compare: finished runs a side before a verdict (default 30)",
    )
    p.add_argument(
        "--runs",
        action="store_true",
        help="loops: the latest loop episodes of the slice (run, trace, how it ended)",
    )
    p.add_argument(
        "--limit", type=_positive_int, default=20, help="--runs: episodes to list (default 20)"
    )
    p.add_argument(
        "--since",
        default=None,
        help="look-back window (loops, runs: 1h; versions: 7d; compare: 24h)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="API base URL (default: $LOOPWATCH_API or http://127.0.0.1:6066)",
    )
    p.add_argument("--json", action="store_true", help="print raw JSON instead of a table")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the API (default 10)"
    )
    p.set_defaults(func=_lazy("streams.cli.query", "cmd_query"))
    from streams.cli.hold import add_parser as add_hold

    add_hold(sub, _lazy)
    return parser


def _positive_mb(text: str) -> float:
    from streams.replay.runs import parse_memory_mb

    try:
        return parse_memory_mb(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number between 0 and 1")
    return value


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return int(text)


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
