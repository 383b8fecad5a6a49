//! Protobuf wire reading for the OTLP trace messages, with the acceptance rules of upb (the
//! decoder behind Python's `protobuf` package, which `streams/spanpath/otlp/proto.py` uses):
//!
//! - a tag is a varint of at most 5 bytes whose value fits 32 bits; field number 0 (except
//!   inside an unknown group), wire types 6 and 7, and an end-group tag outside its group
//!   are corrupt;
//! - a varint has at most 10 bytes (bits past 64 are dropped); a length has at most 5 bytes;
//!   a submessage must fit in the enclosing message; any other field is read against the
//!   whole input and a field that ends past its message's end is corrupt (a string's UTF-8
//!   is checked before that);
//! - a known field arriving with another wire type is an unknown field (skipped), so a known
//!   field keeps its previous value;
//! - every `string` field anywhere in the tree must be UTF-8, parsed or not by loopwatch;
//! - nesting: the top message has depth budget 100; entering a submessage with no budget
//!   left is `MaxDepth`, entering an unknown group with no budget left is `Malformed`;
//! - a singular message field seen twice is merged; a oneof member replaces another member,
//!   the same message member seen twice is merged; a scalar seen twice keeps the last value.
//!
//! The parse builds borrowed structures (`&str` / `&[u8]` into the input); the conversion to
//! Python values happens afterwards, in the order the Python decoder walks the request.
//! `json/` builds the same structures from OTLP JSON: its ids and bytes values are decoded
//! from hex / base64, hence `Cow` for those fields (always borrowed here).

use std::borrow::Cow;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireErr {
    Malformed,
    BadUtf8,
    MaxDepth,
}

impl WireErr {
    /// upb's `upb_DecodeStatus_String`, as the Python decoder reports it.
    pub fn reason(self) -> &'static str {
        match self {
            WireErr::Malformed => "Wire format was corrupt",
            WireErr::BadUtf8 => "String field had bad UTF-8",
            WireErr::MaxDepth => "Exceeded upb_DecodeOptions_MaxDepth",
        }
    }
}

pub type Res<T> = Result<T, WireErr>;

pub const MAX_DEPTH: i32 = 100;

const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const SGROUP: u8 = 3;
const EGROUP: u8 = 4;
const I32: u8 = 5;

pub struct Rd<'a> {
    full: &'a [u8], // the whole input: upb checks a string's UTF-8 against it (see `string`)
    p: usize,
    end: usize, // the current message's end
}

impl<'a> Rd<'a> {
    #[inline]
    pub fn new(b: &'a [u8]) -> Self {
        Rd {
            full: b,
            p: 0,
            end: b.len(),
        }
    }

    /// Another field in this message? A field that ran past the message's end is corrupt
    /// (upb reads each field against the whole input and checks the message end between
    /// fields; see `string` for the one place where that order shows).
    #[inline]
    fn more(&self) -> Res<bool> {
        if self.p < self.end {
            Ok(true)
        } else if self.p == self.end {
            Ok(false)
        } else {
            Err(WireErr::Malformed)
        }
    }

    #[inline]
    fn byte(&mut self) -> Res<u8> {
        match self.full.get(self.p) {
            Some(&x) => {
                self.p += 1;
                Ok(x)
            }
            None => Err(WireErr::Malformed),
        }
    }

    #[inline]
    fn varint(&mut self) -> Res<u64> {
        let first = self.byte()?;
        if first & 0x80 == 0 {
            return Ok(first as u64);
        }
        let mut v = (first & 0x7f) as u64;
        for i in 1..10u32 {
            let x = self.byte()?;
            v |= ((x & 0x7f) as u64) << (7 * i);
            if x & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireErr::Malformed)
    }

    /// A varint of at most 5 bytes whose value fits 32 bits (tags and lengths).
    #[inline]
    fn varint32(&mut self) -> Res<u32> {
        let mut v: u64 = 0;
        for i in 0..5u32 {
            let x = self.byte()?;
            v |= ((x & 0x7f) as u64) << (7 * i);
            if x & 0x80 == 0 {
                return if v > u32::MAX as u64 {
                    Err(WireErr::Malformed)
                } else {
                    Ok(v as u32)
                };
            }
        }
        Err(WireErr::Malformed)
    }

