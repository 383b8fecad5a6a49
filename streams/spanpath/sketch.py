"""Similarity sketches: how much two calls' arguments or results overlap, estimated from
16 bytes each, without keeping a word of them (issue 29; detectors/similarity.py reads them).

The rule, which native/src/normalize/sketch.rs implements byte for byte (the differential
test holds them equal):

- **Words.** A text's UTF-8 bytes with ASCII A-Z lowercased; a word is a maximal run of
  bytes that are ASCII letters or digits or any byte >= 0x80 (so non-ASCII text is kept as
  written: no Unicode case folding, which Python and Rust do differently). Words shorter
  than 2 bytes are dropped.
- **Features of a value.** The words of every string in it (object values and list items,
  at most 64 deep; object keys are not features: they are the same in every call) and of
  every other scalar as canonical JSON writes it (numbers, `true`, `false`, `null`; NaN
  and infinities have none); a string that is a URL (`http://` or `https://` and no ASCII
  whitespace) is one feature, its bytes as they are: two pages of one site share the
  words of their URLs, not their identity. Read in order until 4096 distinct features
  (after a whole string); of a string, its first 65536 bytes (cut back to a character
  boundary), also for URLs.
- **Items of a result.** A JSON list, or the first non-empty list among an object's values,
  is a list of items; an item that is an object is named by its first string or integer
  among `url`, `link`, `href`, `uri`, `id`, `title`, `name`, else by its whole value; the
  first 64 items are read. A text (a string result, or a string item of nothing else) has
  the URLs in it as items (`http://` or `https://` up to whitespace or one of
  ``<>"'`()[]{}|\\^``, trailing ``.,;:!?`` dropped; the first 64 distinct). An item's
  feature is its name (the URL, for a text) as canonical JSON; the step also carries the top
  32 bits of the first 32 items' hashes (`result_items`, 8 hex digits each, one string) so
  a run can tell items it has already seen.
- **Result features.** Its items when it has at least 2, else its features.
- **The sketch** (one-permutation MinHash, 16 bins of one byte). Each distinct feature is
  hashed under the deployment's key: h = the first 8 bytes (big-endian) of
  SHA-256(seed || feature), seed = SHA-256("loopwatch-sketch\\0" || key) twice (64 bytes);
  its bin is the top 4 bits of h, its rank the other 60. Each bin keeps the least rank, and
  the sketch is the bins' bytes `least rank % 255 + 1` (0: an empty bin), as 32 hex digits:
  all zeros when there are no features (two values without any are equal).

Two sketches estimate the Jaccard overlap of their feature sets (detectors/similarity.py):
the share of bins, among those not empty in both, that hold the same byte. A set of a few features
(a search query) lands mostly one feature per bin, so the estimate is close to exact; a large
one (a page of text) gets MinHash's usual error (about 0.1 at 16 bins).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

from detectors.fingerprint import Fingerprinter, canonical

BINS = 16
MAX_ITEMS = 64  # items of a result read (as a contract's new_items_field)
MAX_RESULT_ITEMS = 32  # item digests a step carries
MAX_FEATURES = 4096  # distinct features hashed per value: bounds a huge result's cost
MAX_DEPTH = 64  # nesting walked for features
MAX_TEXT = 65536  # bytes of one string read for words
_SEED_TAG = b"loopwatch-sketch\x00"
_RANK_MASK = (1 << 60) - 1
_WORD = re.compile(rb"[0-9a-z\x80-\xff]{2,}")
_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")
_URL = re.compile(rb"https?://[^\s<>\"'`()\[\]{}|\\^]+")
_URL_TRAILING = b".,;:!?"
_EMPTY = "00" * BINS  # no features: equal to any other value without any
ITEM_KEYS = ("url", "link", "href", "uri", "id", "title", "name")


class Sketcher:
    """Sketches under one fingerprint key."""

    __slots__ = ("_base",)

    def __init__(self, fp: Fingerprinter) -> None:
        seed = hashlib.sha256(_SEED_TAG + (fp.key or b"")).digest() * 2
        self._base = hashlib.sha256(seed)  # copied per feature: the seed block is hashed once

    def of_features(self, features: set[bytes]) -> str:
        if not features:
            return _EMPTY
        return _bins([self._hash(feature) for feature in features])

    def of_value(self, value: Any) -> str:
        """The sketch of a value's words and integers (arguments, model turns)."""
        return self.of_features(features(value))

    def of_result(self, result: Any) -> tuple[str, str]:
        """(sketch, item hashes) of a tool result: over its items when it lists 2 or more."""
        hashes = self.items(result)
        if len(hashes) >= 2:
            short = "".join(f"{h >> 32:08x}" for h in hashes[:MAX_RESULT_ITEMS])
            return _bins(hashes), short
        return self.of_features(features(result)), ""

    def items(self, result: Any) -> list[int]:
        """The keyed hashes of a result's items, in order (see the module doc)."""
        listed = _item_list(result)
        if listed is not None:
            return [self._hash(_item_json(_item_name(item))) for item in listed[:MAX_ITEMS]]
        if isinstance(result, str):
            return [self._hash(_item_json(url)) for url in urls(result)]
        return []

    def _hash(self, feature: bytes) -> int:
        h = self._base.copy()
        h.update(feature)
        return int.from_bytes(h.digest()[:8], "big")


