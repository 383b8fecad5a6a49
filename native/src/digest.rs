//! The normalizer's digests (detectors/fingerprint.py), first piece of the native normalizer:
//! HMAC-SHA256 (SHA-256 without a key) truncated to 64 bits, over `tag \0 body`, where the
//! body of a value is its canonical JSON (keys sorted, no whitespace, UTF-8, non-ASCII kept).
//!
//! The native side handles the plain cases: None, bool, int, finite float, str without lone
//! surrogates, list, tuple, dict with str keys, nested at most MAX_NEST deep. Anything else
//! (non-str keys, NaN, bytes, other types, deep nesting) answers None and the caller uses the
//! Python implementation, so the odd cases (the repr() fallback, RecursionError) stay exact
//! by construction; `tests/unit/native/test_digest.py` compares the plain ones.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::pyval::escape; // json.encoder.encode_basestring (ensure_ascii=False)

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];
const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// Streaming SHA-256 (FIPS 180-4).
#[derive(Clone)]
pub struct Sha256 {
    h: [u32; 8],
    buf: [u8; 64],
    len: usize, // bytes in buf
    total: u64, // bytes hashed
}

impl Sha256 {
    pub fn new() -> Self {
        Sha256 {
            h: H0,
            buf: [0; 64],
            len: 0,
            total: 0,
        }
    }

    #[inline]
    fn block(h: &mut [u32; 8], b: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("sha") && std::is_x86_feature_detected!("sse4.1") {
                // SAFETY: the CPU has the SHA extensions (checked just above)
                unsafe { shani::block(h, b) };
                return;
            }
        }
        Self::block_soft(h, b);
    }

    fn block_soft(h: &mut [u32; 8], b: &[u8]) {
        let mut w = [0u32; 64];
        for i in 0..16 {
            w[i] = u32::from_be_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b_, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b_) ^ (a & c) ^ (b_ & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b_;
            b_ = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b_, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.len > 0 {
            let n = (64 - self.len).min(data.len());
            self.buf[self.len..self.len + n].copy_from_slice(&data[..n]);
            self.len += n;
            data = &data[n..];
            if self.len < 64 {
                return;
            }
            let buf = self.buf;
            Self::block(&mut self.h, &buf);
            self.len = 0;
        }
        while data.len() >= 64 {
            Self::block(&mut self.h, &data[..64]);
            data = &data[64..];
        }
        self.buf[..data.len()].copy_from_slice(data);
        self.len = data.len();
    }

    pub fn finish(mut self) -> [u8; 32] {
        // 0x80, zeros to 56 bytes mod 64, the bit length: one update (the sketches hash
        // thousands of short features a request, each ending here)
        let bits = self.total.wrapping_mul(8);
        let zeros = (119 - self.len) % 64;
        let mut pad = [0u8; 72];
        pad[0] = 0x80;
        pad[1 + zeros..9 + zeros].copy_from_slice(&bits.to_be_bytes());
        self.update(&pad[..9 + zeros]);
        debug_assert_eq!(self.len, 0);
        let mut out = [0u8; 32];
        for (i, x) in self.h.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&x.to_be_bytes());
        }
        out
    }
}

