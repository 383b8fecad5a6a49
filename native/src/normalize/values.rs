//! Values read from span attributes: counts, identifiers, short codes, emptiness, and the
//! framework envelopes around tool arguments and results (streams/spanpath/values.py).

use super::*;

pub(super) enum AsInt {
    No,
    Small(i64),
    Big,
}

pub(super) fn as_int(py: Python<'_>, v: &V<'_>) -> R<AsInt> {
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

pub(super) fn as_count(py: Python<'_>, v: &V<'_>) -> R<i64> {
    Ok(match as_int(py, v)? {
        AsInt::Small(n) if (0..=MAX_COUNT).contains(&n) => n,
        _ => 0,
    })
}

pub(super) fn ident(py: Python<'_>, v: &V<'_>) -> R<String> {
    Ok(ident_text(&py_str(py, v)?))
}

pub(super) fn str_or_none(py: Python<'_>, v: Option<&V<'_>>) -> R<Option<String>> {
    match v {
        None | Some(V::None) => Ok(None),
        Some(V::Str(s)) if s.is_empty() => Ok(None),
        Some(v) => Ok(Some(ident(py, v)?)),
    }
}

pub(super) fn first<'b, 'a>(attrs: &'b [(&'a str, V<'a>)], keys: &[String]) -> Option<&'b V<'a>> {
    keys.iter()
        .filter_map(|k| aget(attrs, k))
        .find(|v| v.present())
}

pub(super) fn is_code_like(s: &str) -> bool {
    !s.is_empty()
        && s.chars().count() <= MAX_CODE_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'/' | b'-'))
}

pub(super) fn short_code(py: Python<'_>, v: Option<&V<'_>>) -> R<Option<String>> {
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

pub(super) fn is_empty_result(v: &V<'_>) -> bool {
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

pub(super) const OLL_ENVELOPE: [&str; 5] = ["inputs", "input_str", "tags", "metadata", "kwargs"];

/// _unwrap_arguments -> (args, unwrapped?)
pub(super) fn unwrap_arguments<'a>(args: V<'a>) -> R<(V<'a>, bool)> {
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
            // smolagents' Tool.__call__ adds its own flag, "sanitize_inputs_outputs"
            let ok_keys = d
                .iter()
                .all(|(k, _)| k == "args" || k == "kwargs" || k == "sanitize_inputs_outputs");
            let no_args = !args.get("args").map(|a| a.truthy()).unwrap_or(false);
            if ok_keys && no_args {
                return Ok((kw.clone(), true));
            }
        }
    }
    Ok((args, false))
}

/// _unwrap_result -> (result, sent text if any, call id)
pub(super) fn unwrap_result<'a>(
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
