//! The walk (json_decode.decode_json): the tree to wire structures, with the reference's first error.

use super::*;

pub const MAX_VALUE_DEPTH: usize = 64;

pub(super) const SPAN_KINDS: &[(&str, i32)] = &[
    ("SPAN_KIND_UNSPECIFIED", 0),
    ("SPAN_KIND_INTERNAL", 1),
    ("SPAN_KIND_SERVER", 2),
    ("SPAN_KIND_CLIENT", 3),
    ("SPAN_KIND_PRODUCER", 4),
    ("SPAN_KIND_CONSUMER", 5),
];
pub(super) const STATUS_CODES: &[(&str, i32)] = &[
    ("STATUS_CODE_UNSET", 0),
    ("STATUS_CODE_OK", 1),
    ("STATUS_CODE_ERROR", 2),
];

/// The enum tables, for the test that compares them with the protobuf descriptors.
pub type EnumTable = Vec<(&'static str, i32)>;

pub fn enum_tables() -> (EnumTable, EnumTable) {
    (SPAN_KINDS.to_vec(), STATUS_CODES.to_vec())
}

pub(super) type Bad = String;
pub(super) type R<T> = Result<T, Bad>;

/// An integer's value, or only its sign when it does not fit 127 bits.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum N {
    NegHuge,
    V(i128),
    PosHuge,
}

pub(super) fn int_text(t: &str) -> N {
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t),
    };
    let digits = digits.trim_start_matches('0');
    if digits.len() > 38 {
        return if neg { N::NegHuge } else { N::PosHuge };
    }
    let mut v: i128 = 0;
    for c in digits.bytes() {
        v = v * 10 + (c - b'0') as i128;
    }
    N::V(if neg { -v } else { v })
}

/// `-?[0-9]{1,20}` (json_decode._INT_STR)
pub(super) fn int_str(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.len() <= 20 && d.bytes().all(|c| c.is_ascii_digit())
}

pub(super) fn float_int(f: f64) -> Option<N> {
    if !f.is_finite() || f.fract() != 0.0 {
        return None;
    }
    Some(if f.abs() < 1e38 {
        N::V(f as i128)
    } else if f < 0.0 {
        N::NegHuge
    } else {
        N::PosHuge
    })
}

/// null is absent, as `x is None` in the reference
pub(super) fn nn<'t, 'a>(x: Option<&'t J<'a>>) -> Option<&'t J<'a>> {
    match x {
        Some(J::Null) | None => None,
        v => v,
    }
}

pub(super) fn get<'t, 'a>(o: &'t Obj<'a>, key: &str) -> Option<&'t J<'a>> {
    nn(o.get(key))
}

/// json_decode._get: the camelCase key, else the snake_case one.
pub(super) fn get2<'t, 'a>(o: &'t Obj<'a>, camel: &str, snake: &str) -> Option<&'t J<'a>> {
    get(o, camel).or_else(|| get(o, snake))
}

pub(super) fn jint(x: Option<&J<'_>>, name: &str, lo: i128, hi: i128, shown: bool) -> R<i128> {
    let x = match x {
        None => return Ok(0),
        Some(x) => x,
    };
    let n = match x {
        J::Int(t) => Some(int_text(t)),
        J::Str(s) if int_str(&s.s) => Some(int_text(&s.s)),
        J::Float(f) => float_int(*f),
        _ => None,
    };
    let n = match n {
        Some(n) => n,
        None if shown => return Err(format!("{} is not an integer: {}", name, show_payload(x))),
        None => return Err(format!("{} is not an integer ({})", name, json_type(x))),
    };
    if n < N::V(lo) {
        return Err(if lo == 0 {
            format!("{} is negative", name)
        } else {
            format!("{} is out of range", name)
        });
    }
    if n > N::V(hi) {
        return Err(format!("{} is out of range", name));
    }
    match n {
        N::V(v) => Ok(v),
        _ => Err(format!("{} is out of range", name)),
    }
}

pub(super) fn uint64(x: Option<&J<'_>>, name: &str) -> R<u64> {
    jint(x, name, 0, u64::MAX as i128, true).map(|v| v as u64)
}

