"""What the commands share: where the policy comes from and where output goes."""

from __future__ import annotations

import os
import sys
from typing import IO

from detectors.errors import LoopwatchError


def config_path(arg: str | None) -> str | None:
    return arg or os.environ.get("LOOPWATCH_CONFIG") or None


def open_output(target: str | None) -> IO[str]:
    if target in (None, "-"):
        return sys.stdout
    try:
        return open(target, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise LoopwatchError(f"{target}: cannot write output: {exc.strerror}") from None
