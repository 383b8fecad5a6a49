"""The on-call API served by faust's web server, one route table (`ROUTES`): ``/healthz``
(readiness, also ``/readyz``: HTTP 503 when not ready), ``/livez`` (liveness: the event loop
answers), ``/runs/{run_id}`` (routed to the worker owning the key), ``/find``, ``/episodes``,
``/loops``, ``/runs`` and ``/hold-counts`` summed from the windowed count tables (60 s
tumbling, 24 h) of every worker, ``/versions`` and ``/compare``; optional bearer token.
Read-only; faust's own table/router/stats pages are turned off. The holds' routes are
streams/worker/api/holds.py."""

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
from streams.worker.state.store import Tables
from streams.worker.state.versions import history_of

Answer = dict[str, Any]  # a JSON document (200), or a response a handler made itself

# The API: path -> the Views method that answers it. Every route but the health pages asks
# for the bearer token (when one is set); a handler raises BadRequest (400), NotFound (404)
# or PeerError (503: another worker did not answer, the answer would be partial).
ROUTES: tuple[tuple[str, str, bool], ...] = (
    # (path, method, bearer token required)
    ("/healthz", "healthz", False),
    ("/readyz", "healthz", False),
    ("/livez", "livez", False),
    ("/runs/{run_id}", "run_page", True),
    ("/loops", "loops_page", True),
    ("/find", "find_page", True),
    ("/episodes", "episodes_page", True),
    ("/runs", "runs_page", True),
    ("/versions", "versions_page", True),
    ("/compare", "compare_page", True),
    ("/hold-counts", "hold_counts_page", True),
)