pub(super) fn jenum(x: Option<&J<'_>>, names: &[(&str, i32)], name: &str) -> R<i32> {
    match x {
        None => Ok(0),
        Some(J::Int(t)) => match int_text(t) {
            N::V(v) if (i32::MIN as i128..=i32::MAX as i128).contains(&v) => Ok(v as i32),
            _ => Err(format!("{} is out of range", name)),
        },
        Some(J::Str(s)) => match names.iter().find(|(k, _)| *k == s.s) {
            Some(&(_, v)) => Ok(v),
            None => Err(format!(
                "{} is not a known enum value: {}",
                name,
                show_payload(x.unwrap_or(&J::Null))
            )),
        },
        Some(other) => Err(format!(
            "{} is not an enum integer or name ({})",
            name,
            json_type(other)
        )),
    }
}

pub(super) fn jstr<'t>(x: Option<&'t J<'_>>, name: &str) -> R<&'t str> {
    match x {
        None => Ok(""),
        Some(J::Str(s)) => Ok(&s.s),
        Some(other) => Err(format!("{} is not a string ({})", name, json_type(other))),
    }
}

pub(super) fn jlist<'t, 'a>(x: Option<&'t J<'a>>, name: &str) -> R<&'t [J<'a>]> {
    match x {
        None => Ok(&[]),
        Some(J::Arr(items)) => Ok(items),
        Some(other) => Err(format!("{} is not a list ({})", name, json_type(other))),
    }
}

pub(super) fn jobj<'t, 'a>(x: Option<&'t J<'a>>, name: &str) -> R<Option<&'t Obj<'a>>> {
    match x {
        None => Ok(None),
        Some(J::Obj(o)) => Ok(Some(o)),
        Some(other) => Err(format!("{} is not an object ({})", name, json_type(other))),
    }
}

pub(super) fn opt_id(x: Option<&J<'_>>, nbytes: usize, name: &str) -> R<Option<Vec<u8>>> {
    let s = match x {
        None => return Ok(None),
        Some(J::Str(s)) if s.s.is_empty() => return Ok(None),
        Some(J::Str(s)) => &s.s,
        Some(other) => return Err(format!("{} is not a string ({})", name, json_type(other))),
    };
    let n = s.chars().count();
    if n != 2 * nbytes {
        return Err(format!(
            "has {} of {} hex characters, expected {}",
            name,
            n,
            2 * nbytes
        ));
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(nbytes);
    for pair in b.chunks(2) {
        match (hexval(pair[0]), hexval(pair[1])) {
            (Some(h), Some(l)) => out.push((h << 4 | l) as u8),
            _ => return Err(format!("{} is not hexadecimal", name)),
        }
    }
    Ok(if out.iter().all(|&x| x == 0) {
        None
    } else {
        Some(out)
    })
}

pub(super) fn req_id(x: Option<&J<'_>>, nbytes: usize, name: &str) -> R<Vec<u8>> {
    match opt_id(x, nbytes, name)? {
        Some(v) => Ok(v),
        None => Err(match x {
            None => format!("missing {}", name),
            Some(J::Str(s)) if s.s.is_empty() => format!("missing {}", name),
            _ => format!("{} is all zeros (invalid)", name),
        }),
    }
}

pub(super) fn b64val(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    }
}

/// base64.b64decode(x + padding, validate=True) after the URL-safe translation
/// (binascii.a2b_base64 in strict mode); None when that raises.
pub(super) fn b64decode(x: &str) -> Option<Vec<u8>> {
    if !x.is_ascii() {
        return None;
    }
    let mut s = x.as_bytes().to_vec();
    s.extend(std::iter::repeat(b'=').take((4 - x.len() % 4) % 4));
    if s.first() == Some(&b'=') {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut quad, mut left, mut pads, mut padding) = (0u8, 0u8, 0u8, false);
    for (i, &ch) in s.iter().enumerate() {
        if ch == b'=' {
            padding = true; // (3.11 has no "excess padding" check after a full quad)
            if quad >= 2 {
                pads += 1;
                if quad + pads >= 4 {
                    return if i + 1 < s.len() { None } else { Some(out) };
                }
            }
            continue;
        }
        let v = b64val(ch)?;
        if padding {
            return None;
        }
        pads = 0;
        match quad {
            0 => {
                quad = 1;
                left = v;
            }
            1 => {
                quad = 2;
                out.push(left << 2 | v >> 4);
                left = v & 0x0f;
            }
            2 => {
                quad = 3;
                out.push(left << 4 | v >> 2);
                left = v & 0x03;
            }
            _ => {
                quad = 0;
                out.push(left << 6 | v);
                left = 0;
            }
        }
    }
    if quad != 0 {
        return None;
    }
    Some(out)
}