    /// A field's tag; field number 0 is corrupt in a message (but not inside an unknown
    /// group, where upb only matches the end tag: `group_tag`).
    #[inline]
    fn tag(&mut self) -> Res<(u32, u8)> {
        let (field, wt) = self.group_tag()?;
        if field == 0 {
            return Err(WireErr::Malformed);
        }
        Ok((field, wt))
    }

    #[inline]
    fn group_tag(&mut self) -> Res<(u32, u8)> {
        let t = self.varint32()?;
        let (field, wt) = (t >> 3, (t & 7) as u8);
        if wt > 5 {
            return Err(WireErr::Malformed);
        }
        Ok((field, wt))
    }

    #[inline]
    fn fixed64(&mut self) -> Res<u64> {
        let end = self.p.checked_add(8).ok_or(WireErr::Malformed)?;
        let s = self.full.get(self.p..end).ok_or(WireErr::Malformed)?;
        self.p = end;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    #[inline]
    fn fixed32(&mut self) -> Res<()> {
        let end = self.p.checked_add(4).ok_or(WireErr::Malformed)?;
        if end > self.full.len() {
            return Err(WireErr::Malformed);
        }
        self.p = end;
        Ok(())
    }

    #[inline]
    fn delimited(&mut self) -> Res<&'a [u8]> {
        let n = self.varint32()? as usize;
        let end = self.p.checked_add(n).ok_or(WireErr::Malformed)?;
        let s = self.full.get(self.p..end).ok_or(WireErr::Malformed)?;
        self.p = end;
        Ok(s)
    }

    /// A length-delimited submessage: a reader over its bytes.
    #[inline]
    fn sub(&mut self) -> Res<Rd<'a>> {
        let n = self.varint32()? as usize;
        let end = self.p.checked_add(n).ok_or(WireErr::Malformed)?;
        if end > self.end {
            return Err(WireErr::Malformed);
        }
        let r = Rd {
            full: self.full,
            p: self.p,
            end,
        };
        self.p = end;
        Ok(r)
    }

    /// A `string` field. Its bytes may run past the message's end (then `more` reports the
    /// overrun after this field) but not past the input's end; upb checks the UTF-8 first, so
    /// such a string is BadUtf8 when those bytes are not UTF-8, else Malformed.
    #[inline]
    fn string(&mut self) -> Res<&'a str> {
        let s = self.delimited()?;
        std::str::from_utf8(s).map_err(|_| WireErr::BadUtf8)
    }

    /// Skip the value of an unknown (or wrong-wire-type) field.
    fn skip(&mut self, field: u32, wt: u8, depth: i32) -> Res<()> {
        match wt {
            VARINT => self.varint().map(|_| ()),
            I64 => self.fixed64().map(|_| ()),
            LEN => self.delimited().map(|_| ()),
            I32 => self.fixed32(),
            SGROUP => self.skip_group(field, depth),
            _ => Err(WireErr::Malformed), // an end-group tag outside its group
        }
    }

    fn skip_group(&mut self, field: u32, depth: i32) -> Res<()> {
        let depth = depth - 1;
        if depth < 0 {
            return Err(WireErr::Malformed);
        }
        loop {
            if !self.more()? {
                return Err(WireErr::Malformed);
            }
            let (f, wt) = self.group_tag()?;
            if wt == EGROUP {
                return if f == field {
                    Ok(())
                } else {
                    Err(WireErr::Malformed)
                };
            }
            self.skip(f, wt, depth)?;
        }
    }
}

/// Budget check on entering a submessage (after its length was checked, as upb does).
#[inline]
fn enter(depth: i32) -> Res<i32> {
    if depth - 1 < 0 {
        Err(WireErr::MaxDepth)
    } else {
        Ok(depth - 1)
    }
}

// ---------------------------------------------------------------------------------------------
// The parsed tree
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
pub enum Val<'a> {
    Unset,
    Str(&'a str),
    Bool(bool),
    Int(i64),
    Double(f64),
    Array(Vec<Val<'a>>),
    KvList(Vec<Kv<'a>>),
    Bytes(Cow<'a, [u8]>),
    StrIndex,
}

#[derive(Debug)]
pub struct Kv<'a> {
    pub key: &'a str,
    pub val: Val<'a>,
}

#[derive(Debug)]
pub struct Event<'a> {
    pub time: u64,
    pub name: &'a str,
    pub attrs: Vec<Kv<'a>>,
}

#[derive(Debug, Default)]
pub struct Span<'a> {
    pub trace_id: Cow<'a, [u8]>,
    pub span_id: Cow<'a, [u8]>,
    pub parent: Cow<'a, [u8]>,
    pub name: &'a str,
    pub kind: i32,
    pub start: u64,
    pub end: u64,
    pub attrs: Vec<Kv<'a>>,
    pub events: Vec<Event<'a>>,
    pub status_code: i32,
    pub status_message: &'a str,
}

