//! One export request: spans decoded, normalized and grouped by run.

use super::*;

#[pymethods]
impl SpanPath {
    /// SpanPath(spec_json, step_cls, key): `spec_json` from streams/spanpath/native_spec.py; raises
    /// ValueError naming what the native side does not support.
    #[new]
    #[pyo3(signature = (spec, step_cls, key=None))]
    fn new(py: Python<'_>, spec: &str, step_cls: Py<PyAny>, key: Option<&[u8]>) -> PyResult<Self> {
        let root = match loads(spec) {
            Ok(v) => crate::pyval::into_owned(v),
            Err(_) => return Err(ve("spec: not JSON the native side can read")),
        };
        let fields = s_strs(sget(&root, "step_fields").map_err(ve)?, "step_fields").map_err(ve)?;
        if fields.iter().map(|x| x.as_str()).collect::<Vec<_>>() != STEP_FIELDS.to_vec() {
            return Err(ve("Step fields differ from the native build's"));
        }
        let opt_strs = |k: &str| -> PyResult<Option<Vec<String>>> {
            match root.get(k) {
                None | Some(V::None) => Ok(None),
                Some(x) => Ok(Some(s_strs(x, k).map_err(ve)?)),
            }
        };
        let strs = |k: &str| -> PyResult<Vec<String>> {
            s_strs(sget(&root, k).map_err(ve)?, k).map_err(ve)
        };
        let run_keys = opt_strs("run_keys")?;
        let task_attr = s_opt_str(&root, "task_attr").map_err(ve)?;
        let sequence = strs("sequence")?;
        // the fields every profile reads the same way, keys in rank order
        // (streams/spanpath/runkey.py `common_fields`: the rule is written there only)
        let mut common: Vec<(usize, Vec<String>)> = Vec::new();
        for (name, keys) in sget(&root, "common_fields")
            .map_err(ve)?
            .dict()
            .ok_or_else(|| ve("spec: common_fields is not a mapping"))?
        {
            common.push((
                field_index(name).map_err(ve)?,
                s_strs(keys, "common_fields").map_err(ve)?,
            ));
        }
        let mut profiles = Vec::new();
        for p in s_list(sget(&root, "profiles").map_err(ve)?, "profiles").map_err(ve)? {
            profiles.push(parse_profile(py, p, &common)?);
        }
        let mut tools = HashMap::default();
        for (name, c) in sget(&root, "tools")
            .map_err(ve)?
            .dict()
            .ok_or_else(|| ve("tools"))?
        {
            tools.insert(name.to_string(), parse_contract(name, c).map_err(ve)?);
        }
        let out_of_steps = compile_pattern(
            py,
            &s_str(sget(&root, "out_of_steps").map_err(ve)?, "out_of_steps").map_err(ve)?,
        )?;
        Ok(SpanPath {
            pads: key.and_then(pads_of),
            run_keys,
            resource_prompt_version: strs("resource_prompt_version")?,
            resource_tool_version: strs("resource_tool_version")?,
            sequence,
            task_attr,
            known_codes: strs("known_codes")?.into_iter().collect(),
            status_codes: strs("status_codes")?,
            transient: patterns(py, sget(&root, "transient_patterns").map_err(ve)?)?,
            out_of_steps,
            tool_call_finish: strs("tool_call_finish_reasons")?.into_iter().collect(),
            profiles,
            fallback: fallback::Fallback::parse(sget(&root, "fallback").map_err(ve)?)
                .map_err(ve)?,
            limit_names: s_map(sget(&root, "limit_names").map_err(ve)?, "limit_names")
                .map_err(ve)?,
            tools,
            step_cls,
            sketch_base: sketch_base(key),
            similarity: parse_sim(sget(&root, "similarity").map_err(ve)?).map_err(ve)?,
            turn_sketches: matches!(root.get("turn_sketches"), Some(V::Bool(true))),
        })
    }

