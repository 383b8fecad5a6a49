//! Recognition: a span's field view under its profile, the kind matchers, derived field
//! sources, and the resource's labels.

use super::*;

impl SpanPath {
    // -------------------------------------------------------------- recognition

    pub(super) fn view<'s, 'a>(
        &self,
        p: &'s Profile,
        span: &'s Span<'a>,
    ) -> [Option<&'s V<'a>>; NF] {
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

    pub(super) fn matches(&self, py: Python<'_>, m: &M, f: &Facts<'_, '_>) -> R<bool> {
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

    pub(super) fn tool_name(&self, py: Python<'_>, f: &Facts<'_, '_>) -> R<String> {
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
    pub(super) fn field<'a>(
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

    pub(super) fn derive<'a>(
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

    pub(super) fn resource<'a>(&self, py: Python<'_>, res: &[(&'a str, V<'a>)]) -> R<Res<'a>> {
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
}
