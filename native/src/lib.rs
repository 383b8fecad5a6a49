//! loopwatch_native: the compiled span path. Today: OTLP protobuf bytes and OTLP JSON bytes ->
//! SpanRecord values, the same values and the same DecodeError messages as
//! `streams/spanpath/otlp/proto.py` and `streams/spanpath/otlp/json_decode.py` (the references;
//! `tests/unit/native/test_decode_proto.py` and `tests/unit/native/test_decode_json.py` run both on the same
//! inputs). Both formats are parsed into the structures of `wire.rs` first.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};

mod digest;
mod ids;
mod json;
mod normalize;
mod packing;
mod partition;
mod pyval;
mod wire;

/// A Rust integer as a Python int (the conversion cannot fail).
macro_rules! int {
    ($py:expr, $x:expr) => {
        match $x.into_pyobject($py) {
            Ok(v) => v.into_any(),
            Err(e) => match e {},
        }
    };
}

use ids::{at, hex, id_problem, ids_valid, parent_hex};
use wire::{Kv, Val};

/// Bumped when the Python-facing signature or behaviour changes; `streams/spanpath/native.py` refuses
/// an extension built from another version (a stale build) and falls back to Python.
const API: u32 = 12;

const STRINDEX: &str = "value uses string_value_strindex (dictionary references are profiles-only)";

/// Why a conversion failed: a decoding problem (message without the source) or a Python error.
enum Fail {
    Bad(String),
    Py(PyErr),
}

impl From<PyErr> for Fail {
    fn from(e: PyErr) -> Self {
        Fail::Py(e)
    }
}

/// "attribute 'k': <reason>", the key shown with Python's repr().
fn wrap_key(py: Python<'_>, key: &str, reason: String) -> Fail {
    match PyString::new(py, key).repr() {
        Ok(r) => Fail::Bad(format!("attribute {}: {}", r, reason)),
        Err(e) => Fail::Py(e),
    }
}

/// Attribute keys repeat across the spans of a request: one Python str per distinct key.
type Keys<'a, 'py> = HashMap<&'a str, Bound<'py, PyString>>;

fn conv_val<'a, 'py>(
    py: Python<'py>,
    keys: &mut Keys<'a, 'py>,
    v: &Val<'a>,
) -> Result<Bound<'py, PyAny>, Fail> {
    Ok(match v {
        Val::Str(s) => PyString::new(py, s).into_any(),
        Val::Unset => py.None().into_bound(py),
        Val::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Val::Int(i) => int!(py, *i),
        Val::Double(d) => PyFloat::new(py, *d).into_any(),
        Val::Bytes(b) => PyBytes::new(py, b).into_any(),
        Val::Array(items) => {
            let list = PyList::empty(py);
            for x in items {
                list.append(conv_val(py, keys, x)?)?;
            }
            list.into_any()
        }
        Val::KvList(kvs) => conv_attrs(py, keys, kvs)?.into_any(),
        Val::StrIndex => return Err(Fail::Bad(STRINDEX.to_string())),
    })
}

fn conv_attrs<'a, 'py>(
    py: Python<'py>,
    keys: &mut Keys<'a, 'py>,
    kvs: &[Kv<'a>],
) -> Result<Bound<'py, PyDict>, Fail> {
    let d = PyDict::new(py);
    for kv in kvs {
        let value = match &kv.val {
            Val::Str(s) if !s.is_empty() => PyString::new(py, s).into_any(),
            other => match conv_val(py, keys, other) {
                Ok(x) => x,
                Err(Fail::Bad(reason)) => return Err(wrap_key(py, kv.key, reason)),
                Err(e) => return Err(e),
            },
        };
        let key = keys
            .entry(kv.key)
            .or_insert_with(|| PyString::new(py, kv.key));
        d.set_item(&*key, value)?;
    }
    Ok(d)
}

/// decode_proto(data, source, record, event, error) -> list[record]
///
/// `record` / `event` are the SpanRecord / SpanEvent classes (called positionally), `error` the
/// exception class raised with "<source>: <reason>" for malformed input.
#[pyfunction]
fn decode_proto<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    source: &str,
    record: &Bound<'py, PyAny>,
    event: &Bound<'py, PyAny>,
    error: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let raise = |msg: String| -> PyErr {
        match error.call1((msg,)) {
            Ok(exc) => PyErr::from_value(exc),
            Err(e) => e,
        }
    };
    let tree = match wire::parse_request(data.as_bytes()) {
        Ok(t) => t,
        Err(e) => {
            return Err(raise(format!(
                "{}: truncated or corrupt protobuf: {}",
                source,
                e.reason()
            )))
        }
    };
    convert(py, &tree, source, record, event, &raise)
}

