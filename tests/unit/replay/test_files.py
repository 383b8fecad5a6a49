"""Reading and writing the Collector fileexporter formats (streams/replay/files.py)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from streams.errors import DecodeError
from streams.replay.files import (
    Payload,
    file_encoding,
    iter_batches,
    iter_payloads,
    write_jsonl,
    write_pb,
)
from streams.spanpath.otlp import proto_to_json_bytes

TRACE = "0af7651916cd43dd8448eb211c80319c"


def message(n: int, spans: int = 1) -> bytes:
    """An export message whose spans have ids 00..0<n><i> (distinct per message)."""
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(spans):
        ss.spans.add(
            trace_id=bytes.fromhex(TRACE),
            span_id=bytes([0, 0, 0, 0, 0, 0, n, i + 1]),
            name=f"m{n}s{i}",
            start_time_unix_nano=1000 * n + i,
        )
    return req.SerializeToString()


def span_names(batches: list[tuple[str, list]]) -> list[tuple[str, list[str]]]:
    return [(src, [s.name for s in spans]) for src, spans in batches]


class Errors(list[DecodeError]):
    def __call__(self, e: DecodeError) -> None:
        self.append(e)

    @property
    def texts(self) -> list[str]:
        return [str(e) for e in self]


def test_file_encoding_table() -> None:
    assert file_encoding("a/b.pb") == ("otlp_proto", False)
    assert file_encoding("b.BINPB.gz") == ("otlp_proto", True)
    assert file_encoding("x.jsonl") == ("otlp_json", False)
    assert file_encoding("x.json.gz") == ("otlp_json", True)
    assert file_encoding("x.txt") is None
    assert file_encoding("x.gz") is None


@pytest.mark.parametrize("name", ["traces.pb", "traces.binpb", "traces.pb.gz"])
def test_length_prefixed_messages(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    msgs = [message(1), message(2, spans=3), message(3)]
    assert write_pb(path, msgs) == 3
    raw = path.read_bytes()
    if name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b"
        raw = gzip.decompress(raw)
    assert raw[:4] == struct.pack(">I", len(msgs[0]))
    payloads = list(iter_payloads([path]))
    assert payloads == [
        Payload(f"{path}#1", "otlp_proto", msgs[0]),
        Payload(f"{path}#2", "otlp_proto", msgs[1]),
        Payload(f"{path}#3", "otlp_proto", msgs[2]),
    ]
    errors = Errors()
    assert span_names(list(iter_batches([path], errors))) == [
        (f"{path}#1", ["m1s0"]),
        (f"{path}#2", ["m2s0", "m2s1", "m2s2"]),
        (f"{path}#3", ["m3s0"]),
    ]
    assert errors == []


def test_gzip_output_is_deterministic(tmp_path: Path) -> None:
    write_pb(tmp_path / "a.pb.gz", [message(1)])
    write_pb(tmp_path / "b.pb.gz", [message(1)])
    assert (tmp_path / "a.pb.gz").read_bytes() == (tmp_path / "b.pb.gz").read_bytes()


@pytest.mark.parametrize("name", ["traces.jsonl", "traces.json", "traces.jsonl.gz"])
def test_json_lines(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    docs = [proto_to_json_bytes(message(n)) for n in (1, 2)]
    assert write_jsonl(path, [docs[0], docs[1].decode()]) == 2
    text = path.read_bytes()
    if name.endswith(".gz"):
        text = gzip.decompress(text)
    assert text == docs[0] + b"\n" + docs[1] + b"\n"
    # blank lines are skipped and do not shift the line numbers
    blank = b"\n" + docs[0] + b"\n\n  \n" + docs[1] + b"\r\n"
    path.write_bytes(gzip.compress(blank) if name.endswith(".gz") else blank)
    assert list(iter_payloads([path])) == [
        Payload(f"{path}:2", "otlp_json", docs[0]),
        Payload(f"{path}:5", "otlp_json", docs[1]),
    ]
    errors = Errors()
    assert span_names(list(iter_batches([path], errors))) == [
        (f"{path}:2", ["m1s0"]),
        (f"{path}:5", ["m2s0"]),
    ]
    assert errors == []


def test_single_pretty_printed_document(tmp_path: Path) -> None:
    doc = json.loads(proto_to_json_bytes(message(4, spans=2)))
    path = tmp_path / "one.json"
    pretty = "\n" + json.dumps(doc, indent=2) + "\n"
    path.write_text(pretty)
    payloads = list(iter_payloads([path]))
    assert len(payloads) == 1
    assert payloads[0].source == str(path)
    assert payloads[0].encoding == "otlp_json"
    assert json.loads(payloads[0].data) == doc
    errors = Errors()
    assert span_names(list(iter_batches([path], errors))) == [(str(path), ["m4s0", "m4s1"])]
    assert errors == []
    # the same, gzipped
    gz = tmp_path / "one.json.gz"
    gz.write_bytes(gzip.compress(pretty.encode()))
    assert span_names(list(iter_batches([gz], errors))) == [(str(gz), ["m4s0", "m4s1"])]
    assert errors == []


def test_pretty_document_with_a_syntax_error_is_one_error_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "resourceSpans": [\n    {"scopeSpans": ]\n  ]\n}\n')
    errors = Errors()
    assert list(iter_batches([path], errors)) == []
    assert errors.texts == [f"{path}: invalid JSON at line 3 column 20: Expecting value"]


def test_jsonl_with_a_broken_first_line_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = proto_to_json_bytes(message(5))
    path.write_bytes(b'{"resourceSpans": [\n' + good + b"\n" + good + b"\n")
    errors = Errors()
    assert span_names(list(iter_batches([path], errors))) == [
        (f"{path}:2", ["m5s0"]),
        (f"{path}:3", ["m5s0"]),
    ]
    assert len(errors) == 1
    assert errors.texts[0].startswith(
        f"{path}:1: invalid JSON at line 1 column 20: Expecting value"
    )


def test_bad_message_is_reported_and_the_next_one_decoded(tmp_path: Path) -> None:
    path = tmp_path / "t.pb"
    write_pb(path, [message(1), b"\xff\xff\xff", message(3)])
    jl = tmp_path / "u.jsonl"
    jl.write_bytes(b'{"resourceSpans": 5}\n' + proto_to_json_bytes(message(4)) + b"\n")
    errors = Errors()
    got = span_names(list(iter_batches([path, jl], errors)))
    assert got == [(f"{path}#1", ["m1s0"]), (f"{path}#3", ["m3s0"]), (f"{jl}:2", ["m4s0"])]
    assert errors.texts == [
        f"{path}#2: truncated or corrupt protobuf: Wire format was corrupt",
        f"{jl}:1: resourceSpans is not a list (number)",
    ]


def test_recursive_directory_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "exports"
    (root / "sub" / "zz").mkdir(parents=True)
    write_pb(root / "b.pb", [message(2)])
    write_jsonl(root / "a.jsonl", [proto_to_json_bytes(message(1))])
    write_jsonl(root / "sub" / "c.json.gz", [proto_to_json_bytes(message(3))])
    write_pb(root / "sub" / "zz" / "d.binpb", [message(4)])
    write_pb(root / "z.pb", [message(5)])
    (root / "notes.txt").write_text("not an export")
    (root / "sub" / "README.md").write_text("ignored")
    errors = Errors()
    got = span_names(list(iter_batches([root], errors)))
    assert got == [
        (f"{root}/a.jsonl:1", ["m1s0"]),
        (f"{root}/b.pb#1", ["m2s0"]),
        (f"{root}/sub/c.json.gz:1", ["m3s0"]),
        (f"{root}/sub/zz/d.binpb#1", ["m4s0"]),
        (f"{root}/z.pb#1", ["m5s0"]),
    ]
    assert errors == []


def test_broken_framing_stops_that_file_and_the_next_file_still_decodes(tmp_path: Path) -> None:
    bad = tmp_path / "a.pb"
    m1, m2 = message(1), message(2)
    bad.write_bytes(struct.pack(">I", len(m1)) + m1 + struct.pack(">I", len(m2)) + m2 + b"\x00\x00")
    good = tmp_path / "b.pb"
    write_pb(good, [message(3)])
    errors = Errors()
    got = span_names(list(iter_batches([bad, good], errors)))
    assert got == [(f"{bad}#1", ["m1s0"]), (f"{bad}#2", ["m2s0"]), (f"{good}#1", ["m3s0"])]
    offset = 8 + len(m1) + len(m2)
    assert errors.texts == [
        f"{bad}: message 3 at offset {offset}: truncated length prefix (2 of 4 bytes)"
    ]
    # iter_payloads raises at the same place
    with pytest.raises(DecodeError, match="truncated length prefix"):
        list(iter_payloads([bad]))


def test_length_beyond_the_file(tmp_path: Path) -> None:
    m1 = message(1)
    path = tmp_path / "a.pb"
    path.write_bytes(struct.pack(">I", len(m1)) + m1 + struct.pack(">I", 1000) + b"x" * 10)
    errors = Errors()
    assert span_names(list(iter_batches([path], errors))) == [(f"{path}#1", ["m1s0"])]
    assert errors.texts == [
        f"{path}: message 2 at offset {4 + len(m1)}: length 1000 runs past the end of the "
        "file (10 bytes left)"
    ]
    gz = tmp_path / "a.pb.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    errors.clear()
    assert span_names(list(iter_batches([gz], errors))) == [(f"{gz}#1", ["m1s0"])]
    assert errors.texts == [
        f"{gz}: message 2 at decompressed offset {4 + len(m1)}: length 1000 but only 10 bytes "
        "remain"
    ]


def test_corrupt_gzip(tmp_path: Path) -> None:
    notgz = tmp_path / "a.pb.gz"
    notgz.write_bytes(b"plain bytes, not gzip")
    truncated = tmp_path / "b.jsonl.gz"
    lines = b"".join(proto_to_json_bytes(message(n)) + b"\n" for n in range(1, 40))
    truncated.write_bytes(gzip.compress(lines)[:-30])
    flipped = tmp_path / "c.pb.gz"
    write_pb(flipped, [message(n, spans=5) for n in range(1, 30)])
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    after = tmp_path / "d.pb"
    write_pb(after, [message(99)])

    errors = Errors()
    got = span_names(list(iter_batches([notgz, truncated, flipped, after], errors)))
    assert got[-1] == (f"{after}#1", ["m99s0"])  # reading went on after every broken file
    assert (
        errors.texts[0]
        == f"{notgz}: corrupt gzip data after start of file: Not a gzipped file (b'pl')"
    )
    assert errors.texts[1].startswith(f"{truncated}: corrupt gzip data after {truncated}:")
    assert "ended before the end-of-stream marker" in errors.texts[1]
    # a streamed gzip member shows damage at the latest at its CRC check; a message that
    # decompressed to garbage before that is reported as undecodable on its own
    assert errors.texts[-1].startswith(f"{flipped}: corrupt gzip data after {flipped}#")
    assert all(t.startswith(f"{flipped}") for t in errors.texts[2:])
    # what came before the damage was delivered
    assert got[0][0] == f"{truncated}:1"
    assert (f"{flipped}#1", ["m1s0", "m1s1", "m1s2", "m1s3", "m1s4"]) in got


def test_missing_path_and_unsupported_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pb"
    other = tmp_path / "notes.txt"
    other.write_text("x")
    good = tmp_path / "ok.pb"
    write_pb(good, [message(1)])
    with pytest.raises(DecodeError, match=r"nope\.pb: no such file or directory$"):
        list(iter_payloads([missing]))
    errors = Errors()
    assert span_names(list(iter_batches([missing, other, good], errors))) == [
        (f"{good}#1", ["m1s0"])
    ]
    assert errors.texts == [
        f"{missing}: no such file or directory",
        f"{other}: not an export file (expected .binpb, .json, .jsonl, .pb, optionally .gz)",
    ]


def test_empty_files(tmp_path: Path) -> None:
    (tmp_path / "a.pb").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(b"\n\n")
    write_pb(tmp_path / "c.pb.gz", [])
    errors = Errors()
    assert list(iter_batches([tmp_path], errors)) == []
    assert errors == []


def test_write_jsonl_compacts_a_pretty_document(tmp_path: Path) -> None:
    doc = {"resourceSpans": [{"scopeSpans": []}], "ünïcode": "ok"}
    path = tmp_path / "x.jsonl"
    assert write_jsonl(path, [json.dumps(doc, indent=2), b'  {"resourceSpans": []}  ']) == 2
    assert path.read_text(encoding="utf-8").splitlines() == [
        '{"resourceSpans":[{"scopeSpans":[]}],"ünïcode":"ok"}',
        '{"resourceSpans": []}',
    ]
