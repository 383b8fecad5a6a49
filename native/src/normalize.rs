//! The native normalizer: OTLP protobuf bytes -> steps grouped by run, the same steps as
//! `group_steps(Normalizer(policy, fp), decode_proto(data))` (streams/spanpath/normalize.py is the
//! reference; tests/unit/test_native_normalize.py compares the two).
//!
//! The policy arrives once, as the JSON spec of streams/spanpath/native_spec.py. Regular expressions
//! (transient message patterns, termination message patterns) are Python `re` patterns,
//! compiled from the spec's pattern text and called for the few spans that carry an error
//! or status message, so they match exactly as the reference does.
//!
//! A batch where anything needs Python's own decision (see pyval.rs: `Hard`), or that the
//! Python decoder would reject, answers None: the caller runs the Python path on it, which
//! gives the reference's result or error by construction.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{HashMap as StdHashMap, HashSet as StdHashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// FxHash (rustc's): attribute keys and rule values are short strings looked up per span;
/// SipHash's flooding resistance buys nothing for keys that come from the policy.
#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl Hasher for Fx {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut h = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            h = (h.rotate_left(5) ^ u64::from_le_bytes(a)).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            h = (h.rotate_left(5) ^ b as u64).wrapping_mul(K);
        }
        self.0 = h;
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0 = (self.0.rotate_left(5) ^ i as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type HashMap<K, V> = StdHashMap<K, V, BuildHasherDefault<Fx>>;
type HashSet<K> = StdHashSet<K, BuildHasherDefault<Fx>>;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::digest::Sha256;
use crate::pyval::{
    as_json, canonical, crc32, dict_set, ident_text, loads, py_int, py_lower, py_split, py_str,
    py_strip, repr_into, repr_str_into, Hard, PyInt, R, V,
};
use crate::wire::{self, Kv, Val};

// Field indices: the recognition FIELDS (detectors/recognition.py) then the policy's own.
const FIELDS: [&str; 24] = [
    "operation",
    "span_kind",
    "tool_name",
    "call_id",
    "arguments",
    "result",
    "error_type",
    "error_message",
    "prompt_version",
    "tool_version",
    "agent_name",
    "conversation",
    "input_tokens",
    "output_tokens",
    "handoff_from",
    "handoff_to",
    "plan_steps",
    "output_messages",
    "requested_calls",
    "finish_reason",
    "metadata",
    "sequence",
    "task_type",
    "run_key",
];
const NF: usize = FIELDS.len();
const F_TOOL_NAME: usize = 2;
const F_CALL_ID: usize = 3;
const F_ARGUMENTS: usize = 4;
const F_RESULT: usize = 5;
const F_ERROR_TYPE: usize = 6;
const F_ERROR_MESSAGE: usize = 7;
const F_PROMPT_VERSION: usize = 8;
const F_TOOL_VERSION: usize = 9;
const F_AGENT_NAME: usize = 10;
const F_CONVERSATION: usize = 11;
const F_INPUT_TOKENS: usize = 12;
const F_OUTPUT_TOKENS: usize = 13;
const F_HANDOFF_FROM: usize = 14;
const F_HANDOFF_TO: usize = 15;
const F_PLAN_STEPS: usize = 16;
const F_OUTPUT_MESSAGES: usize = 17;
const F_REQUESTED_CALLS: usize = 18;
const F_FINISH_REASON: usize = 19;
const F_METADATA: usize = 20;
const F_SEQUENCE: usize = 21;
const F_TASK_TYPE: usize = 22;
const F_RUN_KEY: usize = 23;

/// Step fields in the order this module builds them (checked against detectors.model).
pub const STEP_FIELDS: [&str; 38] = [
    "run_id",
    "trace_id",
    "span_id",
    "parent_span_id",
    "kind",
    "start_ns",
    "end_ns",
    "sequence",
    "content_digest",
    "name",
    "call_id",
    "tool_version",
    "prompt_version",
    "agent_name",
    "service_name",
    "session_id",
    "task_type",
    "action_fp",
    "result_fp",
    "error_code",
    "empty_result",
    "version",
    "state_fp",
    "state_terminal",
    "cursor_fp",
    "item_fps",
    "business_fp",
    "idempotency_fp",
    "from_agent",
    "to_agent",
    "plan_fp",
    "input_tokens",
    "output_tokens",
    "is_root",
    "status_error",
    "termination",
    "guard_ns",
    "wants_tools",
];

const TOOL: &str = "tool";
const HANDOFF: &str = "handoff";
const PLAN: &str = "plan";
const LLM: &str = "llm";
const SUMMARY: &str = "summary";
const AGENT: &str = "agent";
const OTHER: &str = "other";
const STATUS_ERROR: i32 = 2;
const MAX_ITEMS: usize = 64;
const MAX_CODE_LEN: usize = 64;
const MAX_FUTURE_NS: u128 = 24 * 3600 * 1_000_000_000;
const MAX_COUNT: i64 = i64::MAX;

// ------------------------------------------------------------------------------ the spec

enum M {
    All(Vec<M>),
    Any(Vec<M>),
    Not(Box<M>),
    Root(bool),
    Has(Vec<usize>),
    FieldIn(usize, HashSet<String>),
    AttrIn(String, HashSet<String>),
    Name(HashSet<String>),
    NamePrefix(Vec<String>),
    NameSuffix(Vec<String>),
    NameContains(Vec<String>),
    ToolName(HashSet<String>),
    ToolNamePrefix(Vec<String>),
}

#[derive(Clone, Copy, PartialEq)]
enum Fmt {
    GenaiMessages,
    CallList,
    OpenInferenceFlat,
}

struct Source {
    attribute: Option<String>,
    event: Option<String>,
    path: Vec<(String, Option<usize>)>,
    plain: bool,
    format: Option<Fmt>,
    name_after: Option<String>,
    name_before: Option<String>,
    span_name: bool,
    argument: Option<String>,
    tool_name_after: Option<String>,
    when: Option<M>,
}

struct Profile {
    scopes: HashSet<String>,
    scope_prefixes: Vec<String>,
    has_attributes: Vec<String>,
    everything: bool,
    kinds: Vec<(&'static str, M)>,
    keymap: HashMap<String, Vec<(usize, usize)>>, // attribute key -> [(field, rank)]
    derived: Vec<Vec<Source>>,                    // per field
    exception_types: HashMap<String, String>,
    message_patterns: Vec<(Py<PyAny>, String)>,
    finish_reasons: HashMap<String, String>,
}

#[derive(Clone, Copy)]
enum Op {
    Trim,
    Lower,
    Collapse,
}

struct Contract {
    name: String,
    identity: Option<Vec<String>>,
    defaults: Vec<(Cow<'static, str>, V<'static>)>,
    normalize: Vec<(String, Vec<Op>)>,
    version_field: Option<String>,
    state_field: Option<String>,
    terminal_states: HashSet<String>,
    cursor_arg: Option<String>,
    new_items_field: Option<String>,
    side_effect: bool,
    idempotency_key_arg: Option<String>,
    business_identity: Option<Vec<String>>,
}

type SpecErr = String;

fn ve<S: Into<String>>(s: S) -> PyErr {
    PyValueError::new_err(s.into())
}

fn sget<'v>(d: &'v V<'static>, key: &str) -> Result<&'v V<'static>, SpecErr> {
    d.get(key).ok_or_else(|| format!("spec: missing {}", key))
}

fn s_str(v: &V<'static>, what: &str) -> Result<String, SpecErr> {
    v.as_str()
        .map(|s| s.to_string())
        .ok_or_else(|| format!("spec: {} is not a string", what))
}

fn s_opt_str(d: &V<'static>, key: &str) -> Result<Option<String>, SpecErr> {
    match d.get(key) {
        None | Some(V::None) => Ok(None),
        Some(v) => s_str(v, key).map(Some),
    }
}

fn s_strs(v: &V<'static>, what: &str) -> Result<Vec<String>, SpecErr> {
    match v {
        V::List(items) => items.iter().map(|x| s_str(x, what)).collect(),
        _ => Err(format!("spec: {} is not a list", what)),
    }
}

fn s_list<'v>(v: &'v V<'static>, what: &str) -> Result<&'v Vec<V<'static>>, SpecErr> {
    match v {
        V::List(items) => Ok(items),
        _ => Err(format!("spec: {} is not a list", what)),
    }
}

fn s_map(v: &V<'static>, what: &str) -> Result<HashMap<String, String>, SpecErr> {
    match v {
        V::Dict(items) => items
            .iter()
            .map(|(k, x)| Ok((k.to_string(), s_str(x, what)?)))
            .collect(),
        _ => Err(format!("spec: {} is not a mapping", what)),
    }
}

fn field_index(name: &str) -> Result<usize, SpecErr> {
    FIELDS
        .iter()
        .position(|f| *f == name)
        .ok_or_else(|| format!("spec: unknown field {}", name))
}

fn kind_name(k: &str) -> Result<&'static str, SpecErr> {
    Ok(match k {
        "tool" => TOOL,
        "handoff" => HANDOFF,
        "plan" => PLAN,
        "llm" => LLM,
        "summary" => SUMMARY,
        "agent" => AGENT,
        _ => return Err(format!("spec: unknown kind {}", k)),
    })
}

