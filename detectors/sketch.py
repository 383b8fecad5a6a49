"""Similarity sketches: how much two calls' arguments or results overlap, estimated from a
few keyed hashes each, without keeping a word of them; and the identity of a call, which is
compared exactly (issues 29 and 36; detectors/similarity.py reads both).

The rule, which native/src/normalize/sketch.rs implements byte for byte (the differential
test holds them equal):

- **Words.** A text's UTF-8 bytes with ASCII A-Z lowercased; a word is a maximal run of
  bytes that are ASCII letters or digits or any byte >= 0x80 (so non-ASCII text is kept as
  written: no Unicode case folding, which Python and Rust do differently). Every word
  counts, however short: `doc-1` and `doc-2` differ in `1` and `2`.
- **Identifiers.** A string with no ASCII whitespace, of 1 to 64 bytes, that is not one
  plain word (it holds a digit or a byte that is no letter: `doc-1`, `A12`, `u-1@x.io`,
  `2024-11-02`, `/srv/a.txt`) is an identifier. 64 bytes holds what names a record (UUIDs
  are 36, ULIDs 26, order numbers, SKUs, e-mail addresses, paths, dates); a longer string
  without spaces is more often content (base64, minified code, a token) than a name. A URL
  (`http://` or `https://` and no ASCII whitespace) is an identifier of any length.
- **Features of a value** (a result, a model turn). The words of every string in it (object
  values and list items, at most 64 deep; object keys are not features: they are the same
  in every call) and of every other scalar as canonical JSON writes it (numbers, `true`,
  `false`, `null`; NaN and infinities have none); an identifier is also one feature as a
  whole, its bytes as written behind a 0x00 byte (never a word); a URL is only that one
  feature (two pages of one site share the words of their URLs, not their identity). Read
  in order until 4096 distinct features (after a whole string); of a string, its first
  65536 bytes (cut back to a character boundary), also for URLs.
- **The identity of a call, and its argument features.** What the tool's contract names
  (`identity`, `business_identity`, `cursor_arg`), when it names any: those arguments'
  values. Otherwise what names a record: the value of any argument whose key names an
  identifier (split at `_`, `-`, `.`, spaces and lower-to-upper case changes, its last word,
  lowercased, is one of ID_WORDS: `id`, `order_id`, `orderId`, `uuid`, `api_key`,
  `page_token`, `tenant`, `customer`, `page`, `offset`, ...), at any depth, and every
  identifier string (URLs included). The identity is the list of [path, value] in the
  order of a walk over object keys sorted as canonical JSON sorts them (a path is the keys
  and list positions down to the value); its digest, the first 8 bytes of SHA-256(seed ||
  0x01 "identity" 0x00 || its canonical JSON) as 16 hex digits (no identity: None). The argument
  features are those of the other arguments (the ones a tool's `similarity.arguments`
  names, else all but the cursor and the idempotency key), without what the identity holds:
  that is compared exactly, not by words.
- **Items of a result.** A JSON list, or the first non-empty list among an object's values,
  is a list of items; an item that is an object is named by its first string or integer
  among `url`, `link`, `href`, `uri`, `id`, `title`, `name`, else by its whole value; the
  first 64 items are read. A text (a string result, or a string item of nothing else) has
  the URLs in it as items (`http://` or `https://` up to whitespace or one of
  ``<>"'`()[]{}|\\^``, trailing ``.,;:!?`` dropped; the first 64 distinct). An item's
  feature is its name (the URL, for a text) as canonical JSON; the step carries the first
  32 items' hashes (`result_items`, one string). A result with at least 2 items is compared
  by them (the run's seen items) and has no sketch; any other result is sketched.
- **The sketch** (bottom-k, k = 32). Each distinct feature is hashed under the deployment's
  key: the first 4 bytes of SHA-256(seed || feature), seed = SHA-256("loopwatch-sketch\\0"
  || key) twice (64 bytes), as 8 hex digits. The sketch is the 32 least of them, distinct,
  ascending, concatenated (fewer when the value has fewer features; "" when it has none).

**The estimate** (detectors/similarity.py `similarity`). With t the least of the two
sketches' largest hashes among those that hold 32 (no bound when neither does), every
feature of either value whose hash is at most t is in its value's sketch; the estimate is
the share of those hashes that both sketches hold. When both values have fewer than 32
features (a query, a call's arguments, a short result) that is their Jaccard overlap
exactly, a 32-bit collision aside; for larger ones it is the overlap of a random sample of
32 to 64 features of their union.

Measured (tests/unit/detectors/test_sketch_error.py; 1,000 pairs a size, true overlap uniform in
0.1-0.95; `python -m tests.unit.detectors.test_sketch_error` prints it), mean |error| / p99:

    features    before (16 one-byte bins)    now (bottom-32)
    2-10        0.022-0.067 / 0.20-0.33      0 / 0
    20          0.070 / 0.22                 0 / 0
    50          0.077 / 0.26                 0.033 / 0.12
    200         0.079 / 0.30                 0.048 / 0.17
    1000        0.086 / 0.27                 0.052 / 0.18

Decisions at the thresholds (0.4 arguments, 0.7 results) on every pair of calls of one
tool, and of model turns, of the labeled corpus with its traps (tests/near_duplicate_corpus.py)
under four keys, estimated against exactly computed on the same features: before, 7.45%
of 30,560 argument and 6.90% of 28,084 result decisions were wrong; now none.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .contract import contract_args, without_attempt_args
from .fingerprint import canonical
from .policy import Similarity, ToolContract
from .similarity import K

MAX_ITEMS = 64  # items of a result read (as a contract's new_items_field)
MAX_RESULT_ITEMS = 32  # item hashes a step carries
MAX_FEATURES = 4096  # distinct features hashed per value: bounds a huge result's cost
MAX_DEPTH = 64  # nesting walked for features
MAX_TEXT = 65536  # bytes of one string read for words
MAX_IDENTIFIER = 64  # bytes of the longest string read as an identifier (not a URL)
ID_WORDS = frozenset(
    [
        "id",
        "ids",
        "uuid",
        "guid",
        "key",
        "keys",
        "token",
        "slug",
        "sku",
        "ref",
        "urn",
        "arn",
        "number",
        "cursor",
        "page",
        "offset",
        "tenant",
        "org",
        "organization",
        "account",
        "workspace",
        "namespace",
        "customer",
        "user",
    ]
)
_SEED_TAG = b"loopwatch-sketch\x00"
_IDENTITY_TAG = b"\x01identity\x00"  # (no feature starts with 0x01)
_WORD = re.compile(rb"[0-9a-z\x80-\xff]+")
_PLAIN_WORD = re.compile(rb"[a-zA-Z\x80-\xff]+")  # one word without digits: no identifier
_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")
_URL = re.compile(rb"https?://[^\s<>\"'`()\[\]{}|\\^]+")
_URL_TRAILING = b".,;:!?"
ITEM_KEYS = ("url", "link", "href", "uri", "id", "title", "name")


class Sketcher:
    """Sketches under one fingerprint key."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes | None) -> None:
        seed = hashlib.sha256(_SEED_TAG + (key or b"")).digest() * 2
        self._base = hashlib.sha256(seed)  # copied per feature: the seed block is hashed once

    def of_features(self, found: set[bytes]) -> str:
        """The sketch of a feature set: its K least hashes, ascending."""
        if not found:
            return ""
        hashes = sorted({self._hash(f) for f in found})
        return "".join(hashes[:K])

    def of_value(self, value: Any) -> str:
        """The sketch of a value's features (a result without items, a model turn)."""
        return self.of_features(features(value))

    def of_call(
        self, args: dict[str, Any], contract: ToolContract | None, sim: Similarity
    ) -> tuple[str, str | None]:
        """(sketch of the argument features, identity digest) of a tool call (module doc)."""
        found, identity = call_view(args, contract, sim)
        if not identity:
            return self.of_features(found), None
        h = self._base.copy()
        h.update(_IDENTITY_TAG + _item_json(identity))
        return self.of_features(found), h.digest()[:8].hex()

    def of_result(self, result: Any) -> tuple[str | None, str]:
        """(sketch, item hashes) of a tool result: items when it lists 2 or more, and then
        no sketch (it is compared by its items)."""
        hashes = self.items(result)
        if len(hashes) >= 2:
            return None, "".join(hashes[:MAX_RESULT_ITEMS])
        return self.of_value(result), ""

    def items(self, result: Any) -> list[str]:
        """The keyed hashes of a result's items, in order (see the module doc)."""
        listed = _item_list(result)
        if listed is not None:
            return [self._hash(_item_json(_item_name(item))) for item in listed[:MAX_ITEMS]]
        if isinstance(result, str):
            return [self._hash(_item_json(url)) for url in urls(result)]
        return []

    def _hash(self, feature: bytes) -> str:
        h = self._base.copy()
        h.update(feature)
        return h.digest()[:4].hex()


