//! The native normalizer: OTLP protobuf bytes -> steps grouped by run, the same steps as
//! `group_steps(Normalizer(policy, fp), decode_proto(data))` (streams/spanpath/normalize.py is the
//! reference; tests/unit/native/test_normalize.py compares the two).
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
use crate::ids::{hex, ids_valid, parent_hex};
use crate::pyval::{
    as_json, canonical, crc32, dict_set, ident_text, loads, py_int, py_lower, py_split, py_str,
    py_strip, repr_into, repr_str_into, Hard, PyInt, R, V,
};
use crate::wire::{self, Kv, Val};

mod batch;
mod calls;
mod contract;
mod error_codes;
mod fallback;
mod sketch;
mod spans;
mod spec;
mod step;
mod termination;
mod tool;
mod values;
mod view;

use self::calls::*;
use self::sketch::*;
use self::spans::*;
use self::spec::*;
use self::step::*;
use self::termination::denied_calls;
use self::values::*;

// Field indices: the recognition FIELDS (detectors/recognition.py) then the policy's own.
const FIELDS: [&str; 27] = [
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
    "model",
    "model_output",
    "model_input",
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
const F_MODEL: usize = 21;
const F_MODEL_OUTPUT: usize = 22;
const F_MODEL_INPUT: usize = 23;
const F_SEQUENCE: usize = 24;
const F_TASK_TYPE: usize = 25;
const F_RUN_KEY: usize = 26;

/// Step fields in the order this module builds them (checked against detectors.model).
pub const STEP_FIELDS: [&str; 46] = [
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
    "model",
    "step_limit",
    "limit_counts",
    "action_sketch",
    "result_sketch",
    "result_items",
    "identity_fp",
    "denied_calls",
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
    similarity: Sim, // the policy's, or the tool's own over it
}

type SpecErr = String;

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
    model: Option<String>,
    step_limit: Option<i64>,
    limit_counts: Option<String>,
    action_sketch: Option<String>,
    result_sketch: Option<String>,
    result_items: String,
    identity_fp: Option<String>,
    denied_calls: Vec<String>,
}

struct Facts<'s, 'a> {
    span: &'s Span<'a>,
    profile: &'s Profile,
    view: [Option<&'s V<'a>>; NF],
    tool: RefCell<Option<Option<String>>>, // Some(None) while being computed
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
    fallback: fallback::Fallback,
    limit_names: HashMap<String, String>,
    tools: HashMap<String, Contract>,
    step_cls: Py<PyAny>,
    sketch_base: Sha256, // sketch.rs
    similarity: Sim,     // tools without a contract
    turn_sketches: bool, // model turns' output and last input message
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