fn parse_matcher(v: &V<'static>) -> Result<M, SpecErr> {
    let items = v.dict().ok_or("spec: a matcher is not a mapping")?;
    if items.len() != 1 {
        return Err("spec: a matcher has one key".into());
    }
    let (key, arg) = &items[0];
    let set = |a: &V<'static>| -> Result<HashSet<String>, SpecErr> {
        Ok(s_strs(a, key)?.into_iter().collect())
    };
    Ok(match key.as_ref() {
        "all" => M::All(
            s_list(arg, "all")?
                .iter()
                .map(parse_matcher)
                .collect::<Result<_, _>>()?,
        ),
        "any" => M::Any(
            s_list(arg, "any")?
                .iter()
                .map(parse_matcher)
                .collect::<Result<_, _>>()?,
        ),
        "not" => M::Not(Box::new(parse_matcher(arg)?)),
        "root" => match arg {
            V::Bool(b) => M::Root(*b),
            _ => return Err("spec: root is not a bool".into()),
        },
        "has" => M::Has(
            s_strs(arg, "has")?
                .iter()
                .map(|f| field_index(f))
                .collect::<Result<_, _>>()?,
        ),
        "field" | "attribute" => {
            let pair = s_list(arg, key)?;
            if pair.len() != 2 {
                return Err("spec: field/attribute is [name, values]".into());
            }
            let name = s_str(&pair[0], key)?;
            let values = set(&pair[1])?;
            if key == "field" {
                M::FieldIn(field_index(&name)?, values)
            } else {
                M::AttrIn(name, values)
            }
        }
        "name" => M::Name(set(arg)?),
        "name_prefix" => M::NamePrefix(s_strs(arg, key)?),
        "name_suffix" => M::NameSuffix(s_strs(arg, key)?),
        "name_contains" => M::NameContains(s_strs(arg, key)?),
        "tool_name" => M::ToolName(set(arg)?),
        "tool_name_prefix" => M::ToolNamePrefix(s_strs(arg, key)?),
        other => return Err(format!("spec: unknown matcher {}", other)),
    })
}

fn parse_source(v: &V<'static>) -> Result<Source, SpecErr> {
    let mut path = Vec::new();
    if let Some(p) = v.get("path") {
        for step in s_list(p, "path")? {
            let pair = s_list(step, "path step")?;
            let key = s_str(&pair[0], "path key")?;
            let index = match &pair[1] {
                V::None => None,
                V::Int(i) if *i >= 0 => Some(*i as usize),
                _ => return Err("spec: path index".into()),
            };
            path.push((key, index));
        }
    }
    let format = match s_opt_str(v, "format")?.as_deref() {
        None => None,
        Some("genai_messages") => Some(Fmt::GenaiMessages),
        Some("call_list") => Some(Fmt::CallList),
        Some("openinference_flat") => Some(Fmt::OpenInferenceFlat),
        Some(other) => return Err(format!("spec: unknown call format {}", other)),
    };
    Ok(Source {
        attribute: s_opt_str(v, "attribute")?,
        event: s_opt_str(v, "event")?,
        path,
        plain: matches!(v.get("plain"), Some(V::Bool(true))),
        format,
        name_after: s_opt_str(v, "name_after")?,
        name_before: s_opt_str(v, "name_before")?,
        span_name: matches!(v.get("span_name"), Some(V::Bool(true))),
        argument: s_opt_str(v, "argument")?,
        tool_name_after: s_opt_str(v, "tool_name_after")?,
        when: match v.get("when") {
            None | Some(V::None) => None,
            Some(m) => Some(parse_matcher(m)?),
        },
    })
}

fn compile_pattern(py: Python<'_>, pattern: &str) -> PyResult<Py<PyAny>> {
    let re = py.import("re")?;
    Ok(re
        .call_method1("compile", (pattern,))?
        .getattr("search")?
        .unbind())
}

fn patterns(py: Python<'_>, v: &V<'static>) -> PyResult<Vec<(Py<PyAny>, String)>> {
    let mut out = Vec::new();
    for pair in s_list(v, "patterns").map_err(ve)? {
        let pair = s_list(pair, "pattern").map_err(ve)?;
        let p = s_str(&pair[0], "pattern").map_err(ve)?;
        let r = s_str(&pair[1], "pattern").map_err(ve)?;
        out.push((compile_pattern(py, &p)?, r));
    }
    Ok(out)
}

fn parse_profile(
    py: Python<'_>,
    v: &V<'static>,
    common: &[(usize, Vec<String>)],
) -> PyResult<Profile> {
    let scopes: HashSet<String> = s_strs(sget(v, "scopes").map_err(ve)?, "scopes")
        .map_err(ve)?
        .into_iter()
        .collect();
    let scope_prefixes = s_strs(sget(v, "scope_prefixes").map_err(ve)?, "x").map_err(ve)?;
    let has_attributes = s_strs(sget(v, "has_attributes").map_err(ve)?, "x").map_err(ve)?;
    let everything = scopes.is_empty() && scope_prefixes.is_empty() && has_attributes.is_empty();
    let mut kinds = Vec::new();
    for rule in s_list(sget(v, "kinds").map_err(ve)?, "kinds").map_err(ve)? {
        let kind =
            kind_name(&s_str(sget(rule, "kind").map_err(ve)?, "kind").map_err(ve)?).map_err(ve)?;
        kinds.push((
            kind,
            parse_matcher(sget(rule, "match").map_err(ve)?).map_err(ve)?,
        ));
    }
    let mut keymap: HashMap<String, Vec<(usize, usize)>> = HashMap::default();
    let keys = sget(v, "keys")
        .map_err(ve)?
        .dict()
        .ok_or_else(|| ve("keys"))?;
    let mut lists: Vec<(usize, Vec<String>)> = Vec::new();
    for (f, ks) in keys {
        lists.push((field_index(f).map_err(ve)?, s_strs(ks, "keys").map_err(ve)?));
    }
    lists.extend(common.iter().cloned());
    for (f, ks) in lists {
        for (rank, k) in ks.into_iter().enumerate() {
            keymap.entry(k).or_default().push((f, rank));
        }
    }
    let mut derived: Vec<Vec<Source>> = (0..NF).map(|_| Vec::new()).collect();
    for (f, sources) in sget(v, "derived")
        .map_err(ve)?
        .dict()
        .ok_or_else(|| ve("derived"))?
    {
        let idx = field_index(f).map_err(ve)?;
        for s in s_list(sources, "sources").map_err(ve)? {
            derived[idx].push(parse_source(s).map_err(ve)?);
        }
    }
    let term = sget(v, "termination").map_err(ve)?;
    Ok(Profile {
        scopes,
        scope_prefixes,
        has_attributes,
        everything,
        kinds,
        keymap,
        derived,
        exception_types: s_map(sget(term, "exception_types").map_err(ve)?, "x").map_err(ve)?,
        message_patterns: patterns(py, sget(term, "message_patterns").map_err(ve)?)?,
        finish_reasons: s_map(sget(term, "finish_reasons").map_err(ve)?, "x").map_err(ve)?,
    })
}

fn parse_contract(name: &str, v: &V<'static>) -> Result<Contract, SpecErr> {
    let opt_strs = |key: &str| -> Result<Option<Vec<String>>, SpecErr> {
        match v.get(key) {
            None | Some(V::None) => Ok(None),
            Some(x) => s_strs(x, key).map(Some),
        }
    };
    let defaults = match sget(v, "defaults")? {
        V::Dict(d) => d.clone(),
        _ => return Err("spec: defaults is not a mapping".into()),
    };
    let mut normalize = Vec::new();
    for (arg, ops) in sget(v, "normalize")?.dict().ok_or("spec: normalize")? {
        let mut list = Vec::new();
        for op in s_strs(ops, "ops")? {
            list.push(match op.as_str() {
                "trim" => Op::Trim,
                "lowercase" => Op::Lower,
                "collapse_whitespace" => Op::Collapse,
                other => return Err(format!("normalization {:?} is not native", other)),
            });
        }
        normalize.push((arg.to_string(), list));
    }
    Ok(Contract {
        name: name.to_string(),
        identity: opt_strs("identity")?,
        defaults,
        normalize,
        version_field: s_opt_str(v, "version_field")?,
        state_field: s_opt_str(v, "state_field")?,
        terminal_states: s_strs(sget(v, "terminal_states")?, "terminal_states")?
            .into_iter()
            .collect(),
        cursor_arg: s_opt_str(v, "cursor_arg")?,
        new_items_field: s_opt_str(v, "new_items_field")?,
        side_effect: matches!(v.get("side_effect"), Some(V::Bool(true))),
        idempotency_key_arg: s_opt_str(v, "idempotency_key_arg")?,
        business_identity: opt_strs("business_identity")?,
    })
}

// ------------------------------------------------------------------------------ spans

type Attrs<'a> = Vec<(&'a str, V<'a>)>;

struct Ev<'a> {
    name: &'a str,
    time: u64,
    attrs: Attrs<'a>,
}

struct Span<'a> {
    trace_id: String,
    span_id: String,
    parent: Option<String>,
    name: &'a str,
    start: u64,
    end: u64,
    status_code: i32,
    status_message: &'a str,
    scope: &'a str,
    attrs: Attrs<'a>,
    events: Vec<Ev<'a>>,
}

