//! Tool and handoff steps: names, call ids, arguments and results reduced to digests.

use super::*;

impl SpanPath {
    pub(super) fn fill_handoff(&self, py: Python<'_>, o: &mut Out, f: &Facts<'_, '_>) -> R<()> {
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

    pub(super) fn fill_tool<'a>(
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
        let sim = match contract {
            Some(c) => &c.similarity,
            None => &self.similarity,
        };
        if sim.enabled {
            let (sketch, identity) = self.sketch_call(py, &args, contract, sim)?;
            o.action_sketch = sketch;
            o.identity_fp = identity;
            if has_result && code.is_none() && !o.empty_result {
                // (a failure or an empty result is never compared: detectors/similarity.py)
                if sim.result_items {
                    let (sketch, items) = self.sketch_result(&result)?;
                    o.result_sketch = sketch;
                    o.result_items = items;
                } else {
                    o.result_sketch = self.sketch_value(&result);
                }
            }
        }
        Ok(())
    }
}