/// The parsed request -> list[record], resource dicts shared per ResourceSpans.
fn convert<'a, 'py>(
    py: Python<'py>,
    tree: &[wire::ResourceSpans<'a>],
    source: &str,
    record: &Bound<'py, PyAny>,
    event: &Bound<'py, PyAny>,
    raise: &dyn Fn(String) -> PyErr,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    let mut keys: Keys<'a, 'py> = HashMap::new();
    let mut n = 0usize;
    for (ri, rs) in tree.iter().enumerate() {
        let resource = match conv_attrs(py, &mut keys, &rs.resource) {
            Ok(d) => d,
            Err(Fail::Bad(reason)) => {
                let place = format!("resourceSpans[{}].resource", ri);
                return Err(raise(format!("{}: {}", source, at(&place, &reason))));
            }
            Err(Fail::Py(e)) => return Err(e),
        };
        for ss in &rs.scopes {
            let scope_name = PyString::new(py, ss.scope_name);
            for sp in &ss.spans {
                match span_record(py, &mut keys, sp, &resource, &scope_name, record, event) {
                    Ok(r) => out.append(r)?,
                    Err(Fail::Bad(reason)) => {
                        let place = format!("span {}", n);
                        return Err(raise(format!("{}: {}", source, at(&place, &reason))));
                    }
                    Err(Fail::Py(e)) => return Err(e),
                }
                n += 1;
            }
        }
    }
    Ok(out)
}

fn span_record<'a, 'py>(
    py: Python<'py>,
    keys: &mut Keys<'a, 'py>,
    sp: &wire::Span<'a>,
    resource: &Bound<'py, PyDict>,
    scope_name: &Bound<'py, PyString>,
    record: &Bound<'py, PyAny>,
    event: &Bound<'py, PyAny>,
) -> Result<Bound<'py, PyAny>, Fail> {
    let (tid, sid, pid) = (&*sp.trace_id, &*sp.span_id, &*sp.parent);
    if !ids_valid(tid, sid, pid) {
        return Err(Fail::Bad(id_problem(tid, sid, pid)));
    }
    let attrs = conv_attrs(py, keys, &sp.attrs)?;
    let events = PyList::empty(py);
    for (i, ev) in sp.events.iter().enumerate() {
        let ev_attrs = match conv_attrs(py, keys, &ev.attrs) {
            Ok(d) => d,
            Err(Fail::Bad(reason)) => return Err(Fail::Bad(format!("event {}: {}", i, reason))),
            Err(e) => return Err(e),
        };
        events.append(event.call1((PyString::new(py, ev.name), ev.time, ev_attrs))?)?;
    }
    let parent: Bound<'py, PyAny> = match parent_hex(pid) {
        Some(text) => PyString::new(py, &text).into_any(),
        None => py.None().into_bound(py),
    };
    let args = PyTuple::new(
        py,
        [
            PyString::new(py, &hex(tid)).into_any(),
            PyString::new(py, &hex(sid)).into_any(),
            parent,
            PyString::new(py, sp.name).into_any(),
            int!(py, sp.kind),
            int!(py, sp.start),
            int!(py, sp.end),
            int!(py, sp.status_code),
            PyString::new(py, sp.status_message).into_any(),
            attrs.into_any(),
            resource.clone().into_any(),
            events.into_any(),
            scope_name.clone().into_any(),
        ],
    )?;
    Ok(record.call1(args)?)
}

/// decode_json(data, source, record, event, error, max_depth, max_digits, trailing_comma_msgs)
/// -> list[record] | None
///
/// OTLP JSON bytes, as `streams/spanpath/otlp/json_decode.decode_json_py` decodes them. None when the
/// document nests deeper than `max_depth`: there the reference's outcome depends on Python's
/// recursion limit, so the caller asks it. `max_digits` is sys.get_int_max_str_digits();
/// `trailing_comma_msgs` is true on CPython 3.13+, whose json module names a trailing comma.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn decode_json<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    source: &str,
    record: &Bound<'py, PyAny>,
    event: &Bound<'py, PyAny>,
    error: &Bound<'py, PyAny>,
    max_depth: usize,
    max_digits: usize,
    trailing_comma_msgs: bool,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let raise = |msg: String| -> PyErr {
        match error.call1((msg,)) {
            Ok(exc) => PyErr::from_value(exc),
            Err(e) => e,
        }
    };
    let opts = json::Opts {
        max_depth,
        max_digits,
        trailing_comma_msgs,
    };
    let repr = |key: &str| -> String {
        match PyString::new(py, key).repr() {
            Ok(r) => r.to_string(),
            Err(_) => format!("{:?}", key),
        }
    };
    match json::with_request(data.as_bytes(), opts, &repr, |tree| {
        convert(py, tree, source, record, event, &raise)
    }) {
        Ok(out) => out.map(Some),
        Err(json::DocErr::Delegate) => Ok(None),
        Err(json::DocErr::Bad(reason)) => Err(raise(format!("{}: {}", source, reason))),
    }
}

/// The span kind and status code names the JSON decoder knows, for the descriptor test.
#[pyfunction]
fn json_enums() -> (json::EnumTable, json::EnumTable) {
    json::enum_tables()
}

/// The wire schema the parser knows: [(message, field number, kind)], for the descriptor test.
#[pyfunction]
fn schema() -> Vec<(&'static str, u32, &'static str)> {
    wire::SCHEMA.to_vec()
}

#[pymodule]
fn loopwatch_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("API", API)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(decode_proto, m)?)?;
    m.add_function(wrap_pyfunction!(decode_json, m)?)?;
    m.add_function(wrap_pyfunction!(json_enums, m)?)?;
    m.add_function(wrap_pyfunction!(schema, m)?)?;
    m.add_function(wrap_pyfunction!(partition::murmur2, m)?)?;
    m.add_class::<digest::Digests>()?;
    m.add_class::<normalize::SpanPath>()?;
    m.add_class::<packing::StateWriter>()?;
    Ok(())
}