fn aget<'b, 'a>(attrs: &'b [(&'a str, V<'a>)], key: &str) -> Option<&'b V<'a>> {
    attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
}

fn conv_val<'a>(v: &'a Val<'a>) -> R<V<'a>> {
    Ok(match v {
        Val::Str(s) => V::Str(Cow::Borrowed(s)),
        Val::Unset => V::None,
        Val::Bool(b) => V::Bool(*b),
        Val::Int(i) => V::Int(*i),
        Val::Double(d) => V::Float(*d),
        Val::Bytes(b) => V::Bytes(b),
        Val::Array(items) => V::List(items.iter().map(conv_val).collect::<R<_>>()?),
        Val::KvList(kvs) => {
            let mut d = Vec::with_capacity(kvs.len());
            for kv in kvs {
                dict_set(&mut d, Cow::Borrowed(kv.key), conv_val(&kv.val)?);
            }
            V::Dict(d)
        }
        Val::StrIndex => return Err(Hard), // the Python decoder rejects the batch
    })
}

fn conv_attrs<'a>(kvs: &'a [Kv<'a>]) -> R<Attrs<'a>> {
    let mut out: Attrs<'a> = Vec::with_capacity(kvs.len());
    for kv in kvs {
        let v = conv_val(&kv.val)?;
        if let Some(slot) = out.iter_mut().find(|(k, _)| *k == kv.key) {
            slot.1 = v;
        } else {
            out.push((kv.key, v));
        }
    }
    Ok(out)
}

fn hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

struct Res<'a> {
    service: Option<String>,
    prompt_version: Option<String>,
    tool_version: Option<String>,
    task_type: Option<String>,
    run_key: Option<V<'a>>,
}

// ------------------------------------------------------------------------------ the step

#[derive(Default)]
struct Out {
    run_id: String,
    kind: &'static str,
    sequence: Option<i64>,
    content_digest: String,
    name: String,
    call_id: Option<String>,
    tool_version: Option<String>,
    prompt_version: Option<String>,
    agent_name: Option<String>,
    service_name: Option<String>,
    session_id: Option<String>,
    task_type: Option<String>,
    action_fp: Option<String>,
    result_fp: Option<String>,
    error_code: Option<String>,
    empty_result: bool,
    version: Option<f64>,
    state_fp: Option<String>,
    state_terminal: bool,
    cursor_fp: Option<String>,
    item_fps: Vec<String>,
    business_fp: Option<String>,
    idempotency_fp: Option<String>,
    from_agent: Option<String>,
    to_agent: Option<String>,
    plan_fp: Option<String>,
    input_tokens: i64,
    output_tokens: i64,
    is_root: bool,
    status_error: bool,
    termination: Option<String>,
    guard_ns: Option<u64>,
    wants_tools: bool,
}

struct Facts<'s, 'a> {
    span: &'s Span<'a>,
    profile: &'s Profile,
    view: [Option<&'s V<'a>>; NF],
    tool: RefCell<Option<Option<String>>>, // Some(None) while being computed
}

enum AsInt {
    No,
    Small(i64),
    Big,
}

fn as_int(py: Python<'_>, v: &V<'_>) -> R<AsInt> {
    Ok(match v {
        V::Bool(_) => AsInt::No,
        V::Int(i) => AsInt::Small(*i),
        V::Big(_) => AsInt::Big,
        V::Float(f) => {
            if f.is_finite() && f.fract() == 0.0 {
                if f.abs() < 9.2e18 {
                    AsInt::Small(*f as i64)
                } else {
                    AsInt::Big
                }
            } else {
                AsInt::No
            }
        }
        V::Str(s) => match py_int(py, py_strip(s))? {
            None => AsInt::No,
            Some(PyInt::Small(i)) => AsInt::Small(i),
            Some(PyInt::Big) => AsInt::Big,
        },
        _ => AsInt::No,
    })
}

fn as_count(py: Python<'_>, v: &V<'_>) -> R<i64> {
    Ok(match as_int(py, v)? {
        AsInt::Small(n) if (0..=MAX_COUNT).contains(&n) => n,
        _ => 0,
    })
}

fn ident(py: Python<'_>, v: &V<'_>) -> R<String> {
    Ok(ident_text(&py_str(py, v)?))
}

fn str_or_none(py: Python<'_>, v: Option<&V<'_>>) -> R<Option<String>> {
    match v {
        None | Some(V::None) => Ok(None),
        Some(V::Str(s)) if s.is_empty() => Ok(None),
        Some(v) => Ok(Some(ident(py, v)?)),
    }
}

fn first<'b, 'a>(attrs: &'b [(&'a str, V<'a>)], keys: &[String]) -> Option<&'b V<'a>> {
    keys.iter()
        .filter_map(|k| aget(attrs, k))
        .find(|v| v.present())
}

fn is_code_like(s: &str) -> bool {
    !s.is_empty()
        && s.chars().count() <= MAX_CODE_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'/' | b'-'))
}

fn short_code(py: Python<'_>, v: Option<&V<'_>>) -> R<Option<String>> {
    let v = match v {
        None | Some(V::None) | Some(V::Bool(_)) => return Ok(None),
        Some(v) => v,
    };
    let text = py_str(py, v)?;
    let mut code = py_strip(&text);
    if code.is_empty() {
        return Ok(None);
    }
    if code.contains('.') && !code.contains(' ') {
        code = code.rsplit('.').next().unwrap_or(code);
    }
    if !is_code_like(code) {
        return Ok(Some("error".into()));
    }
    Ok(Some(code.to_ascii_lowercase()))
}

fn is_empty_result(v: &V<'_>) -> bool {
    match v {
        V::Dict(d) => {
            if d.is_empty() {
                return true;
            }
            let mut payload = false;
            for (k, x) in d {
                if matches!(k.as_ref(), "ok" | "next" | "cursor") {
                    continue;
                }
                if !(x.is_none() || x.is_empty_container_or_str()) {
                    return false;
                }
                payload = true;
            }
            payload
        }
        V::None => true,
        V::Str(s) => s.is_empty(),
        V::List(l) => l.is_empty(),
        _ => false,
    }
}

const OLL_ENVELOPE: [&str; 5] = ["inputs", "input_str", "tags", "metadata", "kwargs"];

/// _unwrap_arguments -> (args, unwrapped?)
fn unwrap_arguments<'a>(args: V<'a>) -> R<(V<'a>, bool)> {
    if let V::Dict(d) = &args {
        if !d.is_empty() && d.iter().all(|(k, _)| OLL_ENVELOPE.contains(&k.as_ref())) {
            if let Some(x) = args.get("inputs") {
                return Ok((as_json(x)?, true));
            }
            if let Some(x) = args.get("input_str") {
                return Ok((as_json(x)?, true));
            }
        }
        if let Some(kw @ V::Dict(_)) = args.get("kwargs") {
            let ok_keys = d.iter().all(|(k, _)| k == "args" || k == "kwargs");
            let no_args = !args.get("args").map(|a| a.truthy()).unwrap_or(false);
            if ok_keys && no_args {
                return Ok((kw.clone(), true));
            }
        }
    }
    Ok((args, false))
}

/// _unwrap_result -> (result, sent text if any, call id)
fn unwrap_result<'a>(
    py: Python<'_>,
    mut result: V<'a>,
) -> R<(V<'a>, Option<V<'a>>, Option<String>)> {
    if let V::Dict(d) = &result {
        if d.iter().any(|(k, _)| k == "output")
            && d.iter().all(|(k, _)| k == "output" || k == "kwargs")
        {
            result = as_json(result.get("output").unwrap_or(&V::None))?;
        }
    }
    if !matches!(result, V::Dict(_)) {
        return Ok((result, None, None));
    }
    if let (Some(own), Some(_), Some(_)) = (
        result.get("raw_output"),
        result.get("tool_name"),
        result.get("raw_input"),
    ) {
        let sent = if matches!(own, V::Str(_)) {
            Some(own.clone())
        } else {
            None
        };
        return Ok((as_json(own)?, sent, None));
    }
    let mut inner: Option<&V<'a>> = None;
    if result
        .get("type")
        .map(|t| t.eq_str("tool"))
        .unwrap_or(false)
    {
        if let Some(data @ V::Dict(_)) = result.get("data") {
            inner = Some(data);
        }
    }
    if inner.is_none() && result.get("lc").map(|x| x.eq_int(1)).unwrap_or(false) {
        if let Some(kw @ V::Dict(_)) = result.get("kwargs") {
            if let Some(V::List(id)) = result.get("id") {
                if id.last().map(|x| x.eq_str("ToolMessage")).unwrap_or(false) {
                    inner = Some(kw);
                }
            }
        }
    }
    let inner = match inner {
        Some(i) if i.get("content").is_some() => i,
        _ => return Ok((result, None, None)),
    };
    let call_id = match inner.get("tool_call_id") {
        Some(c) if c.truthy() => Some(py_str(py, c)?.into_owned()),
        _ => None,
    };
    let content = inner.get("content").cloned().unwrap_or(V::None);
    let parsed = as_json(&content)?;
    let sent = if content.is_none() {
        None
    } else {
        Some(content)
    };
    Ok((parsed, sent, call_id))
}

