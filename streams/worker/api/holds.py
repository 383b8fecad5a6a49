"""The on-call API's holds (docs/CONTRACTS.md §7) and verdicts: ``GET /holds`` (the active ones; ``?all=1``
also released and expired: the audit trail), ``POST /holds`` (place one), ``GET`` /
``DELETE /holds/{id}`` (one; release it). The only writes the API has, and only with the
bearer token (``LOOPWATCH_API_TOKEN``): a worker without a token refuses them all (401,
nothing written). Reading needs the token only when one is configured. ``GET /holds``
answers with an ETag and a 304 to ``If-None-Match``: the guards ask every few seconds.
``GET /verdicts/{run}``: is the run held, has it looped (routed to the worker that owns the
run, as ``/runs/{id}``): for dispatchers without the guard."""

from __future__ import annotations

import json
import time
from typing import Any

from faust.web import View

from detectors.holds import Hold, HoldError, parse_duration, scope_from
from detectors.model import GUARD_IGNORED
from streams.errors import BrokerError
from streams.worker.api.answers import check_bearer, fired
from streams.worker.state import retained
from streams.worker.state.holds import HoldBook
from streams.worker.state.store import decode_envelope

UNAUTHORIZED = {
    "error": "placing or releasing a hold needs the bearer token (Authorization: Bearer <token>, "
    "LOOPWATCH_API_TOKEN on the worker and the client)"
}


def may_write(header: str | None, token: str | None) -> bool:
    """Writes need a configured token, sent: no token on the worker, no writes (reads
    are open then: check_bearer)."""
    return bool(token) and check_bearer(header, token)