    /// normalize(data) -> None, or (steps by run id, invalid count, latest end, span count,
    /// [(span_id, trace_id, exception name)] of the invalid spans, earliest and latest end
    /// of all spans (0, 0 without spans)): what
    /// `group_steps(normalizer, decode_proto(data))` gives. None: the batch needs the Python
    /// path (malformed input, for its error; or a value only Python decides).
    fn normalize<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Batch<'py>> {
        match wire::parse_request(data) {
            Ok(tree) => self.batch(py, &tree),
            Err(_) => Ok(None),
        }
    }

    /// normalize_json(data, max_depth, max_digits, trailing_comma_msgs) -> what `normalize`
    /// gives, for OTLP JSON bytes: `group_steps(normalizer, decode_json(data))`. None where
    /// the Python decoder raises, and for documents nested deeper than `max_depth` (its
    /// outcome there depends on Python's recursion limit); the other arguments are the
    /// interpreter's, as for `decode_json`.
    fn normalize_json<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        max_depth: usize,
        max_digits: usize,
        trailing_comma_msgs: bool,
    ) -> PyResult<Batch<'py>> {
        let opts = crate::json::Opts {
            max_depth,
            max_digits,
            trailing_comma_msgs,
        };
        // messages are not shown: any error hands the document to the Python path
        let repr = |key: &str| -> String { key.to_string() };
        crate::json::with_request(data, opts, &repr, |tree| self.batch(py, tree))
            .unwrap_or(Ok(None))
    }
}

impl SpanPath {
    /// One parsed request -> the grouped steps (see `normalize`).
    fn batch<'a, 'py>(
        &self,
        py: Python<'py>,
        tree: &'a [wire::ResourceSpans<'a>],
    ) -> PyResult<Batch<'py>> {
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        // the Python decoder validates every span before any is normalized
        for rs in tree {
            for ss in &rs.scopes {
                for sp in &ss.spans {
                    let (tid, sid, pid): (&[u8], &[u8], &[u8]) =
                        (&sp.trace_id, &sp.span_id, &sp.parent);
                    if !ids_valid(tid, sid, pid) {
                        return Ok(None);
                    }
                }
            }
        }
        let mut shared = Shared::default();
        let mut order: Vec<(String, Vec<Bound<'py, PyAny>>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::default();
        let mut invalid = 0usize;
        let invalid_list = PyList::empty(py);
        let mut max_end = 0u64;
        let (mut first_end, mut last_end) = (u64::MAX, 0u64); // over every span, valid or not
        let mut n = 0usize;
        for rs in tree {
            let resource = match conv_attrs(&rs.resource) {
                Ok(r) => r,
                Err(Hard) => return Ok(None),
            };
            let res = match self.resource(py, &resource) {
                Ok(r) => r,
                Err(Hard) => return Ok(None),
            };
            for ss in &rs.scopes {
                for sp in &ss.spans {
                    n += 1;
                    first_end = first_end.min(sp.end);
                    last_end = last_end.max(sp.end);
                    let attrs = match conv_attrs(&sp.attrs) {
                        Ok(a) => a,
                        Err(Hard) => return Ok(None),
                    };
                    let mut events = Vec::with_capacity(sp.events.len());
                    for ev in &sp.events {
                        match conv_attrs(&ev.attrs) {
                            Ok(a) => events.push(Ev {
                                name: ev.name,
                                time: ev.time,
                                attrs: a,
                            }),
                            Err(Hard) => return Ok(None),
                        }
                    }
                    let pid: &[u8] = &sp.parent;
                    let span = Span {
                        trace_id: hex(&sp.trace_id),
                        span_id: hex(&sp.span_id),
                        parent: parent_hex(pid),
                        name: sp.name,
                        start: sp.start,
                        end: sp.end,
                        status_code: sp.status_code,
                        status_message: sp.status_message,
                        scope: ss.scope_name,
                        attrs,
                        events,
                    };
                    match self.step(py, &span, &res, now_ns) {
                        Err(Hard) => return Ok(None),
                        Ok(Err(exc)) => {
                            invalid += 1;
                            invalid_list.append((&span.span_id, &span.trace_id, exc))?;
                        }
                        Ok(Ok(o)) => {
                            let run_id = o.run_id.clone();
                            let end = span.end;
                            let step = self.to_python(py, &span, o, &mut shared)?;
                            match index.get(&run_id) {
                                Some(&i) => order[i].1.push(step),
                                None => {
                                    index.insert(run_id.clone(), order.len());
                                    order.push((run_id, vec![step]));
                                }
                            }
                            if end > max_end {
                                max_end = end;
                            }
                        }
                    }
                }
            }
        }
        let by_run = PyDict::new(py);
        for (run_id, steps) in order {
            by_run.set_item(shared.get(py, &run_id), PyList::new(py, steps)?)?;
        }
        if n == 0 {
            first_end = 0;
        }
        Ok(Some((
            by_run,
            invalid,
            max_end,
            n,
            invalid_list,
            first_end,
            last_end,
        )))
    }
}
