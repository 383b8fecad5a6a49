//! Similarity sketches (detectors/sketch.py states the rule; this is it byte for byte).

use super::contract::{pick, without_attempt_args};
use super::*;

const K: usize = 32; // hashes a sketch keeps (detectors/similarity.py K)
const MAX_RESULT_ITEMS: usize = 32;
const MAX_FEATURES: usize = 4096;
const MAX_DEPTH: usize = 64;
const MAX_TEXT: usize = 65536;
const MAX_IDENTIFIER: usize = 64;
const SEED_TAG: &[u8] = b"loopwatch-sketch\x00";
const IDENTITY_TAG: &[u8] = b"\x01identity\x00"; // (no feature starts with 0x01)
const ITEM_KEYS: [&str; 7] = ["url", "link", "href", "uri", "id", "title", "name"];
const ID_WORDS: [&str; 24] = [
    "id",
    "ids",
    "uuid",
    "guid",
    "key",
    "keys",
    "token",
    "slug",
    "sku",
    "ref",
    "urn",
    "arn",
    "number",
    "cursor",
    "page",
    "offset",
    "tenant",
    "org",
    "organization",
    "account",
    "workspace",
    "namespace",
    "customer",
    "user",
];

/// A feature set: borrowed words and strings where they can be.
type Found<'v> = HashSet<Cow<'v, [u8]>>;

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

fn add_words<'v>(text: &'v [u8], found: &mut Found<'v>) {
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
        let word = &text[start..i];
        found.insert(if upper {
            Cow::Owned(word.to_ascii_lowercase())
        } else {
            Cow::Borrowed(word)
        });
    }
}

const SPACE: [u8; 6] = [b' ', b'\t', b'\n', b'\r', 0x0b, 0x0c];

fn is_url(b: &[u8]) -> bool {
    (b.starts_with(b"http://") || b.starts_with(b"https://"))
        && !b.iter().any(|c| SPACE.contains(c))
}

/// A short string without whitespace that is not one plain word (sketch.py `_is_identifier`).
fn is_identifier(b: &[u8]) -> bool {
    !b.is_empty()
        && b.len() <= MAX_IDENTIFIER
        && !b.iter().any(|c| SPACE.contains(c))
        && b.iter().any(|&c| c < 0x80 && !c.is_ascii_alphabetic())
}

/// Whether an argument's key names an identifier (sketch.py `names_identifier`).
pub(super) fn names_identifier(key: &str) -> bool {
    let k = key.as_bytes();
    let end = k.len();
    let mut i = end;
    while i > 0 && k[i - 1].is_ascii_alphabetic() {
        i -= 1;
        if k[i].is_ascii_uppercase() && i > 0 && k[i - 1].is_ascii_lowercase() {
            break;
        }
    }
    if i == end {
        return false;
    }
    let word = key[i..end].to_ascii_lowercase();
    ID_WORDS.contains(&word.as_str())
}

/// Numbers, booleans and null as JSON writes them: their words.
fn add_scalar(v: &V<'_>, found: &mut Found<'_>) {
    if matches!(v, V::Bytes(_)) || matches!(v, V::Float(f) if !f.is_finite()) {
        return;
    }
    let mut text = Vec::new();
    if canonical(v, &mut text, 0).is_ok() {
        let mut words = HashSet::default();
        add_words(&text, &mut words);
        found.extend(words.into_iter().map(|w| Cow::Owned(w.into_owned())));
    }
}