def _item_json(name: Any) -> bytes:
    """An item's name as canonical JSON (repr for what JSON cannot hold, as fingerprints)."""
    try:
        return canonical(name)
    except (TypeError, ValueError, RecursionError):
        return repr(name).encode("utf-8", "replace")


def _bins(hashes: list[int]) -> str:
    """The sketch of 64-bit feature hashes: per bin (top 4 bits) the least rank (the rest)."""
    mins = [_RANK_MASK + 1] * BINS
    for value in hashes:
        b = value >> 60
        rank = value & _RANK_MASK
        if rank < mins[b]:
            mins[b] = rank
    return bytes(0 if m > _RANK_MASK else m % 255 + 1 for m in mins).hex()


def _item_list(result: Any) -> list[Any] | None:
    if isinstance(result, list):
        return result
    if isinstance(result, dict):
        for value in result.values():
            if isinstance(value, list) and value:
                return value
    return None


def _item_name(item: Any) -> Any:
    if isinstance(item, dict):
        for key in ITEM_KEYS:
            value = item.get(key)
            if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
                return value
        return item
    if isinstance(item, str):
        found = urls(item, 1)
        if found:
            return found[0]
    return item


def urls(text: str, limit: int = MAX_ITEMS) -> list[str]:
    """The first `limit` distinct URLs in a text, in order."""
    raw = _head(_utf8(text))
    if b"http" not in raw:
        return []
    seen: dict[str, None] = {}
    for match in _URL.finditer(raw):
        url = match.group().rstrip(_URL_TRAILING)
        if len(url) > 8:  # more than the scheme
            seen.setdefault(url.decode("utf-8", "surrogatepass"), None)
            if len(seen) >= limit:
                break
    return list(seen)


def features(value: Any) -> set[bytes]:
    found: set[bytes] = set()
    for text in _leaves(value, 0):
        if text.startswith((b"http://", b"https://")) and _SPACE.search(text) is None:
            found.add(_head(text))  # a URL names one resource: one feature, not its words
        else:
            found.update(_WORD.findall(_head(text).lower()))
        if len(found) >= MAX_FEATURES:
            break
    return found


def _leaves(value: Any, depth: int) -> Iterator[bytes]:
    if isinstance(value, str):
        yield _utf8(value)
    elif isinstance(value, dict):
        if depth < MAX_DEPTH:
            for item in value.values():
                yield from _leaves(item, depth + 1)
    elif isinstance(value, list | tuple):
        if depth < MAX_DEPTH:
            for item in value:
                yield from _leaves(item, depth + 1)
    else:
        try:  # numbers, booleans and null as JSON writes them
            yield canonical(value)
        except (TypeError, ValueError):  # NaN, infinities, bytes: nothing to compare
            return


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _head(raw: bytes) -> bytes:
    """The first MAX_TEXT bytes, cut back to a character boundary."""
    if len(raw) <= MAX_TEXT:
        return raw
    cut = MAX_TEXT
    while cut > 0 and raw[cut] & 0xC0 == 0x80:
        cut -= 1
    return raw[:cut]
