//! Trace and span ids as every path handles them: hex text, the validity rule and its message
//! (streams/spanpath/otlp/proto.py `_pb_id_problem`), and where a decode error happened
//! (streams/spanpath/otlp/common.py `_at`). One copy for the decoders and the normalizer.

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Lowercase hex of `b`.
pub fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(HEX[(x >> 4) as usize] as char);
        s.push(HEX[(x & 15) as usize] as char);
    }
    s
}

pub fn all_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// A 16-byte trace id and an 8-byte span id, neither all zero; a parent id empty or 8 bytes.
pub fn ids_valid(tid: &[u8], sid: &[u8], pid: &[u8]) -> bool {
    tid.len() == 16
        && sid.len() == 8
        && (pid.is_empty() || pid.len() == 8)
        && !all_zero(tid)
        && !all_zero(sid)
}

/// The parent span id as text, or None (empty or all zero: a root span).
pub fn parent_hex(pid: &[u8]) -> Option<String> {
    if pid.is_empty() || all_zero(pid) {
        None
    } else {
        Some(hex(pid))
    }
}

/// What is wrong with ids that are not `ids_valid`.
pub fn id_problem(tid: &[u8], sid: &[u8], pid: &[u8]) -> String {
    for (name, value, size) in [
        ("traceId", tid, 16usize),
        ("spanId", sid, 8),
        ("parentSpanId", pid, 8),
    ] {
        if value.is_empty() {
            if name != "parentSpanId" {
                return format!("missing {}", name);
            }
        } else if value.len() != size {
            return format!("has {} of {} bytes, expected {}", name, value.len(), size);
        }
    }
    "has an all-zero (invalid) traceId or spanId".to_string()
}

/// `place` and `reason` as one message (streams.spanpath.otlp.common._at).
pub fn at(place: &str, reason: &str) -> String {
    if reason.starts_with("has ") || reason.starts_with("missing ") || reason.starts_with("is ") {
        format!("{} {}", place, reason)
    } else {
        format!("{}: {}", place, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        let (t, s) = ([1u8; 16], [2u8; 8]);
        assert!(ids_valid(&t, &s, &[]) && ids_valid(&t, &s, &[3; 8]));
        assert!(!ids_valid(&[0; 16], &s, &[]) && !ids_valid(&t, &s, &[3; 4]));
        assert_eq!(id_problem(&t, &[], &[]), "missing spanId");
        assert_eq!(
            id_problem(&t, &s, &[3; 4]),
            "has parentSpanId of 4 bytes, expected 8"
        );
        assert_eq!(parent_hex(&[0; 8]), None);
        assert_eq!(parent_hex(&[0xab; 8]).as_deref(), Some("abababababababab"));
        assert_eq!(at("span 3", "missing spanId"), "span 3 missing spanId");
        assert_eq!(at("span 3", "bad"), "span 3: bad");
    }
}
