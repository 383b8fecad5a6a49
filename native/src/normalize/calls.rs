//! The tool calls a model turn requested and the steps a plan lists (streams/spanpath/calls.py).

use super::*;

pub(super) fn genai_message_calls<'a>(messages: &V<'a>, py: Python<'_>) -> R<Vec<(String, V<'a>)>> {
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

pub(super) fn flat_calls<'a>(
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

pub(super) fn call_list<'a>(value: &V<'a>) -> R<Vec<(String, V<'a>)>> {
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

pub(super) fn plan_calls<'a>(py: Python<'_>, raw: &V<'a>) -> R<Vec<(String, V<'a>)>> {
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

impl SpanPath {
    pub(super) fn requested_calls<'a>(
        &self,
        py: Python<'_>,
        f: &Facts<'_, 'a>,
    ) -> R<Vec<(String, V<'a>)>> {
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
}
