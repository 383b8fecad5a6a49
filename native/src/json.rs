//! OTLP JSON -> the wire structures of `wire.rs`, with the behaviour of the Python reference
//! `streams/spanpath/otlp/json_decode.py` (which parses with CPython 3.11's `json` C scanner and then
//! walks the dicts). Two phases, as there: the whole text is scanned into a tree first (so a
//! syntax error anywhere wins over a semantic one), then the tree is walked in the reference's
//! order, producing the reference's first error message.
//!
//! What the scanner reproduces of `json.loads`: its error messages and positions (character
//! offsets, line/column), numbers (`-0` is the int 0; integers of more digits than the int
//! string limit fail as "number too large"; float literals round correctly, overflow to inf),
//! NaN / Infinity / -Infinity, duplicate keys (the last value in the first key's place),
//! escapes with surrogate pairs and lone surrogates (the reference then rejects the whole
//! document if one survives in the final tree). serde_json differs on most of these, hence a
//! scanner of our own.
//!
//! Nesting deeper than the caller's `max_depth` is not decided here (`Outcome::Delegate`): the
//! reference's answer there depends on Python's recursion limit and stack depth.

use crate::ids::at;
use std::borrow::Cow;
use std::collections::HashMap;

use crate::wire::{Event, Kv, ResourceSpans, ScopeSpans, Span, Val};

// ---------------------------------------------------------------------------------------------
// The tree
// ---------------------------------------------------------------------------------------------

pub enum J<'a> {
    Null,
    Bool(bool),
    /// An integer literal, as written (`-?(0|[1-9][0-9]*)`).
    Int(&'a str),
    Float(f64),
    Str(JStr<'a>),
    Arr(Vec<J<'a>>),
    Obj(Obj<'a>),
}

pub struct JStr<'a> {
    pub s: Cow<'a, str>,
    /// Holds an unpaired surrogate (written as U+FFFD in `s`): such a string never equals one
    /// without, and the document is rejected if one is left in it.
    pub lone: bool,
}

impl JStr<'_> {
    fn same(&self, other: &JStr<'_>) -> bool {
        self.lone == other.lone && self.s == other.s
    }
}

/// A JSON object with Python dict semantics: keys in first-seen order, the last value kept.
pub struct Obj<'a> {
    items: Vec<(JStr<'a>, J<'a>)>,
    /// Built once an object grows past a few keys, so hostile wide objects stay linear
    /// (boxed: it keeps `J` small, and the tree moves `J`s around a lot).
    #[allow(clippy::box_collection)]
    index: Option<Box<HashMap<(bool, String), usize>>>,
}

const INDEX_FROM: usize = 16;

impl<'a> Obj<'a> {
    fn new() -> Self {
        Obj {
            items: Vec::with_capacity(8),
            index: None,
        }
    }

    fn insert(&mut self, k: JStr<'a>, v: J<'a>) {
        if let Some(ix) = self.index.as_deref_mut() {
            match ix.get(&(k.lone, k.s.to_string())) {
                Some(&i) => self.items[i].1 = v,
                None => {
                    ix.insert((k.lone, k.s.to_string()), self.items.len());
                    self.items.push((k, v));
                }
            }
            return;
        }
        if let Some(slot) = self.items.iter_mut().find(|(key, _)| key.same(&k)) {
            slot.1 = v;
            return;
        }
        self.items.push((k, v));
        if self.items.len() >= INDEX_FROM {
            let ix = self
                .items
                .iter()
                .enumerate()
                .map(|(i, (key, _))| ((key.lone, key.s.to_string()), i))
                .collect();
            self.index = Some(Box::new(ix));
        }
    }

    /// `d.get(key)`, null included (callers treat null as absent, as the reference does).
    pub fn get(&self, key: &str) -> Option<&J<'a>> {
        if let Some(ix) = &self.index {
            return ix.get(&(false, key.to_string())).map(|&i| &self.items[i].1);
        }
        self.items
            .iter()
            .find(|(k, _)| !k.lone && k.s == key)
            .map(|(_, v)| v)
    }

    pub fn items(&self) -> &[(JStr<'a>, J<'a>)] {
        &self.items
    }
}

