//! The weight files of a Hugging Face folder: one `model.safetensors`, or
//! shards listed by `model.safetensors.index.json` (transformers'
//! `save_pretrained` shards a model over 5 GB). Only the files' headers are
//! held; each tensor is read from its file when asked for, so a folder far
//! larger than memory loads one tensor at a time.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{Value, json};

use super::{fmt_err, write_atomic, write_safetensors};
use crate::error::{Error, Result, io};

/// The single-file weights' name.
pub const SINGLE: &str = "model.safetensors";
/// The sharded weights' index.
pub const INDEX: &str = "model.safetensors.index.json";
/// transformers' default `max_shard_size` ("5GB").
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;
/// The largest header weft reads (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Where one tensor's bytes are.
#[derive(Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset in the file.
    start: u64,
    len: usize,
}

/// The tensors of one safetensors file or of a sharded set, by name.
#[derive(Debug)]
pub(crate) struct Weights {
    files: Vec<PathBuf>,
    tensors: HashMap<String, Entry>,
}

fn bytes_per(dtype: Dtype) -> Option<usize> {
    Some(match dtype {
        Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
        Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
        Dtype::I8 | Dtype::U8 | Dtype::BOOL => 1,
        _ => return None,
    })
}

fn dtype_of(path: &Path, name: &str, s: &str) -> Result<Dtype> {
    Ok(match s {
        "F64" => Dtype::F64,
        "F32" => Dtype::F32,
        "F16" => Dtype::F16,
        "BF16" => Dtype::BF16,
        "I64" => Dtype::I64,
        "I32" => Dtype::I32,
        "I16" => Dtype::I16,
        "I8" => Dtype::I8,
        "U64" => Dtype::U64,
        "U32" => Dtype::U32,
        "U16" => Dtype::U16,
        "U8" => Dtype::U8,
        "BOOL" => Dtype::BOOL,
        other => {
            return Err(Error::Tensor {
                path: path.to_path_buf(),
                tensor: name.into(),
                reason: format!("dtype {other:?} is not one weft reads"),
            });
        }
    })
}

/// Reads one safetensors file's header: its tensors, checked against the
/// file's size.
fn header(path: &Path, file: usize) -> Result<Vec<(String, Entry)>> {
    let f = weft_trace::input::open(path).map_err(io(path))?;
    let size = f.metadata().map_err(io(path))?.len();
    let bad = |reason: String| fmt_err(path, format!("not a valid safetensors file: {reason}"));
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).map_err(|_| {
        bad(format!(
            "{size} bytes, shorter than the 8-byte header length"
        ))
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > size {
        return Err(bad(format!(
            "a header of {n} bytes in a file of {size} bytes"
        )));
    }
    #[allow(clippy::cast_possible_truncation)] // n <= MAX_HEADER
    let mut text = vec![0u8; n as usize];
    f.read_exact_at(&mut text, 8).map_err(io(path))?;
    let v: Value = serde_json::from_slice(&text).map_err(|e| bad(format!("header: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("the header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let mut out = Vec::with_capacity(obj.len());
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| {
            t.get(k)
                .ok_or_else(|| bad(format!("tensor `{name}` has no {k}")))
        };
        let dtype = dtype_of(
            path,
            name,
            field("dtype")?
                .as_str()
                .ok_or_else(|| bad(format!("tensor `{name}`: dtype is not a string")))?,
        )?;
        let nums = |k: &str| -> Result<Vec<u64>> {
            field(k)?
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad(format!("tensor `{name}`: {k} is not a list of integers")))
        };
        let shape = nums("shape")?;
        let offsets = nums("data_offsets")?;
        let [a, b] = offsets[..] else {
            return Err(bad(format!(
                "tensor `{name}`: data_offsets is not two numbers"
            )));
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|e| e.checked_mul(bytes_per(dtype)? as u64));
        if a > b || Some(b - a) != numel || data_start + b > size {
            return Err(bad(format!(
                "tensor `{name}`: bytes {a}..{b} do not hold shape {shape:?} of {dtype:?} \
                 inside the file's {} data bytes",
                size - data_start
            )));
        }
        let to_usize =
            |x: u64| usize::try_from(x).map_err(|_| bad(format!("tensor `{name}` is too large")));
        out.push((
            name.clone(),
            Entry {
                file,
                dtype,
                shape: shape.into_iter().map(to_usize).collect::<Result<_>>()?,
                start: data_start + a,
                len: to_usize(b - a)?,
            },
        ));
    }
    Ok(out)
}

impl Weights {
    /// One safetensors file.
    pub(crate) fn file(path: &Path) -> Result<Self> {
        let tensors = header(path, 0)?.into_iter().collect();
        Ok(Self {
            files: vec![path.to_path_buf()],
            tensors,
        })
    }

    /// A folder's weights: `model.safetensors`, or the shards its
    /// `model.safetensors.index.json` lists (file names inside the folder;
    /// every listed tensor must be in the file the index names).
    pub(crate) fn folder(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE);
        if single.exists() {
            return Self::file(&single);
        }
        let index = dir.join(INDEX);
        if !index.exists() {
            let hint = if dir.join("pytorch_model.bin").exists() {
                "only pytorch_model.bin is present; re-save with \
                 `model.save_pretrained(dir, safe_serialization=True)`"
            } else {
                "the folder has neither model.safetensors nor model.safetensors.index.json"
            };
            return Err(fmt_err(&single, format!("file not found: {hint}")));
        }
        let text = weft_trace::input::read_to_string(&index, weft_trace::input::INDEX_BYTES)
            .map_err(io(&index))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| fmt_err(&index, format!("not valid JSON ({e})")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| fmt_err(&index, "no `weight_map` object"))?;
        let mut files: Vec<String> = Vec::new();
        let mut want: Vec<(&String, usize)> = Vec::with_capacity(map.len());
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                fmt_err(&index, format!("weight_map[{name:?}] is not a file name"))
            })?;
            let plain = Path::new(file)
                .file_name()
                .is_some_and(|f| f == std::ffi::OsStr::new(file));
            if !plain || file == ".." {
                return Err(fmt_err(
                    &index,
                    format!("weight_map[{name:?}] = {file:?} is not a file name inside the folder"),
                ));
            }
            let at = match files.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    files.push(file.to_string());
                    files.len() - 1
                }
            };
            want.push((name, at));
        }
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        let mut found: Vec<HashMap<String, Entry>> = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            found.push(header(p, i)?.into_iter().collect());
        }
        let mut tensors = HashMap::with_capacity(want.len());
        for (name, file) in want {
            let e = found[file]
                .remove(name)
                .ok_or_else(|| Error::MissingTensor {
                    path: paths[file].clone(),
                    tensor: name.clone(),
                })?;
            tensors.insert(name.clone(), e);
        }
        Ok(Self {
            files: paths,
            tensors,
        })
    }

    /// The file that holds `name` (for messages), or the first file.
    pub(crate) fn path_of(&self, name: &str) -> &Path {
        let i = self.tensors.get(name).map_or(0, |e| e.file);
        &self.files[i]
    }

    /// The tensors' names.
    /// The values the files hold, all tensors together (each tensor's
    /// length was checked against its file's size when the header was
    /// read, so this is bounded by the files on disk).
    pub(crate) fn elements(&self) -> u64 {
        self.tensors
            .values()
            .map(|e| e.shape.iter().product::<usize>() as u64)
            .sum()
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// `name`'s shape, if stored.
    pub(crate) fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Reads `name` as f32 (from F32, F64, F16 or BF16).
    pub(crate) fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            path: self.files[0].clone(),
            tensor: name.into(),
        })?;
        let path = &self.files[e.file];
        let mut bytes = vec![0u8; e.len];
        File::open(path)
            .and_then(|f| f.read_exact_at(&mut bytes, e.start))
            .map_err(io(path))?;
        super::to_f32(path, name, e.dtype, &bytes)
    }
}