#[derive(Debug, Default)]
pub struct ScopeSpans<'a> {
    pub scope_name: &'a str,
    pub spans: Vec<Span<'a>>,
}

#[derive(Debug, Default)]
pub struct ResourceSpans<'a> {
    pub resource: Vec<Kv<'a>>,
    pub scopes: Vec<ScopeSpans<'a>>,
}

// ---------------------------------------------------------------------------------------------
// Messages (field numbers from opentelemetry-proto; `tests/unit/native/test_decode_proto.py` checks this
// table against the installed descriptors)
// ---------------------------------------------------------------------------------------------

/// (message, field number, kind) for every field the parser knows; kinds: "string", "bytes",
/// "message", "scalar". Exposed to Python so a test can compare it with the descriptors.
pub const SCHEMA: &[(&str, u32, &str)] = &[
    (
        "opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest",
        1,
        "message",
    ),
    ("opentelemetry.proto.trace.v1.ResourceSpans", 1, "message"),
    ("opentelemetry.proto.trace.v1.ResourceSpans", 2, "message"),
    ("opentelemetry.proto.trace.v1.ResourceSpans", 3, "string"),
    ("opentelemetry.proto.resource.v1.Resource", 1, "message"),
    ("opentelemetry.proto.resource.v1.Resource", 2, "scalar"),
    ("opentelemetry.proto.resource.v1.Resource", 3, "message"),
    ("opentelemetry.proto.common.v1.EntityRef", 1, "string"),
    ("opentelemetry.proto.common.v1.EntityRef", 2, "string"),
    ("opentelemetry.proto.common.v1.EntityRef", 3, "string"),
    ("opentelemetry.proto.common.v1.EntityRef", 4, "string"),
    ("opentelemetry.proto.common.v1.KeyValue", 1, "string"),
    ("opentelemetry.proto.common.v1.KeyValue", 2, "message"),
    ("opentelemetry.proto.common.v1.KeyValue", 3, "scalar"),
    ("opentelemetry.proto.common.v1.AnyValue", 1, "string"),
    ("opentelemetry.proto.common.v1.AnyValue", 2, "scalar"),
    ("opentelemetry.proto.common.v1.AnyValue", 3, "scalar"),
    ("opentelemetry.proto.common.v1.AnyValue", 4, "scalar"),
    ("opentelemetry.proto.common.v1.AnyValue", 5, "message"),
    ("opentelemetry.proto.common.v1.AnyValue", 6, "message"),
    ("opentelemetry.proto.common.v1.AnyValue", 7, "bytes"),
    ("opentelemetry.proto.common.v1.AnyValue", 8, "scalar"),
    ("opentelemetry.proto.common.v1.ArrayValue", 1, "message"),
    ("opentelemetry.proto.common.v1.KeyValueList", 1, "message"),
    ("opentelemetry.proto.trace.v1.ScopeSpans", 1, "message"),
    ("opentelemetry.proto.trace.v1.ScopeSpans", 2, "message"),
    ("opentelemetry.proto.trace.v1.ScopeSpans", 3, "string"),
    (
        "opentelemetry.proto.common.v1.InstrumentationScope",
        1,
        "string",
    ),
    (
        "opentelemetry.proto.common.v1.InstrumentationScope",
        2,
        "string",
    ),
    (
        "opentelemetry.proto.common.v1.InstrumentationScope",
        3,
        "message",
    ),
    (
        "opentelemetry.proto.common.v1.InstrumentationScope",
        4,
        "scalar",
    ),
    ("opentelemetry.proto.trace.v1.Span", 1, "bytes"),
    ("opentelemetry.proto.trace.v1.Span", 2, "bytes"),
    ("opentelemetry.proto.trace.v1.Span", 3, "string"),
    ("opentelemetry.proto.trace.v1.Span", 4, "bytes"),
    ("opentelemetry.proto.trace.v1.Span", 5, "string"),
    ("opentelemetry.proto.trace.v1.Span", 6, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 7, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 8, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 9, "message"),
    ("opentelemetry.proto.trace.v1.Span", 10, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 11, "message"),
    ("opentelemetry.proto.trace.v1.Span", 12, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 13, "message"),
    ("opentelemetry.proto.trace.v1.Span", 14, "scalar"),
    ("opentelemetry.proto.trace.v1.Span", 15, "message"),
    ("opentelemetry.proto.trace.v1.Span", 16, "scalar"),
    ("opentelemetry.proto.trace.v1.Span.Event", 1, "scalar"),
    ("opentelemetry.proto.trace.v1.Span.Event", 2, "string"),
    ("opentelemetry.proto.trace.v1.Span.Event", 3, "message"),
    ("opentelemetry.proto.trace.v1.Span.Event", 4, "scalar"),
    ("opentelemetry.proto.trace.v1.Span.Link", 1, "bytes"),
    ("opentelemetry.proto.trace.v1.Span.Link", 2, "bytes"),
    ("opentelemetry.proto.trace.v1.Span.Link", 3, "string"),
    ("opentelemetry.proto.trace.v1.Span.Link", 4, "message"),
    ("opentelemetry.proto.trace.v1.Span.Link", 5, "scalar"),
    ("opentelemetry.proto.trace.v1.Span.Link", 6, "scalar"),
    ("opentelemetry.proto.trace.v1.Status", 2, "string"),
    ("opentelemetry.proto.trace.v1.Status", 3, "scalar"),
];

