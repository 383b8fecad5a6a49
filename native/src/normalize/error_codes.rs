//! A tool call's error code (streams/spanpath/error_codes.py).

use super::*;

impl SpanPath {
    pub(super) fn error_code<'a>(
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

    pub(super) fn stated_code(
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
}
