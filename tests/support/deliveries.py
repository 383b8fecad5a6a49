"""The same spans delivered as users really have them: in random order, in
random batches, with re-sent batches, split over several files and formats.

`reshuffle(messages, rng)` takes export messages (serialized ExportTraceServiceRequest) and
deals their spans anew: every span keeps its resource and scope, the spans are shuffled
(`order="random"`), or kept in the order they end (`order="time"`), cut into batches of
random size, and about `dup_share` of the batches are sent a second time at a random later
place. `write_files(dir, batches, rng, n)` writes the batches to n files of the
fileexporter formats (`.jsonl`, `.pb.gz`, `.pb`, `.json.gz`, ...), each batch to a random
file, so a file holds batches of any time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from streams.replay.files import write_jsonl, write_pb
from streams.spanpath.otlp import proto_to_json_bytes

FORMATS = (".jsonl", ".pb.gz", ".pb", ".jsonl.gz", ".binpb")

_Item = tuple[bytes, bytes, str, Span]  # resource, scope (serialized), schema url, span


def _spans(messages: Iterable[bytes]) -> list[_Item]:
    out: list[_Item] = []
    for message in messages:
        req = ExportTraceServiceRequest.FromString(message)
        for rs in req.resource_spans:
            resource = rs.resource.SerializeToString()
            for ss in rs.scope_spans:
                scope = ss.scope.SerializeToString()
                out.extend((resource, scope, ss.schema_url, span) for span in ss.spans)
    return out


def _message(items: Sequence[_Item]) -> bytes:
    """One export message of these spans, grouped by resource and scope as an SDK does."""
    req = ExportTraceServiceRequest()
    groups: dict[tuple[bytes, bytes, str], list[Span]] = {}
    for resource, scope, schema, span in items:
        groups.setdefault((resource, scope, schema), []).append(span)
    by_resource: dict[bytes, object] = {}
    for (resource, scope, schema), spans in groups.items():
        rs = by_resource.get(resource)
        if rs is None:
            rs = req.resource_spans.add()
            rs.resource.CopyFrom(Resource.FromString(resource))
            by_resource[resource] = rs
        ss = rs.scope_spans.add()  # type: ignore[attr-defined]
        ss.scope.CopyFrom(InstrumentationScope.FromString(scope))
        ss.schema_url = schema
        ss.spans.extend(spans)
    return bytes(req.SerializeToString())


def reshuffle(
    messages: Iterable[bytes],
    rng: random.Random,
    *,
    order: Literal["random", "time"] = "random",
    batch: tuple[int, int] = (1, 40),
    dup_share: float = 0.3,
) -> list[bytes]:
    """The messages' spans dealt into new export batches (see the module docstring)."""
    items = _spans(messages)
    if order == "random":
        rng.shuffle(items)
    else:
        items.sort(key=lambda it: (it[3].end_time_unix_nano, it[3].span_id))
    batches: list[bytes] = []
    i = 0
    while i < len(items):
        n = rng.randint(*batch)
        batches.append(_message(items[i : i + n]))
        i += n
    if dup_share:
        for b in [b for b in batches if rng.random() < dup_share]:
            at = batches.index(b) + 1
            batches.insert(rng.randint(at, len(batches)), b)
    return batches


def exported_in_time_order(total_spans: int, seed: int) -> list[bytes]:
    """The bench corpus (~20 interleaved live runs, 20% looping) as an SDK's batch span
    processor exports it: spans in the order they end, 40 to 120 per export."""
    from bench.corpus import export_messages

    return reshuffle(
        export_messages(total_spans, seed=seed, loop_share=0.2),
        random.Random(seed),
        order="time",
        batch=(40, 120),
        dup_share=0,
    )


def write_files(
    directory: Path, batches: Sequence[bytes], rng: random.Random, n: int
) -> list[Path]:
    """The batches dealt at random over n files of the fileexporter formats, cycling
    through FORMATS; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [directory / f"part-{i}{FORMATS[i % len(FORMATS)]}" for i in range(n)]
    dealt: list[list[bytes]] = [[] for _ in names]
    for b in batches:
        dealt[rng.randrange(n)].append(b)
    for path, msgs in zip(names, dealt, strict=True):
        if ".json" in path.name:
            write_jsonl(path, [proto_to_json_bytes(m) for m in msgs])
        else:
            write_pb(path, msgs)
    return names
