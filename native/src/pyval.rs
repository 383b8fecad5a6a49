//! Python values as the normalizer sees them (attribute values and parsed JSON), with the
//! exact semantics of the Python reference (streams/spanpath/normalize.py) for what it does with
//! them: `json.scanner` parsing, canonical JSON (detectors/fingerprint.py), `repr()`/`str()`,
//! `str.strip()`, `str.lower()`, `int(str)`.
//!
//! Where reproducing CPython exactly would need its Unicode tables (`repr`/`lower` of
//! non-ASCII text, `int()` of non-ASCII digits) the Python function itself is called. Where a
//! value cannot be represented here (lone surrogates, very deep nesting, NaN in a digest,
//! bytes in canonical JSON) the answer is `Hard`: the caller hands the whole batch to the
//! Python normalizer, so those cases stay exact by construction.

use std::borrow::Cow;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// "The Python implementation must decide": the batch goes to the Python path.
#[derive(Debug, Clone, Copy)]
pub struct Hard;

pub type R<T> = Result<T, Hard>;

impl From<PyErr> for Hard {
    fn from(_: PyErr) -> Self {
        Hard
    }
}

#[derive(Debug, Clone)]
pub enum V<'a> {
    None,
    Bool(bool),
    Int(i64),
    Big(String), // an int outside i64, as Python's str() of it
    Float(f64),
    Str(Cow<'a, str>),
    Bytes(&'a [u8]),
    List(Vec<V<'a>>),
    Dict(Vec<(Cow<'a, str>, V<'a>)>), // unique keys, insertion order
}

/// Deepest nesting handled here (Python's limits are near 1000; deeper goes to Python).
pub const MAX_NEST: usize = 200;

impl<'a> V<'a> {
    pub fn is_none(&self) -> bool {
        matches!(self, V::None)
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            V::Str(s) => Some(s),
            _ => None,
        }
    }
    /// `value is not None and value != ""`
    pub fn present(&self) -> bool {
        match self {
            V::None => false,
            V::Str(s) => !s.is_empty(),
            _ => true,
        }
    }
    pub fn dict(&self) -> Option<&Vec<(Cow<'a, str>, V<'a>)>> {
        match self {
            V::Dict(d) => Some(d),
            _ => None,
        }
    }
    /// dict.get(key) for a dict (None otherwise or when missing)
    pub fn get(&self, key: &str) -> Option<&V<'a>> {
        match self {
            V::Dict(d) => d.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    /// Python truthiness
    pub fn truthy(&self) -> bool {
        match self {
            V::None => false,
            V::Bool(b) => *b,
            V::Int(i) => *i != 0,
            V::Big(_) => true,
            V::Float(f) => *f != 0.0,
            V::Str(s) => !s.is_empty(),
            V::Bytes(b) => !b.is_empty(),
            V::List(l) => !l.is_empty(),
            V::Dict(d) => !d.is_empty(),
        }
    }
    /// `value == n` for a small int n (True == 1, 1.0 == 1)
    pub fn eq_int(&self, n: i64) -> bool {
        match self {
            V::Bool(b) => (*b as i64) == n,
            V::Int(i) => *i == n,
            V::Float(f) => *f == n as f64,
            _ => false,
        }
    }
    pub fn eq_str(&self, s: &str) -> bool {
        matches!(self, V::Str(x) if x == s)
    }
    /// `== []` / `== {}` / `== ""`
    pub fn is_empty_container_or_str(&self) -> bool {
        match self {
            V::Str(s) => s.is_empty(),
            V::List(l) => l.is_empty(),
            V::Dict(d) => d.is_empty(),
            _ => false,
        }
    }
}

/// Insert or replace (dict[key] = value: a replaced key keeps its position).
pub fn dict_set<'a>(d: &mut Vec<(Cow<'a, str>, V<'a>)>, key: Cow<'a, str>, value: V<'a>) {
    if let Some(slot) = d.iter_mut().find(|(k, _)| *k == key) {
        slot.1 = value;
    } else {
        d.push((key, value));
    }
}

// ------------------------------------------------------------------------------ text helpers

/// str.isspace()
#[inline]
pub fn py_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n'
            | '\u{b}'
            | '\u{c}'
            | '\r'
            | '\u{1c}'..='\u{1f}'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// str.strip()
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

/// str.split() (no argument)
pub fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(py_space).filter(|p| !p.is_empty())
}

