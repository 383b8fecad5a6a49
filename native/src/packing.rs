//! The column writer of the worker's state format: `loopwatch_native.StateWriter`, the same
//! methods and the same bytes as `ColumnWriter` in `streams/worker/state/packing.py` (the reference, and
//! the fallback; `tests/unit/native/test_packing.py` runs both on the same values). The
//! worker encodes a run's state on every batch that touches it: in Python that is one
//! interpreted pass per column (about a hundred per state), here one typed loop.
//!
//! The JSON part (kinds, string pool, items) is encoded by the Python encoder handed to the
//! constructor: the items are the Python values themselves, so floats, big ints and anything
//! odd round-trip exactly as the reference writes them.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString};

use crate::pyval::crc32;

const FORMAT_PACKED: u8 = 2;

/// A value's exact type, as the reference's `set(map(type, values))` tells them apart.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ty {
    Str,
    Int,
    Bool,
    None,
    List,
    Other(usize), // the type object's address
}

fn ty_of(v: &Bound<'_, PyAny>) -> Ty {
    if v.is_none() {
        Ty::None
    } else if v.is_exact_instance_of::<PyString>() {
        Ty::Str
    } else if v.is_exact_instance_of::<PyInt>() {
        Ty::Int
    } else if v.is_exact_instance_of::<PyBool>() {
        Ty::Bool
    } else if v.is_exact_instance_of::<PyList>() {
        Ty::List
    } else {
        Ty::Other(v.get_type_ptr() as usize)
    }
}

