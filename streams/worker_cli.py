"""`loopwatch worker`: run the Kafka stream service (streams/worker/) in the foreground.

Startup order: settings (env, `streams.settings`) and policy (YAML) are validated, the broker
is probed with a short timeout and the topics are created (`streams.topics`), the web and
metrics ports are checked, then the faust worker runs until SIGTERM/SIGINT (graceful stop:
agents finish the current batch, offsets are committed, the producer is flushed).

Any problem before the worker runs is one clear line on stderr and exit status 2
(`streams.cli.main` turns a LoopwatchError into that).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys

from detectors.errors import LoopwatchError
from detectors.policy import load_policy
from streams.runtime import tune_gc


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def cmd_worker(args: argparse.Namespace) -> int:
    from streams.settings import WorkerSettings
    from streams.topics import ensure_topics

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
    logging.getLogger("loopwatch").setLevel(
        min(logging.INFO, logging.getLevelName(settings.log_level.upper()))
    )

    import faust

    from alerts.metrics import Metrics
    from streams.engine import fingerprinter_from_env
    from streams.worker.service import build_app

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
    worker = faust.Worker(
        service.app,
        loglevel=settings.log_level,
        quiet=True,
        override_logging=False,
    )
    tune_gc()
    worker.execute_from_commandline()  # raises SystemExit when stopped
    return 0  # pragma: no cover
