"""The normalizer's digests in loopwatch_native (first piece of the native normalizer)
against detectors/fingerprint.py: same HMAC-SHA256 / SHA-256 digests of the same tagged
canonical JSON. The native side answers None where the Python implementation decides (non-
str keys, NaN, bytes, subclasses, lone surrogates, deep nesting); every answer it does give
must equal Python's."""

from __future__ import annotations

import enum
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detectors.fingerprint import Fingerprinter

try:
    import loopwatch_native
except ImportError:  # pragma: no cover - the fallback-only installation
    loopwatch_native = None

pytestmark = pytest.mark.skipif(loopwatch_native is None, reason="loopwatch_native is not built")

DIFF = settings(
    max_examples=int(os.environ.get("LOOPWATCH_DIFF_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

KEYS = [None, b"", b"k", b"bench-key", b"x" * 63, b"x" * 64, b"x" * 65, bytes(range(200))]
texts = st.text(
    st.characters(codec=None, exclude_categories=()),  # surrogates included
    max_size=20,
) | st.sampled_from(["", 'a"b\\c\n\r\t\b\f\x00\x1f\x7f', "\u2028", "\U0001f600"])
# Tags are tool names and fixed words: decoded span strings, never lone surrogates (the
# decoders refuse invalid UTF-8); the Python reference cannot encode one in a tag.
tags = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(),
    st.sampled_from([0.0, -0.0, 1e16, 1e-5, 1.5e300, 5e-324, float("nan"), float("inf")]),
    texts,
    st.binary(max_size=4),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(texts, inner, max_size=4),
        st.dictionaries(st.one_of(st.integers(0, 3), st.none(), texts), inner, max_size=3),
    ),
    max_leaves=12,
)


def digests(key: bytes | None) -> Any:
    assert loopwatch_native is not None
    return loopwatch_native.Digests(key)


def check_value(key: bytes | None, tag: str, value: Any) -> bool:
    want = Fingerprinter(key).of_value(tag, value)
    got = digests(key).of_value(tag, value)
    assert got is None or got == want
    return got is not None


@DIFF
@given(st.sampled_from(KEYS), tags, values)
def test_of_value(key: bytes | None, tag: str, value: Any) -> None:
    check_value(key, tag, value)


@DIFF
@given(st.sampled_from(KEYS), tags, texts)
def test_of_text(key: bytes | None, tag: str, text: str) -> None:
    got = digests(key).of_text(tag, text)
    assert got is None or got == Fingerprinter(key).of_text(tag, text)


@DIFF
@given(st.sampled_from(KEYS), st.binary(max_size=300))
def test_digest(key: bytes | None, data: bytes) -> None:
    assert digests(key).digest(data) == Fingerprinter(key).digest(data)
    assert digests(key).keyed == Fingerprinter(key).keyed


def deep(levels: int) -> list[Any]:
    v: list[Any] = []
    for _ in range(levels):
        v = [v]
    return v


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("value", "native"),
    [
        ({"b": [1, 2.5, None, True], "a": {"z": "é", "y": -(10**30)}}, True),
        (("t", 1), True),
        ({"k": "\ud800"}, False),  # lone surrogate: Python's repr() fallback
        ({1: "a"}, False),  # non-str key
        (float("nan"), False),
        (b"bytes", False),
        (Color.RED, False),  # int subclass
        ([[[[]]]] * 3, True),
        (deep(300), False),  # deep: Python decides (RecursionError path)
        (deep(150), True),
    ],
    ids=lambda x: type(x).__name__,
)
def test_plain_values_are_native_and_the_rest_is_left_to_python(value: Any, native: bool) -> None:
    for key in (None, b"bench-key"):
        assert check_value(key, "args", value) is native


def test_huge_int_is_left_to_python() -> None:
    # past sys.int_max_str_digits: Python's of_value raises ValueError there (its repr()
    # fallback fails too); the native side does not decide
    assert digests(b"k").of_value("args", 10**5000) is None


def test_non_str_arguments_to_of_text_are_left_to_python() -> None:
    assert digests(b"k").of_text("tag\ud800", "x") is None
    assert digests(b"k").of_text("tag", "x\udfff") is None
