"""The on-call API served by faust's web server: ``/healthz`` (readiness, also ``/readyz``:
HTTP 503 when not ready), ``/livez`` (liveness: the event loop answers), ``/runs/{run_id}`` (routed
to the worker owning the key), ``/loops`` and ``/runs`` summed from the windowed count
tables (60 s tumbling, 24 h) of every worker, optional bearer token. Read-only; faust's own
table/router/stats pages are turned off."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from alerts.trace_links import TraceLinks
from detectors.model import NS
from streams.worker import faust_internals
from streams.worker.api.answers import (
    BadRequest,
    PeerError,
    add_spread,
    check_bearer,
    find_runs,
    merge_episodes,
    merge_matches,
    merge_rows,
    parse_by,
    parse_filters,
    parse_limit,
    parse_prefix,
    parse_since,
    recent_episodes,
    retained_view,
    run_view,
    sum_windows,
    window,
)
from streams.worker.api.params import HOLD_LABELS, LOOP_LABELS, RUN_LABELS
from streams.worker.api.versions import (
    DEFAULT_COMPARE_SINCE,
    DEFAULT_VERSIONS_SINCE,
    NotFound,
    answer_compare,
    local_share,
    merged_history,
    parse_compare,
    versions_rows,
)
from streams.worker.kafka.topics import WINDOW_EXPIRES_SECONDS
from streams.worker.state import retained
from streams.worker.state.retained import Retention, retention_doc
from streams.worker.state.versions import history_of


class Views:
    """`app`: the faust app; `runs`, `finished`: the tables; `loop_counts`, `run_counts`:
    the raw (unwindowed) count tables; `health`: the /healthz document."""

    def __init__(
        self,
        app: Any,
        runs: Any,
        finished: Any,
        retained: Any,
        episodes: Any,
        retention: Retention | None,
        loop_counts: Any,
        run_counts: Any,
        api_token: str | None,
        health: Callable[[], dict[str, Any]],
        links: TraceLinks | None = None,
        partitions: Callable[[], set[int]] = set,
        versions: Any = None,
        version_counts: Any = None,
        hold_counts: Any = None,
    ) -> None:
        self.app = app
        self.runs = runs
        self.finished = finished
        self.retained = retained
        self.episodes = episodes
        self.retention = retention
        self.loop_counts = loop_counts
        self.run_counts = run_counts
        self.api_token = api_token
        self.health = health
        self.links = links
        self.partitions = partitions  # the table partitions this worker owns
        self.versions = versions if versions is not None else {}
        self.version_counts = version_counts if version_counts is not None else {}
        self.hold_counts = hold_counts if hold_counts is not None else {}

    def wire(self) -> None:
        app = self.app
        views = self

        def denied(view: Any, request: Any) -> Any:
            if check_bearer(request.headers.get("Authorization"), views.api_token):
                return None
            return view.json(
                {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="loopwatch"'},
            )

        async def healthz(view: Any, request: Any) -> Any:
            doc = views.health()
            return view.json(doc, status=503 if doc.get("status") == "not_ready" else 200)

        async def livez(view: Any, request: Any) -> Any:
            # liveness: the process and its event loop answer (nothing else is asked)
            return view.json({"status": "alive"})

        async def local_run(view: Any, request: Any, run_id: str) -> Any:
            key = run_id.encode("utf-8")
            raw = views.runs.get(key)
            if raw is None and views.retention is not None:
                kept = views.retained.get(key)
                if kept is not None:
                    return view.json(retained_view(run_id, kept, views.retention, views.links))
            finished = views.finished.get(key) is not None
            doc = run_view(run_id, raw, finished, views.links)
            if views.retention is not None:
                doc["retention"] = retention_doc(views.retention)
                kept = views.retained.get(key) if raw is not None else None
                if kept is not None:  # in flight: its side-effect calls so far
                    doc["side_effects"] = retained.side_effects(retained.decode(kept))
            return view.json(doc)

        routed_run = app.table_route(table=self.runs, match_info="run_id")(local_run)

        async def run_page(view: Any, request: Any, run_id: str) -> Any:
            if (resp := denied(view, request)) is not None:
                return resp
            if not run_id or len(run_id) > 512:
                return view.json({"error": "run_id: expected 1 to 512 characters"}, status=400)
            return await routed_run(view, request, run_id=run_id)

        async def loops_page(view: Any, request: Any) -> Any:
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                by = parse_by(request.query.get("by"))
                since, seconds = parse_since(request.query.get("since"))
                where = parse_filters(request.query)
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
            rows = sum_windows(
                views.loop_counts.items(),
                LOOP_LABELS,
                by,
                seconds,
                time.time(),
                "events",
                where,
            )
            complete = True
            if views.retention is not None:
                cutoff = time.time_ns() - seconds * NS
                complete = add_spread(
                    rows,
                    by,
                    views.partitions(),
                    views.episodes,
                    faust_internals.newest_first,
                    cutoff,
                    where,
                )
            try:
                rows = await views.gather_peers(request, rows, by, "events")
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            doc: dict[str, Any] = {"by": by, "where": where, **covered, "rows": rows}
            if not complete:
                doc["runs_partial"] = True  # more episodes in the window than one answer reads
            return view.json(doc)

        async def summed(
            view: Any,
            request: Any,
            items: Any,
            labels: tuple[str, ...],
            value_name: str,
            default_since: str | None = None,
        ) -> Any:
            """A windowed count table summed by all its labels over `since=`, on every
            worker (GET /runs, GET /hold-counts)."""
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                # absent: the default; empty or anything unreadable: 400
                since, seconds = parse_since(request.query.get("since", default_since))
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            by = list(labels)
            covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
            rows = sum_windows(items, labels, by, seconds, time.time(), value_name)
            try:
                rows = await views.gather_peers(request, rows, by, value_name)
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            return view.json({**covered, "rows": rows})

        async def runs_page(view: Any, request: Any) -> Any:
            return await summed(view, request, views.run_counts.items(), RUN_LABELS, "runs")

        async def hold_counts_page(view: Any, request: Any) -> Any:
            """GET /hold-counts?since=24h: per on-call hold, the calls it denied, the calls
            that ran under it undecided and the runs it touched (detectors/holds.py): rows
            of hold_id, measure, calls."""
            items = views.hold_counts.items()
            return await summed(view, request, items, HOLD_LABELS, "calls", "24h")

        async def find_page(view: Any, request: Any) -> Any:
            """GET /find?run=PREFIX: the runs whose id starts with PREFIX, on every worker."""
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                prefix = parse_prefix(request.query.get("run"))
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            matches = find_runs(
                prefix,
                views.partitions(),
                views.runs,
                views.retained if views.retention is not None else None,
                faust_internals.prefix_items,
            )
            try:
                docs = await views.peer_docs(request)
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            merged = merge_matches([matches, *(d.get("matches", []) for d in docs)])
            doc: dict[str, Any] = {"run": prefix, "matches": merged}
            if views.retention is not None:
                doc["retention"] = retention_doc(views.retention)
            return view.json(doc)

        async def episodes_page(view: Any, request: Any) -> Any:
            """GET /episodes: the latest loop episodes of a slice (since=, label filters,
            limit=), newest first, from every worker."""
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                since, seconds = parse_since(request.query.get("since"))
                where = parse_filters(request.query)
                limit = parse_limit(request.query.get("limit"))
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            if views.retention is None:
                return view.json(
                    {"error": "finished runs are not kept (LOOPWATCH_RUN_RETENTION_HOURS=0)"},
                    status=404,
                )
            covered, seconds = window(since, seconds, views.retention.looping_ns // NS)
            cutoff = time.time_ns() - seconds * NS
            rows = recent_episodes(
                views.partitions(),
                views.episodes,
                views.retained,
                faust_internals.newest_first,
                cutoff,
                where,
                limit,
            )
            try:
                docs = await views.peer_docs(request)
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            rows = merge_episodes([rows, *(d.get("rows", []) for d in docs)], limit)
            return view.json({"where": where, **covered, "rows": rows})

        async def with_peers(
            view: Any, request: Any, mine: dict[str, Any], merge: Callable[[list[Any]], Any]
        ) -> Any:
            """A peer's request (scope=local) gets this worker's raw share; the worker asked
            merges every worker's share (a predecessor, a p-value need them all)."""
            if request.query.get("scope") == "local":
                return view.json(mine)
            try:
                docs = await views.peer_docs(request)
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            return merge([mine, *docs])

        async def versions_page(view: Any, request: Any) -> Any:
            """GET /versions: every version seen since (7d), with the one it replaced."""
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                since, seconds = parse_since(request.query.get("since", DEFAULT_VERSIONS_SINCE))
                where = parse_filters(request.query)
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            mine = {"versions": history_of(views.versions.items()).rows()}

            def merge(shares: list[Any]) -> Any:
                cutoff = time.time_ns() - seconds * NS
                history = merged_history(shares)
                rows = versions_rows(
                    history, cutoff, where.get("service_name"), where.get("agent_name")
                )
                return view.json({"since": since, "where": where, "rows": rows})

            return await with_peers(view, request, mine, merge)

        async def compare_page(view: Any, request: Any) -> Any:
            """GET /compare: a version's loop rate against the one it replaced (or
            baseline=), per shape, with Fisher's exact test."""
            if (resp := denied(view, request)) is not None:
                return resp
            try:
                since, seconds = parse_since(request.query.get("since", DEFAULT_COMPARE_SINCE))
                ask = parse_compare(request.query)
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
            mine = local_share(
                views.versions.items(), views.version_counts.items(), seconds, time.time()
            )

            def merge(shares: list[Any]) -> Any:
                try:
                    return view.json(answer_compare(ask, shares, covered))
                except BadRequest as exc:
                    return view.json({"error": str(exc)}, status=400)
                except NotFound as exc:
                    return view.json({"error": str(exc)}, status=404)

            return await with_peers(view, request, mine, merge)

        app.page("/healthz")(healthz)
        app.page("/readyz")(healthz)
        app.page("/livez")(livez)
        app.page("/runs/{run_id}")(run_page)
        app.page("/loops")(loops_page)
        app.page("/find")(find_page)
        app.page("/episodes")(episodes_page)
        app.page("/runs")(runs_page)
        app.page("/versions")(versions_page)
        app.page("/compare")(compare_page)
        app.page("/hold-counts")(hold_counts_page)

    async def gather_peers(
        self, request: Any, rows: list[dict[str, Any]], by: list[str], value_name: str
    ) -> list[dict[str, Any]]:
        """Each worker holds the aggregates of its partitions: ask the others and sum."""
        docs = await self.peer_docs(request)
        if not docs:
            return rows
        all_rows = list(rows)
        for data in docs:
            all_rows.extend(data.get("rows", []))
        return merge_rows(all_rows, by, value_name)

    async def peer_docs(self, request: Any) -> list[dict[str, Any]]:
        """The same request's answer from every other worker (`scope=local`: its own
        partitions only); [] when this is such a request or there are no others."""
        if request.query.get("scope") == "local":
            return []
        try:
            hosts = set(self.app.router.tables_metadata())
        except Exception:
            return []
        me = str(self.app.conf.canonical_url).rstrip("/")
        peers = [h for h in hosts if str(h).rstrip("/") != me]
        docs: list[dict[str, Any]] = []
        headers = {}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        for host in peers:
            url = request.url.with_host(_host_of(host)).with_port(_port_of(host))
            url = url.update_query(scope="local")
            try:
                async with self.app.http_client.get(url, headers=headers, timeout=10) as resp:
                    if resp.status != 200:
                        raise PeerError(f"worker {host} answered HTTP {resp.status}")
                    data = await resp.json()
            except PeerError:
                raise
            except Exception as exc:
                raise PeerError(f"worker {host} did not answer ({type(exc).__name__})") from None
            docs.append(data)
        return docs


def _host_of(url: Any) -> str:
    from yarl import URL

    return URL(str(url)).host or "127.0.0.1"


def _port_of(url: Any) -> int:
    from yarl import URL

    return URL(str(url)).port or 80
