//! A minimal, bounds-checked safetensors header reader and writer.
//!
//! Layout of a safetensors file: an 8-byte little-endian `u64` `N`, then `N`
//! bytes of UTF-8 JSON (padded with spaces), then the data section. The JSON
//! maps each tensor name to `{"dtype", "shape", "data_offsets": [begin,
//! end]}` with offsets relative to the data section, plus an optional
//! `"__metadata__"` map of strings.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// Largest header this crate reads (the safetensors reference uses the same
/// bound). A larger claim is rejected before anything is allocated.
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;
/// Most dimensions a stored tensor may have.
pub const MAX_DIMS: usize = 16;

/// One tensor described by a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// First byte of the data, counted from the start of the file.
    pub start: u64,
    /// One past the last byte, counted from the start of the file.
    pub end: u64,
}

/// A parsed, validated safetensors header.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SafetensorsHeader {
    /// Bytes taken by the header, including the 8-byte length prefix.
    pub header_bytes: u64,
    /// Tensors, sorted by their position in the file.
    pub entries: Vec<HeaderEntry>,
    /// The `__metadata__` map.
    pub metadata: BTreeMap<String, String>,
}

impl SafetensorsHeader {
    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<&HeaderEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// Reads the header length from the first 8 bytes and checks it against the
/// bound and the file's length. Returns `N`, the JSON length.
///
/// # Errors
/// [`Error::Header`] when the prefix is short or the length is out of bounds.
pub fn header_len(prefix: &[u8], file_len: u64, path: &Path) -> Result<u64> {
    let bad = |reason: String| Error::Header {
        path: path.to_owned(),
        reason,
    };
    let Some(first) = prefix.get(..8) else {
        return Err(bad(format!(
            "file is {} bytes, shorter than the 8-byte length prefix",
            prefix.len()
        )));
    };
    let mut b = [0u8; 8];
    b.copy_from_slice(first);
    let n = u64::from_le_bytes(b);
    if n > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )));
    }
    if n + 8 > file_len {
        return Err(bad(format!(
            "header length {n} runs past the end of the {file_len}-byte file"
        )));
    }
    Ok(n)
}

