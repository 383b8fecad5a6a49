"""The on-call API's HTTP client for the commands (`loopwatch query`, `loopwatch hold`),
stdlib only: the URL from --url or $LOOPWATCH_API, a bearer token from
$LOOPWATCH_API_TOKEN, no redirects, one LoopwatchError line for every failure."""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from detectors.errors import LoopwatchError

DEFAULT_API = "http://127.0.0.1:6066"


def base_url(arg: str | None) -> str:
    url = (arg or os.environ.get("LOOPWATCH_API") or DEFAULT_API).strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoopwatchError(f"on-call API URL {url!r}: expected http://HOST:PORT or https://...")
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise LoopwatchError(f"on-call API URL {url!r}: invalid port") from None
    return url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect: the bearer token must not travel to another address."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_message(body: bytes, fallback: str) -> str:
    """The error text of an error response: {"error": ...} / {"message": ...} / plain text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        for key in ("error", "message", "detail"):
            value = doc.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if isinstance(value, str) and value.strip():
                return value.strip()
    first = text.splitlines()[0].strip() if text else ""
    if first and not first.startswith("<"):
        return first[:200]
    return fallback


class ApiClient:
    """GET JSON from the on-call API; every failure is a LoopwatchError with one clear line."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        host = urllib.parse.urlsplit(self.base_url).hostname or ""
        proxies = urllib.request.ProxyHandler({} if _is_loopback(host) else None)
        self.opener = urllib.request.build_opener(proxies, _NoRedirect())

    def unreachable(self, why: str | None = None) -> LoopwatchError:
        detail = f" ({why})" if why else ""
        return LoopwatchError(
            f"cannot reach the on-call API at {self.base_url}{detail}: "
            "is `loopwatch worker` running?"
        )

    def get(self, path: str, params: Mapping[str, str] | None = None) -> tuple[int, bytes, Any]:
        """(status, body, parsed JSON) of a 2xx answer. HTTPError is raised for 4xx/5xx so
        the caller can map a 404; everything else becomes a LoopwatchError here."""
        return self.send("GET", path, params)

    def send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
    ) -> tuple[int, bytes, Any]:
        """`get` for any method; `body` is sent as JSON."""
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        headers = {"Accept": "application/json", "User-Agent": "loopwatch-query"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self.opener.open(request, timeout=self.timeout) as response:
                status = response.status
                body = response.read()
        except urllib.error.HTTPError:
            raise
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, ConnectionRefusedError):
                raise self.unreachable() from None
            if isinstance(reason, TimeoutError):
                raise self.unreachable(f"no answer within {self.timeout:g} s") from None
            if isinstance(reason, socket.gaierror):
                raise self.unreachable("unknown host") from None
            raise self.unreachable(getattr(reason, "strerror", None) or str(reason)) from None
        except ConnectionRefusedError:
            raise self.unreachable() from None
        except TimeoutError:
            raise self.unreachable(f"no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:  # reset, disconnected, bad status
            raise self.unreachable(type(exc).__name__) from None
        if status >= 300:  # a redirect we refused to follow
            raise LoopwatchError(
                f"the on-call API at {self.base_url} answered {path} with HTTP {status} "
                "(redirects are not followed: check --url)"
            )
        try:
            doc = json.loads(body)
        except ValueError:
            raise LoopwatchError(
                f"the on-call API at {self.base_url} answered {path} with invalid JSON"
            ) from None
        return status, body, doc

    def http_error(self, exc: urllib.error.HTTPError, path: str) -> LoopwatchError:
        try:
            body = exc.read()
        except OSError:
            body = b""
        message = _server_message(body, exc.reason if isinstance(exc.reason, str) else "")
        code = exc.code
        if code in (401, 403):
            hint = (
                "LOOPWATCH_API_TOKEN was sent and refused"
                if self.token
                else "set LOOPWATCH_API_TOKEN"
            )
            return LoopwatchError(
                f"the on-call API refused {path}: {message} (HTTP {code}; {hint})"
            )
        if 400 <= code < 500:
            return LoopwatchError(
                f"{message} (HTTP {code})" if message else f"HTTP {code} on {path}"
            )
        return LoopwatchError(
            f"the on-call API at {self.base_url} failed on {path}: "
            f"{message or 'server error'} (HTTP {code})"
        )