class Views:
    """The on-call API over this worker's tables (`Tables`: the faust tables; the count
    tables read whole, every window); `health`: the /healthz document; `partitions`: the
    table partitions this worker owns."""

    def __init__(
        self,
        app: Any,
        tables: Tables,
        retention: Retention | None,
        api_token: str | None,
        health: Callable[[], dict[str, Any]],
        links: TraceLinks | None = None,
        partitions: Callable[[], set[int]] = set,
    ) -> None:
        self.app = app
        self.tables = tables
        self.retention = retention
        self.api_token = api_token
        self.health = health
        self.links = links
        self.partitions = partitions
        self.routed_run: Any = None

    def wire(self) -> None:
        """Register every route of ROUTES with faust's web server."""
        app = self.app
        self.routed_run = app.table_route(table=self.tables.runs, match_info="run_id")(
            self.local_run
        )
        for path, name, guarded in ROUTES:
            app.page(path)(self.answering(getattr(self, name), guarded))

    def answering(self, handler: Callable[..., Any], guarded: bool) -> Callable[..., Any]:
        """`handler` as a faust page: the bearer token checked, its document served, its
        BadRequest / NotFound / PeerError answered as 400 / 404 / 503."""

        async def page(view: Any, request: Any, **match: Any) -> Any:
            if guarded and not check_bearer(request.headers.get("Authorization"), self.api_token):
                return view.json(
                    {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="loopwatch"'},
                )
            try:
                answer = await handler(view, request, **match)
            except BadRequest as exc:
                return view.json({"error": str(exc)}, status=400)
            except NotFound as exc:
                return view.json({"error": str(exc)}, status=404)
            except PeerError as exc:
                return view.json({"error": f"{exc}: the answer would be partial"}, status=503)
            return view.json(answer) if isinstance(answer, dict) else answer

        return page

    # ------------------------------------------------------------------ health

    async def healthz(self, view: Any, request: Any) -> Any:
        doc = self.health()
        return view.json(doc, status=503 if doc.get("status") == "not_ready" else 200)

    async def livez(self, view: Any, request: Any) -> Answer:
        # liveness: the process and its event loop answer (nothing else is asked)
        return {"status": "alive"}

    # ------------------------------------------------------------------ runs

    async def local_run(self, view: Any, request: Any, run_id: str) -> Any:
        """GET /runs/{run_id} on the worker that owns the run's partition."""
        tables, retention = self.tables, self.retention
        key = run_id.encode("utf-8")
        raw = tables.runs.get(key)
        if raw is None and retention is not None:
            kept = tables.retained.get(key)
            if kept is not None:
                return view.json(retained_view(run_id, kept, retention, self.links))
        finished = tables.finished.get(key) is not None
        doc = run_view(run_id, raw, finished, self.links)
        if retention is not None:
            doc["retention"] = retention_doc(retention)
            kept = tables.retained.get(key) if raw is not None else None
            if kept is not None:  # in flight: its side-effect calls so far
                doc["side_effects"] = retained.side_effects(retained.decode(kept))
        return view.json(doc)

    async def run_page(self, view: Any, request: Any, run_id: str) -> Any:
        if not run_id or len(run_id) > 512:
            raise BadRequest("run_id: expected 1 to 512 characters")
        return await self.routed_run(view, request, run_id=run_id)

    async def find_page(self, view: Any, request: Any) -> Answer:
        """GET /find?run=PREFIX: the runs whose id starts with PREFIX, on every worker."""
        prefix = parse_prefix(request.query.get("run"))
        tables, retention = self.tables, self.retention
        matches = find_runs(
            prefix,
            self.partitions(),
            tables.runs,
            tables.retained if retention is not None else None,
            faust_internals.prefix_items,
        )
        docs = await self.peer_docs(request)
        merged = merge_matches([matches, *(d.get("matches", []) for d in docs)])
        doc: Answer = {"run": prefix, "matches": merged}
        if retention is not None:
            doc["retention"] = retention_doc(retention)
        return doc

    # ------------------------------------------------------------------ counts

    async def loops_page(self, view: Any, request: Any) -> Answer:
        by = parse_by(request.query.get("by"))
        since, seconds = parse_since(request.query.get("since"))
        where = parse_filters(request.query)
        covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
        items = self.tables.loop_counts.items()
        rows = sum_windows(items, LOOP_LABELS, by, seconds, time.time(), "events", where)
        complete = True
        if self.retention is not None:
            cutoff = time.time_ns() - seconds * NS
            complete = add_spread(
                rows,
                by,
                self.partitions(),
                self.tables.episodes,
                faust_internals.newest_first,
                cutoff,
                where,
            )
        rows = await self.gather_peers(request, rows, by, "events")
        doc: Answer = {"by": by, "where": where, **covered, "rows": rows}
        if not complete:
            doc["runs_partial"] = True  # more episodes in the window than one answer reads
        return doc

    async def summed(
        self,
        request: Any,
        items: Any,
        labels: tuple[str, ...],
        value_name: str,
        default_since: str | None = None,
    ) -> Answer:
        """A windowed count table summed by all its labels over `since=`, on every worker
        (GET /runs, GET /hold-counts)."""
        # absent: the default; empty or anything unreadable: 400
        since, seconds = parse_since(request.query.get("since", default_since))
        by = list(labels)
        covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
        rows = sum_windows(items, labels, by, seconds, time.time(), value_name)
        rows = await self.gather_peers(request, rows, by, value_name)
        return {**covered, "rows": rows}

    async def runs_page(self, view: Any, request: Any) -> Answer:
        return await self.summed(request, self.tables.run_counts.items(), RUN_LABELS, "runs")

    async def hold_counts_page(self, view: Any, request: Any) -> Answer:
        """GET /hold-counts?since=24h: per on-call hold, the calls it denied, the calls that
        ran under it undecided and the runs it touched (detectors/holds.py): rows of
        hold_id, measure, calls."""
        items = self.tables.hold_counts.items()
        return await self.summed(request, items, HOLD_LABELS, "calls", "24h")

    async def episodes_page(self, view: Any, request: Any) -> Answer:
        """GET /episodes: the latest loop episodes of a slice (since=, label filters,
        limit=), newest first, from every worker."""
        since, seconds = parse_since(request.query.get("since"))
        where = parse_filters(request.query)
        limit = parse_limit(request.query.get("limit"))
        if self.retention is None:
            raise NotFound("finished runs are not kept (LOOPWATCH_RUN_RETENTION_HOURS=0)")
        covered, seconds = window(since, seconds, self.retention.looping_ns // NS)
        cutoff = time.time_ns() - seconds * NS
        rows = recent_episodes(
            self.partitions(),
            self.tables.episodes,
            self.tables.retained,
            faust_internals.newest_first,
            cutoff,
            where,
            limit,
        )
        docs = await self.peer_docs(request)
        rows = merge_episodes([rows, *(d.get("rows", []) for d in docs)], limit)
        return {"where": where, **covered, "rows": rows}

    # ------------------------------------------------------------------ versions

    async def with_peers(
        self, request: Any, mine: Answer, merge: Callable[[list[Any]], Answer]
    ) -> Answer:
        """A peer's request (scope=local) gets this worker's raw share; the worker asked
        merges every worker's share (a predecessor, a p-value need them all)."""
        if request.query.get("scope") == "local":
            return mine
        return merge([mine, *await self.peer_docs(request)])

    async def versions_page(self, view: Any, request: Any) -> Answer:
        """GET /versions: every version seen since (7d), with the one it replaced."""
        since, seconds = parse_since(request.query.get("since", DEFAULT_VERSIONS_SINCE))
        where = parse_filters(request.query)
        mine = {"versions": history_of(self.tables.versions.items()).rows()}

        def merge(shares: list[Any]) -> Answer:
            cutoff = time.time_ns() - seconds * NS
            history = merged_history(shares)
            rows = versions_rows(
                history, cutoff, where.get("service_name"), where.get("agent_name")
            )
            return {"since": since, "where": where, "rows": rows}

        return await self.with_peers(request, mine, merge)

    async def compare_page(self, view: Any, request: Any) -> Answer:
        """GET /compare: a version's loop rate against the one it replaced (or baseline=),
        per shape, with Fisher's exact test."""
        since, seconds = parse_since(request.query.get("since", DEFAULT_COMPARE_SINCE))
        ask = parse_compare(request.query)
        covered, seconds = window(since, seconds, int(WINDOW_EXPIRES_SECONDS))
        tables = self.tables
        mine = local_share(
            tables.versions.items(), tables.version_counts.items(), seconds, time.time()
        )
        return await self.with_peers(
            request, mine, lambda shares: answer_compare(ask, shares, covered)
        )

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
