//! One span into one step (streams/spanpath/normalize.py `Normalizer._step`), and the step
//! into its Python object.

use super::*;

impl SpanPath {
    // -------------------------------------------------------------- the step

    /// Ok(Ok(step)) / Ok(Err(exception name)) for an invalid span / Err(Hard).
    pub(super) fn step<'a>(
        &self,
        py: Python<'_>,
        span: &Span<'a>,
        res: &Res<'a>,
        now_ns: u128,
    ) -> R<Result<Out, &'static str>> {
        if span.end as u128 > now_ns + MAX_FUTURE_NS {
            return Ok(Err("ValueError"));
        }
        let profile = self
            .profiles
            .iter()
            .find(|p| {
                p.everything
                    || p.scopes.contains(span.scope)
                    || p.scope_prefixes
                        .iter()
                        .any(|x| span.scope.starts_with(x.as_str()))
                    || p.has_attributes
                        .iter()
                        .any(|a| span.attrs.iter().any(|(k, _)| k == a))
            })
            .ok_or(Hard)?; // no profile: Python raises StopIteration
        let view = self.view(profile, span);
        let mut f = Facts {
            span,
            profile,
            view,
            tool: RefCell::new(None),
        };
        let mut kind = OTHER;
        let mut matched = false;
        for (k, m) in &profile.kinds {
            if self.matches(py, m, &f)? {
                kind = k;
                matched = true;
                break;
            }
        }
        if !matched && span.parent.is_some() {
            // no kind rule matched: read the span by what it carries (fallback.rs)
            if let Some((k, picks)) = self.fallback.classify(&span.attrs)? {
                kind = k;
                for (field, at) in picks {
                    if f.view[field].is_none() {
                        f.view[field] = Some(&span.attrs[at].1);
                    }
                }
                *f.tool.borrow_mut() = None;
            }
        }
        let v = |i: usize| f.view[i];
        let mut o = Out {
            kind,
            ..Default::default()
        };
        // run id
        o.run_id = match &self.run_keys {
            Some(_) => {
                let value = v(F_RUN_KEY).or(res.run_key.as_ref());
                match value {
                    Some(x) if !x.is_none() => ident(py, x)?,
                    _ => span.trace_id.clone(),
                }
            }
            None => span.trace_id.clone(),
        };
        o.sequence = self.sequence_of(py, &f)?;
        o.content_digest = self.content_digest(py, span, &f)?;
        o.is_root = span.parent.is_none();
        o.status_error = span.status_code == STATUS_ERROR;
        o.denied_calls = denied_calls(span);
        o.service_name = res.service.clone();
        let derived = &profile.derived;
        let mut prompt_version = v(F_PROMPT_VERSION).cloned();
        if prompt_version.is_none() && !derived[F_PROMPT_VERSION].is_empty() {
            prompt_version = self.field(py, F_PROMPT_VERSION, &f, None)?;
        }
        o.prompt_version = match &prompt_version {
            Some(x) => Some(ident(py, x)?),
            None => res.prompt_version.clone(),
        };
        let mut agent = v(F_AGENT_NAME).cloned();
        if agent.is_none() && !derived[F_AGENT_NAME].is_empty() {
            agent = self.field(py, F_AGENT_NAME, &f, None)?;
        }
        o.agent_name = str_or_none(py, agent.as_ref())?;
        o.session_id = str_or_none(py, v(F_CONVERSATION))?;
        o.task_type = match v(F_TASK_TYPE) {
            Some(x) => Some(ident(py, x)?),
            None => res.task_type.clone(),
        };
        if let Some(x) = v(F_INPUT_TOKENS) {
            o.input_tokens = as_count(py, x)?;
        }
        if let Some(x) = v(F_OUTPUT_TOKENS) {
            o.output_tokens = as_count(py, x)?;
        }
        if kind == TOOL {
            self.fill_tool(py, &mut o, span, res, &f)?;
        } else if kind == HANDOFF {
            self.fill_handoff(py, &mut o, &f)?;
        } else if kind == PLAN {
            let raw = as_json(v(F_PLAN_STEPS).unwrap_or(&V::None))?;
            o.plan_fp = self.plan_fp(py, &plan_calls(py, &raw)?)?;
        } else if kind == LLM {
            let calls = self.requested_calls(py, &f)?;
            if calls.len() >= 2 {
                o.plan_fp = self.plan_fp(py, &calls)?;
            }
            let mut finish = self.field(py, F_FINISH_REASON, &f, None)?;
            if let Some(V::List(items)) = &finish {
                finish = items.last().cloned();
                if matches!(finish, Some(V::None)) {
                    finish = None;
                }
            }
            o.model = str_or_none(py, v(F_MODEL))?;
            o.wants_tools = !calls.is_empty()
                || match &finish {
                    Some(V::Str(s)) => self.tool_call_finish.contains(py_lower(py, s)?.as_ref()),
                    _ => false,
                };
            if self.turn_sketches {
                if let Some(out) = v(F_MODEL_OUTPUT) {
                    o.action_sketch = self.sketch_value(&as_json(out)?);
                }
                if let Some(obs) = self.last_input_message(&f)? {
                    o.result_sketch = self.sketch_value(&as_json(&obs)?);
                }
            }
        }
        if o.is_root || kind == AGENT {
            self.fill_termination(py, &mut o, &f)?;
        }
        Ok(Ok(o))
    }

    pub(super) fn sequence_of(&self, py: Python<'_>, f: &Facts<'_, '_>) -> R<Option<i64>> {
        if let Some(x) = f.view[F_SEQUENCE] {
            match as_int(py, x)? {
                AsInt::Small(n) => return Ok(Some(n)),
                AsInt::Big => return Err(Hard),
                AsInt::No => {}
            }
        }
        if let Some(meta) = f.view[F_METADATA] {
            let meta = as_json(meta)?;
            if let V::Dict(_) = meta {
                for key in &self.sequence {
                    if let Some(x) = meta.get(key) {
                        match as_int(py, x)? {
                            AsInt::Small(n) => return Ok(Some(n)),
                            AsInt::Big => return Err(Hard),
                            AsInt::No => {}
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    pub(super) fn content_digest(
        &self,
        py: Python<'_>,
        span: &Span<'_>,
        f: &Facts<'_, '_>,
    ) -> R<String> {
        let mut t = String::with_capacity(128);
        t.push('(');
        repr_str_into(py, span.name, &mut t)?;
        t.push_str(&format!(
            ", {}, {}, {}, ",
            span.start, span.end, span.status_code
        ));
        match &span.parent {
            Some(p) => repr_str_into(py, p, &mut t)?,
            None => t.push_str("None"),
        }
        t.push_str(&format!(", {}", span.attrs.len()));
        for i in [F_ARGUMENTS, F_RESULT, F_INPUT_TOKENS, F_OUTPUT_TOKENS] {
            t.push_str(", ");
            match f.view[i] {
                Some(x) => repr_into(py, x, &mut t, 0)?,
                None => t.push_str("None"),
            }
        }
        t.push(')');
        Ok(format!("{:08x}", crc32(t.as_bytes())))
    }
}

impl SpanPath {
    pub(super) fn to_python<'py>(
        &self,
        py: Python<'py>,
        span: &Span<'_>,
        o: Out,
        shared: &mut Shared<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        fn opt<'py>(py: Python<'py>, s: Option<String>) -> Bound<'py, PyAny> {
            match s {
                Some(s) => PyString::new(py, &s).into_any(),
                None => py.None().into_bound(py),
            }
        }
        // the values the spans of a request mostly share: one str object each
        let mut one = |x: Option<&str>| match x {
            Some(x) => shared.get(py, x),
            None => py.None().into_bound(py),
        };
        let run_id = one(Some(&o.run_id));
        let trace_id = one(Some(&span.trace_id));
        let parent = one(span.parent.as_deref());
        let name = one(Some(&o.name));
        let tool_version = one(o.tool_version.as_deref());
        let prompt_version = one(o.prompt_version.as_deref());
        let agent_name = one(o.agent_name.as_deref());
        let service_name = one(o.service_name.as_deref());
        let session_id = one(o.session_id.as_deref());
        let task_type = one(o.task_type.as_deref());
        let from_agent = one(o.from_agent.as_deref());
        let to_agent = one(o.to_agent.as_deref());
        let s = |x: &str| PyString::new(py, x).into_any();
        let b = |x: bool| pyo3::types::PyBool::new(py, x).to_owned().into_any();
        let items: Vec<Bound<'py, PyAny>> = vec![
            run_id,
            trace_id,
            s(&span.span_id),
            parent,
            pyo3::intern!(py, "x").clone().into_any(), // replaced below
            span.start.into_pyobject(py)?.into_any(),
            span.end.into_pyobject(py)?.into_any(),
            match o.sequence {
                Some(n) => n.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            },
            s(&o.content_digest),
            name,
            opt(py, o.call_id),
            tool_version,
            prompt_version,
            agent_name,
            service_name,
            session_id,
            task_type,
            opt(py, o.action_fp),
            opt(py, o.result_fp),
            opt(py, o.error_code),
            b(o.empty_result),
            match o.version {
                Some(x) => pyo3::types::PyFloat::new(py, x).into_any(),
                None => py.None().into_bound(py),
            },
            opt(py, o.state_fp),
            b(o.state_terminal),
            opt(py, o.cursor_fp),
            PyTuple::new(py, o.item_fps.iter().map(|x| PyString::new(py, x)))?.into_any(),
            opt(py, o.business_fp),
            opt(py, o.idempotency_fp),
            from_agent,
            to_agent,
            opt(py, o.plan_fp),
            o.input_tokens.into_pyobject(py)?.into_any(),
            o.output_tokens.into_pyobject(py)?.into_any(),
            b(o.is_root),
            b(o.status_error),
            opt(py, o.termination),
            match o.guard_ns {
                Some(n) => n.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            },
            b(o.wants_tools),
            opt(py, o.model),
            match o.step_limit {
                Some(n) => n.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            },
            opt(py, o.limit_counts),
            opt(py, o.action_sketch),
            opt(py, o.result_sketch),
            s(&o.result_items),
            opt(py, o.identity_fp),
            PyTuple::new(py, o.denied_calls.iter().map(|x| PyString::new(py, x)))?.into_any(),
        ];
        let mut items = items;
        items[4] = match o.kind {
            TOOL => pyo3::intern!(py, "tool"),
            HANDOFF => pyo3::intern!(py, "handoff"),
            PLAN => pyo3::intern!(py, "plan"),
            LLM => pyo3::intern!(py, "llm"),
            SUMMARY => pyo3::intern!(py, "summary"),
            AGENT => pyo3::intern!(py, "agent"),
            _ => pyo3::intern!(py, "other"),
        }
        .clone()
        .into_any();
        self.step_cls.bind(py).call1(PyTuple::new(py, items)?)
    }
}

/// One Python str per distinct value within a request (run and trace ids, names, labels):
/// the steps of a run hold the same few values, and a new str for each field of each step
/// was an allocation the run's state then kept.
#[derive(Default)]
pub(super) struct Shared<'py> {
    strs: HashMap<String, Bound<'py, PyString>>,
}

impl<'py> Shared<'py> {
    pub(super) fn get(&mut self, py: Python<'py>, text: &str) -> Bound<'py, PyAny> {
        if let Some(s) = self.strs.get(text) {
            return s.clone().into_any();
        }
        let s = PyString::new(py, text);
        self.strs.insert(text.to_string(), s.clone());
        s.into_any()
    }
}
