"""`loopwatch inspect PATH...`: what loopwatch sees in a trace export, span by span.

For each run: every span (in start order) with the recognition profile that read it, the
kind rule that matched, and the fields it was recognized as: names, codes, ids and digest
prefixes, never argument or result values. Then the spans no rule recognized, counted by
span name and attribute keys: a framework whose runs give 0 steps shows here why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import yaml

from detectors.errors import LoopwatchError
from detectors.model import OTHER, Step
from detectors.policy import Policy, load_policy
from detectors.profile_suggest import Observed, observe, profile_name, suggest
from streams.spanpath.limits import declared_limit
from streams.spanpath.normalize import STEP_ERRORS, Normalizer
from streams.spanpath.spans import SpanRecord

MAX_UNRECOGNIZED_ROWS = 40


def describe(step: Step, profile: str, rule: str | None) -> dict[str, Any]:
    """The recognized fields of one step, without any raw content."""
    row: dict[str, Any] = {
        "span_id": step.span_id,
        "parent_span_id": step.parent_span_id,
        "kind": step.kind,
        "profile": profile,
        "rule": rule,
    }
    optional = {
        "name": step.name or None,
        "sequence": step.sequence,
        "agent": step.agent_name,
        "call_id": step.call_id,
        "action_fp": step.action_fp[:12] if step.action_fp else None,
        "result_fp": step.result_fp[:12] if step.result_fp else None,
        "error_code": step.error_code,
        "from_agent": step.from_agent,
        "to_agent": step.to_agent,
        "plan_fp": step.plan_fp[:12] if step.plan_fp else None,
        "wants_tools": step.wants_tools or None,
        "tokens": step.tokens or None,
        "prompt_version": step.prompt_version,
        "tool_version": step.tool_version,
        "termination": step.termination,
        "limit": step.step_limit,
        "limit_counts": step.limit_counts if step.step_limit is not None else None,
    }
    row.update({k: v for k, v in optional.items() if v is not None})
    if step.kind == "tool" and step.result_fp is None and step.error_code is None:
        row["result_observed"] = False
    return row


class Inspection:
    def __init__(self, policy: Policy, normalizer: Normalizer) -> None:
        self.policy = policy
        self.normalizer = normalizer
        self.runs: dict[str, list[tuple[int, int, dict[str, Any], str]]] = defaultdict(list)
        self.unrecognized: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
        self.invalid: list[str] = []
        self.spans = 0
        self.observed: dict[tuple[str, str], Observed] = {}  # for --suggest-profile

    def add(self, spans: Iterable[SpanRecord]) -> None:
        for span in spans:
            self.spans += 1
            try:
                step, profile, rule = self.normalizer.explain(span)
            except STEP_ERRORS as exc:
                self.invalid.append(f"span {span.span_id}: {type(exc).__name__}")
                continue
            row = describe(step, profile.name, rule)
            if step.step_limit is not None:
                declared = declared_limit(span.attributes)
                row["limit_from"] = declared.where if declared is not None else "?"
            self.runs[step.run_id].append((span.start_ns, span.end_ns, row, span.name))
            if step.kind == OTHER:
                keys = tuple(sorted(span.attributes))
                self.unrecognized[(span.scope_name, span.name, keys)] += 1
                if not step.is_root:  # the root is the run's agent span: generic reads it
                    observe(
                        self.observed,
                        span.scope_name,
                        span.name,
                        span.attributes,
                        self.policy.tools,
                    )

    def write_text(self, out: IO[str]) -> None:
        for run_id, rows in self.runs.items():
            rows.sort(key=lambda r: (r[0], r[1], r[2]["span_id"]))
            kinds = Counter(r[2]["kind"] for r in rows)
            print(
                f"run {run_id}: {len(rows)} spans, "
                + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                file=out,
            )
            for _start, _end, row, name in rows:
                fields = "  ".join(
                    f"{k}={v}"
                    for k, v in row.items()
                    if k not in ("span_id", "parent_span_id", "kind", "profile", "rule")
                )
                rule = f"{row['profile']}/{row['rule']}" if row["rule"] else row["profile"]
                print(
                    f"  {row['span_id']}  {row['kind']:<8} {name[:48]:<48} [{rule}]  {fields}",
                    file=out,
                )
            print(file=out)
        steps = sum(1 for rows in self.runs.values() for r in rows if r[2]["kind"] != OTHER)
        print(
            f"{self.spans} spans, {len(self.runs)} runs, {steps} recognized as steps, "
            f"{sum(self.unrecognized.values())} not recognized, {len(self.invalid)} invalid",
            file=out,
        )
        if self.unrecognized:
            print(
                "\nnot recognized (no kind rule matched), by scope, span name and keys:", file=out
            )
            top = self.unrecognized.most_common(MAX_UNRECOGNIZED_ROWS)
            for (scope, name, keys), n in top:
                print(
                    f"  {n:>6}  [{scope or '-'}] {name[:60]}  keys: {', '.join(keys) or '-'}",
                    file=out,
                )
            if len(self.unrecognized) > len(top):
                print(f"  ... {len(self.unrecognized) - len(top)} more", file=out)
        if self.invalid:
            print("\ninvalid spans:", file=out)
            for line in self.invalid[:MAX_UNRECOGNIZED_ROWS]:
                print(f"  {line}", file=out)

    def write_suggestion(self, out: IO[str], paths: list[str]) -> int:
        """0: a profile written (or every span recognized); 1: nothing could be read off
        the unrecognized spans (said in one line)."""
        body = suggest(self.observed.values(), self.policy.tools)
        unrecognized = sum(o.spans for o in self.observed.values())
        if body is None:
            if not unrecognized:
                print(
                    f"loopwatch: nothing to suggest: every one of {self.spans} spans was "
                    "recognized (or is a run's root)",
                    file=sys.stderr,
                )
                return 0
            print(
                f"loopwatch: nothing to suggest from {unrecognized} unrecognized spans: no "
                "attribute holds a tool the policy declares and no span name embeds one "
                "(declare the agent's tools under tools:), and no span carries token counts",
                file=sys.stderr,
            )
            return 1
        name = profile_name(self.observed.values())
        out.write(
            f"# A starter profile read off {unrecognized} spans loopwatch did not recognize in\n"
            f"# {' '.join(paths)}. Review it, add it under `profiles:` in the policy file, and\n"
            "# check with `loopwatch inspect` which spans it reads ([" + name + "/...]).\n"
        )
        out.write(yaml.safe_dump({"profiles": {name: body}}, sort_keys=False, width=100))
        return 0

    def write_json(self, out: IO[str]) -> None:
        for run_id, rows in self.runs.items():
            rows.sort(key=lambda r: (r[0], r[1], r[2]["span_id"]))
            doc = {"run_id": run_id, "spans": [{**r[2], "span_name": r[3]} for r in rows]}
            out.write(json.dumps(doc, separators=(",", ":")) + "\n")
        doc2 = {
            "unrecognized": [
                {"scope": s, "span_name": n, "attribute_keys": list(k), "spans": c}
                for (s, n, k), c in self.unrecognized.most_common()
            ],
            "invalid": self.invalid,
        }
        out.write(json.dumps(doc2, separators=(",", ":")) + "\n")


def cmd_inspect(args: argparse.Namespace) -> int:
    from streams.cli.common import config_path
    from streams.replay.files import expand_paths, iter_batches
    from streams.runtime import fingerprinter_from_env

    policy = load_policy(config_path(args.config))
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        raise LoopwatchError(f"{missing[0]}: no such file or directory")
    fp = fingerprinter_from_env()
    inspection = Inspection(policy, Normalizer(policy, fp))

    def report(exc: Exception) -> None:
        print(f"loopwatch: skipped: {exc}", file=sys.stderr)

    for file in expand_paths(args.paths, report):
        for _source, spans in iter_batches([file], report):
            assert isinstance(spans, list)  # no native span path: decoded spans
            inspection.add(spans)
    if getattr(args, "suggest_profile", False):
        return inspection.write_suggestion(sys.stdout, list(args.paths))
    if args.json:
        inspection.write_json(sys.stdout)
    else:
        inspection.write_text(sys.stdout)
    return 0
