"""Which span path is active (streams/spanpath/native.py): named by `loopwatch --version` and
/healthz, one warning line when the pure-Python fallback is in use, and CI's demand that
the native path is the one tested (LOOPWATCH_REQUIRE_NATIVE=1)."""

from __future__ import annotations

import io
import os

import pytest

from streams.cli import main as cli
from streams.spanpath import native
from streams.spanpath.otlp import proto


def test_version_names_the_active_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("loopwatch ") and out.count("\n") == 1
    assert f"span path: {native.ACTIVE} (" in out


def test_decode_proto_follows_the_active_path() -> None:
    if native.ACTIVE == "native":
        assert proto.decode_proto is proto._decode_native
    else:
        assert proto.decode_proto is proto.decode_proto_py


def test_fallback_warns_once_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "EXT", None)
    monkeypatch.setattr(native, "_WHY", "loopwatch_native is not built")
    monkeypatch.setattr(native, "_warned", False)
    err = io.StringIO()
    native.warn_if_fallback(err)
    native.warn_if_fallback(err)
    assert err.getvalue() == (
        "loopwatch: warning: span path is python: loopwatch_native is not built\n"
    )


def test_native_path_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "EXT", object())
    monkeypatch.setattr(native, "_warned", False)
    err = io.StringIO()
    native.warn_if_fallback(err)
    assert err.getvalue() == ""


def test_the_required_path_is_the_active_one() -> None:
    """CI (LOOPWATCH_REQUIRE_NATIVE=1) tests the native path; LOOPWATCH_NATIVE=0 turns it
    off (CI's second, fallback pass); elsewhere either path, with its reason."""
    off = os.environ.get("LOOPWATCH_NATIVE", "").lower() in native._OFF
    if off:
        assert native.ACTIVE == "python", native.describe()
    elif os.environ.get("LOOPWATCH_REQUIRE_NATIVE") == "1":
        assert native.ACTIVE == "native", native.describe()
    else:
        assert native.ACTIVE in ("native", "python") and native.describe()
