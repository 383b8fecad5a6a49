//! The policy spec (streams/spanpath/native_spec.py's JSON) parsed into profiles, matchers,
//! field sources and tool contracts.

use super::*;

pub(super) fn ve<S: Into<String>>(s: S) -> PyErr {
    PyValueError::new_err(s.into())
}

pub(super) fn sget<'v>(d: &'v V<'static>, key: &str) -> Result<&'v V<'static>, SpecErr> {
    d.get(key).ok_or_else(|| format!("spec: missing {}", key))
}

pub(super) fn s_str(v: &V<'static>, what: &str) -> Result<String, SpecErr> {
    v.as_str()
        .map(|s| s.to_string())
        .ok_or_else(|| format!("spec: {} is not a string", what))
}

pub(super) fn s_opt_str(d: &V<'static>, key: &str) -> Result<Option<String>, SpecErr> {
    match d.get(key) {
        None | Some(V::None) => Ok(None),
        Some(v) => s_str(v, key).map(Some),
    }
}

pub(super) fn s_strs(v: &V<'static>, what: &str) -> Result<Vec<String>, SpecErr> {
    match v {
        V::List(items) => items.iter().map(|x| s_str(x, what)).collect(),
        _ => Err(format!("spec: {} is not a list", what)),
    }
}

pub(super) fn s_list<'v>(v: &'v V<'static>, what: &str) -> Result<&'v Vec<V<'static>>, SpecErr> {
    match v {
        V::List(items) => Ok(items),
        _ => Err(format!("spec: {} is not a list", what)),
    }
}

pub(super) fn s_map(v: &V<'static>, what: &str) -> Result<HashMap<String, String>, SpecErr> {
    match v {
        V::Dict(items) => items
            .iter()
            .map(|(k, x)| Ok((k.to_string(), s_str(x, what)?)))
            .collect(),
        _ => Err(format!("spec: {} is not a mapping", what)),
    }
}

pub(super) fn field_index(name: &str) -> Result<usize, SpecErr> {
    FIELDS
        .iter()
        .position(|f| *f == name)
        .ok_or_else(|| format!("spec: unknown field {}", name))
}

pub(super) fn kind_name(k: &str) -> Result<&'static str, SpecErr> {
    Ok(match k {
        "tool" => TOOL,
        "handoff" => HANDOFF,
        "plan" => PLAN,
        "llm" => LLM,
        "summary" => SUMMARY,
        "other" => OTHER,
        "agent" => AGENT,
        _ => return Err(format!("spec: unknown kind {}", k)),
    })
}

pub(super) fn parse_matcher(v: &V<'static>) -> Result<M, SpecErr> {
    let items = v.dict().ok_or("spec: a matcher is not a mapping")?;
    if items.len() != 1 {
        return Err("spec: a matcher has one key".into());
    }
    let (key, arg) = &items[0];
    let set = |a: &V<'static>| -> Result<HashSet<String>, SpecErr> {
        Ok(s_strs(a, key)?.into_iter().collect())
    };
    Ok(match key.as_ref() {
        "all" => M::All(
            s_list(arg, "all")?
                .iter()
                .map(parse_matcher)
                .collect::<Result<_, _>>()?,
        ),
        "any" => M::Any(
            s_list(arg, "any")?
                .iter()
                .map(parse_matcher)
                .collect::<Result<_, _>>()?,
        ),
        "not" => M::Not(Box::new(parse_matcher(arg)?)),
        "root" => match arg {
            V::Bool(b) => M::Root(*b),
            _ => return Err("spec: root is not a bool".into()),
        },
        "has" => M::Has(
            s_strs(arg, "has")?
                .iter()
                .map(|f| field_index(f))
                .collect::<Result<_, _>>()?,
        ),
        "field" | "attribute" => {
            let pair = s_list(arg, key)?;
            if pair.len() != 2 {
                return Err("spec: field/attribute is [name, values]".into());
            }
            let name = s_str(&pair[0], key)?;
            let values = set(&pair[1])?;
            if key == "field" {
                M::FieldIn(field_index(&name)?, values)
            } else {
                M::AttrIn(name, values)
            }
        }
        "name" => M::Name(set(arg)?),
        "name_prefix" => M::NamePrefix(s_strs(arg, key)?),
        "name_suffix" => M::NameSuffix(s_strs(arg, key)?),
        "name_contains" => M::NameContains(s_strs(arg, key)?),
        "tool_name" => M::ToolName(set(arg)?),
        "tool_name_prefix" => M::ToolNamePrefix(s_strs(arg, key)?),
        other => return Err(format!("spec: unknown matcher {}", other)),
    })
}