def call_view(
    args: dict[str, Any], contract: ToolContract | None, sim: Similarity
) -> tuple[set[bytes], list[list[Any]]]:
    """(argument features, identity pairs) of a tool call (module doc)."""
    merged = contract_args(args, contract)
    found: set[bytes] = set()
    declared = _declared_identity(contract)
    if declared is not None:
        compared = _compared(merged, contract, sim)
        for name in declared:
            compared.pop(name, None)
        _walk_value(compared, 0, found)
        return found, [[[name], merged.get(name)] for name in declared]
    identity: list[list[Any]] = []
    key = contract.idempotency_key_arg if contract is not None else None
    cursor = contract.cursor_arg if contract is not None else None
    domain = {k: v for k, v in merged.items() if k != key} if key in merged else merged
    if sim.arguments is None:  # the compared arguments are the walked ones
        _walk_args(domain, 0, [], cursor, found, identity)
    else:
        _walk_args(domain, 0, [], cursor, None, identity)
        picked = {k: merged.get(k) for k in sim.arguments}
        _walk_args(picked, 0, [], cursor, found, None)
    return found, identity


def _declared_identity(contract: ToolContract | None) -> list[str] | None:
    """The arguments the contract names as the call's identity (its `identity` or
    `business_identity`, with the cursor), sorted; None when it names none."""
    if contract is None or (contract.identity is None and contract.business_identity is None):
        return None
    names = set(contract.identity or ()) | set(contract.business_identity or ())
    if contract.cursor_arg is not None:
        names.add(contract.cursor_arg)
    return sorted(names)


