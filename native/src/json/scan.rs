//! The scanner (CPython 3.11 Modules/_json.c): text to tree, with `json.loads`' messages and positions.

use super::*;

pub enum ParseErr {
    /// json.JSONDecodeError(msg, doc, pos); `pos` is a byte offset into the text.
    Syntax(&'static str, usize),
    /// ValueError from int(): more digits than the int string conversion limit.
    TooLarge,
    /// Nested deeper than the caller's limit: the reference decides.
    TooDeep,
}

pub(super) enum E {
    Err(ParseErr),
    /// StopIteration(pos): becomes "Expecting value" at pos at the top.
    Stop(usize),
}

impl From<ParseErr> for E {
    fn from(e: ParseErr) -> Self {
        E::Err(e)
    }
}

pub(super) type PR<T> = Result<T, E>;

pub(super) struct Scanner<'a> {
    s: &'a str,
    b: &'a [u8],
    depth: usize,
    max_depth: usize,
    max_digits: usize,
    trailing_comma_msgs: bool,
    lone: bool,
}

#[inline]
pub(super) fn ws(c: u8) -> bool {
    c == b' ' || c == b'\t' || c == b'\n' || c == b'\r'
}

pub(super) fn hexval(c: u8) -> Option<u32> {
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