/// str.lower(): ASCII here, anything else by Python itself.
pub fn py_lower<'s>(py: Python<'_>, s: &'s str) -> R<Cow<'s, str>> {
    if s.is_ascii() {
        if s.bytes().any(|b| b.is_ascii_uppercase()) {
            Ok(Cow::Owned(s.to_ascii_lowercase()))
        } else {
            Ok(Cow::Borrowed(s))
        }
    } else {
        let out = PyString::new(py, s).call_method0(intern!(py, "lower"))?;
        Ok(Cow::Owned(out.extract::<String>()?))
    }
}

static CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xedb88320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// zlib.crc32
pub fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c ^ 0xffff_ffff
}

pub const MAX_IDENT: usize = 256;

/// normalize._ident of a text
pub fn ident_text(text: &str) -> String {
    let mut n = 0usize;
    let mut cut = text.len();
    for (i, _) in text.char_indices() {
        if n == MAX_IDENT - 9 {
            cut = i;
        }
        n += 1;
        if n > MAX_IDENT {
            return format!("{}~{:08x}", &text[..cut], crc32(text.as_bytes()));
        }
    }
    text.to_string()
}

// ------------------------------------------------------------------------------ repr / str

/// float.__repr__
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let s = format!("{:e}", f); // shortest round-trip digits, as repr
    let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let nd = digits.len() as i32;
    let decpt = exp + 1;
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if decpt <= -4 || decpt > 16 {
        out.push_str(&digits[..1]);
        if nd > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    } else if decpt <= 0 {
        out.push_str("0.");
        for _ in 0..(-decpt) {
            out.push('0');
        }
        out.push_str(&digits);
    } else if decpt >= nd {
        out.push_str(&digits);
        for _ in 0..(decpt - nd) {
            out.push('0');
        }
        out.push_str(".0");
    } else {
        out.push_str(&digits[..decpt as usize]);
        out.push('.');
        out.push_str(&digits[decpt as usize..]);
    }
    out
}

fn str_repr(py: Python<'_>, s: &str, out: &mut String) -> R<()> {
    if !s.is_ascii() {
        let r = PyString::new(py, s).repr()?;
        out.push_str(r.to_str()?);
        return Ok(());
    }
    let b = s.as_bytes();
    if b.iter()
        .all(|&c| (0x20..0x7f).contains(&c) && c != b'\\' && c != b'\'')
    {
        out.push('\'');
        out.push_str(s);
        out.push('\'');
        return Ok(());
    }
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    Ok(())
}

fn bytes_repr(b: &[u8], out: &mut String) {
    let quote = if b.contains(&b'\'') && !b.contains(&b'"') {
        b'"'
    } else {
        b'\''
    };
    out.push('b');
    out.push(quote as char);
    for &c in b {
        match c {
            b'\\' => out.push_str("\\\\"),
            b'\t' => out.push_str("\\t"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c as char);
            }
            c if !(0x20..0x7f).contains(&c) => out.push_str(&format!("\\x{:02x}", c)),
            c => out.push(c as char),
        }
    }
    out.push(quote as char);
}