fn genai_message_calls<'a>(messages: &V<'a>, py: Python<'_>) -> R<Vec<(String, V<'a>)>> {
    let mut calls = Vec::new();
    if let V::List(ms) = messages {
        for m in ms {
            if let Some(V::List(parts)) = m.get("parts") {
                for part in parts {
                    if matches!(part, V::Dict(_))
                        && part
                            .get("type")
                            .map(|t| t.eq_str("tool_call"))
                            .unwrap_or(false)
                    {
                        let name = py_str(py, part.get("name").unwrap_or(&V::None))?.into_owned();
                        calls.push((name, as_json(part.get("arguments").unwrap_or(&V::None))?));
                    }
                }
            }
        }
    }
    Ok(calls)
}

fn flat_calls<'a>(
    py: Python<'_>,
    attrs: &[(&'a str, V<'a>)],
    prefix: &str,
) -> R<Vec<(String, V<'a>)>> {
    let mut calls = Vec::new();
    let mut index = 0usize;
    loop {
        let name = match aget(
            attrs,
            &format!("{}{}.tool_call.function.name", prefix, index),
        ) {
            None | Some(V::None) => return Ok(calls),
            Some(n) => py_str(py, n)?.into_owned(),
        };
        let args = aget(
            attrs,
            &format!("{}{}.tool_call.function.arguments", prefix, index),
        )
        .unwrap_or(&V::None);
        calls.push((name, as_json(args)?));
        index += 1;
    }
}

fn call_list<'a>(value: &V<'a>) -> R<Vec<(String, V<'a>)>> {
    let mut calls = Vec::new();
    if let V::List(items) = value {
        for item in items {
            if !matches!(item, V::Dict(_)) {
                continue;
            }
            let item = match item.get("function") {
                Some(f @ V::Dict(_)) => f,
                _ => item,
            };
            let name = ["toolName", "tool_name", "name", "function"]
                .iter()
                .find_map(|k| item.get(k).and_then(|x| x.as_str()));
            let name = match name {
                Some(n) => n.to_string(),
                None => continue,
            };
            let args = ["input", "args", "arguments", "parameters"]
                .iter()
                .find_map(|k| item.get(k))
                .unwrap_or(&V::None);
            calls.push((name, as_json(args)?));
        }
    }
    Ok(calls)
}

fn plan_calls<'a>(py: Python<'_>, raw: &V<'a>) -> R<Vec<(String, V<'a>)>> {
    let mut calls = Vec::new();
    if let V::List(items) = raw {
        for item in items {
            if let V::Dict(_) = item {
                let tool = match item.get("tool") {
                    Some(t) if t.truthy() => t,
                    _ => item.get("name").unwrap_or(&V::None),
                };
                let args = match item.get("arguments") {
                    Some(a) => a,
                    None => item.get("args").unwrap_or(&V::None),
                };
                calls.push((py_str(py, tool)?.into_owned(), as_json(args)?));
            } else {
                calls.push((py_str(py, item)?.into_owned(), V::None));
            }
        }
    }
    Ok(calls)
}

#[pyclass(module = "loopwatch_native", frozen)]
pub struct SpanPath {
    pads: Option<(Sha256, Sha256)>,
    run_keys: Option<Vec<String>>,
    resource_prompt_version: Vec<String>,
    resource_tool_version: Vec<String>,
    sequence: Vec<String>,
    task_attr: Option<String>,
    known_codes: HashSet<String>,
    status_codes: Vec<String>,
    transient: Vec<(Py<PyAny>, String)>,
    out_of_steps: Py<PyAny>,
    tool_call_finish: HashSet<String>,
    profiles: Vec<Profile>,
    tools: HashMap<String, Contract>,
    step_cls: Py<PyAny>,
}