/// SHA-256 rounds with the x86 SHA extensions (Intel's SHA-NI flow, as in the `sha2` crate).
#[cfg(target_arch = "x86_64")]
mod shani {
    use super::K;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn rounds4(abef: &mut __m128i, cdgh: &mut __m128i, w: __m128i, i: usize) {
        let k = _mm_loadu_si128(K.as_ptr().add(4 * i) as *const __m128i);
        let t1 = _mm_add_epi32(w, k);
        *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, t1);
        let t2 = _mm_shuffle_epi32(t1, 0x0E);
        *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, t2);
    }

    #[inline(always)]
    unsafe fn schedule(v0: __m128i, v1: __m128i, v2: __m128i, v3: __m128i) -> __m128i {
        let t1 = _mm_sha256msg1_epu32(v0, v1);
        let t2 = _mm_alignr_epi8(v3, v2, 4);
        let t3 = _mm_add_epi32(t1, t2);
        _mm_sha256msg2_epu32(t3, v3)
    }

    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub unsafe fn block(state: &mut [u32; 8], b: &[u8]) {
        let mask = _mm_set_epi64x(
            0x0C0D_0E0F_0809_0A0Bu64 as i64,
            0x0405_0607_0001_0203u64 as i64,
        );
        let sp = state.as_ptr() as *const __m128i;
        let dcba = _mm_loadu_si128(sp);
        let efgh = _mm_loadu_si128(sp.add(1));
        let cdab = _mm_shuffle_epi32(dcba, 0xB1);
        let efgh = _mm_shuffle_epi32(efgh, 0x1B);
        let mut abef = _mm_alignr_epi8(cdab, efgh, 8);
        let mut cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
        let (abef_save, cdgh_save) = (abef, cdgh);
        let dp = b.as_ptr() as *const __m128i;
        let mut w = [
            _mm_shuffle_epi8(_mm_loadu_si128(dp), mask),
            _mm_shuffle_epi8(_mm_loadu_si128(dp.add(1)), mask),
            _mm_shuffle_epi8(_mm_loadu_si128(dp.add(2)), mask),
            _mm_shuffle_epi8(_mm_loadu_si128(dp.add(3)), mask),
        ];
        for (i, x) in w.iter().enumerate() {
            rounds4(&mut abef, &mut cdgh, *x, i);
        }
        for i in 4..16 {
            let next = schedule(w[i % 4], w[(i + 1) % 4], w[(i + 2) % 4], w[(i + 3) % 4]);
            w[i % 4] = next;
            rounds4(&mut abef, &mut cdgh, next, i);
        }
        abef = _mm_add_epi32(abef, abef_save);
        cdgh = _mm_add_epi32(cdgh, cdgh_save);
        let feba = _mm_shuffle_epi32(abef, 0x1B);
        let dchg = _mm_shuffle_epi32(cdgh, 0xB1);
        let dcba = _mm_blend_epi16(feba, dchg, 0xF0);
        let hgef = _mm_alignr_epi8(dchg, feba, 8);
        let sp = state.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(sp, dcba);
        _mm_storeu_si128(sp.add(1), hgef);
    }
}