/// repr(value)
pub fn repr_into(py: Python<'_>, v: &V<'_>, out: &mut String, depth: usize) -> R<()> {
    if depth > MAX_NEST {
        return Err(Hard);
    }
    match v {
        V::None => out.push_str("None"),
        V::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        V::Int(i) => out.push_str(&i.to_string()),
        V::Big(s) => out.push_str(s),
        V::Float(f) => out.push_str(&float_repr(*f)),
        V::Str(s) => str_repr(py, s, out)?,
        V::Bytes(b) => bytes_repr(b, out),
        V::List(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(py, x, out, depth + 1)?;
            }
            out.push(']');
        }
        V::Dict(items) => {
            out.push('{');
            for (i, (k, x)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                str_repr(py, k, out)?;
                out.push_str(": ");
                repr_into(py, x, out, depth + 1)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

pub fn repr_str_into(py: Python<'_>, s: &str, out: &mut String) -> R<()> {
    str_repr(py, s, out)
}

/// str(value)
pub fn py_str<'s>(py: Python<'_>, v: &'s V<'_>) -> R<Cow<'s, str>> {
    match v {
        V::Str(s) => Ok(Cow::Borrowed(s)),
        other => {
            let mut out = String::new();
            repr_into(py, other, &mut out, 0)?;
            Ok(Cow::Owned(out))
        }
    }
}

// ------------------------------------------------------------------------------ int(str)

pub enum PyInt {
    Small(i64),
    Big,
}

/// int(text) (Python's str->int: whitespace, sign, digits with single underscores);
/// None: ValueError.
pub fn py_int(py: Python<'_>, text: &str) -> R<Option<PyInt>> {
    if !text.is_ascii() {
        let builtins = py.import("builtins")?;
        return match builtins.getattr(intern!(py, "int"))?.call1((text,)) {
            Ok(v) => Ok(Some(match v.extract::<i64>() {
                Ok(i) => PyInt::Small(i),
                Err(_) => PyInt::Big,
            })),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyValueError>(py) => Ok(None),
            Err(_) => Err(Hard),
        };
    }
    let t = py_strip(text).as_bytes();
    let (neg, body) = match t.first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    if body.is_empty() || body[0] == b'_' || body[body.len() - 1] == b'_' {
        return Ok(None);
    }
    let mut digits = String::with_capacity(body.len() + 1);
    if neg {
        digits.push('-');
    }
    let mut prev_us = false;
    let mut nd = 0usize;
    for &c in body {
        if c == b'_' {
            if prev_us {
                return Ok(None);
            }
            prev_us = true;
        } else if c.is_ascii_digit() {
            prev_us = false;
            digits.push(c as char);
            nd += 1;
        } else {
            return Ok(None);
        }
    }
    if nd > 4300 {
        return Ok(None); // int_max_str_digits: ValueError
    }
    Ok(Some(match digits.parse::<i64>() {
        Ok(i) => PyInt::Small(i),
        Err(_) => PyInt::Big,
    }))
}

// ------------------------------------------------------------------------------ JSON

pub enum JErr {
    NotJson,
    Hard,
}

struct P<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
}

const MAX_INT_DIGITS: usize = 4300;

/// normalize._loads of an already stripped text: the C scanner at index 0, the whole text.
pub fn loads(s: &str) -> Result<V<'_>, JErr> {
    let mut p = P {
        s,
        b: s.as_bytes(),
        i: 0,
    };
    let v = p.value(0)?;
    if p.i != p.b.len() {
        return Err(JErr::NotJson);
    }
    Ok(v)
}