fn pads_of(key: &[u8]) -> Option<(Sha256, Sha256)> {
    if key.is_empty() {
        return None;
    }
    let mut block = [0u8; 64];
    if key.len() > 64 {
        let mut h = Sha256::new();
        h.update(key);
        block[..32].copy_from_slice(&h.finish());
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(&block.map(|b| b ^ 0x36));
    let mut outer = Sha256::new();
    outer.update(&block.map(|b| b ^ 0x5c));
    Some((inner, outer))
}

impl SpanPath {
    fn digest(&self, data: &[u8]) -> String {
        let d = match &self.pads {
            Some((inner, outer)) => {
                let mut i = inner.clone();
                i.update(data);
                let mut o = outer.clone();
                o.update(&i.finish());
                o.finish()
            }
            None => {
                let mut h = Sha256::new();
                h.update(data);
                h.finish()
            }
        };
        hex(&d[..8])
    }

    fn of_value(&self, tag: &str, v: &V<'_>) -> R<String> {
        let mut data = Vec::with_capacity(tag.len() + 64);
        data.extend_from_slice(tag.as_bytes());
        data.push(0);
        canonical(v, &mut data, 0)?;
        Ok(self.digest(&data))
    }

    fn of_text(&self, tag: &str, text: &str) -> String {
        let mut data = Vec::with_capacity(tag.len() + 1 + text.len());
        data.extend_from_slice(tag.as_bytes());
        data.push(0);
        data.extend_from_slice(text.as_bytes());
        self.digest(&data)
    }

    fn search(&self, py: Python<'_>, pattern: &Py<PyAny>, text: &str) -> R<bool> {
        Ok(!pattern.call1(py, (text,))?.is_none(py))
    }

    // -------------------------------------------------------------- recognition

    fn view<'s, 'a>(&self, p: &'s Profile, span: &'s Span<'a>) -> [Option<&'s V<'a>>; NF] {
        let mut view: [Option<&'s V<'a>>; NF] = [None; NF];
        let mut best = [usize::MAX; NF];
        for (k, v) in &span.attrs {
            if !v.present() {
                continue;
            }
            if let Some(hits) = p.keymap.get(*k) {
                for &(f, rank) in hits {
                    if rank < best[f] {
                        best[f] = rank;
                        view[f] = Some(v);
                    }
                }
            }
        }
        view
    }

    fn matches(&self, py: Python<'_>, m: &M, f: &Facts<'_, '_>) -> R<bool> {
        Ok(match m {
            M::All(parts) => {
                for x in parts {
                    if !self.matches(py, x, f)? {
                        return Ok(false);
                    }
                }
                true
            }
            M::Any(parts) => {
                for x in parts {
                    if self.matches(py, x, f)? {
                        return Ok(true);
                    }
                }
                false
            }
            M::Not(inner) => !self.matches(py, inner, f)?,
            M::Root(r) => f.span.parent.is_none() == *r,
            M::Has(fields) => fields.iter().any(|&i| f.view[i].is_some()),
            M::FieldIn(i, values) => match f.view[*i] {
                None => false,
                Some(v) => values.contains(py_str(py, v)?.as_ref()),
            },
            M::AttrIn(name, values) => match aget(&f.span.attrs, name) {
                None | Some(V::None) => false,
                Some(v) => values.contains(py_str(py, v)?.as_ref()),
            },
            M::Name(names) => names.contains(f.span.name),
            M::NamePrefix(ps) => ps.iter().any(|p| f.span.name.starts_with(p.as_str())),
            M::NameSuffix(ps) => ps.iter().any(|p| f.span.name.ends_with(p.as_str())),
            M::NameContains(ts) => {
                let lowered = py_lower(py, f.span.name)?;
                ts.iter().any(|t| lowered.contains(t.as_str()))
            }
            M::ToolName(tools) => tools.contains(&self.tool_name(py, f)?),
            M::ToolNamePrefix(ps) => {
                let tool = self.tool_name(py, f)?;
                ps.iter().any(|p| tool.starts_with(p.as_str()))
            }
        })
    }

    fn tool_name(&self, py: Python<'_>, f: &Facts<'_, '_>) -> R<String> {
        if let Some(Some(t)) = &*f.tool.borrow() {
            return Ok(t.clone());
        }
        if f.tool.borrow().is_some() {
            return Err(Hard); // a tool name rule that asks for the tool name (recursion)
        }
        *f.tool.borrow_mut() = Some(None);
        let name = self.field(py, F_TOOL_NAME, f, None)?;
        let tool = match name {
            Some(v) => ident(py, &v)?,
            None => ident_text(f.span.name),
        };
        *f.tool.borrow_mut() = Some(Some(tool.clone()));
        Ok(tool)
    }

    /// _field: the attribute value, else the first derived value (not None, not "").
    fn field<'a>(
        &self,
        py: Python<'_>,
        idx: usize,
        f: &Facts<'_, 'a>,
        args: Option<&V<'a>>,
    ) -> R<Option<V<'a>>> {
        if let Some(v) = f.view[idx] {
            return Ok(Some(v.clone()));
        }
        for source in &f.profile.derived[idx] {
            if let Some(v) = self.derive(py, source, f, args)? {
                if v.present() {
                    return Ok(Some(v));
                }
            }
        }
        Ok(None)
    }

    fn derive<'a>(
        &self,
        py: Python<'_>,
        s: &Source,
        f: &Facts<'_, 'a>,
        args: Option<&V<'a>>,
    ) -> R<Option<V<'a>>> {
        if let Some(w) = &s.when {
            if !self.matches(py, w, f)? {
                return Ok(None);
            }
        }
        if let Some(attr) = &s.attribute {
            let value = match &s.event {
                None => aget(&f.span.attrs, attr),
                Some(ev) => f
                    .span
                    .events
                    .iter()
                    .find(|e| e.name == ev && aget(&e.attrs, attr).is_some())
                    .and_then(|e| aget(&e.attrs, attr)),
            };
            let mut value = match value {
                None | Some(V::None) => return Ok(None),
                Some(v) => v.clone(),
            };
            if s.plain {
                return Ok(match &value {
                    V::Str(t) if !(t.is_empty() || t.starts_with('{') || t.starts_with('[')) => {
                        Some(value.clone())
                    }
                    _ => None,
                });
            }
            for (key, index) in &s.path {
                value = as_json(&value)?;
                value = match value {
                    V::Dict(_) => value.get(key).cloned().unwrap_or(V::None),
                    V::List(items) => match index {
                        Some(i) if *i < items.len() => items.into_iter().nth(*i).unwrap_or(V::None),
                        _ => return Ok(None),
                    },
                    _ => return Ok(None),
                };
            }
            return Ok(if value.is_none() { None } else { Some(value) });
        }
        let name = f.span.name;
        if let Some(p) = &s.name_after {
            return Ok(name
                .strip_prefix(p.as_str())
                .map(|x| V::Str(Cow::Owned(x.to_string()))));
        }
        if let Some(p) = &s.name_before {
            return Ok(name
                .strip_suffix(p.as_str())
                .map(|x| V::Str(Cow::Owned(x.to_string()))));
        }
        if s.span_name {
            return Ok(Some(V::Str(Cow::Owned(name.to_string()))));
        }
        if let Some(a) = &s.argument {
            return Ok(match args {
                Some(d @ V::Dict(_)) => match d.get(a) {
                    None | Some(V::None) => None,
                    Some(v) => Some(v.clone()),
                },
                _ => None,
            });
        }
        if let Some(p) = &s.tool_name_after {
            let tool = self.tool_name(py, f)?;
            return Ok(tool
                .strip_prefix(p.as_str())
                .map(|x| V::Str(Cow::Owned(x.to_string()))));
        }
        Ok(None)
    }

    fn resource<'a>(&self, py: Python<'_>, res: &[(&'a str, V<'a>)]) -> R<Res<'a>> {
        Ok(Res {
            service: str_or_none(py, aget(res, "service.name"))?,
            prompt_version: str_or_none(py, first(res, &self.resource_prompt_version))?,
            tool_version: str_or_none(py, first(res, &self.resource_tool_version))?,
            task_type: match &self.task_attr {
                Some(a) => str_or_none(py, aget(res, a))?,
                None => None,
            },
            run_key: match &self.run_keys {
                Some(keys) => first(res, keys).cloned(),
                None => None,
            },
        })
    }

    // -------------------------------------------------------------- the step

    /// Ok(Ok(step)) / Ok(Err(exception name)) for an invalid span / Err(Hard).
    fn step<'a>(
        &self,
        py: Python<'_>,
        span: &Span<'a>,
        res: &Res<'a>,
        now_ns: u128,
    ) -> R<Result<Out, &'static str>> {
        if span.end as u128 > now_ns + MAX_FUTURE_NS {
            return Ok(Err("ValueError"));
        }
        let profile = self
            .profiles
            .iter()
            .find(|p| {
                p.everything
                    || p.scopes.contains(span.scope)
                    || p.scope_prefixes
                        .iter()
                        .any(|x| span.scope.starts_with(x.as_str()))
                    || p.has_attributes
                        .iter()
                        .any(|a| span.attrs.iter().any(|(k, _)| k == a))
            })
            .ok_or(Hard)?; // no profile: Python raises StopIteration
        let view = self.view(profile, span);
        let f = Facts {
            span,
            profile,
            view,
            tool: RefCell::new(None),
        };
        let mut kind = OTHER;
        for (k, m) in &profile.kinds {
            if self.matches(py, m, &f)? {
                kind = k;
                break;
            }
        }
        let v = |i: usize| f.view[i];
        let mut o = Out {
            kind,
            ..Default::default()
        };
        // run id
        o.run_id = match &self.run_keys {
            Some(_) => {
                let value = v(F_RUN_KEY).or(res.run_key.as_ref());
                match value {
                    Some(x) if !x.is_none() => ident(py, x)?,
                    _ => span.trace_id.clone(),
                }
            }
            None => span.trace_id.clone(),
        };
        o.sequence = self.sequence_of(py, &f)?;
        o.content_digest = self.content_digest(py, span, &f)?;
        o.is_root = span.parent.is_none();
        o.status_error = span.status_code == STATUS_ERROR;
        o.service_name = res.service.clone();
        let derived = &profile.derived;
        let mut prompt_version = v(F_PROMPT_VERSION).cloned();
        if prompt_version.is_none() && !derived[F_PROMPT_VERSION].is_empty() {
            prompt_version = self.field(py, F_PROMPT_VERSION, &f, None)?;
        }
        o.prompt_version = match &prompt_version {
            Some(x) => Some(ident(py, x)?),
            None => res.prompt_version.clone(),
        };
        let mut agent = v(F_AGENT_NAME).cloned();
        if agent.is_none() && !derived[F_AGENT_NAME].is_empty() {
            agent = self.field(py, F_AGENT_NAME, &f, None)?;
        }
        o.agent_name = str_or_none(py, agent.as_ref())?;
        o.session_id = str_or_none(py, v(F_CONVERSATION))?;
        o.task_type = match v(F_TASK_TYPE) {
            Some(x) => Some(ident(py, x)?),
            None => res.task_type.clone(),
        };
        if let Some(x) = v(F_INPUT_TOKENS) {
            o.input_tokens = as_count(py, x)?;
        }
        if let Some(x) = v(F_OUTPUT_TOKENS) {
            o.output_tokens = as_count(py, x)?;
        }
        if kind == TOOL {
            self.fill_tool(py, &mut o, span, res, &f)?;
        } else if kind == HANDOFF {
            self.fill_handoff(py, &mut o, &f)?;
        } else if kind == PLAN {
            let raw = as_json(v(F_PLAN_STEPS).unwrap_or(&V::None))?;
            o.plan_fp = self.plan_fp(py, &plan_calls(py, &raw)?)?;
        } else if kind == LLM {
            let calls = self.requested_calls(py, &f)?;
            if calls.len() >= 2 {
                o.plan_fp = self.plan_fp(py, &calls)?;
            }
            let mut finish = self.field(py, F_FINISH_REASON, &f, None)?;
            if let Some(V::List(items)) = &finish {
                finish = items.last().cloned();
                if matches!(finish, Some(V::None)) {
                    finish = None;
                }
            }
            o.wants_tools = !calls.is_empty()
                || match &finish {
                    Some(V::Str(s)) => self.tool_call_finish.contains(py_lower(py, s)?.as_ref()),
                    _ => false,
                };
        }
        if o.is_root || kind == AGENT {
            self.fill_termination(py, &mut o, &f)?;
        }
        Ok(Ok(o))
    }

    fn sequence_of(&self, py: Python<'_>, f: &Facts<'_, '_>) -> R<Option<i64>> {
        if let Some(x) = f.view[F_SEQUENCE] {
            match as_int(py, x)? {
                AsInt::Small(n) => return Ok(Some(n)),
                AsInt::Big => return Err(Hard),
                AsInt::No => {}
            }
        }
        if let Some(meta) = f.view[F_METADATA] {
            let meta = as_json(meta)?;
            if let V::Dict(_) = meta {
                for key in &self.sequence {
                    if let Some(x) = meta.get(key) {
                        match as_int(py, x)? {
                            AsInt::Small(n) => return Ok(Some(n)),
                            AsInt::Big => return Err(Hard),
                            AsInt::No => {}
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    fn content_digest(&self, py: Python<'_>, span: &Span<'_>, f: &Facts<'_, '_>) -> R<String> {
        let mut t = String::with_capacity(128);
        t.push('(');
        repr_str_into(py, span.name, &mut t)?;
        t.push_str(&format!(
            ", {}, {}, {}, ",
            span.start, span.end, span.status_code
        ));
        match &span.parent {
            Some(p) => repr_str_into(py, p, &mut t)?,
            None => t.push_str("None"),
        }
        t.push_str(&format!(", {}", span.attrs.len()));
        for i in [F_ARGUMENTS, F_RESULT, F_INPUT_TOKENS, F_OUTPUT_TOKENS] {
            t.push_str(", ");
            match f.view[i] {
                Some(x) => repr_into(py, x, &mut t, 0)?,
                None => t.push_str("None"),
            }
        }
        t.push(')');
        Ok(format!("{:08x}", crc32(t.as_bytes())))
    }

    fn contract_args<'a>(
        &self,
        py: Python<'_>,
        args: &[(Cow<'a, str>, V<'a>)],
        c: Option<&Contract>,
    ) -> R<Vec<(Cow<'a, str>, V<'a>)>> {
        let c = match c {
            None => return Ok(args.to_vec()),
            Some(c) => c,
        };
        let mut merged: Vec<(Cow<'a, str>, V<'a>)> = c
            .defaults
            .iter()
            .map(|(k, v)| (Cow::Owned(k.to_string()), v.clone()))
            .collect();
        for (k, v) in args {
            dict_set(&mut merged, k.clone(), v.clone());
        }
        for (arg, ops) in &c.normalize {
            if let Some(slot) = merged.iter_mut().find(|(k, _)| k == arg) {
                for op in ops {
                    if let V::Str(s) = &slot.1 {
                        let new = match op {
                            Op::Trim => py_strip(s).to_string(),
                            Op::Lower => py_lower(py, s)?.into_owned(),
                            Op::Collapse => py_split(s).collect::<Vec<_>>().join(" "),
                        };
                        slot.1 = V::Str(Cow::Owned(new));
                    }
                }
            }
        }
        Ok(merged)
    }

    fn plan_fp(&self, py: Python<'_>, calls: &[(String, V<'_>)]) -> R<Option<String>> {
        if calls.is_empty() {
            return Ok(None);
        }
        let mut normalized = Vec::with_capacity(calls.len());
        for (tool, a) in calls {
            let a2 = match a {
                V::Dict(d) => V::Dict(self.contract_args(py, d, self.tools.get(tool))?),
                other => other.clone(),
            };
            normalized.push(V::List(vec![V::Str(Cow::Borrowed(tool.as_str())), a2]));
        }
        Ok(Some(self.of_value("plan", &V::List(normalized))?))
    }

    fn requested_calls<'a>(&self, py: Python<'_>, f: &Facts<'_, 'a>) -> R<Vec<(String, V<'a>)>> {
        if let Some(raw) = f.view[F_OUTPUT_MESSAGES] {
            return genai_message_calls(&as_json(raw)?, py);
        }
        for source in &f.profile.derived[F_REQUESTED_CALLS] {
            if let Some(w) = &source.when {
                if !self.matches(py, w, f)? {
                    continue;
                }
            }
            let key = source.attribute.as_deref().unwrap_or("");
            let calls = if source.format == Some(Fmt::OpenInferenceFlat) {
                flat_calls(py, &f.span.attrs, key)?
            } else if let Some(x) = aget(&f.span.attrs, key) {
                let value = as_json(x)?;
                if source.format == Some(Fmt::GenaiMessages) {
                    genai_message_calls(&value, py)?
                } else {
                    call_list(&value)?
                }
            } else {
                continue;
            };
            if !calls.is_empty() {
                return Ok(calls);
            }
        }
        Ok(Vec::new())
    }

    fn fill_handoff(&self, py: Python<'_>, o: &mut Out, f: &Facts<'_, '_>) -> R<()> {
        let raw = self.field(py, F_ARGUMENTS, f, None)?;
        let args = match raw {
            Some(r) => Some(unwrap_arguments(as_json(&r)?)?.0),
            None => None,
        };
        let to = self.field(py, F_HANDOFF_TO, f, args.as_ref())?;
        let from = self.field(py, F_HANDOFF_FROM, f, args.as_ref())?;
        o.to_agent = str_or_none(py, to.as_ref())?;
        o.from_agent = str_or_none(py, from.as_ref())?;
        o.name = format!(
            "{}->{}",
            o.from_agent.as_deref().unwrap_or("?"),
            o.to_agent.as_deref().unwrap_or("?")
        );
        o.call_id = str_or_none(py, f.view[F_CALL_ID])?;
        Ok(())
    }

    fn fill_tool<'a>(
        &self,
        py: Python<'_>,
        o: &mut Out,
        span: &Span<'a>,
        res: &Res<'a>,
        f: &Facts<'_, 'a>,
    ) -> R<()> {
        let tool = self.tool_name(py, f)?;
        let contract = self.tools.get(&tool);
        o.name = tool.clone();
        o.call_id = str_or_none(py, f.view[F_CALL_ID])?;
        o.tool_version = match f.view[F_TOOL_VERSION] {
            Some(x) => Some(ident(py, x)?),
            None => res.tool_version.clone(),
        };
        let raw_args = self.field(py, F_ARGUMENTS, f, None)?;
        let wrapped = match &raw_args {
            Some(r) => as_json(r)?,
            None => V::Dict(Vec::new()),
        };
        let (args, unwrapped) = unwrap_arguments(wrapped.clone())?;
        if o.call_id.is_none() && unwrapped {
            if let Some(kw @ V::Dict(_)) = wrapped.get("kwargs") {
                if let Some(c) = kw.get("tool_call_id") {
                    if c.truthy() {
                        o.call_id = Some(py_str(py, c)?.into_owned());
                    }
                }
            }
        }
        let args: Vec<(Cow<'a, str>, V<'a>)> = match args {
            V::Dict(d) => d,
            other => {
                let single = match contract.and_then(|c| c.identity.as_ref()) {
                    Some(id) if !id.is_empty() => id[0].clone(),
                    _ => "input".to_string(),
                };
                vec![(Cow::Owned(single), other)]
            }
        };
        let mut raw_result = self.field(py, F_RESULT, f, None)?;
        let has_result = raw_result.is_some();
        let mut result = V::None;
        if let Some(r) = &raw_result {
            let (res_v, sent, envelope_call_id) = unwrap_result(py, as_json(r)?)?;
            result = res_v;
            if sent.is_some() {
                raw_result = sent;
            }
            if o.call_id.is_none() {
                o.call_id = envelope_call_id;
            }
        }
        o.action_fp = Some(self.action_fp(py, &tool, &args, contract)?);
        let code = self.error_code(py, span, f, &result)?;
        o.error_code = code.clone();
        if has_result {
            o.result_fp = Some(match &raw_result {
                Some(V::Str(s)) => self.of_text("result", s),
                _ => self.of_value("result", &result)?,
            });
            o.empty_result = is_empty_result(&result);
        } else if let Some(c) = &code {
            o.result_fp = Some(self.of_text("code", c));
        }
        if let Some(c) = contract {
            self.fill_contract(py, o, c, &args, &result)?;
        }
        Ok(())
    }

    fn action_fp<'a>(
        &self,
        py: Python<'_>,
        tool: &str,
        args: &[(Cow<'a, str>, V<'a>)],
        contract: Option<&Contract>,
    ) -> R<String> {
        let mut merged = self.contract_args(py, args, contract)?;
        if let Some(c) = contract {
            if let Some(identity) = &c.identity {
                merged = pick(&merged, identity);
            } else {
                for arg in [&c.cursor_arg, &c.idempotency_key_arg]
                    .into_iter()
                    .flatten()
                {
                    merged.retain(|(k, _)| k != arg);
                }
            }
        }
        self.of_value(tool, &V::Dict(merged))
    }

    fn fill_contract<'a>(
        &self,
        py: Python<'_>,
        o: &mut Out,
        c: &Contract,
        args: &[(Cow<'a, str>, V<'a>)],
        result: &V<'a>,
    ) -> R<()> {
        let empty = V::Dict(Vec::new());
        let res = if matches!(result, V::Dict(_)) {
            result
        } else {
            &empty
        };
        let args_v = V::Dict(args.to_vec());
        if let Some(vf) = &c.version_field {
            match res.get(vf) {
                Some(V::Int(i)) => o.version = Some(*i as f64),
                Some(V::Float(x)) => o.version = Some(*x),
                Some(V::Big(_)) => return Err(Hard),
                _ => {}
            }
        }
        if let Some(sf) = &c.state_field {
            if let Some(state) = res.get(sf) {
                if !state.is_none() {
                    o.state_fp = Some(self.of_value("state", state)?);
                    o.state_terminal = c.terminal_states.contains(py_str(py, state)?.as_ref());
                }
            }
        }
        if let Some(ca) = &c.cursor_arg {
            o.cursor_fp = Some(self.of_value("cursor", args_v.get(ca).unwrap_or(&V::None))?);
        }
        if let Some(nf) = &c.new_items_field {
            if let Some(V::List(items)) = res.get(nf) {
                let mut fps = Vec::new();
                for i in items.iter().take(MAX_ITEMS) {
                    let mut d = self.of_value("item", i)?;
                    d.truncate(8);
                    fps.push(d);
                }
                o.item_fps = fps;
            }
        }
        if c.side_effect {
            let merged = self.contract_args(py, args, Some(c))?;
            let identity = match &c.business_identity {
                Some(b) if !b.is_empty() => Some(b),
                _ => c.identity.as_ref(),
            };
            let mut business = match identity {
                Some(id) if !id.is_empty() => pick(&merged, id),
                _ => merged,
            };
            if let (Some(idem), None) = (&c.idempotency_key_arg, identity) {
                business.retain(|(k, _)| k != idem);
            }
            o.business_fp = Some(self.of_value(&c.name, &V::Dict(business))?);
            if let Some(idem) = &c.idempotency_key_arg {
                match args_v.get(idem) {
                    None | Some(V::None) => {}
                    Some(V::Str(s)) if s.is_empty() => {}
                    Some(key) => o.idempotency_fp = Some(self.of_value("idempotency", key)?),
                }
            }
        }
        Ok(())
    }

    fn error_code<'a>(
        &self,
        py: Python<'_>,
        span: &Span<'a>,
        f: &Facts<'_, 'a>,
        result: &V<'a>,
    ) -> R<Option<String>> {
        let error_type = self.field(py, F_ERROR_TYPE, f, None)?;
        let code = self.stated_code(py, span, error_type.as_ref(), result)?;
        let code = match code {
            None => return Ok(None),
            Some(c) if self.known_codes.contains(&c) => return Ok(Some(c)),
            Some(c) => c,
        };
        let message = self.field(py, F_ERROR_MESSAGE, f, None)?;
        let mut texts: Vec<&str> = span
            .events
            .iter()
            .filter(|e| e.name == "exception")
            .filter_map(|e| aget(&e.attrs, "exception.message").and_then(|m| m.as_str()))
            .collect();
        if !span.status_message.is_empty() {
            texts.push(span.status_message);
        }
        if let Some(V::Str(m)) = &message {
            texts.push(m);
        }
        for text in texts {
            for (pattern, transient) in &self.transient {
                if self.search(py, pattern, text)? {
                    return Ok(Some(transient.clone()));
                }
            }
        }
        Ok(Some(code))
    }

    fn stated_code(
        &self,
        py: Python<'_>,
        span: &Span<'_>,
        error_type: Option<&V<'_>>,
        result: &V<'_>,
    ) -> R<Option<String>> {
        if let Some(c) = short_code(py, error_type)? {
            return Ok(Some(c));
        }
        if matches!(result, V::Dict(_)) && matches!(result.get("ok"), Some(V::Bool(false))) {
            let mut inner = match result.get("code") {
                Some(c) if c.truthy() => Some(c),
                _ => result.get("error_code"),
            };
            if inner.map(|x| x.is_none()).unwrap_or(true) {
                if let Some(e @ V::Dict(_)) = result.get("error") {
                    inner = e.get("code");
                }
            }
            return Ok(Some(
                short_code(py, inner)?.unwrap_or_else(|| "error".to_string()),
            ));
        }
        if span.status_code == STATUS_ERROR {
            for e in &span.events {
                if e.name == "exception" {
                    if let Some(c) = short_code(py, aget(&e.attrs, "exception.type"))? {
                        return Ok(Some(c));
                    }
                }
            }
            let message = py_lower(py, span.status_message)?;
            for known in &self.status_codes {
                if message.contains(known.as_str()) {
                    return Ok(Some(known.clone()));
                }
            }
            return Ok(Some("error".into()));
        }
        Ok(None)
    }

    fn fill_termination(&self, py: Python<'_>, o: &mut Out, f: &Facts<'_, '_>) -> R<()> {
        let span = f.span;
        if o.kind == OTHER && !o.is_root {
            return Ok(());
        }
        if o.kind == OTHER {
            o.kind = AGENT;
        }
        o.name = match &o.agent_name {
            Some(a) => a.clone(),
            None => ident_text(span.name),
        };
        let p = f.profile;
        let mut reason: Option<String> = None;
        for e in &span.events {
            if e.name == "loop_guard" {
                o.guard_ns = Some(match o.guard_ns {
                    None => e.time,
                    Some(g) => g.min(e.time),
                });
                reason = Some("loop_guard".into());
            }
        }
        if reason.is_none() {
            let mut types: Vec<Option<&V<'_>>> = vec![f.view[F_ERROR_TYPE]];
            for e in &span.events {
                if e.name == "exception" {
                    types.push(aget(&e.attrs, "exception.type"));
                }
            }
            for t in types.into_iter().flatten() {
                if t.is_none() {
                    continue;
                }
                let text = py_str(py, t)?;
                let short = text.rsplit('.').next().unwrap_or(&text);
                reason = p
                    .exception_types
                    .get(text.as_ref())
                    .or_else(|| p.exception_types.get(short))
                    .cloned();
                if reason.is_some() {
                    break;
                }
            }
        }
        if reason.is_none() && !span.status_message.is_empty() {
            for (pattern, mapped) in &p.message_patterns {
                if self.search(py, pattern, span.status_message)? {
                    reason = Some(mapped.clone());
                    break;
                }
            }
        }
        if reason.is_none() {
            let mut finish = self.field(py, F_FINISH_REASON, f, None)?;
            if let Some(V::List(items)) = &finish {
                if !items.is_empty() {
                    finish = items.last().cloned();
                }
            }
            if let Some(x) = &finish {
                if !x.is_none() {
                    let text = py_str(py, x)?;
                    reason = p.finish_reasons.get(py_lower(py, &text)?.as_ref()).cloned();
                }
            }
        }
        if reason.is_none() && o.is_root {
            if let Some(V::Str(out)) = aget(&span.attrs, "output.value") {
                if out.contains("\"messages\"") {
                    if let Some(last) = last_message_text(&as_json(&V::Str(out.clone()))?) {
                        if self.search(py, &self.out_of_steps, &last)? {
                            reason = Some("turn_limit".into());
                        }
                    }
                }
            }
        }
        o.termination = reason;
        Ok(())
    }

    fn to_python<'py>(
        &self,
        py: Python<'py>,
        span: &Span<'_>,
        o: Out,
        shared: &mut Shared<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        fn opt<'py>(py: Python<'py>, s: Option<String>) -> Bound<'py, PyAny> {
            match s {
                Some(s) => PyString::new(py, &s).into_any(),
                None => py.None().into_bound(py),
            }
        }
        // the values the spans of a request mostly share: one str object each
        let mut one = |x: Option<&str>| match x {
            Some(x) => shared.get(py, x),
            None => py.None().into_bound(py),
        };
        let run_id = one(Some(&o.run_id));
        let trace_id = one(Some(&span.trace_id));
        let parent = one(span.parent.as_deref());
        let name = one(Some(&o.name));
        let tool_version = one(o.tool_version.as_deref());
        let prompt_version = one(o.prompt_version.as_deref());
        let agent_name = one(o.agent_name.as_deref());
        let service_name = one(o.service_name.as_deref());
        let session_id = one(o.session_id.as_deref());
        let task_type = one(o.task_type.as_deref());
        let from_agent = one(o.from_agent.as_deref());
        let to_agent = one(o.to_agent.as_deref());
        let s = |x: &str| PyString::new(py, x).into_any();
        let b = |x: bool| pyo3::types::PyBool::new(py, x).to_owned().into_any();
        let items: Vec<Bound<'py, PyAny>> = vec![
            run_id,
            trace_id,
            s(&span.span_id),
            parent,
            pyo3::intern!(py, "x").clone().into_any(), // replaced below
            span.start.into_pyobject(py)?.into_any(),
            span.end.into_pyobject(py)?.into_any(),
            match o.sequence {
                Some(n) => n.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            },
            s(&o.content_digest),
            name,
            opt(py, o.call_id),
            tool_version,
            prompt_version,
            agent_name,
            service_name,
            session_id,
            task_type,
            opt(py, o.action_fp),
            opt(py, o.result_fp),
            opt(py, o.error_code),
            b(o.empty_result),
            match o.version {
                Some(x) => pyo3::types::PyFloat::new(py, x).into_any(),
                None => py.None().into_bound(py),
            },
            opt(py, o.state_fp),
            b(o.state_terminal),
            opt(py, o.cursor_fp),
            PyTuple::new(py, o.item_fps.iter().map(|x| PyString::new(py, x)))?.into_any(),
            opt(py, o.business_fp),
            opt(py, o.idempotency_fp),
            from_agent,
            to_agent,
            opt(py, o.plan_fp),
            o.input_tokens.into_pyobject(py)?.into_any(),
            o.output_tokens.into_pyobject(py)?.into_any(),
            b(o.is_root),
            b(o.status_error),
            opt(py, o.termination),
            match o.guard_ns {
                Some(n) => n.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            },
            b(o.wants_tools),
        ];
        let mut items = items;
        items[4] = match o.kind {
            TOOL => pyo3::intern!(py, "tool"),
            HANDOFF => pyo3::intern!(py, "handoff"),
            PLAN => pyo3::intern!(py, "plan"),
            LLM => pyo3::intern!(py, "llm"),
            SUMMARY => pyo3::intern!(py, "summary"),
            AGENT => pyo3::intern!(py, "agent"),
            _ => pyo3::intern!(py, "other"),
        }
        .clone()
        .into_any();
        self.step_cls.bind(py).call1(PyTuple::new(py, items)?)
    }
}

