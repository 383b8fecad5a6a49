"""The on-call's holds, fetched in the background: the only module of the guard that makes
network calls, and never on the decision path.

A daemon thread asks `GET <url>/holds` every `refresh_seconds` with the last answer's ETag
(`If-None-Match`: an unchanged set costs a 304) and swaps in the new set; `match` reads the
set it has. When the API cannot be reached the guard keeps its last set and fails open,
except that with `side_effects_fail_closed` a side-effect call is denied while no answer is
fresh (never answered, or the last refresh failed); one log line a minute says so, and
`failures` counts every failed refresh.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from .detectors.holds import Call, Hold, HoldError, HoldIndex, Scope, hold_from
from .detectors.model import Step

log = logging.getLogger("loopwatch_guard")
UNREACHABLE = "holds-unreachable"  # the id of a fail-closed denial
LOG_EVERY_NS = 60 * 10**9


class HoldsClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        refresh_seconds: float = 5.0,
        side_effects_fail_closed: bool = False,
        timeout: float = 2.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.url = url.rstrip("/") + "/holds"
        self.token = token
        self.refresh_seconds = refresh_seconds
        self.side_effects_fail_closed = side_effects_fail_closed
        self.timeout = timeout
        self.clock = clock
        self._holds: tuple[Hold, ...] = ()
        self._index = HoldIndex(())
        self.etag: str | None = None
        self.fresh = False  # the last refresh got an answer
        self.failures = 0  # refreshes that got none
        self.refreshed_ns: int | None = None
        self._logged_ns: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def holds(self) -> tuple[Hold, ...]:
        return self._holds

    @holds.setter
    def holds(self, holds: tuple[Hold, ...]) -> None:
        # one swap of (set, index): the decision path reads either the old or the new pair
        self._index, self._holds = HoldIndex(holds), holds

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        """Fetch once now (a hold placed before the agent started applies to its first
        call), then every refresh_seconds in a daemon thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="loopwatch-holds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            self.refresh()

    def refresh(self) -> bool:
        """One conditional GET; True when an answer came (200 or 304)."""
        request = urllib.request.Request(self.url, headers={"Accept": "application/json"})
        if self.etag is not None:
            request.add_header("If-None-Match", self.etag)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = json.loads(response.read())
                self.holds = tuple(hold_from(doc) for doc in body.get("holds", ()))
                self.etag = response.headers.get("ETag")
        except urllib.error.HTTPError as exc:
            if exc.code != 304:
                return self._failed(f"HTTP {exc.code}")
        except (OSError, ValueError, HoldError, AttributeError) as exc:
            return self._failed(type(exc).__name__ + (f": {exc}" if str(exc) else ""))
        self.fresh = True
        self.refreshed_ns = self.clock()
        return True

    def _failed(self, why: str) -> bool:
        self.fresh = False
        self.failures += 1
        now = self.clock()
        if self._logged_ns is None or now - self._logged_ns >= LOG_EVERY_NS:
            self._logged_ns = now
            mode = (
                "side-effect calls are denied until it answers"
                if self.side_effects_fail_closed
                else "failing open"
            )
            log.warning(
                "loopwatch_guard: holds: %s unreachable (%s): keeping the last %d hold(s), %s "
                "(%d failed refreshes so far)",
                self.url,
                why,
                len(self.holds),
                mode,
                self.failures,
            )
        return False

    # ------------------------------------------------------------------ the decision path

    def match(self, run: Any, step: Step) -> Hold | None:
        """The first active hold the proposed call falls under (no I/O)."""
        contract = run.policy.tools.get(step.name)
        side_effect = bool(contract is not None and contract.side_effect)
        now = self.clock()
        call = Call(
            run.run_id,
            step.name,
            step.tool_version,
            run.service,
            run.agent,
            run.prompt_version,
            side_effect,
        )
        hold = self._index.find(call, lambda h: h.active(now))
        if hold is not None:
            return hold
        if side_effect and self.side_effects_fail_closed and not self.fresh:
            return Hold(
                UNREACHABLE,
                Scope(side_effects=True),
                "the holds API cannot be reached and side-effect tools fail closed",
                "loopwatch_guard",
                now,
                now + 1,
            )
        return None
