//! Similarity sketches (streams/spanpath/sketch.py states the rule; this is it byte for byte).

use super::contract::{drop_attempt_args, pick};
use super::*;

const BINS: usize = 16;
const MAX_RESULT_ITEMS: usize = 32;
const MAX_FEATURES: usize = 4096;
const MAX_DEPTH: usize = 64;
const MAX_TEXT: usize = 65536;
const SEED_TAG: &[u8] = b"loopwatch-sketch\x00";
const RANK_MASK: u64 = (1u64 << 60) - 1;
const ITEM_KEYS: [&str; 7] = ["url", "link", "href", "uri", "id", "title", "name"];

/// Near-duplicate settings the span path needs (the policy's, or a tool's over it).
#[derive(Clone)]
pub(super) struct Sim {
    pub(super) enabled: bool,
    pub(super) arguments: Option<Vec<String>>,
    pub(super) result_items: bool,
}

/// What names an item (sketch.py `_item_name`): an object's first string or integer among
/// ITEM_KEYS, a string's first URL, else the item itself.
fn item_name<'v, 'a>(item: &'v V<'a>) -> Cow<'v, V<'a>> {
    match item {
        V::Dict(d) => {
            for key in ITEM_KEYS {
                if let Some((_, x)) = d.iter().find(|(k, _)| k == key) {
                    if matches!(x, V::Str(_) | V::Int(_) | V::Big(_)) {
                        return Cow::Borrowed(x);
                    }
                }
            }
            Cow::Borrowed(item)
        }
        V::Str(s) => match urls(s, 1).into_iter().next() {
            Some(u) => Cow::Owned(V::Str(Cow::Owned(u))),
            None => Cow::Borrowed(item),
        },
        _ => Cow::Borrowed(item),
    }
}

/// SHA-256 after the 64-byte seed block: each feature's hash starts from a copy.
pub(super) fn sketch_base(key: Option<&[u8]>) -> Sha256 {
    let mut h = Sha256::new();
    h.update(SEED_TAG);
    h.update(key.unwrap_or(b""));
    let seed = h.finish();
    let mut base = Sha256::new();
    base.update(&seed);
    base.update(&seed);
    base
}

fn head(raw: &[u8]) -> &[u8] {
    if raw.len() <= MAX_TEXT {
        return raw;
    }
    let mut cut = MAX_TEXT;
    while cut > 0 && raw[cut] & 0xC0 == 0x80 {
        cut -= 1;
    }
    &raw[..cut]
}

#[inline]
fn is_word(b: u8) -> bool {
    b.is_ascii_digit() || b.is_ascii_lowercase() || b.is_ascii_uppercase() || b >= 0x80
}

fn add_words<'v>(text: &'v [u8], found: &mut HashSet<Cow<'v, [u8]>>) {
    let text = head(text);
    let mut i = 0;
    while i < text.len() {
        if !is_word(text[i]) {
            i += 1;
            continue;
        }
        let start = i;
        let mut upper = false;
        while i < text.len() && is_word(text[i]) {
            upper |= text[i].is_ascii_uppercase();
            i += 1;
        }
        if i - start >= 2 {
            let word = &text[start..i];
            found.insert(if upper {
                Cow::Owned(word.to_ascii_lowercase())
            } else {
                Cow::Borrowed(word)
            });
        }
    }
}

