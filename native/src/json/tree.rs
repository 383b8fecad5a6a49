//! The tree the scanner builds: values, strings with their escapes, objects with their keys in order.

use super::*;

pub enum J<'a> {
    Null,
    Bool(bool),
    /// An integer literal, as written (`-?(0|[1-9][0-9]*)`).
    Int(&'a str),
    Float(f64),
    Str(JStr<'a>),
    Arr(Vec<J<'a>>),
    Obj(Obj<'a>),
}

pub struct JStr<'a> {
    pub s: Cow<'a, str>,
    /// Holds an unpaired surrogate (written as U+FFFD in `s`): such a string never equals one
    /// without, and the document is rejected if one is left in it.
    pub lone: bool,
}

impl JStr<'_> {
    pub(super) fn same(&self, other: &JStr<'_>) -> bool {
        self.lone == other.lone && self.s == other.s
    }
}

/// A JSON object with Python dict semantics: keys in first-seen order, the last value kept.
pub struct Obj<'a> {
    pub(super) items: Vec<(JStr<'a>, J<'a>)>,
    /// Built once an object grows past a few keys, so hostile wide objects stay linear
    /// (boxed: it keeps `J` small, and the tree moves `J`s around a lot).
    #[allow(clippy::box_collection)]
    index: Option<Box<HashMap<(bool, String), usize>>>,
}

pub(super) const INDEX_FROM: usize = 16;

impl<'a> Obj<'a> {
    pub(super) fn new() -> Self {
        Obj {
            items: Vec::with_capacity(8),
            index: None,
        }
    }

    pub(super) fn insert(&mut self, k: JStr<'a>, v: J<'a>) {
        if let Some(ix) = self.index.as_deref_mut() {
            match ix.get(&(k.lone, k.s.to_string())) {
                Some(&i) => self.items[i].1 = v,
                None => {
                    ix.insert((k.lone, k.s.to_string()), self.items.len());
                    self.items.push((k, v));
                }
            }
            return;
        }
        if let Some(slot) = self.items.iter_mut().find(|(key, _)| key.same(&k)) {
            slot.1 = v;
            return;
        }
        self.items.push((k, v));
        if self.items.len() >= INDEX_FROM {
            let ix = self
                .items
                .iter()
                .enumerate()
                .map(|(i, (key, _))| ((key.lone, key.s.to_string()), i))
                .collect();
            self.index = Some(Box::new(ix));
        }
    }

    /// `d.get(key)`, null included (callers treat null as absent, as the reference does).
    pub fn get(&self, key: &str) -> Option<&J<'a>> {
        if let Some(ix) = &self.index {
            return ix.get(&(false, key.to_string())).map(|&i| &self.items[i].1);
        }
        self.items
            .iter()
            .find(|(k, _)| !k.lone && k.s == key)
            .map(|(_, v)| v)
    }

    pub fn items(&self) -> &[(JStr<'a>, J<'a>)] {
        &self.items
    }
}
