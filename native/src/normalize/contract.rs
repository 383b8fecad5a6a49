//! The tool contract applied to one call (detectors/contract.py).

use super::*;

impl SpanPath {
    pub(super) fn contract_args<'a>(
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

    pub(super) fn plan_fp(&self, py: Python<'_>, calls: &[(String, V<'_>)]) -> R<Option<String>> {
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
}

impl SpanPath {
    pub(super) fn action_fp<'a>(
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
                without_attempt_args(&mut merged, c);
            }
        }
        self.of_value(tool, &V::Dict(merged))
    }

    pub(super) fn fill_contract<'a>(
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
}

/// The arguments without the cursor and the idempotency key (contract.py
/// `without_attempt_args`): neither defines the action.
pub(super) fn without_attempt_args(merged: &mut Vec<(Cow<'_, str>, V<'_>)>, c: &Contract) {
    for arg in [&c.cursor_arg, &c.idempotency_key_arg]
        .into_iter()
        .flatten()
    {
        merged.retain(|(k, _)| k != arg);
    }
}

pub(super) fn pick<'a>(
    merged: &[(Cow<'a, str>, V<'a>)],
    keys: &[String],
) -> Vec<(Cow<'a, str>, V<'a>)> {
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