/// The walk; `repr` renders an attribute key as Python's repr() does.
pub struct Walk<'r> {
    pub repr: &'r dyn Fn(&str) -> String,
}

impl Walk<'_> {
    fn any<'t>(&self, v: Option<&'t J<'_>>, depth: usize) -> R<Val<'t>> {
        let o = match v {
            None => return Ok(Val::Unset),
            Some(J::Obj(o)) => o,
            Some(other) => return Err(format!("value is not an object ({})", json_type(other))),
        };
        let mut found = false;
        let mut result = Val::Unset;
        for (k, x) in o.items() {
            if matches!(x, J::Null) || k.lone {
                continue;
            }
            let kind = match &*k.s {
                "stringValue" | "string_value" => 0,
                "boolValue" | "bool_value" => 1,
                "intValue" | "int_value" => 2,
                "doubleValue" | "double_value" => 3,
                "arrayValue" | "array_value" => 4,
                "kvlistValue" | "kvlist_value" => 5,
                "bytesValue" | "bytes_value" => 6,
                "stringValueStrindex" | "string_value_strindex" => 7,
                _ => continue,
            };
            if found {
                return Err("value has more than one kind".into());
            }
            result = self.kind(kind, x, depth)?;
            found = true;
        }
        Ok(result)
    }

    fn kind<'t>(&self, kind: u8, x: &'t J<'_>, depth: usize) -> R<Val<'t>> {
        Ok(match kind {
            0 => match x {
                J::Str(s) => Val::Str(&s.s),
                _ => return Err(format!("stringValue is not a string ({})", json_type(x))),
            },
            1 => match x {
                J::Bool(b) => Val::Bool(*b),
                _ => return Err(format!("boolValue is not a boolean ({})", json_type(x))),
            },
            2 => Val::Int(jint(
                Some(x),
                "intValue",
                i64::MIN as i128,
                i64::MAX as i128,
                false,
            )? as i64),
            3 => Val::Double(match x {
                J::Float(f) => *f,
                // float(int): the int -0 is 0, so +0.0; beyond the double range, inf (the
                // reference maps float()'s OverflowError to inf, as float("1e999") gives)
                J::Int(t) => t.parse::<f64>().map_or(f64::NAN, |f| f + 0.0),
                J::Str(s) => match &*s.s {
                    "NaN" => f64::NAN,
                    "Infinity" => f64::INFINITY,
                    "-Infinity" => f64::NEG_INFINITY,
                    t if float_str(t) => t.parse::<f64>().unwrap_or(f64::NAN),
                    _ => return Err("doubleValue is not a number (string)".into()),
                },
                _ => return Err(format!("doubleValue is not a number ({})", json_type(x))),
            }),
            4 => {
                if depth >= MAX_VALUE_DEPTH {
                    return Err(format!("value nesting deeper than {}", MAX_VALUE_DEPTH));
                }
                let o = jobj(Some(x), "arrayValue")?;
                let values = jlist(o.and_then(|o| get(o, "values")), "arrayValue.values")?;
                let mut out = Vec::with_capacity(values.len());
                for (i, v) in values.iter().enumerate() {
                    match self.any(nn(Some(v)), depth + 1) {
                        Ok(x) => out.push(x),
                        Err(e) => return Err(format!("[{}]: {}", i, e)),
                    }
                }
                Val::Array(out)
            }
            5 => {
                if depth >= MAX_VALUE_DEPTH {
                    return Err(format!("value nesting deeper than {}", MAX_VALUE_DEPTH));
                }
                let o = jobj(Some(x), "kvlistValue")?;
                let values = jlist(o.and_then(|o| get(o, "values")), "kvlistValue.values")?;
                Val::KvList(self.attr_list(values, depth + 1)?)
            }
            6 => match x {
                J::Str(s) => match b64decode(&s.s) {
                    Some(b) => Val::Bytes(Cow::Owned(b)),
                    None => return Err("bytesValue is not valid base64".into()),
                },
                _ => {
                    return Err(format!(
                        "bytesValue is not a base64 string ({})",
                        json_type(x)
                    ))
                }
            },
            _ => {
                return Err(
                    "value uses stringValueStrindex (dictionary references are profiles-only)"
                        .into(),
                )
            }
        })
    }

    /// json_decode._json_attrs: a JSON list of {"key", "value"} (null / absent: none).
    fn attrs<'t>(&self, kvs: Option<&'t J<'_>>, depth: usize) -> R<Vec<Kv<'t>>> {
        let list = jlist(kvs, "attributes")?;
        self.attr_list(list, depth)
    }

    fn attr_list<'t>(&self, list: &'t [J<'_>], depth: usize) -> R<Vec<Kv<'t>>> {
        let mut out = Vec::with_capacity(list.len());
        for (i, kv) in list.iter().enumerate() {
            let o = match kv {
                J::Obj(o) => o,
                other => {
                    return Err(format!(
                        "attribute {} is not an object ({})",
                        i,
                        json_type(other)
                    ))
                }
            };
            let key: &'t str = match get(o, "key") {
                None => "",
                Some(J::Str(s)) => &s.s,
                Some(other) => {
                    return Err(format!(
                        "attribute {} key is not a string ({})",
                        i,
                        json_type(other)
                    ))
                }
            };
            match self.any(get(o, "value"), depth) {
                Ok(val) => out.push(Kv { key, val }),
                Err(e) => return Err(format!("attribute {}: {}", (self.repr)(key), e)),
            }
        }
        Ok(out)
    }

    fn events<'t>(&self, evs: Option<&'t J<'_>>) -> R<Vec<Event<'t>>> {
        let list = jlist(evs, "events")?;
        let mut out = Vec::with_capacity(list.len());
        for (i, e) in list.iter().enumerate() {
            let ev = (|| -> R<Event<'t>> {
                let o = match e {
                    J::Obj(o) => o,
                    other => return Err(format!("is not an object ({})", json_type(other))),
                };
                let name = jstr(get(o, "name"), "name")?;
                let time = uint64(get2(o, "timeUnixNano", "time_unix_nano"), "timeUnixNano")?;
                let attrs = self.attrs(get(o, "attributes"), 0)?;
                Ok(Event { time, name, attrs })
            })();
            match ev {
                Ok(ev) => out.push(ev),
                Err(err) => return Err(format!("event {}: {}", i, err)),
            }
        }
        Ok(out)
    }

    fn span<'t>(&self, sp: &'t J<'_>) -> R<Span<'t>> {
        let g = match sp {
            J::Obj(o) => o,
            other => return Err(format!("is not an object ({})", json_type(other))),
        };
        let trace_id = req_id(get2(g, "traceId", "trace_id"), 16, "traceId")?;
        let span_id = req_id(get2(g, "spanId", "span_id"), 8, "spanId")?;
        let parent = opt_id(get2(g, "parentSpanId", "parent_span_id"), 8, "parentSpanId")?;
        let name = jstr(get(g, "name"), "name")?;
        let kind = jenum(get(g, "kind"), SPAN_KINDS, "kind")?;
        let start = uint64(
            get2(g, "startTimeUnixNano", "start_time_unix_nano"),
            "startTimeUnixNano",
        )?;
        let end = uint64(
            get2(g, "endTimeUnixNano", "end_time_unix_nano"),
            "endTimeUnixNano",
        )?;
        let (status_code, status_message) = match get(g, "status") {
            None => (0, ""),
            Some(J::Obj(st)) => (
                jenum(get(st, "code"), STATUS_CODES, "status.code")?,
                jstr(get(st, "message"), "status.message")?,
            ),
            Some(other) => return Err(format!("status is not an object ({})", json_type(other))),
        };
        let attrs = self.attrs(get(g, "attributes"), 0)?;
        let events = self.events(get(g, "events"))?;
        Ok(Span {
            trace_id: Cow::Owned(trace_id),
            span_id: Cow::Owned(span_id),
            parent: Cow::Owned(parent.unwrap_or_default()),
            name,
            kind,
            start,
            end,
            attrs,
            events,
            status_code,
            status_message,
        })
    }

    /// decode_json's walk over the top-level object; Err is the message after "<source>: ".
    pub fn request<'t>(&self, doc: &'t Obj<'_>) -> R<Vec<ResourceSpans<'t>>> {
        let rss = jlist(
            get2(doc, "resourceSpans", "resource_spans"),
            "resourceSpans",
        )?;
        let mut out = Vec::with_capacity(rss.len());
        let mut n = 0usize;
        for (ri, rs) in rss.iter().enumerate() {
            let place = format!("resourceSpans[{}]", ri);
            let rs = match rs {
                J::Obj(o) => o,
                other => {
                    return Err(at(
                        &place,
                        &format!("is not an object ({})", json_type(other)),
                    ))
                }
            };
            let resource = jobj(get(rs, "resource"), "resource")
                .and_then(|res| self.attrs(res.and_then(|r| get(r, "attributes")), 0))
                .map_err(|e| at(&format!("{}.resource", place), &e))?;
            let sss = scope_spans_of(rs).map_err(|e| at(&place, &e))?;
            let mut scopes = Vec::with_capacity(sss.len());
            for (si, ss) in sss.iter().enumerate() {
                let splace = format!("{}.scopeSpans[{}]", place, si);
                let (scope_name, spans) = (|| -> R<(&'t str, &'t [J<'_>])> {
                    let ss = match ss {
                        J::Obj(o) => o,
                        other => return Err(format!("is not an object ({})", json_type(other))),
                    };
                    let scope = match get(ss, "scope") {
                        None => get2(ss, "instrumentationLibrary", "instrumentation_library"),
                        x => x,
                    };
                    let name = jstr(
                        jobj(scope, "scope")?.and_then(|s| get(s, "name")),
                        "scope.name",
                    )?;
                    Ok((name, jlist(get(ss, "spans"), "spans")?))
                })()
                .map_err(|e| at(&splace, &e))?;
                let mut out_spans = Vec::with_capacity(spans.len());
                for sp in spans {
                    out_spans.push(self.span(sp).map_err(|e| at(&format!("span {}", n), &e))?);
                    n += 1;
                }
                scopes.push(ScopeSpans {
                    scope_name,
                    spans: out_spans,
                });
            }
            out.push(ResourceSpans { resource, scopes });
        }
        Ok(out)
    }
}