impl<'a> P<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }
    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }
    fn lit(&mut self, word: &str) -> bool {
        if self.b[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<V<'a>, JErr> {
        let c = self.peek().ok_or(JErr::NotJson)?;
        match c {
            b'"' => {
                self.i += 1;
                Ok(V::Str(self.string()?))
            }
            b'{' => {
                if depth >= MAX_NEST {
                    return Err(JErr::Hard);
                }
                self.i += 1;
                self.object(depth + 1)
            }
            b'[' => {
                if depth >= MAX_NEST {
                    return Err(JErr::Hard);
                }
                self.i += 1;
                self.array(depth + 1)
            }
            b'n' if self.lit("null") => Ok(V::None),
            b't' if self.lit("true") => Ok(V::Bool(true)),
            b'f' if self.lit("false") => Ok(V::Bool(false)),
            b'N' if self.lit("NaN") => Ok(V::Float(f64::NAN)),
            b'I' if self.lit("Infinity") => Ok(V::Float(f64::INFINITY)),
            b'-' if self.lit("-Infinity") => Ok(V::Float(f64::NEG_INFINITY)),
            _ => self.number(),
        }
    }

    fn number(&mut self) -> Result<V<'a>, JErr> {
        let start = self.i;
        let b = self.b;
        let mut i = self.i;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i) {
            Some(b'1'..=b'9') => {
                i += 1;
                while let Some(b'0'..=b'9') = b.get(i) {
                    i += 1;
                }
            }
            Some(b'0') => i += 1,
            _ => return Err(JErr::NotJson),
        }
        let int_end = i;
        let mut is_float = false;
        if b.get(i) == Some(&b'.') && matches!(b.get(i + 1), Some(b'0'..=b'9')) {
            i += 2;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            is_float = true;
        }
        if let Some(b'e' | b'E') = b.get(i) {
            let e_start = i;
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            let d0 = i;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            if i > d0 {
                is_float = true;
            } else {
                i = e_start;
            }
        }
        self.i = i;
        let text = &self.s[start..i];
        if is_float {
            return text.parse::<f64>().map(V::Float).map_err(|_| JErr::Hard);
        }
        let _ = int_end;
        match text.parse::<i64>() {
            Ok(n) => Ok(V::Int(n)),
            Err(_) => {
                let nd = text.trim_start_matches('-').len();
                if nd > MAX_INT_DIGITS {
                    Err(JErr::NotJson) // int(): exceeds the digit limit (ValueError)
                } else {
                    Ok(V::Big(text.to_string()))
                }
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, JErr> {
        let h = self.b.get(self.i..self.i + 4).ok_or(JErr::NotJson)?;
        let mut c = 0u32;
        for &x in h {
            c = (c << 4)
                | match x {
                    b'0'..=b'9' => (x - b'0') as u32,
                    b'a'..=b'f' => (x - b'a' + 10) as u32,
                    b'A'..=b'F' => (x - b'A' + 10) as u32,
                    _ => return Err(JErr::NotJson),
                };
        }
        self.i += 4;
        Ok(c)
    }

    /// After the opening quote.
    fn string(&mut self) -> Result<Cow<'a, str>, JErr> {
        let b = self.b;
        let start = self.i;
        let mut i = self.i;
        // fast path: no escapes
        loop {
            match b.get(i) {
                None => return Err(JErr::NotJson),
                Some(b'"') => {
                    self.i = i + 1;
                    return Ok(Cow::Borrowed(&self.s[start..i]));
                }
                Some(b'\\') => break,
                Some(&c) if c < 0x20 => return Err(JErr::NotJson),
                _ => i += 1,
            }
        }
        let mut out = String::with_capacity(i - start + 16);
        out.push_str(&self.s[start..i]);
        self.i = i;
        loop {
            let c = *b.get(self.i).ok_or(JErr::NotJson)?;
            match c {
                b'"' => {
                    self.i += 1;
                    return Ok(Cow::Owned(out));
                }
                b'\\' => {
                    self.i += 1;
                    let e = *b.get(self.i).ok_or(JErr::NotJson)?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let c1 = self.hex4()?;
                            if (0xd800..0xdc00).contains(&c1) {
                                if b.get(self.i) == Some(&b'\\') && b.get(self.i + 1) == Some(&b'u')
                                {
                                    self.i += 2;
                                    let c2 = self.hex4()?;
                                    if (0xdc00..0xe000).contains(&c2) {
                                        let cp = 0x10000 + (((c1 - 0xd800) << 10) | (c2 - 0xdc00));
                                        out.push(char::from_u32(cp).ok_or(JErr::Hard)?);
                                        continue;
                                    }
                                }
                                return Err(JErr::Hard); // a lone surrogate
                            }
                            out.push(char::from_u32(c1).ok_or(JErr::Hard)?);
                        }
                        _ => return Err(JErr::NotJson),
                    }
                }
                c if c < 0x20 => return Err(JErr::NotJson),
                _ => {
                    // copy a run of plain characters
                    let run = self.i;
                    let mut j = self.i;
                    while let Some(&x) = b.get(j) {
                        if x == b'"' || x == b'\\' || x < 0x20 {
                            break;
                        }
                        j += 1;
                    }
                    out.push_str(&self.s[run..j]);
                    self.i = j;
                }
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<V<'a>, JErr> {
        let mut d: Vec<(Cow<'a, str>, V<'a>)> = Vec::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(V::Dict(d));
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(JErr::NotJson);
            }
            self.i += 1;
            let key = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return Err(JErr::NotJson);
            }
            self.i += 1;
            self.ws();
            let v = self.value(depth)?;
            dict_set(&mut d, key, v);
            self.ws();
            match self.peek() {
                Some(b'}') => {
                    self.i += 1;
                    return Ok(V::Dict(d));
                }
                Some(b',') => {
                    self.i += 1;
                    self.ws();
                }
                _ => return Err(JErr::NotJson),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<V<'a>, JErr> {
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(V::List(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.ws();
            match self.peek() {
                Some(b']') => {
                    self.i += 1;
                    return Ok(V::List(items));
                }
                Some(b',') => {
                    self.i += 1;
                    self.ws();
                }
                _ => return Err(JErr::NotJson),
            }
        }
    }
}