/// One Python str per distinct value within a request (run and trace ids, names, labels):
/// the steps of a run hold the same few values, and a new str for each field of each step
/// was an allocation the run's state then kept.
#[derive(Default)]
struct Shared<'py> {
    strs: HashMap<String, Bound<'py, PyString>>,
}

impl<'py> Shared<'py> {
    fn get(&mut self, py: Python<'py>, text: &str) -> Bound<'py, PyAny> {
        if let Some(s) = self.strs.get(text) {
            return s.clone().into_any();
        }
        let s = PyString::new(py, text);
        self.strs.insert(text.to_string(), s.clone());
        s.into_any()
    }
}

fn pick<'a>(merged: &[(Cow<'a, str>, V<'a>)], keys: &[String]) -> Vec<(Cow<'a, str>, V<'a>)> {
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let v = merged
            .iter()
            .find(|(x, _)| x == k)
            .map(|(_, v)| v.clone())
            .unwrap_or(V::None);
        dict_set(&mut out, Cow::Owned(k.clone()), v);
    }
    out
}

fn last_message_text(doc: &V<'_>) -> Option<String> {
    let messages = match doc.get("messages") {
        Some(V::List(m)) if !m.is_empty() => m,
        _ => return None,
    };
    let last = messages.last()?;
    if !matches!(last, V::Dict(_)) {
        return None;
    }
    let data = last.get("data").unwrap_or(last);
    match data.get("content") {
        Some(V::Str(s)) if matches!(data, V::Dict(_)) => Some(s.to_string()),
        _ => None,
    }
}