// ---------------------------------------------------------------------------------------------
// The scanner (CPython 3.11 Modules/_json.c, scan_once_unicode and friends)
// ---------------------------------------------------------------------------------------------

pub enum ParseErr {
    /// json.JSONDecodeError(msg, doc, pos); `pos` is a byte offset into the text.
    Syntax(&'static str, usize),
    /// ValueError from int(): more digits than the int string conversion limit.
    TooLarge,
    /// Nested deeper than the caller's limit: the reference decides.
    TooDeep,
}

enum E {
    Err(ParseErr),
    /// StopIteration(pos): becomes "Expecting value" at pos at the top.
    Stop(usize),
}

impl From<ParseErr> for E {
    fn from(e: ParseErr) -> Self {
        E::Err(e)
    }
}

type PR<T> = Result<T, E>;

struct Scanner<'a> {
    s: &'a str,
    b: &'a [u8],
    depth: usize,
    max_depth: usize,
    max_digits: usize,
    trailing_comma_msgs: bool,
    lone: bool,
}

#[inline]
fn ws(c: u8) -> bool {
    c == b' ' || c == b'\t' || c == b'\n' || c == b'\r'
}

fn hexval(c: u8) -> Option<u32> {
    match c {
        b'0'..=b'9' => Some((c - b'0') as u32),
        b'a'..=b'f' => Some((c - b'a' + 10) as u32),
        b'A'..=b'F' => Some((c - b'A' + 10) as u32),
        _ => None,
    }
}

impl<'a> Scanner<'a> {
    #[inline]
    fn skip_ws(&self, mut i: usize) -> usize {
        while i < self.b.len() && ws(self.b[i]) {
            i += 1;
        }
        i
    }

    /// At least `n` characters from byte offset `i` (the C code's length checks count
    /// characters).
    fn chars_from(&self, i: usize, n: usize) -> bool {
        let mut seen = 0;
        for &c in &self.b[i.min(self.b.len())..] {
            if c & 0xC0 != 0x80 {
                seen += 1;
                if seen >= n {
                    return true;
                }
            }
        }
        n == 0
    }

    fn at(&self, i: usize, c: u8) -> bool {
        self.b.get(i) == Some(&c)
    }

    fn lit(&self, i: usize, word: &str) -> bool {
        self.b.get(i..i + word.len()) == Some(word.as_bytes())
    }

    fn value(&mut self, idx: usize) -> PR<(J<'a>, usize)> {
        let b = self.b;
        if idx >= b.len() {
            return Err(E::Stop(idx));
        }
        match b[idx] {
            b'"' => {
                let (s, next) = self.string(idx + 1)?;
                return Ok((J::Str(s), next));
            }
            b'{' | b'[' => {
                if self.depth >= self.max_depth {
                    return Err(E::Err(ParseErr::TooDeep));
                }
                self.depth += 1;
                let r = if b[idx] == b'{' {
                    self.object(idx + 1)
                } else {
                    self.array(idx + 1)
                };
                self.depth -= 1;
                return r;
            }
            b'n' if self.lit(idx, "null") => return Ok((J::Null, idx + 4)),
            b't' if self.lit(idx, "true") => return Ok((J::Bool(true), idx + 4)),
            b'f' if self.lit(idx, "false") => return Ok((J::Bool(false), idx + 5)),
            b'N' if self.lit(idx, "NaN") => return Ok((J::Float(f64::NAN), idx + 3)),
            b'I' if self.lit(idx, "Infinity") => return Ok((J::Float(f64::INFINITY), idx + 8)),
            b'-' if self.lit(idx, "-Infinity") => {
                return Ok((J::Float(f64::NEG_INFINITY), idx + 9))
            }
            _ => {}
        }
        self.number(idx)
    }

