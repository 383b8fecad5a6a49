"""The fingerprint primitives against their definitions (docs/CONTRACTS.md §3)."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from detectors.fingerprint import DIGEST_HEX, Fingerprinter, canonical


@pytest.mark.parametrize("key_len", [1, 9, 32, 63, 64, 65, 100, 200])
def test_keyed_digest_is_hmac_sha256(key_len: int) -> None:
    # The digest precomputes HMAC's padded-key states: it must stay byte-for-byte the
    # standard HMAC, including keys longer than SHA-256's block (hashed first).
    key = bytes((i * 7 + 3) % 256 for i in range(key_len))
    fp = Fingerprinter(key)
    for data in (b"", b"x", b"lookup_order\x00" + b'{"id":"A12"}', bytes(range(256)) * 3):
        expected = hmac.digest(key, data, "sha256")[: DIGEST_HEX // 2].hex()
        assert fp.digest(data) == expected
        assert fp.digest(data) == expected  # the cached states are copied, never consumed


def test_unkeyed_digest_is_sha256() -> None:
    fp = Fingerprinter(None)
    assert not fp.keyed
    assert fp.digest(b"abc") == hashlib.sha256(b"abc").digest()[:8].hex()
    assert Fingerprinter(b"").keyed is False


def test_canonical_json() -> None:
    value = {"b": [3, 1, {"z": 1, "a": "é"}], "a": None, "c": 1.5}
    assert canonical(value) == '{"a":null,"b":[3,1,{"a":"é","z":1}],"c":1.5}'.encode()
    assert canonical(value) == json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")
    with pytest.raises(ValueError):
        canonical(float("nan"))


def test_a_cyclic_value_still_gets_a_digest() -> None:
    # A recursive YAML alias in a tool contract's defaults (`filters: &f [*f]`) is a cycle.
    cyclic: list[object] = []
    cyclic.append(cyclic)
    fp = Fingerprinter(b"k")
    assert fp.of_value("t", {"filters": cyclic}) == fp.of_value("t", {"filters": cyclic})
