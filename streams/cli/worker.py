"""`loopwatch worker`: run the Kafka stream service (streams/worker/) in the foreground.

Startup order: settings (env, `streams.worker.settings`) and policy (YAML) are validated, the broker
is probed with a short timeout and the topics are created (`streams.worker.kafka.topics`), the web and
metrics ports are checked, the data dir is prepared (streams/worker/state/statedir.py), then the
faust worker runs until SIGTERM/SIGINT (graceful stop: agents finish the current batch,
offsets are committed, the producer is flushed). The stop is bounded: after
``LOOPWATCH_STOP_TIMEOUT_SECONDS`` (30) the process exits whatever the broker does, with a
line saying what it abandoned (`BoundedStop`); nothing undelivered was acknowledged, so
its input records are processed again after a restart.

Any problem before the worker runs is one clear line on stderr and exit status 2
(`streams.cli.main.main` turns a LoopwatchError into that).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from detectors.errors import LoopwatchError
from detectors.policy import load_policy
from streams.runtime import tune_gc

# the packages whose modules log as themselves (logging.getLogger(__name__))
OWN_LOGGERS = ("streams", "detectors", "alerts")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def cmd_worker(args: argparse.Namespace) -> int:
    from streams.worker.allocator import limit_arenas

    limit_arenas()  # before any thread: the topic check's Kafka client starts the first
    from streams.worker.kafka.topics import ensure_topics
    from streams.worker.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    config = getattr(args, "config", None) or os.environ.get("LOOPWATCH_CONFIG") or None
    policy = load_policy(config)
    if settings.input_keyed_by_run and policy.run_key != "trace":
        print(
            f"loopwatch: LOOPWATCH_INPUT_KEYED_BY_RUN ignored: run_key is {policy.run_key!r}, "
            "not 'trace', so records keyed by trace id are not keyed by run (using the hop)",
            file=sys.stderr,
        )
        settings = dataclasses.replace(settings, input_keyed_by_run=False)
    if not _port_free(settings.web_host, settings.web_port):
        raise LoopwatchError(
            f"web port {settings.web_host}:{settings.web_port} is in use: stop the other "
            "process or set LOOPWATCH_WEB_PORT"
        )
    if settings.metrics_port and not _port_free(settings.metrics_host, settings.metrics_port):
        raise LoopwatchError(
            f"metrics port {settings.metrics_host}:{settings.metrics_port} is in use: stop the "
            "other process or set LOOPWATCH_METRICS_PORT (0 disables /metrics)"
        )
    layout = ensure_topics(settings)

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for ours in OWN_LOGGERS:  # loopwatch's own lines stay at INFO under a quieter level
        logging.getLogger(ours).setLevel(
            min(logging.INFO, logging.getLevelName(settings.log_level.upper()))
        )

    import faust

    from alerts.metrics import Metrics
    from streams.runtime import fingerprinter_from_env
    from streams.worker.faust_app import build_app
    from streams.worker.kafka.broker import FoldRepeats
    from streams.worker.state.statedir import prepare

    # a data dir that cannot be written: one line, exit 2; damaged table state: moved
    # aside (one warning line each) and rebuilt from the changelogs
    prepare(settings.data_path, settings.app_id, settings.store == "rocksdb://")
    fingerprinter = fingerprinter_from_env(lambda m: print(m, file=sys.stderr))
    metrics = Metrics()
    if settings.metrics_port:
        try:
            metrics.serve(settings.metrics_port, addr=settings.metrics_host)
        except OSError as exc:
            raise LoopwatchError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                f"{exc.strerror}"
            ) from None
    service = build_app(settings, policy, fingerprinter, metrics, layout.detect_partitions)
    mode = (
        f"keyed input, detect on {settings.input_topic}"
        if settings.input_keyed_by_run
        else f"{settings.input_topic} -> {settings.steps_topic}"
    )
    print(
        f"loopwatch worker {settings.app_id}: {settings.bootstrap} ({mode}, "
        f"{layout.detect_partitions} partitions, {settings.input_encoding}, {settings.store}); "
        f"API http://{settings.web_host}:{settings.web_port}"
        + (f", metrics :{settings.metrics_port}/metrics" if settings.metrics_port else ""),
        file=sys.stderr,
        flush=True,
    )
    worker_state = service.worker
    # the library loggers' connection errors: counted into the broker summary lines
    FoldRepeats(worker_state.broker).install()
    stop = BoundedStop(
        settings.stop_timeout_seconds, lambda: abandoned(service), lambda: exit_status(service)
    )
    worker = bounded_worker(faust.Worker, stop)(
        service.app,
        loglevel=settings.log_level,
        quiet=True,
        override_logging=False,
    )
    tune_gc()
    try:
        worker.execute_from_commandline()  # raises SystemExit when stopped
    except SystemExit as exc:
        if exc.code in (0, None) and exit_status(service):
            raise SystemExit(exit_status(service)) from None
        raise
    return 0  # pragma: no cover


def exit_status(service: Any) -> int:
    """0 for a stop that was asked for; FATAL_EXIT_STATUS (3) after a failed table write."""
    from streams.worker.service import FATAL_EXIT_STATUS

    return FATAL_EXIT_STATUS if service.worker.fatal is not None else 0


class BoundedStop:
    """Arms, at the first SIGTERM/SIGINT, a timer that ends the process after `seconds`
    if faust's graceful stop has not (a producer flush or an offset commit waits for an
    unreachable broker for as long as it takes). `abandoned()`: what is left, for the log
    line. The exit status is 0 for a stop that was asked for (`status`: 3 when the worker
    stops itself after a failed table write)."""

    def __init__(
        self,
        seconds: float,
        abandoned: Callable[[], str],
        status: Callable[[], int] = lambda: 0,
    ) -> None:
        self.seconds = seconds
        self.abandoned = abandoned
        self.status = status  # the exit status: 0, or 3 after a failed table write
        self.signalled_at: float | None = None
        self._timer: threading.Timer | None = None

    def arm(self, signum: int) -> None:
        if self._timer is not None:
            return
        self.signalled_at = time.monotonic()
        logging.getLogger(__name__).warning(
            "stopping (%s): exits within %.0f s (LOOPWATCH_STOP_TIMEOUT_SECONDS)",
            signal.Signals(signum).name,
            self.seconds,
        )
        self._timer = threading.Timer(self.seconds, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def expire(self) -> None:
        try:
            left = self.abandoned()
        except Exception as exc:  # the exit must happen whatever this says
            left = f"(unknown: {exc!r})"
        logging.getLogger(__name__).error(
            "stop did not finish within %.0f s: exiting now; abandoned: %s. Nothing "
            "undelivered was acknowledged: those input records are processed again after "
            "a restart",
            self.seconds,
            left,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(self.status())


def bounded_worker(base: Any, stop: BoundedStop) -> Any:
    """faust's Worker class whose signal handling first arms `stop`."""

    class BoundedWorker(base):  # type: ignore[misc]
        def _install_signal_handlers_unix(self) -> None:
            super()._install_signal_handlers_unix()
            # a closed terminal (SIGHUP) stops the worker as SIGTERM does: it leaves its
            # consumer group, flushes and commits (mode's Worker does not handle it: the
            # worker died, and its group member stayed registered for the session timeout)
            self.loop.add_signal_handler(signal.SIGHUP, self._schedule_shutdown, signal.SIGHUP)

        def _schedule_shutdown(self, signum: signal.Signals) -> None:
            stop.arm(signum)
            super()._schedule_shutdown(signum)

    return BoundedWorker


def abandoned(service: Any) -> str:
    """What a forced stop leaves behind: outputs awaiting delivery, the producer's buffer,
    the broker's state."""
    worker = service.worker
    parts = [f"{worker.publisher.waiting} output(s) awaiting delivery"]
    try:
        buffered = service.app.producer.buffer.size
        parts.append(f"{buffered} message(s) in the producer buffer")
    except Exception:
        pass
    broker = worker.broker
    parts.append(f"broker {broker.state} for {broker.seconds_in_state():.0f} s")
    return ", ".join(parts)