/// ExportTraceServiceRequest / TracesData.
pub fn parse_request(b: &[u8]) -> Res<Vec<ResourceSpans<'_>>> {
    let depth = MAX_DEPTH;
    let mut out = Vec::new();
    let mut r = Rd::new(b);
    while r.more()? {
        match r.tag()? {
            (1, LEN) => {
                let s = r.sub()?;
                let mut rs = ResourceSpans::default();
                parse_resource_spans(s, enter(depth)?, &mut rs)?;
                out.push(rs);
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(out)
}

fn parse_resource_spans<'a>(mut r: Rd<'a>, depth: i32, rs: &mut ResourceSpans<'a>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => {
                let s = r.sub()?;
                parse_resource(s, enter(depth)?, &mut rs.resource)?;
            }
            (2, LEN) => {
                let s = r.sub()?;
                let mut ss = ScopeSpans::default();
                parse_scope_spans(s, enter(depth)?, &mut ss)?;
                rs.scopes.push(ss);
            }
            (3, LEN) => {
                r.string()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_resource<'a>(mut r: Rd<'a>, depth: i32, attrs: &mut Vec<Kv<'a>>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => {
                let s = r.sub()?;
                attrs.push(parse_kv(s, enter(depth)?)?);
            }
            (2, VARINT) => {
                r.varint()?;
            }
            (3, LEN) => {
                let s = r.sub()?;
                parse_entity_ref(s, enter(depth)?)?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_entity_ref<'a>(mut r: Rd<'a>, depth: i32) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1..=4, LEN) => {
                r.string()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_scope_spans<'a>(mut r: Rd<'a>, depth: i32, ss: &mut ScopeSpans<'a>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => {
                let s = r.sub()?;
                parse_scope(s, enter(depth)?, &mut ss.scope_name)?;
            }
            (2, LEN) => {
                let s = r.sub()?;
                let mut sp = Span::default();
                parse_span(s, enter(depth)?, &mut sp)?;
                ss.spans.push(sp);
            }
            (3, LEN) => {
                r.string()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_scope<'a>(mut r: Rd<'a>, depth: i32, name: &mut &'a str) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => *name = r.string()?,
            (2, LEN) => {
                r.string()?;
            }
            (3, LEN) => {
                let s = r.sub()?;
                parse_kv(s, enter(depth)?)?;
            }
            (4, VARINT) => {
                r.varint()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_span<'a>(mut r: Rd<'a>, depth: i32, sp: &mut Span<'a>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => sp.trace_id = Cow::Borrowed(r.delimited()?),
            (2, LEN) => sp.span_id = Cow::Borrowed(r.delimited()?),
            (3, LEN) => {
                r.string()?;
            }
            (4, LEN) => sp.parent = Cow::Borrowed(r.delimited()?),
            (5, LEN) => sp.name = r.string()?,
            (6, VARINT) => sp.kind = r.varint()? as u32 as i32,
            (7, I64) => sp.start = r.fixed64()?,
            (8, I64) => sp.end = r.fixed64()?,
            (9, LEN) => {
                let s = r.sub()?;
                sp.attrs.push(parse_kv(s, enter(depth)?)?);
            }
            (11, LEN) => {
                let s = r.sub()?;
                sp.events.push(parse_event(s, enter(depth)?)?);
            }
            (13, LEN) => {
                let s = r.sub()?;
                parse_link(s, enter(depth)?)?;
            }
            (15, LEN) => {
                let s = r.sub()?;
                parse_status(s, enter(depth)?, sp)?;
            }
            (10 | 12 | 14, VARINT) => {
                r.varint()?;
            }
            (16, I32) => r.fixed32()?,
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_event<'a>(mut r: Rd<'a>, depth: i32) -> Res<Event<'a>> {
    let mut ev = Event {
        time: 0,
        name: "",
        attrs: Vec::new(),
    };
    while r.more()? {
        match r.tag()? {
            (1, I64) => ev.time = r.fixed64()?,
            (2, LEN) => ev.name = r.string()?,
            (3, LEN) => {
                let s = r.sub()?;
                ev.attrs.push(parse_kv(s, enter(depth)?)?);
            }
            (4, VARINT) => {
                r.varint()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(ev)
}

fn parse_link<'a>(mut r: Rd<'a>, depth: i32) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1 | 2, LEN) => {
                r.delimited()?;
            }
            (3, LEN) => {
                r.string()?;
            }
            (4, LEN) => {
                let s = r.sub()?;
                parse_kv(s, enter(depth)?)?;
            }
            (5, VARINT) => {
                r.varint()?;
            }
            (6, I32) => r.fixed32()?,
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_status<'a>(mut r: Rd<'a>, depth: i32, sp: &mut Span<'a>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (2, LEN) => sp.status_message = r.string()?,
            (3, VARINT) => sp.status_code = r.varint()? as u32 as i32,
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}