/// normalize._as_json: a JSON string parsed; bytes decoded (or hex); anything else as is.
pub fn as_json<'a>(v: &V<'a>) -> R<V<'a>> {
    match v {
        V::Bytes(b) => match std::str::from_utf8(b) {
            Ok(text) => as_json_borrowed(text).map(|p| p.unwrap_or(V::Str(Cow::Borrowed(text)))),
            Err(_) => {
                let mut h = String::with_capacity(b.len() * 2);
                for x in b.iter() {
                    h.push_str(&format!("{:02x}", x));
                }
                Ok(V::Str(Cow::Owned(h)))
            }
        },
        V::Str(Cow::Borrowed(text)) => {
            let text: &'a str = text;
            as_json_borrowed(text).map(|p| p.unwrap_or_else(|| v.clone()))
        }
        V::Str(Cow::Owned(text)) => {
            let parsed = as_json_borrowed(text)?.map(into_owned);
            Ok(parsed.unwrap_or_else(|| v.clone()))
        }
        other => Ok(other.clone()),
    }
}

/// The parsed value of a JSON text, None when it is not JSON (the text stays as is).
fn as_json_borrowed(text: &str) -> R<Option<V<'_>>> {
    let t = py_strip(text);
    let first = t.as_bytes().first().copied();
    let starts = matches!(first, Some(b'{' | b'[' | b'"' | b'-' | b'0'..=b'9'))
        || t == "null"
        || t == "true"
        || t == "false";
    if !starts {
        return Ok(None);
    }
    match loads(t) {
        Ok(v) => Ok(Some(v)),
        Err(JErr::NotJson) => Ok(None),
        Err(JErr::Hard) => Err(Hard),
    }
}

/// A parsed value detached from the text it was parsed from.
pub fn into_owned<'b>(v: V<'_>) -> V<'b> {
    match v {
        V::None => V::None,
        V::Bool(b) => V::Bool(b),
        V::Int(i) => V::Int(i),
        V::Big(s) => V::Big(s),
        V::Float(f) => V::Float(f),
        V::Str(s) => V::Str(Cow::Owned(s.into_owned())),
        V::Bytes(_) => V::None, // never produced by the JSON parser
        V::List(l) => V::List(l.into_iter().map(into_owned).collect()),
        V::Dict(d) => V::Dict(
            d.into_iter()
                .map(|(k, v)| (Cow::Owned(k.into_owned()), into_owned(v)))
                .collect(),
        ),
    }
}

// ------------------------------------------------------------------------------ canonical

/// json.encoder.encode_basestring (ensure_ascii=False).
pub fn escape(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes())
            }
            c => {
                let mut b = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// Canonical JSON (fingerprint.canonical); Hard where Python falls back to repr().
pub fn canonical(v: &V<'_>, out: &mut Vec<u8>, depth: usize) -> R<()> {
    if depth > MAX_NEST {
        return Err(Hard);
    }
    match v {
        V::None => out.extend_from_slice(b"null"),
        V::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        V::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
        V::Big(s) => out.extend_from_slice(s.as_bytes()),
        V::Float(f) => {
            if !f.is_finite() {
                return Err(Hard);
            }
            out.extend_from_slice(float_repr(*f).as_bytes())
        }
        V::Str(s) => escape(s, out),
        V::Bytes(_) => return Err(Hard),
        V::List(items) => {
            out.push(b'[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(x, out, depth + 1)?;
            }
            out.push(b']');
        }
        V::Dict(items) => {
            let mut sorted: Vec<&(Cow<'_, str>, V<'_>)> = items.iter().collect();
            sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, x)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                escape(k, out);
                out.push(b':');
                canonical(x, out, depth + 1)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}
