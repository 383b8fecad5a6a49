"""Which span path is active: the compiled extension `loopwatch_native` (native/, a pyo3
crate built by `make install`) or the pure-Python decoder, which is the fallback and the
reference the differential tests compare the extension with.

`LOOPWATCH_NATIVE=0` forces the Python path (the CI runs the fallback this way). An
extension built from another API version (a stale build) is not used.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Final, TextIO

API: Final = 12  # loopwatch_native.API this code was written against

_OFF: Final = ("0", "off", "false", "no", "python")


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("LOOPWATCH_NATIVE", "").strip().lower() in _OFF:
        return None, "disabled by LOOPWATCH_NATIVE"
    try:
        import loopwatch_native as ext
    except ImportError:
        return None, "loopwatch_native is not built (make install builds it with cargo)"
    if getattr(ext, "API", None) != API:
        return None, (
            f"loopwatch_native API {getattr(ext, 'API', '?')} != {API}: stale build, "
            "run make install"
        )
    return ext, f"loopwatch_native {ext.__version__}"


EXT, _WHY = _load()
ACTIVE: Final = "native" if EXT is not None else "python"
_warned = False


def describe() -> str:
    """'native (loopwatch_native 0.1.0)' or 'python (<why the extension is not used>)'."""
    return f"{ACTIVE} ({_WHY})"


def warn_if_fallback(stream: TextIO | None = None) -> None:
    """One warning line, once per process, when the pure-Python path is in use."""
    global _warned
    if EXT is None and not _warned:
        _warned = True
        print(f"loopwatch: warning: span path is python: {_WHY}", file=stream or sys.stderr)