/// Walks a value's strings and scalars (at most MAX_DEPTH deep, in order) into `found`
/// until it holds MAX_FEATURES; false once it does (stop walking).
fn walk<'v>(v: &'v V<'_>, depth: usize, found: &mut HashSet<Cow<'v, [u8]>>) -> bool {
    match v {
        V::Str(s) => {
            let b = s.as_bytes();
            if (b.starts_with(b"http://") || b.starts_with(b"https://"))
                && !b
                    .iter()
                    .any(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c))
            {
                // a URL names one resource: one feature, not its words
                found.insert(Cow::Borrowed(head(b)));
            } else {
                add_words(b, found);
            }
        }
        V::List(items) => {
            if depth < MAX_DEPTH {
                for x in items {
                    if !walk(x, depth + 1, found) {
                        return false;
                    }
                }
            }
            return true;
        }
        V::Dict(d) => {
            if depth < MAX_DEPTH {
                for (_, x) in d {
                    if !walk(x, depth + 1, found) {
                        return false;
                    }
                }
            }
            return true;
        }
        V::Bytes(_) => return true,
        V::Float(f) if !f.is_finite() => return true,
        scalar => {
            // numbers, booleans and null as JSON writes them
            let mut text = Vec::new();
            if canonical(scalar, &mut text, 0).is_ok() {
                let mut words = HashSet::default();
                add_words(&text, &mut words);
                found.extend(words.into_iter().map(|w| Cow::Owned(w.into_owned())));
            }
        }
    }
    found.len() < MAX_FEATURES
}

pub(super) fn features<'v>(v: &'v V<'_>) -> HashSet<Cow<'v, [u8]>> {
    let mut found = HashSet::default();
    walk(v, 0, &mut found);
    found
}

/// The first `limit` distinct URLs in a text, in order.
pub(super) fn urls(text: &str, limit: usize) -> Vec<String> {
    let raw = text.as_bytes();
    if !raw.windows(4).any(|w| w == b"http") {
        return Vec::new();
    }
    let raw = head(raw);
    let stop = |b: u8| {
        matches!(
            b,
            b' ' | b'\t'
                | b'\n'
                | b'\r'
                | 0x0b
                | 0x0c
                | b'<'
                | b'>'
                | b'"'
                | b'\''
                | b'`'
                | b'('
                | b')'
                | b'['
                | b']'
                | b'{'
                | b'}'
                | b'|'
                | b'\\'
                | b'^'
        )
    };
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let rest = &raw[i..];
        let scheme = if rest.starts_with(b"https://") {
            8
        } else if rest.starts_with(b"http://") {
            7
        } else {
            i += 1;
            continue;
        };
        let mut j = i + scheme;
        while j < raw.len() && !stop(raw[j]) {
            j += 1;
        }
        if j == i + scheme {
            i += 1; // nothing after the scheme: no match here
            continue;
        }
        let mut end = j;
        while end > i && b".,;:!?".contains(&raw[end - 1]) {
            end -= 1;
        }
        if end - i > 8 {
            let url = String::from_utf8_lossy(&raw[i..end]).into_owned();
            if !out.contains(&url) {
                out.push(url);
                if out.len() >= limit {
                    break;
                }
            }
        }
        i = j;
    }
    out
}

/// The sketch of 64-bit feature hashes: per bin (top 4 bits) the least rank (the rest).
fn bins(hashes: &[u64]) -> String {
    let mut mins = [u64::MAX; BINS];
    for value in hashes {
        let bin = (value >> 60) as usize;
        let rank = value & RANK_MASK;
        if rank < mins[bin] {
            mins[bin] = rank;
        }
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * BINS);
    for m in mins {
        let byte = if m == u64::MAX {
            0
        } else {
            (m % 255 + 1) as usize
        };
        out.push(HEX[byte >> 4] as char);
        out.push(HEX[byte & 15] as char);
    }
    out
}

impl SpanPath {
    pub(super) fn sketch_of(&self, features: &HashSet<Cow<'_, [u8]>>) -> Option<String> {
        let hashes = features
            .iter()
            .map(|f| self.feature_hash(f))
            .collect::<Vec<_>>();
        Some(bins(&hashes)) // no features: all zeros, equal to any other without
    }

    pub(super) fn sketch_value(&self, v: &V<'_>) -> Option<String> {
        self.sketch_of(&features(v))
    }

