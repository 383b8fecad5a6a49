"""`loopwatch hold add | list | release`: the on-call's holds (detectors/holds.py), placed and
released through the on-call API (`POST /holds`, `DELETE /holds/{id}`: the bearer token of
$LOOPWATCH_API_TOKEN), enforced by the guards within their refresh interval."""

from __future__ import annotations

import argparse
import getpass
import os
import urllib.error
from typing import Any

from detectors.errors import LoopwatchError
from detectors.holds import SCOPE_FIELDS, HoldError, parse_duration, scope_from
from streams.cli.client import ApiClient, base_url
from streams.cli.render import utc


def _client(args: argparse.Namespace) -> ApiClient:
    return ApiClient(base_url(args.url), os.environ.get("LOOPWATCH_API_TOKEN"), args.timeout)


def _when(ns: Any) -> str:
    return utc(ns, "%Y-%m-%d %H:%M:%SZ")


def _call(client: ApiClient, method: str, path: str, **kw: Any) -> Any:
    try:
        return client.send(method, path, **kw)[2]
    except urllib.error.HTTPError as exc:
        raise client.http_error(exc, path) from None


def _flags(message: str) -> str:
    """A scope error in the command line's words (--prompt-version, not scope.prompt_version)."""
    for name in sorted(SCOPE_FIELDS, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"scope.{name}", flag).replace(f" {name},", f" {flag},")
        message = message.replace(f" {name} (", f" {flag} (")
    return message.replace("scope: ", "")


def cmd_hold(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "add":
        scope_doc = {
            "service": args.service,
            "agent": args.agent,
            "prompt_version": args.prompt_version,
            "tool": args.tool,
            "tool_version": args.tool_version,
            "side_effects": bool(args.side_effects),
            "run": args.run,
        }
        try:
            scope_from(scope_doc)  # the same checks as the worker's, before asking it
            if args.ttl is not None:
                parse_duration(args.ttl, "--ttl")
        except HoldError as exc:
            raise LoopwatchError(_flags(str(exc))) from None
        if not (args.reason or "").strip():
            raise LoopwatchError("--reason: say why the hold is placed")
        body = {
            "scope": scope_doc,
            "reason": args.reason,
            "ttl": args.ttl,
            "by": args.by or getpass.getuser(),
        }
        doc = _call(client, "POST", "/holds", body=body)
        hold = doc["hold"]
        print(f"{hold['id']}  placed by {hold['by']}, expires {_when(hold['expires_ns'])}")
        print(f"  matches: {doc['matches']}")
        print(f"  release: loopwatch hold release {hold['id']}")
        return 0
    if args.action == "release":
        if not args.id:
            raise LoopwatchError("hold release: which hold? (loopwatch hold list)")
        params = {"by": args.by or getpass.getuser()}
        doc = _call(client, "DELETE", f"/holds/{args.id}", params=params)
        hold = doc["hold"]
        print(
            f"{hold['id']}  released by {hold.get('released_by')} at {_when(hold.get('released_ns'))}"
        )
        return 0
    doc = _call(client, "GET", "/holds", params={"all": "1"} if args.all else None)
    holds = doc.get("holds", [])
    if args.json:
        import json

        print(json.dumps(holds, indent=2))
        return 0
    if not holds:
        print("no holds" + ("" if args.all else " active (--all: released and expired too)"))
        return 0
    for h in holds:
        line = f"{h['id']}  {h.get('status', '?'):8}  {h.get('matches', '')}"
        print(line)
        print(
            f"    why: {h.get('reason')}  by {h.get('by')} at {_when(h.get('created_ns'))}, "
            f"expires {_when(h.get('expires_ns'))}"
        )
        if h.get("released_ns"):
            print(f"    released by {h.get('released_by')} at {_when(h.get('released_ns'))}")
    return 0


def add_parser(sub: Any, lazy: Any) -> None:
    p = sub.add_parser(
        "hold",
        help="place, list or release the on-call's holds (enforced by the in-process guards)",
        description="Holds: containment the on-call places on a version, a tool or a run.",
    )
    p.add_argument("action", choices=("add", "list", "release"))
    p.add_argument("id", nargs="?", help="release: the hold's id")
    p.add_argument("--service")
    p.add_argument("--agent")
    p.add_argument("--prompt-version")
    p.add_argument("--tool")
    p.add_argument("--tool-version")
    p.add_argument("--side-effects", action="store_true", help="every side-effect tool")
    p.add_argument("--run", help="one run: the guard stops it")
    p.add_argument("--reason", help="why (required for add)")
    p.add_argument("--ttl", help="how long it holds (30m, 2h, 1d; default and maximum: the policy)")
    p.add_argument("--by", help="who places or releases it (default: the OS user)")
    p.add_argument("--all", action="store_true", help="list: released and expired holds too")
    p.add_argument("--json", action="store_true", help="list: raw JSON")
    p.add_argument(
        "--url",
        default=None,
        help="API base URL (default: $LOOPWATCH_API or http://127.0.0.1:6066)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the API")
    p.set_defaults(func=lazy("streams.cli.hold", "cmd_hold"))
