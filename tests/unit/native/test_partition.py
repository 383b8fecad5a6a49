"""The native murmur2 (loopwatch_native.murmur2) against aiokafka's, the reference: the same
hash for every length's tail (0-3 bytes past a multiple of 4) and any bytes, and so the
same partition for every run id `key_partition` places.

Runs whenever the extension is built (CI builds it); skipped only on a fallback-only
installation.
"""

from __future__ import annotations

from aiokafka.partitioner import murmur2 as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.spanpath import native
from streams.worker.agents import messages
from tests.native_ext import EXT, requires_native

pytestmark = requires_native


@settings(max_examples=500)
@given(st.binary(max_size=80))
def test_the_native_hash_is_the_java_clients(data: bytes) -> None:
    assert EXT.murmur2(data) == reference(data)


def test_key_partition_uses_the_native_hash() -> None:
    # the native path's (the fallback pass, LOOPWATCH_NATIVE=0, keeps aiokafka's)
    assert messages.murmur2 is (EXT.murmur2 if native.EXT is not None else reference)
    assert EXT.murmur2(b"21") == -973932308 & 0xFFFFFFFF  # the Java client's value
    for n in range(40):  # every tail length, trace-id-like keys
        key = ("%032x" % (n * 0x9E3779B97F4A7C15)).encode()[: n + 1]
        assert messages.key_partition(key, 12) == (reference(key) & 0x7FFFFFFF) % 12
