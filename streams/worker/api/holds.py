"""The on-call API's holds (docs/CONTRACTS.md §7): ``GET /holds`` (the active ones; ``?all=1``
also released and expired: the audit trail), ``POST /holds`` (place one), ``GET`` /
``DELETE /holds/{id}`` (one; release it). The only writes the API has, and only with the
bearer token (``LOOPWATCH_API_TOKEN``): a worker without a token refuses them all (401,
nothing written). Reading needs the token only when one is configured. ``GET /holds``
answers with an ETag and a 304 to ``If-None-Match``: the guards ask every few seconds."""

from __future__ import annotations

import hmac
import json
from typing import Any

from faust.web import View

from detectors.holds import HoldError, parse_duration, scope_from
from streams.errors import BrokerError
from streams.worker.api.answers import check_bearer
from streams.worker.state.holds import HoldBook

UNAUTHORIZED = {
    "error": "placing or releasing a hold needs the bearer token (Authorization: Bearer <token>, "
    "LOOPWATCH_API_TOKEN on the worker and the client)"
}


def may_write(header: str | None, token: str | None) -> bool:
    """Writes need a configured token, sent: no token on the worker, no writes."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def wire_holds(app: Any, book: HoldBook, token: str | None) -> None:
    def unauthorized(view: View, doc: dict[str, str] = UNAUTHORIZED) -> Any:
        return view.json(doc, status=401, headers={"WWW-Authenticate": 'Bearer realm="loopwatch"'})

    def may_read(view: View, request: Any) -> Any:
        if check_bearer(request.headers.get("Authorization"), token):
            return None
        return unauthorized(
            view, {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"}
        )

    class HoldsPage(View):
        async def get(self, request: Any) -> Any:
            if (resp := may_read(self, request)) is not None:
                return resp
            every = request.query.get("all") in ("1", "true", "yes")
            now = book.clock()
            docs = [
                {**h.to_doc(), "status": h.status(now), "matches": h.scope.describe()}
                for h in book.holds(include_inactive=every)
            ]
            etag = book.etag([{k: v for k, v in d.items() if k != "status"} for d in docs])
            headers = {"ETag": etag, "Cache-Control": "no-cache"}
            if request.headers.get("If-None-Match") == etag:
                return self.bytes(b"", status=304, headers=headers)
            doc = {"holds": docs, "loaded": book.loaded.is_set()}
            return self.json(doc, headers=headers)

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