pub(super) fn parse_source(v: &V<'static>) -> Result<Source, SpecErr> {
    let mut path = Vec::new();
    if let Some(p) = v.get("path") {
        for step in s_list(p, "path")? {
            let pair = s_list(step, "path step")?;
            let key = s_str(&pair[0], "path key")?;
            let index = match &pair[1] {
                V::None => None,
                V::Int(i) if *i >= 0 => Some(*i as usize),
                _ => return Err("spec: path index".into()),
            };
            path.push((key, index));
        }
    }
    let format = match s_opt_str(v, "format")?.as_deref() {
        None => None,
        Some("genai_messages") => Some(Fmt::GenaiMessages),
        Some("call_list") => Some(Fmt::CallList),
        Some("openinference_flat") => Some(Fmt::OpenInferenceFlat),
        Some(other) => return Err(format!("spec: unknown call format {}", other)),
    };
    Ok(Source {
        attribute: s_opt_str(v, "attribute")?,
        event: s_opt_str(v, "event")?,
        path,
        plain: matches!(v.get("plain"), Some(V::Bool(true))),
        format,
        name_after: s_opt_str(v, "name_after")?,
        name_before: s_opt_str(v, "name_before")?,
        span_name: matches!(v.get("span_name"), Some(V::Bool(true))),
        argument: s_opt_str(v, "argument")?,
        tool_name_after: s_opt_str(v, "tool_name_after")?,
        when: match v.get("when") {
            None | Some(V::None) => None,
            Some(m) => Some(parse_matcher(m)?),
        },
    })
}

pub(super) fn compile_pattern(py: Python<'_>, pattern: &str) -> PyResult<Py<PyAny>> {
    let re = py.import("re")?;
    Ok(re
        .call_method1(pyo3::intern!(py, "compile"), (pattern,))?
        .getattr(pyo3::intern!(py, "search"))?
        .unbind())
}

pub(super) fn patterns(py: Python<'_>, v: &V<'static>) -> PyResult<Vec<(Py<PyAny>, String)>> {
    let mut out = Vec::new();
    for pair in s_list(v, "patterns").map_err(ve)? {
        let pair = s_list(pair, "pattern").map_err(ve)?;
        let p = s_str(&pair[0], "pattern").map_err(ve)?;
        let r = s_str(&pair[1], "pattern").map_err(ve)?;
        out.push((compile_pattern(py, &p)?, r));
    }
    Ok(out)
}

