"""Helpers for tests that run the real Prometheus and Alertmanager binaries.

Everything binds to 127.0.0.1 on free ports and writes to the test's temp dir:

* `binary`, `http_json`, `wait_for`, `stop_process`, `query`: small utilities (ports come
  from tests.support.worker_proc's `free_port`, which never hands one out twice)
  (the same behaviour as the ones in ``test_rules_and_dashboards.py``; a missing binary is a
  failure, never a skip).
* `Daemon`: a subprocess with a log file, started and waited for on ``/-/ready``; its log
  tail is printed when it fails to come up.
* `start_prometheus` / `start_alertmanager`: the two servers.
* `WebhookSink`: an in-test HTTP server recording every Alertmanager webhook POST.
* `scale_for_durations`: a test copy of a rule file with every ``for:`` divided by a factor.
* `alertmanager_test_config`: a test copy of an Alertmanager config with the webhook URLs
  pointed at a sink and the grouping timers shortened.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.worker_proc import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "rules" / "loopwatch.rules.yml"
AM_CONFIG = REPO / "alerts" / "alertmanager" / "alertmanager.yml"


# ---------------------------------------------------------------------------------------
# utilities


def binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        f"{' / '.join(names)} not found on PATH: run scripts/install-tools.sh "
        "(Debian packages prometheus and prometheus-alertmanager)"
    )


def http_json(url: str, data: Any = None, timeout: float = 5.0) -> Any:
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll `predicate` until it returns something truthy (returned) or fail the test."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def query(base: str, expr: str) -> dict[str, Any]:
    """An instant query; a 400/422 answer comes back as a dict with status "error"."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return http_json(url)  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        doc: dict[str, Any] = json.loads(exc.read() or b"{}")
        return doc | {"status": "error", "http": exc.code}