def _compared(
    merged: dict[str, Any], contract: ToolContract | None, sim: Similarity
) -> dict[str, Any]:
    """The arguments a near-duplicate comparison reads: the ones the tool's `similarity`
    names, else all but the cursor and the idempotency key (a new dict)."""
    if sim.arguments is not None:
        return {k: merged.get(k) for k in sim.arguments}
    return dict(without_attempt_args(merged, contract) if contract is not None else merged)


def names_identifier(key: str) -> bool:
    """Whether an argument's key names an identifier: its last word (ASCII letters back
    from the end to a non-letter, or to an upper-case letter after a lower-case one),
    lowercased, is one of ID_WORDS."""
    end = len(key)
    i = end
    while i > 0 and key[i - 1].isascii() and key[i - 1].isalpha():
        i -= 1
        if key[i].isupper() and i > 0 and key[i - 1].isascii() and key[i - 1].islower():
            break
    return i < end and key[i:end].lower() in ID_WORDS


def _is_url(raw: bytes) -> bool:
    return raw.startswith((b"http://", b"https://")) and _SPACE.search(raw) is None


def _is_identifier(raw: bytes) -> bool:
    """A short string without whitespace that is not one plain word (module doc)."""
    return (
        0 < len(raw) <= MAX_IDENTIFIER
        and _SPACE.search(raw) is None
        and _PLAIN_WORD.fullmatch(raw) is None
    )


def _add_string(raw: bytes, found: set[bytes]) -> None:
    """A string's features (not an argument's identity)."""
    if _is_url(raw):
        found.add(_head(raw))  # a URL names one resource: one feature, not its words
        return
    found.update(_WORD.findall(_head(raw).lower()))
    if _is_identifier(raw):
        found.add(b"\x00" + raw)


def _add_scalar(value: Any, found: set[bytes]) -> None:
    try:  # numbers, booleans and null as JSON writes them
        found.update(_WORD.findall(canonical(value)))
    except (TypeError, ValueError):  # NaN, infinities, bytes: nothing to compare
        return


def features(value: Any) -> set[bytes]:
    found: set[bytes] = set()
    _walk_value(value, 0, found)
    return found


def _walk_value(value: Any, depth: int, found: set[bytes]) -> bool:
    """A value's features into `found`, in order; False once it holds MAX_FEATURES."""
    if isinstance(value, str):
        _add_string(_utf8(value), found)
    elif isinstance(value, dict):
        if depth < MAX_DEPTH:
            for item in value.values():
                if not _walk_value(item, depth + 1, found):
                    return False
        return True
    elif isinstance(value, list | tuple):
        if depth < MAX_DEPTH:
            for item in value:
                if not _walk_value(item, depth + 1, found):
                    return False
        return True
    else:
        _add_scalar(value, found)
    return len(found) < MAX_FEATURES


def _walk_args(
    value: Any,
    depth: int,
    path: list[Any],
    cursor: str | None,
    found: set[bytes] | None,
    identity: list[list[Any]] | None,
) -> bool:
    """A call's arguments, object keys in sorted order: what names a record into
    `identity` (when given), the features of the rest into `found` (when given); False
    once `found` holds MAX_FEATURES."""
    if isinstance(value, str):
        raw = _utf8(value)
        if _is_url(raw) or _is_identifier(raw):
            if identity is not None:
                identity.append([path, value])
        elif found is not None:
            found.update(_WORD.findall(_head(raw).lower()))
    elif isinstance(value, dict):
        if depth < MAX_DEPTH:
            for key in sorted(value):
                item = value[key]
                if names_identifier(key) or (depth == 0 and key == cursor):
                    if identity is not None:
                        identity.append([[*path, key], item])
                elif not _walk_args(item, depth + 1, [*path, key], cursor, found, identity):
                    return False
        return True
    elif isinstance(value, list | tuple):
        if depth < MAX_DEPTH:
            for i, item in enumerate(value):
                if not _walk_args(item, depth + 1, [*path, i], cursor, found, identity):
                    return False
        return True
    elif found is not None:
        _add_scalar(value, found)
    return found is None or len(found) < MAX_FEATURES


def _item_json(name: Any) -> bytes:
    """An item's name as canonical JSON (repr for what JSON cannot hold, as fingerprints)."""
    try:
        return canonical(name)
    except (TypeError, ValueError, RecursionError):
        return repr(name).encode("utf-8", "replace")


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