/// The distinct types of `values`, at most 3 kept (more than 2 always means JSON).
fn types_of(values: &[Bound<'_, PyAny>]) -> Vec<Ty> {
    let mut out: Vec<Ty> = Vec::with_capacity(2);
    for v in values {
        let t = ty_of(v);
        if !out.contains(&t) {
            out.push(t);
            if out.len() > 2 {
                break;
            }
        }
    }
    out
}

/// `_ref_code`: the width of a reference into a pool of `pool_size` entries.
fn ref_width(pool_size: usize) -> usize {
    if pool_size <= 1 << 8 {
        1
    } else if pool_size <= 1 << 16 {
        2
    } else {
        4
    }
}

fn pack_refs(refs: &[u32], pool_size: usize, out: &mut Vec<u8>) {
    let width = ref_width(pool_size);
    for &r in refs {
        out.extend_from_slice(&r.to_le_bytes()[..width]);
    }
}

fn is_lower_hex(s: &str, width: usize) -> bool {
    s.len() == width
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn hex_value(b: u8) -> u8 {
    if b <= b'9' {
        b - b'0'
    } else {
        b - b'a' + 10
    }
}

/// `ColumnWriter` of streams/worker/state/packing.py (see there for the format).
#[pyclass(module = "loopwatch_native", unsendable)]
pub struct StateWriter {
    kinds: String,
    items: Py<PyList>,
    data: Vec<u8>,
    strs: Py<PyDict>, // string pool: entry -> index, in first-seen order (a dict keeps it)
    refs: Vec<u32>,
    ids: Py<PyDict>,   // the dedup map's span ids -> index
    encode: Py<PyAny>, // the reference's JSON encoder (`_JSON.encode`)
}

impl StateWriter {
    fn push_item<'py, T: IntoPyObject<'py>>(&self, py: Python<'py>, value: T) -> PyResult<()> {
        self.items.bind(py).append(value)
    }

    fn column_of(&mut self, py: Python<'_>, values: &[Bound<'_, PyAny>]) -> PyResult<()> {
        let types = types_of(values);
        if types.is_empty() || types == [Ty::None] {
            self.kinds.push('n'); // (an empty column writes nothing)
            return Ok(());
        }
        if types.len() == 1 {
            match types[0] {
                Ty::Str => return self.strs_of(py, values),
                Ty::Int => {
                    if self.ints(values) {
                        return Ok(());
                    }
                }
                Ty::Bool => {
                    let bits: Vec<u8> = values
                        .iter()
                        .map(|v| v.is_truthy().map(u8::from))
                        .collect::<PyResult<_>>()?;
                    if bits.iter().any(|&b| b != 0) {
                        self.kinds.push('z');
                        self.data.extend_from_slice(&bits);
                    } else {
                        self.kinds.push('f');
                    }
                    return Ok(());
                }
                Ty::List => {
                    self.kinds.push('l');
                    let mut flat: Vec<Bound<'_, PyAny>> = Vec::new();
                    let mut lengths: Vec<usize> = Vec::with_capacity(values.len());
                    for v in values {
                        let list = v.downcast::<PyList>()?;
                        lengths.push(list.len());
                        flat.extend(list.iter());
                    }
                    if lengths.iter().all(|&n| n == lengths[0]) {
                        self.push_item(py, lengths[0])?;
                    } else {
                        self.push_item(py, lengths)?;
                    }
                    return self.column_of(py, &flat);
                }
                _ => {}
            }
        } else if types.len() == 2 && types.contains(&Ty::None) {
            self.kinds.push('o');
            let mut mask = vec![0u8; (values.len() + 7) / 8];
            let mut rest: Vec<Bound<'_, PyAny>> = Vec::with_capacity(values.len());
            for (i, v) in values.iter().enumerate() {
                if v.is_none() {
                    mask[i / 8] |= 1 << (i % 8);
                } else {
                    rest.push(v.clone());
                }
            }
            let mask = py.get_type::<PyInt>().call_method1(
                intern!(py, "from_bytes"),
                (PyBytes::new(py, &mask), intern!(py, "little")),
            )?;
            self.push_item(py, mask)?;
            return self.column_of(py, &rest);
        }
        // floats, mixed types, ints wider than int64: JSON, exact
        self.kinds.push('j');
        self.push_item(py, PyList::new(py, values)?)
    }

    /// An int column in its smallest width; false when one is wider than int64.
    fn ints(&mut self, values: &[Bound<'_, PyAny>]) -> bool {
        let mut ints: Vec<i64> = Vec::with_capacity(values.len());
        for v in values {
            match v.extract::<i64>() {
                Ok(i) => ints.push(i),
                Err(_) => return false,
            }
        }
        let lo = ints.iter().copied().min().unwrap_or(0);
        let hi = ints.iter().copied().max().unwrap_or(0);
        let (code, width) = if -(1 << 7) <= lo && hi < 1 << 7 {
            ('b', 1)
        } else if -(1 << 15) <= lo && hi < 1 << 15 {
            ('h', 2)
        } else if -(1 << 31) <= lo && hi < 1 << 31 {
            ('i', 4)
        } else {
            ('q', 8)
        };
        self.kinds.push(code);
        for i in ints {
            self.data.extend_from_slice(&i.to_le_bytes()[..width]);
        }
        true
    }

    fn strs_of(&mut self, py: Python<'_>, values: &[Bound<'_, PyAny>]) -> PyResult<()> {
        let ids = self.ids.bind(py);
        if !ids.is_empty() {
            // span ids already in the dedup map: a one-byte index each
            let mut found: Vec<u32> = Vec::with_capacity(values.len());
            for v in values {
                match ids.get_item(v)? {
                    Some(i) => found.push(i.extract()?),
                    None => break,
                }
            }
            if found.len() == values.len() {
                self.kinds.push('r');
                pack_refs(&found, ids.len(), &mut self.data);
                return Ok(());
            }
        }
        let strings: Vec<&Bound<'_, PyString>> = values
            .iter()
            .map(|v| v.downcast::<PyString>())
            .collect::<Result<_, _>>()?;
        // equal-width lower-case hex (the reference checks the first value, then proves the
        // rest by a round trip through bytes: the same condition)
        if let Ok(first) = strings[0].to_str() {
            let width = first.len();
            if width > 0 && width % 2 == 0 && is_lower_hex(first, width) {
                let mut raw: Vec<u8> = Vec::with_capacity(values.len() * width / 2);
                let mut all = true;
                for s in &strings {
                    match s.to_str() {
                        Ok(t) if is_lower_hex(t, width) => {
                            for pair in t.as_bytes().chunks(2) {
                                raw.push(hex_value(pair[0]) << 4 | hex_value(pair[1]));
                            }
                        }
                        _ => {
                            all = false;
                            break;
                        }
                    }
                }
                if all {
                    self.kinds.push('x');
                    self.push_item(py, width / 2)?;
                    self.data.extend_from_slice(&raw);
                    return Ok(());
                }
            }
        }
        let pool = self.strs.bind(py);
        let start = pool.len();
        let mut indexes: Vec<u32> = Vec::with_capacity(values.len());
        for s in strings {
            match pool.get_item(s)? {
                Some(i) => indexes.push(i.extract()?),
                None => {
                    let i = pool.len();
                    pool.set_item(s, i)?;
                    indexes.push(i as u32);
                }
            }
        }
        if pool.len() - start == values.len() {
            self.kinds.push('S'); // all new and distinct: the reader knows which
        } else {
            self.kinds.push('s');
            self.refs.extend(indexes);
        }
        Ok(())
    }

    fn rows_of(
        &mut self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let list: Vec<Bound<'_, PyAny>> = rows.try_iter()?.collect::<PyResult<_>>()?;
        if list.is_empty() {
            self.kinds.push('t');
            return self.push_item(py, 0);
        }
        let m = match list[0].downcast_exact::<PyList>() {
            Ok(first) => first.len(),
            Err(_) => 0,
        };
        let records = m > 0
            && list.iter().all(|r| match r.downcast_exact::<PyList>() {
                Ok(l) => l.len() == m,
                Err(_) => false,
            });
        if !records {
            self.kinds.push('j');
            return self.push_item(py, rows);
        }
        self.kinds.push('t');
        self.push_item(py, list.len())?;
        self.push_item(py, m)?;
        let mut columns: Vec<Vec<Bound<'_, PyAny>>> =
            (0..m).map(|_| Vec::with_capacity(list.len())).collect();
        for r in &list {
            for (j, v) in r.downcast::<PyList>()?.iter().enumerate() {
                columns[j].push(v);
            }
        }
        let groups: Option<Vec<Vec<usize>>> = match layout {
            Some(l) if !l.is_none() => {
                let (width, groups): (usize, Vec<Vec<usize>>) = l.extract()?;
                if width == m {
                    Some(groups)
                } else {
                    None
                }
            }
            _ => None,
        };
        match groups {
            None => {
                for values in &columns {
                    self.column_of(py, values)?;
                }
            }
            Some(groups) => {
                for group in groups {
                    let mut joined: Vec<Bound<'_, PyAny>> = Vec::new();
                    for j in group {
                        match columns.get(j) {
                            Some(c) => joined.extend(c.iter().cloned()),
                            None => {
                                return Err(PyValueError::new_err("layout index past the record"))
                            }
                        }
                    }
                    self.column_of(py, &joined)?;
                }
            }
        }
        Ok(())
    }
}

#[pymethods]
impl StateWriter {
    #[new]
    fn new(py: Python<'_>, encode: Py<PyAny>) -> Self {
        StateWriter {
            kinds: String::new(),
            items: PyList::empty(py).unbind(),
            data: Vec::new(),
            strs: PyDict::new(py).unbind(),
            refs: Vec::new(),
            ids: PyDict::new(py).unbind(),
            encode,
        }
    }

    fn item(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.items.bind(py).append(value)
    }

    /// Later span id columns refer to these (the dedup map's keys, in order).
    fn set_ids(&mut self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = PyDict::new(py);
        for (i, k) in keys.try_iter()?.enumerate() {
            ids.set_item(k?, i)?;
        }
        self.ids = ids.unbind();
        Ok(())
    }

    fn column(&mut self, py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let values: Vec<Bound<'_, PyAny>> = values.try_iter()?.collect::<PyResult<_>>()?;
        self.column_of(py, &values)
    }

    fn bigint(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        if value.is_exact_instance_of::<PyInt>() && value.ge(0)? {
            let bits: usize = value.call_method0(intern!(py, "bit_length"))?.extract()?;
            let size = (bits + 7) / 8;
            self.push_item(py, size)?;
            match value.extract::<u64>() {
                Ok(small) => self.data.extend_from_slice(&small.to_le_bytes()[..size]),
                Err(_) => {
                    let raw = value
                        .call_method1(intern!(py, "to_bytes"), (size, intern!(py, "little")))?;
                    self.data
                        .extend_from_slice(raw.downcast::<PyBytes>()?.as_bytes());
                }
            }
        } else {
            self.push_item(py, -1)?;
            self.item(py, value)?;
        }
        Ok(())
    }

    #[pyo3(signature = (rows, layout=None))]
    fn rows(
        &mut self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.rows_of(py, rows, layout)
    }

    fn record(&mut self, py: Python<'_>, record: &Bound<'_, PyAny>) -> PyResult<()> {
        let fields = match record.downcast_exact::<PyList>() {
            Ok(l) => l,
            Err(_) => return self.item(py, record), // None (or anything else: JSON)
        };
        let mut lists: Vec<usize> = Vec::new();
        let head = PyList::empty(py);
        for (i, v) in fields.iter().enumerate() {
            match v.downcast_exact::<PyList>() {
                Ok(l) => {
                    lists.push(i);
                    head.append(l.len())?;
                }
                Err(_) => head.append(v)?,
            }
        }
        self.item(py, &head)?;
        self.push_item(py, lists.clone())?;
        for i in lists {
            let values: Vec<Bound<'_, PyAny>> =
                fields.get_item(i)?.downcast::<PyList>()?.iter().collect();
            self.column_of(py, &values)?;
        }
        Ok(())
    }

    #[pyo3(signature = (mapping, layout=None))]
    fn mapping(
        &mut self,
        py: Python<'_>,
        mapping: &Bound<'_, PyAny>,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let n = mapping.len()?;
        self.push_item(py, n)?;
        if n > 0 {
            let keys: Vec<Bound<'_, PyAny>> = mapping.try_iter()?.collect::<PyResult<_>>()?;
            self.column_of(py, &keys)?;
            let values = PyList::new(
                py,
                mapping
                    .call_method0(intern!(py, "values"))?
                    .try_iter()?
                    .collect::<PyResult<Vec<_>>>()?,
            )?;
            self.rows_of(py, values.as_any(), layout)?;
        }
        Ok(())
    }

    /// The whole value.
    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let head = PyList::empty(py);
        head.append(PyString::new(py, &self.kinds))?;
        head.append(self.strs.bind(py).keys())?;
        head.append(self.refs.len())?;
        for item in self.items.bind(py).iter() {
            head.append(item)?;
        }
        let text = self.encode.bind(py).call1((head,))?;
        let j = text.downcast::<PyString>()?.to_str()?.as_bytes().to_vec();
        let mut body: Vec<u8> = Vec::with_capacity(j.len() + self.refs.len() * 2 + self.data.len());
        body.extend_from_slice(&j);
        pack_refs(&self.refs, self.strs.bind(py).len(), &mut body);
        body.extend_from_slice(&self.data);
        let mut out: Vec<u8> = Vec::with_capacity(9 + body.len());
        out.push(FORMAT_PACKED);
        out.extend_from_slice(&crc32(&body).to_le_bytes());
        out.extend_from_slice(&(j.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        Ok(PyBytes::new(py, &out))
    }
}