    fn number(&mut self, start: usize) -> PR<(J<'a>, usize)> {
        let b = self.b;
        let digit = |i: usize| b.get(i).map_or(false, |c| c.is_ascii_digit());
        let mut idx = start;
        if b[idx] == b'-' {
            idx += 1;
            if idx >= b.len() {
                return Err(E::Stop(start));
            }
        }
        match b[idx] {
            b'1'..=b'9' => {
                idx += 1;
                while digit(idx) {
                    idx += 1;
                }
            }
            b'0' => idx += 1,
            _ => return Err(E::Stop(start)),
        }
        let mut is_float = false;
        if idx + 1 < b.len() && b[idx] == b'.' && digit(idx + 1) {
            is_float = true;
            idx += 2;
            while digit(idx) {
                idx += 1;
            }
        }
        if idx + 1 < b.len() && (b[idx] == b'e' || b[idx] == b'E') {
            let e_start = idx;
            idx += 1;
            if idx + 1 < b.len() && (b[idx] == b'-' || b[idx] == b'+') {
                idx += 1;
            }
            while digit(idx) {
                idx += 1;
            }
            if b[idx - 1].is_ascii_digit() {
                is_float = true;
            } else {
                idx = e_start;
            }
        }
        let text = &self.s[start..idx];
        if is_float {
            return Ok((J::Float(text.parse::<f64>().unwrap_or(f64::NAN)), idx));
        }
        let digits = text.len() - usize::from(text.starts_with('-'));
        if self.max_digits > 0 && digits > self.max_digits {
            return Err(E::Err(ParseErr::TooLarge));
        }
        Ok((J::Int(text), idx))
    }

    /// scanstring_unicode: `end` is just after the opening quote.
    fn string(&mut self, mut end: usize) -> PR<(JStr<'a>, usize)> {
        let b = self.b;
        let len = b.len();
        let begin = end - 1;
        let mut out: Option<String> = None;
        let mut lone = false;
        loop {
            let mut next = end;
            let mut c = 0u8;
            while next < len {
                c = b[next];
                if c == b'"' || c == b'\\' {
                    break;
                }
                if c <= 0x1f {
                    return Err(ParseErr::Syntax("Invalid control character at", next).into());
                }
                next += 1;
            }
            if next >= len {
                return Err(ParseErr::Syntax("Unterminated string starting at", begin).into());
            }
            if c == b'"' && out.is_none() {
                return Ok((
                    JStr {
                        s: Cow::Borrowed(&self.s[end..next]),
                        lone: false,
                    },
                    next + 1,
                ));
            }
            let buf = out.get_or_insert_with(String::new);
            buf.push_str(&self.s[end..next]);
            next += 1;
            if c == b'"' {
                end = next;
                break;
            }
            if next == len {
                return Err(ParseErr::Syntax("Unterminated string starting at", begin).into());
            }
            let e = b[next];
            if e != b'u' {
                end = next + 1;
                let ch = match e {
                    b'"' => '"',
                    b'\\' => '\\',
                    b'/' => '/',
                    b'b' => '\u{8}',
                    b'f' => '\u{c}',
                    b'n' => '\n',
                    b'r' => '\r',
                    b't' => '\t',
                    _ => return Err(ParseErr::Syntax("Invalid \\escape", end - 2).into()),
                };
                buf.push(ch);
                continue;
            }
            // \uXXXX: the 4 digits and one more character must follow
            let u_at = next;
            next += 1;
            if !self.chars_from(next, 5) {
                return Err(ParseErr::Syntax("Invalid \\uXXXX escape", u_at).into());
            }
            let mut cp = 0u32;
            for &h in &b[next..next + 4] {
                match hexval(h) {
                    Some(d) => cp = cp << 4 | d,
                    None => return Err(ParseErr::Syntax("Invalid \\uXXXX escape", u_at).into()),
                }
            }
            end = next + 4;
            if (0xD800..=0xDBFF).contains(&cp)
                && self.chars_from(end, 7)
                && b[end] == b'\\'
                && b[end + 1] == b'u'
            {
                let mut c2 = 0u32;
                for &h in &b[end + 2..end + 6] {
                    match hexval(h) {
                        Some(d) => c2 = c2 << 4 | d,
                        None => {
                            return Err(ParseErr::Syntax("Invalid \\uXXXX escape", end + 1).into())
                        }
                    }
                }
                if (0xDC00..=0xDFFF).contains(&c2) {
                    cp = 0x10000 + (((cp - 0xD800) << 10) | (c2 - 0xDC00));
                    end += 6;
                }
            }
            match char::from_u32(cp) {
                Some(ch) => buf.push(ch),
                None => {
                    buf.push('\u{FFFD}');
                    lone = true;
                    self.lone = true;
                }
            }
        }
        Ok((
            JStr {
                s: Cow::Owned(out.unwrap_or_default()),
                lone,
            },
            end,
        ))
    }