def wire_holds(app: Any, book: HoldBook, token: str | None) -> None:
    def unauthorized(view: View, doc: dict[str, str] = UNAUTHORIZED) -> Any:
        return view.json(doc, status=401, headers={"WWW-Authenticate": 'Bearer realm="loopwatch"'})

    def may_read(view: View, request: Any) -> Any:
        if check_bearer(request.headers.get("Authorization"), token):
            return None
        return unauthorized(
            view, {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"}
        )

    # The answer, kept while the set is unchanged, for at most a second (expiries change
    # it without a record): every guard asks every few seconds, mostly for a 304.
    cache: dict[bool, tuple[int, float, str, bytes]] = {}

    def answer(every: bool) -> tuple[str, bytes]:
        now_s = time.monotonic()
        kept = cache.get(every)
        if kept is not None and kept[0] == book.version and now_s - kept[1] < 1.0:
            return kept[2], kept[3]
        version, now = book.version, book.clock()
        docs = [
            {**h.to_doc(), "status": h.status(now), "matches": h.scope.describe()}
            for h in book.holds(include_inactive=every)
        ]
        etag = book.etag([{k: v for k, v in d.items() if k != "status"} for d in docs])
        body = json.dumps({"holds": docs, "loaded": book.loaded.is_set()}).encode()
        if book.loaded.is_set():
            cache[every] = (version, now_s, etag, body)
        return etag, body

    class HoldsPage(View):
        async def get(self, request: Any) -> Any:
            if (resp := may_read(self, request)) is not None:
                return resp
            etag, body = answer(request.query.get("all") in ("1", "true", "yes"))
            headers = {"ETag": etag, "Cache-Control": "no-cache"}
            if request.headers.get("If-None-Match") == etag:
                return self.bytes(b"", status=304, headers=headers)
            return self.bytes(body, content_type="application/json", headers=headers)

        async def post(self, request: Any) -> Any:
            if not may_write(request.headers.get("Authorization"), token):
                return unauthorized(self)
            try:
                body = json.loads(await request.read() or b"{}")
                if not isinstance(body, dict):
                    raise HoldError("body: expected a JSON object with scope, reason, ttl, by")
                scope = scope_from(body.get("scope"))
                ttl = body.get("ttl")
                seconds = None if ttl in (None, "") else parse_duration(str(ttl), "ttl")
                hold = book.place(
                    scope, str(body.get("reason") or ""), str(body.get("by") or ""), seconds
                )
            except (ValueError, HoldError) as exc:
                return self.json({"error": str(exc)}, status=400)
            except BrokerError as exc:
                return self.json({"error": str(exc)}, status=503)
            return self.json({"hold": hold.to_doc(), "matches": hold.scope.describe()}, status=201)

    class HoldPage(View):
        async def get(self, request: Any, hold_id: str) -> Any:
            if (resp := may_read(self, request)) is not None:
                return resp
            hold = book.get(hold_id)
            if hold is None:
                return self.json({"error": f"no hold {hold_id!r}"}, status=404)
            return self.json({"hold": {**hold.to_doc(), "status": hold.status(book.clock())}})

        async def delete(self, request: Any, hold_id: str) -> Any:
            if not may_write(request.headers.get("Authorization"), token):
                return unauthorized(self)
            if book.get(hold_id) is None:
                return self.json({"error": f"no hold {hold_id!r}"}, status=404)
            try:
                hold = book.release(hold_id, request.query.get("by") or "")
            except HoldError as exc:
                return self.json({"error": str(exc)}, status=404)
            except BrokerError as exc:
                return self.json({"error": str(exc)}, status=503)
            return self.json({"hold": {**hold.to_doc(), "status": hold.status(book.clock())}})

    app.page("/holds")(HoldsPage)
    app.page("/holds/{hold_id}")(HoldPage)


def verdict(
    run_id: str,
    raw_state: bytes | None,
    kept: dict[str, Any] | None,
    holds: list[Hold],
) -> dict[str, Any]:
    """GET /verdicts/{run}: whether the run is held and whether it looped, from the worker's
    own state (the run's state while it runs, what was kept of it once finished): what a
    dispatcher without the guard asks before a tool call. `verdict`: `held` (a hold stops
    the run), `looping` (an episode fired), `clean` (none yet), `unknown` (no such run)."""
    loops: list[dict[str, Any]] = []
    labels: dict[str, Any] = {}
    finished = kept is not None
    if raw_state is not None:
        _env, state = decode_envelope(raw_state)
        for episode in fired(run_id, state):
            shape = episode["shape"]
            if shape != GUARD_IGNORED:
                loops.append(
                    {
                        "shape": shape,
                        "event_id": episode["event_id"],
                        "trigger_ns": state.trigger_ns.get(shape),
                    }
                )
        labels = {
            "service": state.service_name,
            "agent": state.agent_name,
            "prompt_version": state.prompt_version,
        }
    elif kept is not None:
        summary = kept.get("summary") or {}
        for event in kept.get("events", []):
            if event.get("shape") != GUARD_IGNORED:
                loops.append(
                    {
                        "shape": event.get("shape"),
                        "event_id": event.get("event_id"),
                        "trigger_span_id": event.get("trigger_span_id"),
                    }
                )
        labels = {
            "service": summary.get("service_name"),
            "agent": summary.get("agent_name"),
            "prompt_version": summary.get("prompt_version"),
        }
    found = raw_state is not None or kept is not None
    applying = [h for h in holds if _applies(h, run_id, labels)]
    stops = any(h.scope_is_run or _whole_run(h) for h in applying)
    if stops:
        answer = "held"
    elif loops:
        answer = "looping"
    else:
        answer = "clean" if found else "unknown"
    return {
        "run_id": run_id,
        "found": found,
        "finished": finished,
        "verdict": answer,
        "loops": loops,
        "holds": [
            {
                "id": h.id,
                "reason": h.reason,
                "matches": h.scope.describe(),
                "stops_run": h.scope_is_run or _whole_run(h),
            }
            for h in applying
        ],
    }


def _whole_run(hold: Hold) -> bool:
    """A hold on the run's labels only (no tool, no side-effect filter): every call of it."""
    s = hold.scope
    return s.tool is None and not s.side_effects and s.run is None


def _applies(hold: Hold, run_id: str, labels: dict[str, Any]) -> bool:
    s = hold.scope
    if s.run is not None:
        return s.run == run_id
    return all(
        getattr(s, name) is None or getattr(s, name) == labels.get(name)
        for name in ("service", "agent", "prompt_version")
    )


def wire_verdicts(
    app: Any, runs: Any, retained_table: Any, book: HoldBook, token: str | None
) -> None:
    async def local(view: Any, request: Any, run_id: str) -> Any:
        key = run_id.encode("utf-8")
        raw = runs.get(key)
        kept_raw = retained_table.get(key) if raw is None else None
        kept = retained.decode(kept_raw) if kept_raw is not None else None
        return view.json(verdict(run_id, raw, kept, book.holds()))

    routed = app.table_route(table=runs, match_info="run_id")(local)

    async def page(view: Any, request: Any, run_id: str) -> Any:
        if not check_bearer(request.headers.get("Authorization"), token):
            return view.json(
                {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                status=401,
            )
        if not run_id or len(run_id) > 512:
            return view.json({"error": "run: expected 1 to 512 characters"}, status=400)
        return await routed(view, request, run_id=run_id)

    app.page("/verdicts/{run_id}")(page)