pub(super) fn parse_profile(
    py: Python<'_>,
    v: &V<'static>,
    common: &[(usize, Vec<String>)],
) -> PyResult<Profile> {
    let scopes: HashSet<String> = s_strs(sget(v, "scopes").map_err(ve)?, "scopes")
        .map_err(ve)?
        .into_iter()
        .collect();
    let scope_prefixes = s_strs(sget(v, "scope_prefixes").map_err(ve)?, "x").map_err(ve)?;
    let has_attributes = s_strs(sget(v, "has_attributes").map_err(ve)?, "x").map_err(ve)?;
    let everything = scopes.is_empty() && scope_prefixes.is_empty() && has_attributes.is_empty();
    let mut kinds = Vec::new();
    for rule in s_list(sget(v, "kinds").map_err(ve)?, "kinds").map_err(ve)? {
        let kind =
            kind_name(&s_str(sget(rule, "kind").map_err(ve)?, "kind").map_err(ve)?).map_err(ve)?;
        kinds.push((
            kind,
            parse_matcher(sget(rule, "match").map_err(ve)?).map_err(ve)?,
        ));
    }
    let mut keymap: HashMap<String, Vec<(usize, usize)>> = HashMap::default();
    let keys = sget(v, "keys")
        .map_err(ve)?
        .dict()
        .ok_or_else(|| ve("keys"))?;
    let mut lists: Vec<(usize, Vec<String>)> = Vec::new();
    for (f, ks) in keys {
        lists.push((field_index(f).map_err(ve)?, s_strs(ks, "keys").map_err(ve)?));
    }
    lists.extend(common.iter().cloned());
    for (f, ks) in lists {
        for (rank, k) in ks.into_iter().enumerate() {
            keymap.entry(k).or_default().push((f, rank));
        }
    }
    let mut derived: Vec<Vec<Source>> = (0..NF).map(|_| Vec::new()).collect();
    for (f, sources) in sget(v, "derived")
        .map_err(ve)?
        .dict()
        .ok_or_else(|| ve("derived"))?
    {
        let idx = field_index(f).map_err(ve)?;
        for s in s_list(sources, "sources").map_err(ve)? {
            derived[idx].push(parse_source(s).map_err(ve)?);
        }
    }
    let term = sget(v, "termination").map_err(ve)?;
    Ok(Profile {
        scopes,
        scope_prefixes,
        has_attributes,
        everything,
        kinds,
        keymap,
        derived,
        exception_types: s_map(sget(term, "exception_types").map_err(ve)?, "x").map_err(ve)?,
        message_patterns: patterns(py, sget(term, "message_patterns").map_err(ve)?)?,
        finish_reasons: s_map(sget(term, "finish_reasons").map_err(ve)?, "x").map_err(ve)?,
    })
}

pub(super) fn parse_contract(name: &str, v: &V<'static>) -> Result<Contract, SpecErr> {
    let opt_strs = |key: &str| -> Result<Option<Vec<String>>, SpecErr> {
        match v.get(key) {
            None | Some(V::None) => Ok(None),
            Some(x) => s_strs(x, key).map(Some),
        }
    };
    let defaults = match sget(v, "defaults")? {
        V::Dict(d) => d.clone(),
        _ => return Err("spec: defaults is not a mapping".into()),
    };
    let mut normalize = Vec::new();
    for (arg, ops) in sget(v, "normalize")?.dict().ok_or("spec: normalize")? {
        let mut list = Vec::new();
        for op in s_strs(ops, "ops")? {
            list.push(match op.as_str() {
                "trim" => Op::Trim,
                "lowercase" => Op::Lower,
                "collapse_whitespace" => Op::Collapse,
                other => return Err(format!("normalization {:?} is not native", other)),
            });
        }
        normalize.push((arg.to_string(), list));
    }
    Ok(Contract {
        name: name.to_string(),
        identity: opt_strs("identity")?,
        defaults,
        normalize,
        version_field: s_opt_str(v, "version_field")?,
        state_field: s_opt_str(v, "state_field")?,
        terminal_states: s_strs(sget(v, "terminal_states")?, "terminal_states")?
            .into_iter()
            .collect(),
        cursor_arg: s_opt_str(v, "cursor_arg")?,
        new_items_field: s_opt_str(v, "new_items_field")?,
        side_effect: matches!(v.get("side_effect"), Some(V::Bool(true))),
        idempotency_key_arg: s_opt_str(v, "idempotency_key_arg")?,
        business_identity: opt_strs("business_identity")?,
        similarity: parse_sim(sget(v, "similarity")?)?,
    })
}

/// {"enabled", "arguments" (null: all), "result_items"} (native_spec.py `_similarity`).
pub(super) fn parse_sim(v: &V<'static>) -> Result<Sim, SpecErr> {
    let arguments = match v.get("arguments") {
        None | Some(V::None) => None,
        Some(x) => Some(s_strs(x, "similarity.arguments")?),
    };
    Ok(Sim {
        enabled: matches!(v.get("enabled"), Some(V::Bool(true))),
        arguments,
        result_items: matches!(v.get("result_items"), Some(V::Bool(true))),
    })
}