    fn object(&mut self, mut idx: usize) -> PR<(J<'a>, usize)> {
        let b = self.b;
        let mut obj = Obj::new();
        idx = self.skip_ws(idx);
        if !self.at(idx, b'}') {
            loop {
                if !self.at(idx, b'"') {
                    return Err(ParseErr::Syntax(
                        "Expecting property name enclosed in double quotes",
                        idx,
                    )
                    .into());
                }
                let (key, next) = self.string(idx + 1)?;
                idx = self.skip_ws(next);
                if !self.at(idx, b':') {
                    return Err(ParseErr::Syntax("Expecting ':' delimiter", idx).into());
                }
                idx = self.skip_ws(idx + 1);
                let (val, next) = self.value(idx)?;
                obj.insert(key, val);
                idx = self.skip_ws(next);
                if self.at(idx, b'}') {
                    break;
                }
                if !self.at(idx, b',') {
                    return Err(ParseErr::Syntax("Expecting ',' delimiter", idx).into());
                }
                let comma = idx;
                idx = self.skip_ws(idx + 1);
                if self.trailing_comma_msgs && self.at(idx, b'}') {
                    return Err(ParseErr::Syntax(
                        "Illegal trailing comma before end of object",
                        comma,
                    )
                    .into());
                }
            }
        }
        let _ = b;
        Ok((J::Obj(obj), idx + 1))
    }

    fn array(&mut self, mut idx: usize) -> PR<(J<'a>, usize)> {
        let mut items = Vec::new();
        idx = self.skip_ws(idx);
        if !self.at(idx, b']') {
            loop {
                let (val, next) = self.value(idx)?;
                items.push(val);
                idx = self.skip_ws(next);
                if self.at(idx, b']') {
                    break;
                }
                if !self.at(idx, b',') {
                    return Err(ParseErr::Syntax("Expecting ',' delimiter", idx).into());
                }
                let comma = idx;
                idx = self.skip_ws(idx + 1);
                if self.trailing_comma_msgs && self.at(idx, b']') {
                    return Err(ParseErr::Syntax(
                        "Illegal trailing comma before end of array",
                        comma,
                    )
                    .into());
                }
            }
        }
        Ok((J::Arr(items), idx + 1))
    }
}

/// Scan options: what the reference's interpreter does.
#[derive(Clone, Copy)]
pub struct Opts {
    /// Deeper nesting is `ParseErr::TooDeep` (the reference decides).
    pub max_depth: usize,
    /// sys.get_int_max_str_digits() (0: no limit).
    pub max_digits: usize,
    /// CPython 3.13+ reports a trailing comma as such.
    pub trailing_comma_msgs: bool,
}

/// json.loads(text) for a `str` (BOM already removed): the tree, and whether an unpaired
/// surrogate was read anywhere.
pub fn parse(text: &str, opts: Opts) -> Result<(J<'_>, bool), ParseErr> {
    if text.starts_with('\u{FEFF}') {
        return Err(ParseErr::Syntax(
            "Unexpected UTF-8 BOM (decode using utf-8-sig)",
            0,
        ));
    }
    let mut sc = Scanner {
        s: text,
        b: text.as_bytes(),
        depth: 0,
        max_depth: opts.max_depth,
        max_digits: opts.max_digits,
        trailing_comma_msgs: opts.trailing_comma_msgs,
        lone: false,
    };
    let start = sc.skip_ws(0);
    let (doc, end) = match sc.value(start) {
        Ok(x) => x,
        Err(E::Stop(at)) => return Err(ParseErr::Syntax("Expecting value", at)),
        Err(E::Err(e)) => return Err(e),
    };
    let end = sc.skip_ws(end);
    if end != text.len() {
        return Err(ParseErr::Syntax("Extra data", end));
    }
    Ok((doc, sc.lone))
}