/// float("...") accepts it, as json_decode._FLOAT_STR says
/// (`-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?`).
pub(super) fn float_str(t: &str) -> bool {
    let b = t.as_bytes();
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let s = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - s
    };
    let int_digits = digits(&mut i);
    if int_digits > 0 {
        if i < b.len() && b[i] == b'.' {
            i += 1;
            digits(&mut i);
        }
    } else {
        if i >= b.len() || b[i] != b'.' {
            return false;
        }
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'-' || b[i] == b'+') {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// json_decode._scope_spans_of: the old instrumentationLibrarySpans when scopeSpans is
/// absent, null or [].
pub(super) fn scope_spans_of<'t, 'a>(rs: &'t Obj<'a>) -> R<&'t [J<'a>]> {
    let ss = get2(rs, "scopeSpans", "scope_spans");
    let empty = match ss {
        None => true,
        Some(J::Arr(items)) => items.is_empty(),
        _ => false,
    };
    if empty {
        if let Some(old) = get2(
            rs,
            "instrumentationLibrarySpans",
            "instrumentation_library_spans",
        ) {
            return jlist(Some(old), "instrumentationLibrarySpans");
        }
    }
    jlist(ss, "scopeSpans")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_reprs() {
        for (x, want) in [
            (1.5e16, "1.5e+16"),
            (1e-5, "1e-05"),
            (-0.0, "-0.0"),
            (0.0001, "0.0001"),
            (123.0, "123.0"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.1, "0.1"),
            (1e300, "1e+300"),
        ] {
            assert_eq!(float_repr(x), want);
        }
    }

    #[test]
    fn base64_strict() {
        assert_eq!(b64decode("aGk"), Some(b"hi".to_vec()));
        assert_eq!(b64decode("aGk="), Some(b"hi".to_vec()));
        assert_eq!(b64decode("a"), None);
        assert_eq!(b64decode("=aGk"), None);
        assert_eq!(b64decode("aG=k"), None);
    }
}