fn parse_kv<'a>(mut r: Rd<'a>, depth: i32) -> Res<Kv<'a>> {
    let mut kv = Kv {
        key: "",
        val: Val::Unset,
    };
    while r.more()? {
        match r.tag()? {
            (1, LEN) => kv.key = r.string()?,
            (2, LEN) => {
                let s = r.sub()?;
                parse_any(s, enter(depth)?, &mut kv.val)?;
            }
            (3, VARINT) => {
                r.varint()?;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(kv)
}

/// AnyValue, merged into `v` (a oneof: another member replaces, the same message member merges).
fn parse_any<'a>(mut r: Rd<'a>, depth: i32, v: &mut Val<'a>) -> Res<()> {
    while r.more()? {
        match r.tag()? {
            (1, LEN) => *v = Val::Str(r.string()?),
            (2, VARINT) => *v = Val::Bool(r.varint()? != 0),
            (3, VARINT) => *v = Val::Int(r.varint()? as i64),
            (4, I64) => *v = Val::Double(f64::from_bits(r.fixed64()?)),
            (5, LEN) => {
                let mut ar = r.sub()?;
                let d = enter(depth)?;
                if !matches!(v, Val::Array(_)) {
                    *v = Val::Array(Vec::new());
                }
                if let Val::Array(items) = v {
                    while ar.more()? {
                        match ar.tag()? {
                            (1, LEN) => {
                                let e = ar.sub()?;
                                let mut item = Val::Unset;
                                parse_any(e, enter(d)?, &mut item)?;
                                items.push(item);
                            }
                            (f, wt) => ar.skip(f, wt, d)?,
                        }
                    }
                }
            }
            (6, LEN) => {
                let mut lr = r.sub()?;
                let d = enter(depth)?;
                if !matches!(v, Val::KvList(_)) {
                    *v = Val::KvList(Vec::new());
                }
                if let Val::KvList(items) = v {
                    while lr.more()? {
                        match lr.tag()? {
                            (1, LEN) => {
                                let e = lr.sub()?;
                                items.push(parse_kv(e, enter(d)?)?);
                            }
                            (f, wt) => lr.skip(f, wt, d)?,
                        }
                    }
                }
            }
            (7, LEN) => *v = Val::Bytes(Cow::Borrowed(r.delimited()?)),
            (8, VARINT) => {
                r.varint()?;
                *v = Val::StrIndex;
            }
            (f, wt) => r.skip(f, wt, depth)?,
        }
    }
    Ok(())
}