/// Why OTLP JSON bytes give no request: the reference decides (nested deeper than
/// `Opts::max_depth`), or the reference's error message (what follows "<source>: ").
pub enum DocErr {
    Delegate,
    Bad(String),
}

/// json_decode.decode_json up to the wire structures: UTF-8 (an optional BOM dropped), the
/// scan, the unpaired-surrogate check, the walk; `f` gets the request. The tree borrows the
/// scanned document, hence the callback. `repr` renders attribute keys in messages.
pub fn with_request<T, F>(
    data: &[u8],
    opts: Opts,
    repr: &dyn Fn(&str) -> String,
    f: F,
) -> Result<T, DocErr>
where
    F: for<'t> FnOnce(&'t [ResourceSpans<'t>]) -> T,
{
    let text = match std::str::from_utf8(data) {
        Ok(t) => t,
        Err(e) => {
            return Err(DocErr::Bad(format!(
                "JSON is not valid UTF-8 (byte offset {})",
                e.valid_up_to()
            )))
        }
    };
    let text = text.strip_prefix('\u{FEFF}').unwrap_or(text);
    let (doc, lone) = match parse(text, opts) {
        Ok(x) => x,
        Err(ParseErr::TooDeep) => return Err(DocErr::Delegate),
        Err(ParseErr::TooLarge) => {
            return Err(DocErr::Bad("invalid JSON: number too large".to_string()))
        }
        Err(ParseErr::Syntax(msg, pos)) => {
            let (line, col) = line_col(text, pos);
            return Err(DocErr::Bad(format!(
                "invalid JSON at line {} column {}: {}",
                line, col, msg
            )));
        }
    };
    if lone && has_lone(&doc) {
        return Err(DocErr::Bad(
            "invalid JSON: string with an unpaired surrogate escape".to_string(),
        ));
    }
    let top = match &doc {
        J::Obj(o) => o,
        other => {
            return Err(DocErr::Bad(format!(
                "top-level JSON value is not an object ({})",
                json_type(other)
            )))
        }
    };
    let tree = Walk { repr }.request(top).map_err(DocErr::Bad)?;
    Ok(f(&tree))
}

/// JSONDecodeError's "line L column C" for a byte offset (both count characters).
pub fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let before = &text.as_bytes()[..pos.min(text.len())];
    let line = before.iter().filter(|&&c| c == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&c| c == b'\n')
        .map_or(0, |i| i + 1);
    let col = before[line_start..]
        .iter()
        .filter(|&&c| c & 0xC0 != 0x80)
        .count()
        + 1;
    (line, col)
}

