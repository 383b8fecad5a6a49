"""What the OTLP protobuf and JSON decoders share: the encodings' names, id sizes and
integer bounds, the attribute value kinds, the span kind and status tables, and the
internal error the decoders turn into `DecodeError` with a position."""

from __future__ import annotations

from typing import Final, NamedTuple

from opentelemetry.proto.trace.v1.trace_pb2 import Span as _PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as _PbStatus

OTLP_PROTO: Final = "otlp_proto"
OTLP_JSON: Final = "otlp_json"
ENCODINGS: Final = (OTLP_PROTO, OTLP_JSON)

TRACE_ID_BYTES: Final = 16
SPAN_ID_BYTES: Final = 8
MAX_VALUE_DEPTH: Final = 64  # nesting of array/kvlist values (upb itself stops at 100)

_U64_MAX: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_I32_MIN: Final = -(1 << 31)
_I32_MAX: Final = (1 << 31) - 1


class _Bad(Exception):
    """Internal: a decoding problem; callers prepend the position, the API raises DecodeError."""


def _at(where: str, reason: str) -> str:
    """Join a position and a reason: "span 4 has traceId of ...", "span 4: attribute ..."."""
    if reason.startswith(("has ", "missing ", "is ")):
        return f"{where} {reason}"
    return f"{where}: {reason}"


# ---------------------------------------------------------------------------------------
# The attribute value kinds (OTLP AnyValue oneof), one row each.
# ---------------------------------------------------------------------------------------


class AnyValueKind(NamedTuple):
    kind: str  # short name
    proto_field: str  # AnyValue oneof member
    json_key: str  # OTLP JSON key (lowerCamelCase); the proto field name is accepted too
    python_type: type | None  # what the decoder produces; None = not valid in traces


ANY_VALUE_KINDS: Final[tuple[AnyValueKind, ...]] = (
    AnyValueKind("string", "string_value", "stringValue", str),
    AnyValueKind("bool", "bool_value", "boolValue", bool),
    AnyValueKind("int", "int_value", "intValue", int),
    AnyValueKind("double", "double_value", "doubleValue", float),
    AnyValueKind("array", "array_value", "arrayValue", list),
    AnyValueKind("kvlist", "kvlist_value", "kvlistValue", dict),
    AnyValueKind("bytes", "bytes_value", "bytesValue", bytes),
    # dictionary references exist only in the profiles signal; a span carrying one is invalid
    AnyValueKind("string_strindex", "string_value_strindex", "stringValueStrindex", None),
)

SPAN_KINDS: Final[dict[str, int]] = dict(_PbSpan.SpanKind.items())  # "SPAN_KIND_CLIENT": 3, ...
STATUS_CODES: Final[dict[str, int]] = dict(_PbStatus.StatusCode.items())  # "STATUS_CODE_ERROR": 2
