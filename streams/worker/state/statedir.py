"""The worker's local state directory (``LOOPWATCH_DATA_DIR``): checked at start and while
running.

The tables live in rocksdb under ``<data dir>/<app id>/v1/tables/<table>-<partition>.db``,
each backed by a compacted changelog topic; faust keeps the changelog offset a partition
was restored to inside its rocksdb database. So:

* a deleted or empty data dir is rebuilt from the changelogs (from their start);
* a damaged partition database (rocksdb refuses to open it) is moved aside, whole, to
  ``<name>.damaged-<UTC time>`` at start, with one warning line, and rebuilt the same way
  (the fired-episode markers are in the changelog too: nothing fires twice);
* a data dir that cannot be created or written is one clear line and exit status 2 at
  start (`prepare`), and an unhealthy ``/healthz`` while running (`writable`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from detectors.errors import LoopwatchError

log = logging.getLogger(__name__)

PROBE_NAME = ".loopwatch-write-probe"


def writable(path: Path) -> str | None:
    """None when a small file can be written (and synced) in `path`; else the error."""
    probe = path / PROBE_NAME
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"loopwatch\n" * 409)  # 4 KiB: a full disk refuses it
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        return f"{exc.strerror or type(exc).__name__} ({exc.filename or path})"
    return None


def prepare(data_path: Path, app_id: str, rocksdb: bool) -> list[Path]:
    """Create the data dir and check it is writable (else LoopwatchError: one line, exit
    2); with rocksdb, move damaged table partitions aside. Returns what was moved aside."""
    try:
        data_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoopwatchError(
            f"data dir {data_path} cannot be created: {exc.strerror or exc} "
            "(LOOPWATCH_DATA_DIR: a writable directory for the table state)"
        ) from None
    if (error := writable(data_path)) is not None:
        raise LoopwatchError(
            f"data dir {data_path} is not writable: {error} "
            "(LOOPWATCH_DATA_DIR: a writable directory for the table state)"
        )
    if not rocksdb:
        return []
    moved = []
    for db in sorted((data_path / app_id).glob("v*/tables/*.db")):
        if (error := _open_error(db)) is None:
            continue
        aside = db.with_name(f"{db.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        try:
            db.rename(aside)
        except OSError as exc:
            raise LoopwatchError(
                f"table state {db} is damaged ({error}) and cannot be moved aside "
                f"({exc.strerror or exc}): move or delete it; it is rebuilt from its changelog"
            ) from None
        log.warning(
            "table state %s is damaged (%s): moved aside to %s; this partition is rebuilt "
            "from its changelog",
            db,
            error,
            aside.name,
        )
        moved.append(aside)
    return moved


def _open_error(db: Path) -> str | None:
    """None when rocksdb opens the partition database; else its error, in one line."""
    from rocksdict import Options, Rdict

    if not db.is_dir():
        return "not a directory"
    options = Options(raw_mode=True)
    options.create_if_missing(False)
    try:
        handle = Rdict(str(db), options)
    except Exception as exc:
        return " ".join(str(exc).split())[:300] or type(exc).__name__
    handle.close()
    return None