/// What one batch gives: None (the Python path decides) or the grouped steps.
type Batch<'py> = Option<(
    Bound<'py, PyDict>,
    usize,
    u64,
    usize,
    Bound<'py, PyList>,
    u64,
    u64,
)>;

#[pymethods]
impl SpanPath {
    /// SpanPath(spec_json, step_cls, key): `spec_json` from streams/spanpath/native_spec.py; raises
    /// ValueError naming what the native side does not support.
    #[new]
    #[pyo3(signature = (spec, step_cls, key=None))]
    fn new(py: Python<'_>, spec: &str, step_cls: Py<PyAny>, key: Option<&[u8]>) -> PyResult<Self> {
        let root = match loads(spec) {
            Ok(v) => crate::pyval::into_owned(v),
            Err(_) => return Err(ve("spec: not JSON the native side can read")),
        };
        let fields = s_strs(sget(&root, "step_fields").map_err(ve)?, "step_fields").map_err(ve)?;
        if fields.iter().map(|x| x.as_str()).collect::<Vec<_>>() != STEP_FIELDS.to_vec() {
            return Err(ve("Step fields differ from the native build's"));
        }
        let opt_strs = |k: &str| -> PyResult<Option<Vec<String>>> {
            match root.get(k) {
                None | Some(V::None) => Ok(None),
                Some(x) => Ok(Some(s_strs(x, k).map_err(ve)?)),
            }
        };
        let strs = |k: &str| -> PyResult<Vec<String>> {
            s_strs(sget(&root, k).map_err(ve)?, k).map_err(ve)
        };
        let run_keys = opt_strs("run_keys")?;
        let task_attr = s_opt_str(&root, "task_attr").map_err(ve)?;
        let sequence = strs("sequence")?;
        let mut common: Vec<(usize, Vec<String>)> = vec![(
            F_SEQUENCE,
            sequence
                .iter()
                .cloned()
                .chain(
                    sequence
                        .iter()
                        .map(|k| format!("traceloop.association.properties.{}", k)),
                )
                .collect(),
        )];
        if let Some(t) = &task_attr {
            common.push((F_TASK_TYPE, vec![t.clone()]));
        }
        if let Some(k) = &run_keys {
            common.push((F_RUN_KEY, k.clone()));
        }
        let mut profiles = Vec::new();
        for p in s_list(sget(&root, "profiles").map_err(ve)?, "profiles").map_err(ve)? {
            profiles.push(parse_profile(py, p, &common)?);
        }
        let mut tools = HashMap::default();
        for (name, c) in sget(&root, "tools")
            .map_err(ve)?
            .dict()
            .ok_or_else(|| ve("tools"))?
        {
            tools.insert(name.to_string(), parse_contract(name, c).map_err(ve)?);
        }
        let out_of_steps = compile_pattern(
            py,
            &s_str(sget(&root, "out_of_steps").map_err(ve)?, "out_of_steps").map_err(ve)?,
        )?;
        Ok(SpanPath {
            pads: key.and_then(pads_of),
            run_keys,
            resource_prompt_version: strs("resource_prompt_version")?,
            resource_tool_version: strs("resource_tool_version")?,
            sequence,
            task_attr,
            known_codes: strs("known_codes")?.into_iter().collect(),
            status_codes: strs("status_codes")?,
            transient: patterns(py, sget(&root, "transient_patterns").map_err(ve)?)?,
            out_of_steps,
            tool_call_finish: strs("tool_call_finish_reasons")?.into_iter().collect(),
            profiles,
            tools,
            step_cls,
        })
    }