    /// (sketch, item hashes) of a tool result: over its items when it lists 2 or more.
    pub(super) fn sketch_result(&self, result: &V<'_>) -> R<(Option<String>, String)> {
        let hashes = self.result_items(result)?;
        if hashes.len() >= 2 {
            let mut short = String::with_capacity(8 * MAX_RESULT_ITEMS);
            for h in hashes.iter().take(MAX_RESULT_ITEMS) {
                short.push_str(&format!("{:08x}", h >> 32));
            }
            return Ok((Some(bins(&hashes)), short));
        }
        Ok((self.sketch_value(result), String::new()))
    }

    fn feature_hash(&self, feature: &[u8]) -> u64 {
        let mut h = self.sketch_base.clone();
        h.update(feature);
        let d = h.finish();
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(&d[..8]);
        u64::from_be_bytes(b8)
    }

    /// An item's name as canonical JSON, hashed (Hard where Python uses repr).
    fn item_hash(&self, name: &V<'_>) -> R<u64> {
        let mut text = Vec::new();
        canonical(name, &mut text, 0)?;
        Ok(self.feature_hash(&text))
    }

    fn result_items(&self, result: &V<'_>) -> R<Vec<u64>> {
        let listed: Option<&Vec<V<'_>>> = match result {
            V::List(items) => Some(items),
            V::Dict(d) => d.iter().find_map(|(_, x)| match x {
                V::List(items) if !items.is_empty() => Some(items),
                _ => None,
            }),
            _ => None,
        };
        if let Some(items) = listed {
            let mut out = Vec::with_capacity(items.len().min(MAX_ITEMS));
            for item in items.iter().take(MAX_ITEMS) {
                out.push(self.item_hash(item_name(item).as_ref())?);
            }
            return Ok(out);
        }
        if let V::Str(s) = result {
            let mut out = Vec::new();
            for u in urls(s, MAX_ITEMS) {
                out.push(self.item_hash(&V::Str(Cow::Owned(u)))?);
            }
            return Ok(out);
        }
        Ok(Vec::new())
    }

    /// The arguments a near-duplicate comparison reads (contract.py `similar_args`).
    pub(super) fn similar_args<'a>(
        &self,
        py: Python<'_>,
        args: &[(Cow<'a, str>, V<'a>)],
        contract: Option<&Contract>,
        sim: &Sim,
    ) -> R<V<'a>> {
        let merged = self.contract_args(py, args, contract)?;
        if let Some(names) = &sim.arguments {
            return Ok(V::Dict(pick(&merged, names)));
        }
        let mut merged = merged;
        if let Some(c) = contract {
            drop_attempt_args(&mut merged, c);
        }
        Ok(V::Dict(merged))
    }

    /// The last message a model turn read (calls.py `last_input_message`).
    pub(super) fn last_input_message<'s, 'a>(&self, f: &Facts<'s, 'a>) -> R<Option<V<'a>>> {
        if let Some(raw) = f.view[F_MODEL_INPUT] {
            let doc = match as_json(raw)? {
                V::Dict(d) => match d.into_iter().find(|(k, _)| k == "messages") {
                    Some((_, x)) => x,
                    None => V::None,
                },
                other => other,
            };
            if let V::List(mut items) = doc {
                if let Some(last) = items.pop() {
                    return Ok(Some(last));
                }
            }
        }
        let mut last: i64 = -1;
        let mut found: Option<&V<'a>> = None;
        for (key, _) in &f.span.attrs {
            let index = if let Some(rest) = key.strip_prefix("llm.input_messages.") {
                rest.strip_suffix(".message.content")
            } else if let Some(rest) = key.strip_prefix("gen_ai.prompt.") {
                rest.strip_suffix(".content")
            } else {
                None
            };
            if let Some(n) = index {
                if !n.is_empty() && n.len() < 10 && n.bytes().all(|b| b.is_ascii_digit()) {
                    let n: i64 = n.parse().unwrap_or(-1);
                    if n > last {
                        last = n;
                        found = aget(&f.span.attrs, key);
                    }
                }
            }
        }
        Ok(found.cloned())
    }
}
