//! The generic fallback (streams/spanpath/fallback.py): what a span no kind rule matched is,
//! by the attributes it carries. The key tables come in the spec; the rule is here.

use super::*;

pub(super) struct Keys {
    exact: Vec<String>,
    suffixes: Vec<String>,
    json_only: Vec<String>,
}

pub(super) struct Fallback {
    model: Keys,
    tool_name: Keys,
    fields: Vec<(&'static str, usize, Keys)>, // (kind, field index, keys)
}

fn is_json_container(v: &V<'_>) -> R<bool> {
    Ok(match v {
        V::Dict(_) | V::List(_) => true,
        V::Str(_) => matches!(as_json(v)?, V::Dict(_) | V::List(_)),
        _ => false,
    })
}

impl Keys {
    fn parse(v: &V<'static>, what: &str) -> Result<Keys, SpecErr> {
        Ok(Keys {
            exact: s_strs(sget(v, "exact")?, what)?,
            suffixes: s_strs(sget(v, "suffixes")?, what)?,
            json_only: s_strs(sget(v, "json_only")?, what)?,
        })
    }

    /// The index in `attrs` of the attribute these keys read, if any.
    fn find(&self, attrs: &Attrs<'_>, strings_only: bool) -> R<Option<usize>> {
        let ok = |v: &V<'_>| v.present() && (!strings_only || matches!(v, V::Str(_)));
        let at = |key: &str| attrs.iter().position(|(k, _)| *k == key);
        for key in &self.exact {
            if let Some(i) = at(key) {
                if ok(&attrs[i].1) {
                    return Ok(Some(i));
                }
            }
        }
        for key in &self.json_only {
            if let Some(i) = at(key) {
                if ok(&attrs[i].1) && is_json_container(&attrs[i].1)? {
                    return Ok(Some(i));
                }
            }
        }
        if !self.suffixes.is_empty() {
            for (i, (k, v)) in attrs.iter().enumerate() {
                if self.suffixes.iter().any(|s| k.ends_with(s.as_str())) && ok(v) {
                    return Ok(Some(i));
                }
            }
        }
        Ok(None)
    }
}

impl Fallback {
    pub(super) fn parse(v: &V<'static>) -> Result<Fallback, SpecErr> {
        let mut fields = Vec::new();
        let mut tool_name = None;
        for (kind, by_field) in sget(v, "fields")?
            .dict()
            .ok_or_else(|| "spec: fallback.fields is not a mapping".to_string())?
        {
            let kind = kind_name(kind)?;
            for (name, keys) in by_field
                .dict()
                .ok_or_else(|| "spec: fallback.fields.* is not a mapping".to_string())?
            {
                if kind == TOOL && name == "tool_name" {
                    tool_name = Some(Keys::parse(keys, "fallback keys")?);
                }
                fields.push((
                    kind,
                    field_index(name)?,
                    Keys::parse(keys, "fallback keys")?,
                ));
            }
        }
        Ok(Fallback {
            model: Keys::parse(sget(v, "model")?, "fallback.model")?,
            tool_name: tool_name.ok_or_else(|| "spec: fallback has no tool_name".to_string())?,
            fields,
        })
    }

    /// (kind, [(field index, attribute index)]) for a span no kind rule matched, or None.
    pub(super) fn classify(
        &self,
        attrs: &Attrs<'_>,
    ) -> R<Option<(&'static str, Vec<(usize, usize)>)>> {
        let kind = if self.model.find(attrs, false)?.is_some() {
            LLM
        } else if self.tool_name.find(attrs, true)?.is_some() {
            TOOL
        } else {
            return Ok(None);
        };
        let mut picks = Vec::new();
        for (k, field, keys) in &self.fields {
            if *k == kind {
                if let Some(i) = keys.find(attrs, *field == F_TOOL_NAME)? {
                    picks.push((*field, i));
                }
            }
        }
        Ok(Some((kind, picks)))
    }
}