    /// normalize(data) -> None, or (steps by run id, invalid count, latest end, span count,
    /// [(span_id, trace_id, exception name)] of the invalid spans, earliest and latest end
    /// of all spans (0, 0 without spans)): what
    /// `group_steps(normalizer, decode_proto(data))` gives. None: the batch needs the Python
    /// path (malformed input, for its error; or a value only Python decides).
    fn normalize<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Batch<'py>> {
        match wire::parse_request(data) {
            Ok(tree) => self.batch(py, &tree),
            Err(_) => Ok(None),
        }
    }

    /// normalize_json(data, max_depth, max_digits, trailing_comma_msgs) -> what `normalize`
    /// gives, for OTLP JSON bytes: `group_steps(normalizer, decode_json(data))`. None where
    /// the Python decoder raises, and for documents nested deeper than `max_depth` (its
    /// outcome there depends on Python's recursion limit); the other arguments are the
    /// interpreter's, as for `decode_json`.
    fn normalize_json<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        max_depth: usize,
        max_digits: usize,
        trailing_comma_msgs: bool,
    ) -> PyResult<Batch<'py>> {
        let opts = crate::json::Opts {
            max_depth,
            max_digits,
            trailing_comma_msgs,
        };
        // messages are not shown: any error hands the document to the Python path
        let repr = |key: &str| -> String { key.to_string() };
        crate::json::with_request(data, opts, &repr, |tree| self.batch(py, tree))
            .unwrap_or(Ok(None))
    }
}

impl SpanPath {
    /// One parsed request -> the grouped steps (see `normalize`).
    fn batch<'a, 'py>(
        &self,
        py: Python<'py>,
        tree: &'a [wire::ResourceSpans<'a>],
    ) -> PyResult<Batch<'py>> {
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        // the Python decoder validates every span before any is normalized
        for rs in tree {
            for ss in &rs.scopes {
                for sp in &ss.spans {
                    let (tid, sid, pid): (&[u8], &[u8], &[u8]) =
                        (&sp.trace_id, &sp.span_id, &sp.parent);
                    if tid.len() != 16
                        || sid.len() != 8
                        || (!pid.is_empty() && pid.len() != 8)
                        || tid.iter().all(|&x| x == 0)
                        || sid.iter().all(|&x| x == 0)
                    {
                        return Ok(None);
                    }
                }
            }
        }
        let mut shared = Shared::default();
        let mut order: Vec<(String, Vec<Bound<'py, PyAny>>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::default();
        let mut invalid = 0usize;
        let invalid_list = PyList::empty(py);
        let mut max_end = 0u64;
        let (mut first_end, mut last_end) = (u64::MAX, 0u64); // over every span, valid or not
        let mut n = 0usize;
        for rs in tree {
            let resource = match conv_attrs(&rs.resource) {
                Ok(r) => r,
                Err(Hard) => return Ok(None),
            };
            let res = match self.resource(py, &resource) {
                Ok(r) => r,
                Err(Hard) => return Ok(None),
            };
            for ss in &rs.scopes {
                for sp in &ss.spans {
                    n += 1;
                    first_end = first_end.min(sp.end);
                    last_end = last_end.max(sp.end);
                    let attrs = match conv_attrs(&sp.attrs) {
                        Ok(a) => a,
                        Err(Hard) => return Ok(None),
                    };
                    let mut events = Vec::with_capacity(sp.events.len());
                    for ev in &sp.events {
                        match conv_attrs(&ev.attrs) {
                            Ok(a) => events.push(Ev {
                                name: ev.name,
                                time: ev.time,
                                attrs: a,
                            }),
                            Err(Hard) => return Ok(None),
                        }
                    }
                    let pid: &[u8] = &sp.parent;
                    let span = Span {
                        trace_id: hex(&sp.trace_id),
                        span_id: hex(&sp.span_id),
                        parent: if !pid.is_empty() && !pid.iter().all(|&x| x == 0) {
                            Some(hex(pid))
                        } else {
                            None
                        },
                        name: sp.name,
                        start: sp.start,
                        end: sp.end,
                        status_code: sp.status_code,
                        status_message: sp.status_message,
                        scope: ss.scope_name,
                        attrs,
                        events,
                    };
                    match self.step(py, &span, &res, now_ns) {
                        Err(Hard) => return Ok(None),
                        Ok(Err(exc)) => {
                            invalid += 1;
                            invalid_list.append((&span.span_id, &span.trace_id, exc))?;
                        }
                        Ok(Ok(o)) => {
                            let run_id = o.run_id.clone();
                            let end = span.end;
                            let step = self.to_python(py, &span, o, &mut shared)?;
                            match index.get(&run_id) {
                                Some(&i) => order[i].1.push(step),
                                None => {
                                    index.insert(run_id.clone(), order.len());
                                    order.push((run_id, vec![step]));
                                }
                            }
                            if end > max_end {
                                max_end = end;
                            }
                        }
                    }
                }
            }
        }
        let by_run = PyDict::new(py);
        for (run_id, steps) in order {
            by_run.set_item(shared.get(py, &run_id), PyList::new(py, steps)?)?;
        }
        if n == 0 {
            first_end = 0;
        }
        Ok(Some((
            by_run,
            invalid,
            max_end,
            n,
            invalid_list,
            first_end,
            last_end,
        )))
    }
}