fn hex8(d: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(16);
    for &x in &d[..8] {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

/// Deepest container nesting handled natively (Python's encoder recurses to ~1000 and then
/// raises RecursionError; deeper values go to the Python implementation).
const MAX_NEST: usize = 200;

/// Canonical JSON of a plain value into `out`; false = not a plain value (use Python).
fn canonical(v: &Bound<'_, PyAny>, out: &mut Vec<u8>, depth: usize) -> PyResult<bool> {
    if v.is_none() {
        out.extend_from_slice(b"null");
    } else if let Ok(b) = v.downcast::<PyBool>() {
        out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
    } else if let Ok(s) = v.downcast::<PyString>() {
        match s.to_str() {
            Ok(text) => escape(text, out),
            Err(_) => return Ok(false), // lone surrogates: Python's encode fails, repr() path
        }
    } else if v.is_exact_instance_of::<PyInt>() {
        match v.extract::<i64>() {
            Ok(i) => out.extend_from_slice(i.to_string().as_bytes()),
            Err(_) => match v.str() {
                Ok(s) => out.extend_from_slice(s.to_str()?.as_bytes()),
                Err(_) => return Ok(false), // past int_max_str_digits: Python decides
            },
        }
    } else if v.is_exact_instance_of::<PyFloat>() {
        let f: f64 = v.extract()?;
        if !f.is_finite() {
            return Ok(false);
        }
        out.extend_from_slice(v.repr()?.to_str()?.as_bytes()); // float.__repr__, exactly
    } else if v.is_exact_instance_of::<PyList>() || v.is_exact_instance_of::<PyTuple>() {
        if depth >= MAX_NEST {
            return Ok(false);
        }
        out.push(b'[');
        for (i, x) in v.try_iter()?.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if !canonical(&x?, out, depth + 1)? {
                return Ok(false);
            }
        }
        out.push(b']');
    } else if let Ok(d) = v.downcast_exact::<PyDict>() {
        if depth >= MAX_NEST {
            return Ok(false);
        }
        let mut items: Vec<(&str, Bound<'_, PyAny>)> = Vec::with_capacity(d.len());
        let mut keys: Vec<Bound<'_, PyString>> = Vec::with_capacity(d.len());
        for (k, _) in d.iter() {
            match k.downcast_exact::<PyString>() {
                Ok(s) => keys.push(s.clone()),
                Err(_) => return Ok(false),
            }
        }
        for (k, (_, val)) in keys.iter().zip(d.iter()) {
            match k.to_str() {
                Ok(s) => items.push((s, val)),
                Err(_) => return Ok(false),
            }
        }
        items.sort_by(|a, b| a.0.cmp(b.0)); // UTF-8 byte order = code point order
        out.push(b'{');
        for (i, (k, val)) in items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            escape(k, out);
            out.push(b':');
            if !canonical(val, out, depth + 1)? {
                return Ok(false);
            }
        }
        out.push(b'}');
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// detectors.fingerprint.Fingerprinter's digests; methods answer None where the Python
/// implementation must decide (see the module comment).
#[pyclass(module = "loopwatch_native", frozen)]
pub struct Digests {
    pads: Option<(Sha256, Sha256)>,
}

impl Digests {
    fn digest_bytes(&self, data: &[u8]) -> String {
        match &self.pads {
            Some((inner, outer)) => {
                let mut i = inner.clone();
                i.update(data);
                let mut o = outer.clone();
                o.update(&i.finish());
                hex8(&o.finish())
            }
            None => {
                let mut h = Sha256::new();
                h.update(data);
                hex8(&h.finish())
            }
        }
    }
}

#[pymethods]
impl Digests {
    #[new]
    #[pyo3(signature = (key=None))]
    fn new(key: Option<&[u8]>) -> Self {
        let pads = match key {
            Some(k) if !k.is_empty() => {
                let mut block = [0u8; 64];
                if k.len() > 64 {
                    let mut h = Sha256::new();
                    h.update(k);
                    block[..32].copy_from_slice(&h.finish());
                } else {
                    block[..k.len()].copy_from_slice(k);
                }
                let mut inner = Sha256::new();
                inner.update(&block.map(|b| b ^ 0x36));
                let mut outer = Sha256::new();
                outer.update(&block.map(|b| b ^ 0x5c));
                Some((inner, outer))
            }
            _ => None,
        };
        Digests { pads }
    }

    #[getter]
    fn keyed(&self) -> bool {
        self.pads.is_some()
    }

    fn digest(&self, data: &[u8]) -> String {
        self.digest_bytes(data)
    }

    fn of_text(&self, tag: &Bound<'_, PyString>, text: &Bound<'_, PyString>) -> Option<String> {
        let (tag, text) = (tag.to_str().ok()?, text.to_str().ok()?);
        let mut data = Vec::with_capacity(tag.len() + 1 + text.len());
        data.extend_from_slice(tag.as_bytes());
        data.push(0);
        data.extend_from_slice(text.as_bytes());
        Some(self.digest_bytes(&data))
    }

    fn of_value(
        &self,
        tag: &Bound<'_, PyString>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<Option<String>> {
        let tag = match tag.to_str() {
            Ok(t) => t,
            Err(_) => return Ok(None),
        };
        let mut data = Vec::with_capacity(tag.len() + 64);
        data.extend_from_slice(tag.as_bytes());
        data.push(0);
        if !canonical(value, &mut data, 0)? {
            return Ok(None);
        }
        Ok(Some(self.digest_bytes(&data)))
    }
}