/// Writes named f32 tensors as a Hugging Face folder's weights: one
/// `model.safetensors` when they fit in `max_shard_bytes`, otherwise
/// `model-0000i-of-0000n.safetensors` shards (tensors in order, a shard
/// closed before a tensor would take it past the limit; a larger tensor
/// gets a shard of its own) and `model.safetensors.index.json`, as
/// transformers' `save_pretrained` writes them. Weight files of the other
/// form left from an earlier save are removed once the new ones are in
/// place, so the folder never holds two sets.
pub(crate) fn save_weights(
    dir: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    max_shard_bytes: u64,
) -> Result<()> {
    let bytes = |t: &(String, Vec<usize>, Vec<f32>)| 4 * t.2.len() as u64;
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, t) in tensors.iter().enumerate() {
        let b = bytes(t);
        if size > 0 && size + b > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(i);
        size += b;
    }
    let stale = stale_weights(dir)?;
    let n = shards.len();
    let mut written = Vec::with_capacity(n + 1);
    if n == 1 {
        write_safetensors(
            &dir.join(SINGLE),
            tensors
                .iter()
                .map(|(a, s, d)| (a.clone(), s.clone(), d.as_slice())),
        )?;
        written.push(SINGLE.to_string());
    } else {
        let mut map = BTreeMap::new();
        for (k, shard) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            write_safetensors(
                &dir.join(&file),
                shard.iter().map(|&i| {
                    let (a, s, d) = &tensors[i];
                    (a.clone(), s.clone(), d.as_slice())
                }),
            )?;
            for &i in shard {
                map.insert(tensors[i].0.clone(), file.clone());
            }
            written.push(file);
        }
        let total: u64 = tensors.iter().map(bytes).sum();
        let index = json!({
            "metadata": { "total_parameters": total / 4, "total_size": total },
            "weight_map": map,
        });
        let text = serde_json::to_string_pretty(&index).map_err(|e| fmt_err(dir, e.to_string()))?;
        write_atomic(&dir.join(INDEX), text.as_bytes())?;
        written.push(INDEX.to_string());
    }
    for f in stale {
        if !written.contains(&f) {
            let p = dir.join(&f);
            std::fs::remove_file(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// The weight files a folder holds now (`model.safetensors`, the index and
/// `model-*-of-*.safetensors` shards).
fn stale_weights(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let shard =
            name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors");
        if name == SINGLE || name == INDEX || shard {
            out.push(name);
        }
    }
    Ok(out)
}