def query_values(base: str, expr: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every series of an instant query (fails on a query error)."""
    res = query(base, expr)
    assert res.get("status") == "success", (expr, res)
    return [(r["metric"], float(r["value"][1])) for r in res["data"]["result"]]


# ---------------------------------------------------------------------------------------
# daemons


class Daemon:
    """A server subprocess with its output in `log`; `stop()` is idempotent."""

    def __init__(self, name: str, cmd: list[str], log: Path, base: str, cwd: Path) -> None:
        self.name = name
        self.base = base
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=cwd)

    def log_tail(self, chars: int = 4000) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=1) as resp:
                return bool(resp.status == 200)

        try:
            wait_for(ready, timeout, f"{self.name} /-/ready")
        except BaseException:
            print(f"--- {self.name} log ---\n{self.log_tail()}")
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            stop_process(self.proc)
        finally:
            self._log_file.close()


def start_prometheus(
    workdir: Path,
    targets: Sequence[str],
    rule_files: Sequence[Path],
    alertmanagers: Sequence[str] = (),
    job: str = "loopwatch",
    interval: str = "1s",
    features: Sequence[str] = (),
) -> Daemon:
    """Prometheus scraping `targets` (host:port) as `job` every `interval`, evaluating
    `rule_files` every `interval` and sending alerts to `alertmanagers` (host:port);
    `features`: --enable-feature values (exemplar-storage: it then scrapes OpenMetrics)."""
    exe = binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]},
        ],
    }
    if alertmanagers:
        config["alerting"] = {
            "alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]
        }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    daemon = Daemon(
        "prometheus",
        [exe, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
         *(f"--enable-feature={f}" for f in features)],
        workdir / "prometheus.log", f"http://127.0.0.1:{port}", workdir,
    )  # fmt: skip
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.stop()
        raise
    return daemon


def start_alertmanager(workdir: Path, config: Path) -> Daemon:
    """A single Alertmanager (clustering off) with `config`."""
    exe = binary("alertmanager", "prometheus-alertmanager")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    daemon = Daemon(
        "alertmanager",
        [exe, f"--config.file={config}", f"--storage.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
         "--log.level=warn"],
        workdir / "alertmanager.log", f"http://127.0.0.1:{port}", workdir,
    )  # fmt: skip
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.stop()
        raise
    return daemon


# ---------------------------------------------------------------------------------------
# webhook receiver


@dataclass
class Notification:
    path: str
    payload: dict[str, Any]
    received: float = field(default_factory=time.monotonic)


class WebhookSink:
    """Records every POST (Alertmanager's webhook_config JSON) with its path; answers 200."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Notification] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = {"unparsable": raw.decode("utf-8", "replace")}
                with sink._lock:
                    sink._calls.append(Notification(self.path, payload))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def calls(self) -> list[Notification]:
        with self._lock:
            return list(self._calls)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------
# test copies of the repo's rule file and Alertmanager config

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                 "y": 31536000}  # fmt: skip
_FOR_LINE = re.compile(r"^(?P<indent>\s*)for:\s*(?P<value>\S+)\s*$")


def duration_seconds(text: str) -> float:
    """A Prometheus duration ("5m", "1h30m", "250ms") in seconds."""
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_seconds(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def scale_for_durations(src: Path, dst: Path, factor: float = 60.0) -> list[tuple[str, str, str]]:
    """Write a copy of the rule file `src` to `dst` in which every alert's ``for:`` is
    divided by `factor` (default 60: minutes become seconds, 5m -> 5s, 10m -> 10s,
    15m -> 15s; never below 1s). Nothing else changes: expressions, range windows,
    thresholds, labels and annotations are byte-identical (checked by re-parsing both
    files). Returns (alert name, old, new) for every rewritten ``for:``, in file order."""
    out_lines: list[str] = []
    changes: list[tuple[str, str, str]] = []
    current: str | None = None
    for line in src.read_text().splitlines(keepends=True):
        m_alert = re.match(r"^\s*-\s*alert:\s*(\S+)", line)
        if m_alert:
            current = m_alert.group(1)
        m = _FOR_LINE.match(line.rstrip("\n"))
        if m:
            old = m.group("value")
            new = format_seconds(duration_seconds(old) / factor)
            line = f"{m.group('indent')}for: {new}\n"
            assert current is not None, "for: outside an alerting rule"
            changes.append((current, old, new))
        out_lines.append(line)
    dst.write_text("".join(out_lines))

    # the copy differs from the original only in `for`
    def without_for(doc: Any) -> Any:
        return [
            [{k: v for k, v in rule.items() if k != "for"} for rule in group["rules"]]
            for group in doc["groups"]
        ]

    original, copy = yaml.safe_load(src.read_text()), yaml.safe_load(dst.read_text())
    assert without_for(original) == without_for(copy), "rule copy changed more than `for:`"
    return changes


def alertmanager_test_config(
    src: Path,
    dst: Path,
    webhook_base: str,
    group_wait: str = "1s",
    group_interval: str = "1s",
) -> dict[str, Any]:
    """Write a copy of the Alertmanager config `src` to `dst` where every webhook URL keeps
    its path but points at `webhook_base` (e.g. the WebhookSink), and every route's
    group_wait / group_interval (where set, and on the root route) become the short test
    values. Receivers, matchers, group_by, repeat intervals and inhibit rules are
    unchanged. Returns the written config."""
    doc = yaml.safe_load(src.read_text())
    base = urllib.parse.urlsplit(webhook_base)

    def retime(route: dict[str, Any], root: bool) -> None:
        for key, value in (("group_wait", group_wait), ("group_interval", group_interval)):
            if root or key in route:
                route[key] = value
        for child in route.get("routes", []) or []:
            retime(child, False)

    retime(doc["route"], True)
    n_hooks = 0
    for receiver in doc.get("receivers", []):
        for hook in receiver.get("webhook_configs", []) or []:
            url = urllib.parse.urlsplit(hook["url"])
            hook["url"] = urllib.parse.urlunsplit(
                (base.scheme, base.netloc, url.path, url.query, url.fragment)
            )
            n_hooks += 1
    assert n_hooks, f"{src}: no webhook_configs to point at the test receiver"
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc  # type: ignore[no-any-return]