/// Parses and validates a safetensors header. `bytes` must start at the
/// beginning of the file and hold at least the whole header; `file_len` is
/// the file's full length. Every offset is checked against `file_len`,
/// every byte count against shape × dtype size, and tensors may not overlap.
/// This is the function the fuzz target exercises.
///
/// # Errors
/// [`Error::Header`] naming `path` and the offending tensor.
pub fn parse_header(bytes: &[u8], file_len: u64, path: &Path) -> Result<SafetensorsHeader> {
    let bad = |reason: String| Error::Header {
        path: path.to_owned(),
        reason,
    };
    let n = header_len(bytes, file_len, path)?;
    let end = 8 + n as usize; // n <= MAX_HEADER_BYTES fits usize
    let json = bytes
        .get(8..end)
        .ok_or_else(|| bad(format!("header of {n} bytes but only {} read", bytes.len())))?;
    if json.first() != Some(&b'{') {
        return Err(bad("header does not start with `{`".into()));
    }
    let value: Value = serde_json::from_slice(json).map_err(|e| bad(format!("JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(bad("header is not a JSON object".into()));
    };
    let data_len = file_len - 8 - n;
    let mut out = SafetensorsHeader {
        header_bytes: 8 + n,
        ..Default::default()
    };
    for (name, v) in map {
        if name == "__metadata__" {
            let Value::Object(m) = v else {
                return Err(bad("__metadata__ is not an object".into()));
            };
            for (k, v) in m {
                let Value::String(s) = v else {
                    return Err(bad(format!("__metadata__[{k:?}] is not a string")));
                };
                out.metadata.insert(k, s);
            }
            continue;
        }
        let tbad = |what: &str| bad(format!("tensor {name:?}: {what}"));
        let Value::Object(t) = v else {
            return Err(tbad("entry is not an object"));
        };
        let dtype: Dtype = t
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| tbad("missing string field `dtype`"))?
            .parse()
            .map_err(|e| tbad(&format!("{e}")))?;
        let shape = t
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| tbad("missing array field `shape`"))?;
        if shape.len() > MAX_DIMS {
            return Err(tbad(&format!(
                "{} dimensions (at most {MAX_DIMS})",
                shape.len()
            )));
        }
        let shape: Vec<u64> = shape
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| tbad("shape entries must be unsigned integers"))
            })
            .collect::<Result<_>>()?;
        let offs = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| tbad("missing field `data_offsets` = [begin, end]"))?;
        let (Some(b), Some(e)) = (offs[0].as_u64(), offs[1].as_u64()) else {
            return Err(tbad("data_offsets must be unsigned integers"));
        };
        if b > e || e > data_len {
            return Err(tbad(&format!(
                "data_offsets [{b}, {e}] outside the {data_len}-byte data section"
            )));
        }
        let want = shape
            .iter()
            .try_fold(dtype.size_bytes() as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad("shape × dtype size overflows"))?;
        if want != e - b {
            return Err(tbad(&format!(
                "shape {shape:?} of {dtype} needs {want} bytes but data_offsets span {}",
                e - b
            )));
        }
        out.entries.push(HeaderEntry {
            name,
            dtype,
            shape,
            start: 8 + n + b,
            end: 8 + n + e,
        });
    }
    out.entries.sort_by_key(|e| (e.start, e.end));
    for w in out.entries.windows(2) {
        if w[1].start < w[0].end {
            return Err(bad(format!(
                "tensors {:?} and {:?} overlap",
                w[0].name, w[1].name
            )));
        }
    }
    Ok(out)
}

/// Builds a header for tensors laid out back to back in the given order.
/// `tensors` gives `(name, dtype, shape, byte length)`. Returns the header
/// bytes (length prefix included, JSON padded with spaces to a multiple of
/// 8 so data stays aligned) and each tensor's absolute file offset.
pub(crate) fn build_header(
    tensors: &[(&str, Dtype, &[u64], u64)],
    metadata: &BTreeMap<String, String>,
) -> (Vec<u8>, Vec<u64>) {
    let mut map = serde_json::Map::new();
    let mut pos = 0u64;
    let mut rel = Vec::with_capacity(tensors.len());
    for &(name, dtype, shape, len) in tensors {
        map.insert(
            name.to_owned(),
            serde_json::json!({
                "dtype": dtype.safetensors_name(),
                "shape": shape,
                "data_offsets": [pos, pos + len],
            }),
        );
        rel.push(pos);
        pos += len;
    }
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut json = serde_json::to_vec(&Value::Object(map)).expect("JSON of strings and integers");
    while json.len() & 7 != 0 {
        json.push(b' ');
    }
    let n = json.len() as u64;
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&json);
    let abs = rel.into_iter().map(|r| r + 8 + n).collect();
    (out, abs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_then_parse() {
        let shape = [2u64, 3];
        let md = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        let (h, abs) = build_header(
            &[("a", Dtype::F32, &shape, 24), ("b", Dtype::U8, &[], 1)],
            &md,
        );
        assert_eq!(h.len() % 8, 0);
        let file_len = h.len() as u64 + 25;
        let p = parse_header(&h, file_len, Path::new("x")).unwrap();
        assert_eq!(p.metadata, md);
        assert_eq!(p.get("a").unwrap().start, abs[0]);
        assert_eq!(p.get("b").unwrap().end, file_len);
        // One byte short: offsets run past the data section.
        assert!(parse_header(&h, file_len - 1, Path::new("x")).is_err());
    }

    #[test]
    fn rejects_huge_length() {
        let mut b = vec![0u8; 16];
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_header(&b, 16, Path::new("f.safetensors")).unwrap_err();
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
    }
}