/// A value's features into `found`, in order (sketch.py `_walk_value`); false once it holds
/// MAX_FEATURES (stop walking).
fn walk<'v>(v: &'v V<'_>, depth: usize, found: &mut Found<'v>) -> bool {
    match v {
        V::Str(s) => {
            let b = s.as_bytes();
            if is_url(b) {
                // a URL names one resource: one feature, not its words
                found.insert(Cow::Borrowed(head(b)));
            } else {
                add_words(b, found);
                if is_identifier(b) {
                    let mut whole = Vec::with_capacity(b.len() + 1);
                    whole.push(0);
                    whole.extend_from_slice(b);
                    found.insert(Cow::Owned(whole));
                }
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
        scalar => add_scalar(scalar, found),
    }
    found.len() < MAX_FEATURES
}

pub(super) fn features<'v>(v: &'v V<'_>) -> Found<'v> {
    let mut found = HashSet::default();
    walk(v, 0, &mut found);
    found
}

/// A call's arguments, object keys sorted (sketch.py `_walk_args`): what names a record into
/// `identity` as [path, value] (when given), the features of the rest into `found` (when
/// given); false once `found` holds MAX_FEATURES.
fn walk_args<'v, 'a>(
    v: &'v V<'a>,
    depth: usize,
    path: &mut Vec<V<'a>>,
    cursor: Option<&str>,
    found: &mut Option<&mut Found<'v>>,
    identity: &mut Option<&mut Vec<V<'a>>>,
) -> bool {
    match v {
        V::Str(s) => {
            let b = s.as_bytes();
            if is_url(b) || is_identifier(b) {
                if let Some(out) = identity {
                    out.push(V::List(vec![V::List(path.clone()), v.clone()]));
                }
            } else if let Some(f) = found {
                add_words(b, f);
            }
        }
        V::Dict(d) => {
            if depth < MAX_DEPTH {
                let mut keys: Vec<&(Cow<'a, str>, V<'a>)> = d.iter().collect();
                keys.sort_by(|x, y| x.0.as_bytes().cmp(y.0.as_bytes()));
                for (key, item) in keys {
                    path.push(V::Str(key.clone()));
                    let go_on =
                        if names_identifier(key) || (depth == 0 && Some(key.as_ref()) == cursor) {
                            if let Some(out) = identity {
                                out.push(V::List(vec![V::List(path.clone()), item.clone()]));
                            }
                            true
                        } else {
                            walk_args(item, depth + 1, path, cursor, found, identity)
                        };
                    path.pop();
                    if !go_on {
                        return false;
                    }
                }
            }
            return true;
        }
        V::List(items) => {
            if depth < MAX_DEPTH {
                for (i, item) in items.iter().enumerate() {
                    path.push(V::Int(i as i64));
                    let go_on = walk_args(item, depth + 1, path, cursor, found, identity);
                    path.pop();
                    if !go_on {
                        return false;
                    }
                }
            }
            return true;
        }
        scalar => {
            if let Some(f) = found {
                add_scalar(scalar, f);
            }
        }
    }
    match found {
        Some(f) => f.len() < MAX_FEATURES,
        None => true,
    }
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

fn hex8(out: &mut String, h: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..8).rev() {
        out.push(HEX[((h >> (4 * shift)) & 15) as usize] as char);
    }
}

/// The arguments the contract names as the call's identity, sorted (sketch.py
/// `_declared_identity`); None when it names none.
fn declared_identity(c: Option<&Contract>) -> Option<Vec<String>> {
    let c = c?;
    if c.identity.is_none() && c.business_identity.is_none() {
        return None;
    }
    let mut names: Vec<String> = c
        .identity
        .iter()
        .chain(c.business_identity.iter())
        .flatten()
        .cloned()
        .collect();
    if let Some(cursor) = &c.cursor_arg {
        names.push(cursor.clone());
    }
    names.sort();
    names.dedup();
    Some(names)
}

impl SpanPath {
    /// A feature set's sketch: its K least hashes, distinct, ascending ("" for none).
    pub(super) fn sketch_of(&self, features: &Found<'_>) -> Option<String> {
        let mut hashes = features
            .iter()
            .map(|f| self.feature_hash(f))
            .collect::<Vec<_>>();
        hashes.sort_unstable();
        hashes.dedup();
        let mut out = String::with_capacity(8 * hashes.len().min(K));
        for h in hashes.into_iter().take(K) {
            hex8(&mut out, h);
        }
        Some(out)
    }

    pub(super) fn sketch_value(&self, v: &V<'_>) -> Option<String> {
        self.sketch_of(&features(v))
    }

    /// (sketch, item hashes) of a tool result: items when it lists 2 or more, and then no
    /// sketch (it is compared by its items).
    pub(super) fn sketch_result(&self, result: &V<'_>) -> R<(Option<String>, String)> {
        let hashes = self.result_items(result)?;
        if hashes.len() >= 2 {
            let mut short = String::with_capacity(8 * MAX_RESULT_ITEMS);
            for &h in hashes.iter().take(MAX_RESULT_ITEMS) {
                hex8(&mut short, h);
            }
            return Ok((None, short));
        }
        Ok((self.sketch_value(result), String::new()))
    }

    fn feature_hash(&self, feature: &[u8]) -> u32 {
        let mut h = self.sketch_base.clone();
        h.update(feature);
        let d = h.finish();
        u32::from_be_bytes([d[0], d[1], d[2], d[3]])
    }

    /// An item's name as canonical JSON, hashed (Hard where Python uses repr).
    fn item_hash(&self, name: &V<'_>) -> R<u32> {
        let mut text = Vec::new();
        canonical(name, &mut text, 0)?;
        Ok(self.feature_hash(&text))
    }

    fn result_items(&self, result: &V<'_>) -> R<Vec<u32>> {
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

    /// (sketch of the argument features, identity digest) of a tool call (sketch.py
    /// `call_view`, then the digest of its identity pairs).
    pub(super) fn sketch_call<'a>(
        &self,
        py: Python<'_>,
        args: &[(Cow<'a, str>, V<'a>)],
        contract: Option<&Contract>,
        sim: &Sim,
    ) -> R<(Option<String>, Option<String>)> {
        let merged = self.contract_args(py, args, contract)?;
        let mut identity: Vec<V<'a>> = Vec::new();
        let sketch;
        if let Some(declared) = declared_identity(contract) {
            let mut compared = match &sim.arguments {
                Some(names) => pick(&merged, names),
                None => {
                    let mut m = merged.clone();
                    if let Some(c) = contract {
                        without_attempt_args(&mut m, c);
                    }
                    m
                }
            };
            compared.retain(|(k, _)| !declared.iter().any(|d| d == k));
            let compared = V::Dict(compared);
            sketch = self.sketch_of(&features(&compared));
            for name in &declared {
                let value = merged
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
                    .unwrap_or(V::None);
                identity.push(V::List(vec![
                    V::List(vec![V::Str(Cow::Owned(name.clone()))]),
                    value,
                ]));
            }
        } else {
            let key = contract.and_then(|c| c.idempotency_key_arg.as_deref());
            let cursor = contract.and_then(|c| c.cursor_arg.as_deref());
            let mut domain = merged.clone();
            if let Some(k) = key {
                domain.retain(|(x, _)| x != k);
            }
            let domain = V::Dict(domain);
            let mut found: Found<'_> = HashSet::default();
            let mut path = Vec::new();
            match &sim.arguments {
                None => {
                    walk_args(
                        &domain,
                        0,
                        &mut path,
                        cursor,
                        &mut Some(&mut found),
                        &mut Some(&mut identity),
                    );
                    sketch = self.sketch_of(&found);
                }
                Some(names) => {
                    walk_args(
                        &domain,
                        0,
                        &mut path,
                        cursor,
                        &mut None,
                        &mut Some(&mut identity),
                    );
                    let picked = V::Dict(pick(&merged, names));
                    walk_args(
                        &picked,
                        0,
                        &mut path,
                        cursor,
                        &mut Some(&mut found),
                        &mut None,
                    );
                    sketch = self.sketch_of(&found);
                }
            }
        }
        let digest = if identity.is_empty() {
            None
        } else {
            let mut text = IDENTITY_TAG.to_vec();
            canonical(&V::List(identity), &mut text, 0)?;
            let mut h = self.sketch_base.clone();
            h.update(&text);
            let d = h.finish();
            let mut out = String::with_capacity(16);
            hex8(&mut out, u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
            hex8(&mut out, u32::from_be_bytes([d[4], d[5], d[6], d[7]]));
            Some(out)
        };
        Ok((sketch, digest))
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
