//! Decoded OTLP spans (wire.rs) as the normalizer reads them: attribute values, ids.

use super::*;

pub(super) fn aget<'b, 'a>(attrs: &'b [(&'a str, V<'a>)], key: &str) -> Option<&'b V<'a>> {
    attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
}

pub(super) fn conv_val<'a>(v: &'a Val<'a>) -> R<V<'a>> {
    Ok(match v {
        Val::Str(s) => V::Str(Cow::Borrowed(s)),
        Val::Unset => V::None,
        Val::Bool(b) => V::Bool(*b),
        Val::Int(i) => V::Int(*i),
        Val::Double(d) => V::Float(*d),
        Val::Bytes(b) => V::Bytes(b),
        Val::Array(items) => V::List(items.iter().map(conv_val).collect::<R<_>>()?),
        Val::KvList(kvs) => {
            let mut d = Vec::with_capacity(kvs.len());
            for kv in kvs {
                dict_set(&mut d, Cow::Borrowed(kv.key), conv_val(&kv.val)?);
            }
            V::Dict(d)
        }
        Val::StrIndex => return Err(Hard), // the Python decoder rejects the batch
    })
}

pub(super) fn conv_attrs<'a>(kvs: &'a [Kv<'a>]) -> R<Attrs<'a>> {
    let mut out: Attrs<'a> = Vec::with_capacity(kvs.len());
    for kv in kvs {
        let v = conv_val(&kv.val)?;
        if let Some(slot) = out.iter_mut().find(|(k, _)| *k == kv.key) {
            slot.1 = v;
        } else {
            out.push((kv.key, v));
        }
    }
    Ok(out)
}
