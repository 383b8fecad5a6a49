//! Why a run's root or an agent span stopped (streams/spanpath/termination.py).

use super::*;

impl SpanPath {
    pub(super) fn fill_termination(&self, py: Python<'_>, o: &mut Out, f: &Facts<'_, '_>) -> R<()> {
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
        if let Some((n, counted)) = self.declared_limit(&span.attrs)? {
            o.step_limit = Some(n);
            o.limit_counts = Some(counted);
        }
        let p = f.profile;
        let mut reason: Option<String> = None;
        for e in &span.events {
            // an observe-mode guard decided and recorded, and the run went on: not a stop
            let observed =
                matches!(aget(&e.attrs, "loopwatch.guard.mode"), Some(V::Str(m)) if m == "observe");
            if e.name == "loop_guard" && !observed {
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
}

/// The deepest level of objects read inside one attribute's JSON value (limits.py MAX_JSON_DEPTH).
const MAX_JSON_DEPTH: usize = 3;

impl SpanPath {
    /// The run's declared limit (streams/spanpath/limits.py `declared_limit`): the first
    /// integer attribute whose key names one; else the first JSON object an attribute holds
    /// with such a key inside, nearer levels first.
    fn declared_limit(&self, attrs: &[(&str, V<'_>)]) -> R<Option<(i64, String)>> {
        for (k, v) in attrs {
            if let Some(found) = self.limit_of(k, v) {
                return Ok(Some(found));
            }
        }
        for (_, v) in attrs {
            let parsed;
            let doc = match v {
                V::Str(text) if may_name_a_limit(text) => {
                    parsed = as_json(v)?;
                    &parsed
                }
                other => other,
            };
            if let V::Dict(_) = doc {
                if let Some(found) = self.limit_inside(doc) {
                    return Ok(Some(found));
                }
            }
        }
        Ok(None)
    }

    /// limits.py `_counts_against`: (the limit, what counts against it) when `key` names a
    /// limit and `value` is a positive integer.
    fn limit_of(&self, key: &str, value: &V<'_>) -> Option<(i64, String)> {
        match value {
            V::Int(n) if *n > 0 => self
                .limit_names
                .get(&limit_name(key))
                .map(|c| (*n, c.clone())),
            _ => None,
        }
    }

    fn limit_inside(&self, doc: &V<'_>) -> Option<(i64, String)> {
        let mut level: Vec<&V<'_>> = vec![doc];
        for _ in 0..MAX_JSON_DEPTH {
            let mut deeper = Vec::new();
            for obj in level {
                if let V::Dict(items) = obj {
                    for (k, v) in items {
                        if let Some(found) = self.limit_of(k, v) {
                            return Some(found);
                        }
                        if let V::Dict(_) = v {
                            deeper.push(v);
                        }
                    }
                }
            }
            level = deeper;
        }
        None
    }
}

/// limits.py `limit_name`: the key's last segment, lower case, without "_" and "-" ("" when
/// it is not ASCII).
fn limit_name(key: &str) -> String {
    let segment = key.rsplit('.').next().unwrap_or("");
    if !segment.is_ascii() {
        return String::new();
    }
    segment
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// limits.py `_MAY_NAME_A_LIMIT`: "max" or "limit" in the text, ASCII case ignored.
fn may_name_a_limit(text: &str) -> bool {
    let b = text.as_bytes();
    let has = |word: &[u8]| b.windows(word.len()).any(|w| w.eq_ignore_ascii_case(word));
    has(b"max") || has(b"limit")
}

pub(super) fn last_message_text(doc: &V<'_>) -> Option<String> {
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

/// The calls the span's enforced guard decisions kept from being dispatched, as
/// "<event time ns> <hold id or -> <call id>" (streams/spanpath/termination.py
/// `denied_calls`: loop_guard events not in observe mode, decision deny / reconcile / stop,
/// a non-empty string call id; distinct ids, in order, at most 8).
pub(super) fn denied_calls(span: &Span<'_>) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut out: Vec<String> = Vec::new();
    for e in &span.events {
        if e.name != "loop_guard" {
            continue;
        }
        let observed =
            matches!(aget(&e.attrs, "loopwatch.guard.mode"), Some(V::Str(m)) if m == "observe");
        let enforced = matches!(
            aget(&e.attrs, "loopwatch.guard.decision"),
            Some(V::Str(d)) if d == "deny" || d == "reconcile" || d == "stop"
        );
        if let Some(V::Str(id)) = aget(&e.attrs, "loopwatch.guard.call_id") {
            if !observed
                && enforced
                && !id.is_empty()
                && !found.iter().any(|f| f == id.as_ref())
                && found.len() < 8
            {
                found.push(id.to_string());
                let hold = hold_token(aget(&e.attrs, "loopwatch.guard.hold_id"));
                out.push(format!("{} {} {}", e.time, hold, id));
            }
        }
    }
    out
}

/// A decision's hold id as the denial records it (termination.py `hold_token`): 1-64
/// characters of ASCII letters, digits and `._:-`; anything else "-".
fn hold_token<'a>(value: Option<&'a V<'_>>) -> &'a str {
    match value {
        Some(V::Str(h))
            if !h.is_empty()
                && h.len() <= 64
                && h.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"._:-".contains(&c)) =>
        {
            h.as_ref()
        }
        _ => "-",
    }
}