/// Is an unpaired surrogate left anywhere in the document (keys included)?
pub fn has_lone(j: &J<'_>) -> bool {
    match j {
        J::Str(s) => s.lone,
        J::Arr(items) => items.iter().any(has_lone),
        J::Obj(o) => o.items.iter().any(|(k, v)| k.lone || has_lone(v)),
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Python renderings used in messages
// ---------------------------------------------------------------------------------------------

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

fn dump_str(s: &str, out: &mut String) {
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
fn dump(x: &J<'_>, out: &mut String, cap: usize) {
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
fn show(x: &J<'_>) -> String {
    let mut text = String::new();
    dump(x, &mut text, 41);
    if text.len() <= 40 {
        text
    } else {
        format!("{}...", &text[..37])
    }
}

fn enum_like(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 40
        && b[0].is_ascii_uppercase()
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_')
}

/// json_decode._show_payload: free text is never quoted, only its length given.
fn show_payload(x: &J<'_>) -> String {
    match x {
        J::Str(s) if !enum_like(&s.s) => format!("a string of {} characters", s.s.chars().count()),
        _ => show(x),
    }
}

// ---------------------------------------------------------------------------------------------
// The walk (json_decode.decode_json), producing wire structures
// ---------------------------------------------------------------------------------------------

pub const MAX_VALUE_DEPTH: usize = 64;

const SPAN_KINDS: &[(&str, i32)] = &[
    ("SPAN_KIND_UNSPECIFIED", 0),
    ("SPAN_KIND_INTERNAL", 1),
    ("SPAN_KIND_SERVER", 2),
    ("SPAN_KIND_CLIENT", 3),
    ("SPAN_KIND_PRODUCER", 4),
    ("SPAN_KIND_CONSUMER", 5),
];
const STATUS_CODES: &[(&str, i32)] = &[
    ("STATUS_CODE_UNSET", 0),
    ("STATUS_CODE_OK", 1),
    ("STATUS_CODE_ERROR", 2),
];

/// The enum tables, for the test that compares them with the protobuf descriptors.
pub type EnumTable = Vec<(&'static str, i32)>;

pub fn enum_tables() -> (EnumTable, EnumTable) {
    (SPAN_KINDS.to_vec(), STATUS_CODES.to_vec())
}

type Bad = String;
type R<T> = Result<T, Bad>;

/// An integer's value, or only its sign when it does not fit 127 bits.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum N {
    NegHuge,
    V(i128),
    PosHuge,
}

fn int_text(t: &str) -> N {
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
fn int_str(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.len() <= 20 && d.bytes().all(|c| c.is_ascii_digit())
}

fn float_int(f: f64) -> Option<N> {
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
fn nn<'t, 'a>(x: Option<&'t J<'a>>) -> Option<&'t J<'a>> {
    match x {
        Some(J::Null) | None => None,
        v => v,
    }
}

fn get<'t, 'a>(o: &'t Obj<'a>, key: &str) -> Option<&'t J<'a>> {
    nn(o.get(key))
}

/// json_decode._get: the camelCase key, else the snake_case one.
fn get2<'t, 'a>(o: &'t Obj<'a>, camel: &str, snake: &str) -> Option<&'t J<'a>> {
    get(o, camel).or_else(|| get(o, snake))
}

fn jint(x: Option<&J<'_>>, name: &str, lo: i128, hi: i128, shown: bool) -> R<i128> {
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

fn uint64(x: Option<&J<'_>>, name: &str) -> R<u64> {
    jint(x, name, 0, u64::MAX as i128, true).map(|v| v as u64)
}

fn jenum(x: Option<&J<'_>>, names: &[(&str, i32)], name: &str) -> R<i32> {
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

fn jstr<'t>(x: Option<&'t J<'_>>, name: &str) -> R<&'t str> {
    match x {
        None => Ok(""),
        Some(J::Str(s)) => Ok(&s.s),
        Some(other) => Err(format!("{} is not a string ({})", name, json_type(other))),
    }
}

fn jlist<'t, 'a>(x: Option<&'t J<'a>>, name: &str) -> R<&'t [J<'a>]> {
    match x {
        None => Ok(&[]),
        Some(J::Arr(items)) => Ok(items),
        Some(other) => Err(format!("{} is not a list ({})", name, json_type(other))),
    }
}

fn jobj<'t, 'a>(x: Option<&'t J<'a>>, name: &str) -> R<Option<&'t Obj<'a>>> {
    match x {
        None => Ok(None),
        Some(J::Obj(o)) => Ok(Some(o)),
        Some(other) => Err(format!("{} is not an object ({})", name, json_type(other))),
    }
}

fn opt_id(x: Option<&J<'_>>, nbytes: usize, name: &str) -> R<Option<Vec<u8>>> {
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

fn req_id(x: Option<&J<'_>>, nbytes: usize, name: &str) -> R<Vec<u8>> {
    match opt_id(x, nbytes, name)? {
        Some(v) => Ok(v),
        None => Err(match x {
            None => format!("missing {}", name),
            Some(J::Str(s)) if s.s.is_empty() => format!("missing {}", name),
            _ => format!("{} is all zeros (invalid)", name),
        }),
    }
}

fn b64val(c: u8) -> Option<u8> {
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
fn b64decode(x: &str) -> Option<Vec<u8>> {
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
fn float_str(t: &str) -> bool {
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
fn scope_spans_of<'t, 'a>(rs: &'t Obj<'a>) -> R<&'t [J<'a>]> {
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
