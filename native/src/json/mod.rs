//! OTLP JSON -> the wire structures of `wire.rs`, with the behaviour of the Python reference
//! `streams/spanpath/otlp/json_decode.py` (which parses with CPython 3.11's `json` C scanner and then
//! walks the dicts). Two phases, as there: the whole text is scanned into a tree first (so a
//! syntax error anywhere wins over a semantic one), then the tree is walked in the reference's
//! order, producing the reference's first error message.
//!
//! What the scanner reproduces of `json.loads`: its error messages and positions (character
//! offsets, line/column), numbers (`-0` is the int 0; integers of more digits than the int
//! string limit fail as "number too large"; float literals round correctly, overflow to inf),
//! NaN / Infinity / -Infinity, duplicate keys (the last value in the first key's place),
//! escapes with surrogate pairs and lone surrogates (the reference then rejects the whole
//! document if one survives in the final tree). serde_json differs on most of these, hence a
//! scanner of our own.
//!
//! Nesting deeper than the caller's `max_depth` is not decided here (`Outcome::Delegate`): the
//! reference's answer there depends on Python's recursion limit and stack depth.
//!
//! `tree.rs` the values, `scan.rs` the scanner, `show.rs` the renderings in messages, `walk.rs`
//! the OTLP walk.

use crate::ids::at;
use crate::wire::{Event, Kv, ResourceSpans, ScopeSpans, Span, Val};
use std::borrow::Cow;
use std::collections::HashMap;

mod scan;
mod show;
mod tree;
mod walk;

pub use scan::*;
pub use show::*;
pub use tree::*;
pub use walk::*;
