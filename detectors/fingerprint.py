"""Canonical JSON and keyed digests (contracts.md §3).

Canonical form: parsed value, object keys sorted, array order kept, no insignificant
whitespace, UTF-8. Nothing else is normalized unless a tool contract says so.
Digests are HMAC-SHA256 under the deployment's key (SHA-256 without one), truncated to 64
bits: collisions inside one run are negligible and state stays small.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

DIGEST_HEX = 16


def canonical(value: Any) -> bytes:
    """Canonical JSON bytes of an already-parsed value."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


class Fingerprinter:
    """Keyed digests. `keyed` says whether an HMAC key is in use (reported once at startup)."""

    __slots__ = ("_key", "keyed")

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or None
        self.keyed = self._key is not None

    def digest(self, data: bytes) -> str:
        if self._key is not None:
            return hmac.digest(self._key, data, "sha256")[: DIGEST_HEX // 2].hex()
        return hashlib.sha256(data).digest()[: DIGEST_HEX // 2].hex()

    def of_value(self, tag: str, value: Any) -> str:
        """Digest of a tagged value: the tag keeps e.g. tool names and arguments apart."""
        try:
            body = canonical(value)
        except (TypeError, ValueError):
            # Non-JSON values (NaN, bytes) still get a stable digest from their repr.
            body = repr(value).encode("utf-8", "replace")
        return self.digest(tag.encode("utf-8") + b"\x00" + body)

    def of_text(self, tag: str, text: str) -> str:
        return self.digest(tag.encode("utf-8") + b"\x00" + text.encode("utf-8", "replace"))


def stable_id(*parts: str) -> str:
    """Unkeyed deterministic id (event ids): same inputs, same id, in every process."""
    return hashlib.sha256("\x1f".join(parts).encode("utf-8")).hexdigest()[:32]
