//! The Kafka Java client's default partitioner hash (org.apache.kafka.common.utils.Utils.murmur2),
//! which aiokafka and faust's table router use too: the worker's ingest computes it for every
//! run of every export request (`streams/worker/agents/messages.py` `key_partition`), where
//! aiokafka's pure-Python one was 1% of an unkeyed worker's time.

use pyo3::prelude::*;

/// murmur2(data) -> the unsigned 32-bit hash, as aiokafka.partitioner.murmur2 returns it.
#[pyfunction]
pub fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= (rest[2] as u32) << 16;
    }
    if rest.len() >= 2 {
        h ^= (rest[1] as u32) << 8;
    }
    if !rest.is_empty() {
        h ^= rest[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}
