//! Python renderings of values, as the reference's messages quote them.

use super::*;

pub fn json_type(x: &J<'_>) -> &'static str {
    match x {
        J::Null => "null",
        J::Bool(_) => "boolean",
        J::Int(_) | J::Float(_) => "number",
        J::Str(_) => "string",
        J::Arr(_) => "array",
        J::Obj(_) => "object",
    }
}

/// Python's repr(float) ('r' format, shortest round-trip digits).
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let e = format!("{:e}", x);
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1;
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    let n = digits.len() as i32;
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat((-decpt) as usize));
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            out.push_str(&"0".repeat((decpt - n) as usize));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        out.push_str(&format!("e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs()));
    }
    out
}

pub(super) fn dump_str(s: &str, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(ch),
            _ => {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
        }
    }
    out.push('"');
}

/// json.dumps(x) (default options), stopping once past `cap` characters.
pub(super) fn dump(x: &J<'_>, out: &mut String, cap: usize) {
    if out.len() > cap {
        return;
    }
    match x {
        J::Null => out.push_str("null"),
        J::Bool(true) => out.push_str("true"),
        J::Bool(false) => out.push_str("false"),
        J::Int(t) => out.push_str(if *t == "-0" { "0" } else { t }),
        J::Float(f) => {
            if f.is_nan() {
                out.push_str("NaN")
            } else if f.is_infinite() {
                out.push_str(if *f > 0.0 { "Infinity" } else { "-Infinity" })
            } else {
                out.push_str(&float_repr(*f))
            }
        }
        J::Str(s) => dump_str(&s.s, out),
        J::Arr(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(v, out, cap);
                if out.len() > cap {
                    return;
                }
            }
            out.push(']');
        }
        J::Obj(o) => {
            out.push('{');
            for (i, (k, v)) in o.items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump_str(&k.s, out);
                out.push_str(": ");
                dump(v, out, cap);
                if out.len() > cap {
                    return;
                }
            }
            out.push('}');
        }
    }
}

/// json_decode._show: json.dumps, cut to 40 characters.
pub(super) fn show(x: &J<'_>) -> String {
    let mut text = String::new();
    dump(x, &mut text, 41);
    if text.len() <= 40 {
        text
    } else {
        format!("{}...", &text[..37])
    }
}

pub(super) fn enum_like(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 40
        && b[0].is_ascii_uppercase()
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_')
}

/// json_decode._show_payload: free text is never quoted, only its length given.
pub(super) fn show_payload(x: &J<'_>) -> String {
    match x {
        J::Str(s) if !enum_like(&s.s) => format!("a string of {} characters", s.s.chars().count()),
        _ => show(x),
    }
}
