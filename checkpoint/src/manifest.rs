//! `manifest.json`: what a checkpoint holds and where, with checksums.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::region::Region;
use crate::safetensors::MAX_DIMS;

/// Value of the manifest's `format` field.
pub const FORMAT_NAME: &str = "weft-checkpoint";
/// The manifest version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// File name of the manifest inside a checkpoint folder.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Largest manifest this crate reads.
pub const MAX_MANIFEST_BYTES: u64 = 256 * 1024 * 1024;
/// Default size of a checksum chunk (4 MiB).
pub const DEFAULT_CHUNK_BYTES: u64 = 4 * 1024 * 1024;
/// Bounds on the checksum chunk size a manifest may declare.
pub const CHUNK_BYTES_RANGE: (u64, u64) = (64, 1 << 30);
/// Largest world size a manifest may declare.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;
/// Longest tensor name a manifest may hold, in bytes.
pub const MAX_NAME_BYTES: usize = 4096;
/// Most grid cells examined when checking that one tensor's shards tile it.
pub const MAX_TILING_CELLS: u64 = 1 << 24;

/// The whole manifest. Field order here is the order in the JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub version: u32,
    /// Training step the checkpoint was taken after.
    pub step: u64,
    /// The layout (mesh) that saved it.
    pub layout: Layout,
    /// How shard bytes are checksummed.
    pub checksum: ChecksumSpec,
    /// Every shard file in the folder, with its exact size.
    pub files: Vec<FileEntry>,
    /// Every tensor by global name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The trainer's extra state.
    #[serde(default)]
    pub state: TrainerState,
    /// crc32c (8 hex digits) of this manifest's JSON as [`Manifest::to_json`]
    /// writes it with this field left out: every byte a resume depends on
    /// (step, optimizer step, layout, shard checksums) is covered. Set by
    /// `to_json`; manifests written before it existed have none and are
    /// accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_crc32c: Option<String>,
}

/// The device mesh a checkpoint was saved from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Number of ranks that took part.
    pub world_size: u32,
    /// Named mesh dimensions, outermost first (`[{"name":"dp","size":4}]`);
    /// their sizes multiply to `world_size`. May be empty.
    #[serde(default)]
    pub mesh: Vec<MeshDim>,
}

impl Layout {
    /// A flat layout of `world_size` ranks with one mesh dimension `name`.
    pub fn flat(name: &str, world_size: u32) -> Self {
        Layout {
            world_size,
            mesh: vec![MeshDim {
                name: name.to_owned(),
                size: world_size,
            }],
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ranks", self.world_size)?;
        if !self.mesh.is_empty() {
            let dims: Vec<String> = self
                .mesh
                .iter()
                .map(|d| format!("{}={}", d.name, d.size))
                .collect();
            write!(f, " ({})", dims.join(", "))?;
        }
        Ok(())
    }
}

/// One named mesh dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshDim {
    /// `"dp"`, `"tp"`, `"pp"`, `"fsdp"`, ...
    pub name: String,
    /// Ranks along this dimension.
    pub size: u32,
}

/// How shard bytes are checksummed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChecksumSpec {
    /// Always `"crc32c"` (Castagnoli).
    pub algorithm: String,
    /// Each shard's bytes are split into chunks of this many bytes (the
    /// last may be shorter), each with its own checksum, so a reader that
    /// needs part of a shard verifies only the chunks it reads.
    pub chunk_bytes: u64,
}

impl Default for ChecksumSpec {
    fn default() -> Self {
        ChecksumSpec {
            algorithm: "crc32c".to_owned(),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }
}

/// A shard file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint folder: `rank-NNNNN.safetensors`.
    pub name: String,
    /// The rank that wrote it.
    pub rank: u32,
    /// Exact size in bytes.
    pub bytes: u64,
}

/// A tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Element type.
    pub dtype: Dtype,
    /// Global (unsharded) shape.
    pub shape: Vec<u64>,
    /// The pieces that together cover the tensor exactly once.
    pub shards: Vec<ShardEntry>,
}

/// A piece of a tensor stored in one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File (in [`Manifest::files`]) holding it, under the tensor's global name.
    pub file: String,
    /// Where the piece starts in the global tensor.
    pub offsets: Vec<u64>,
    /// Extent of the piece; its bytes are stored row-major.
    pub shape: Vec<u64>,
    /// Absolute offset of the piece's first byte in the file.
    pub byte_offset: u64,
    /// Number of bytes (elements × dtype size).
    pub byte_len: u64,
    /// crc32c of each `chunk_bytes` chunk of the piece's bytes.
    pub crc32c: Vec<u32>,
}

impl ShardEntry {
    /// The region of the global tensor this shard holds.
    pub fn region(&self) -> Region {
        Region::new(self.offsets.clone(), self.shape.clone())
    }
}

/// Bytes stored as a lower-case hex string in JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HexBytes(pub Vec<u8>);

impl Serialize for HexBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(self.0.len() * 2);
        for b in &self.0 {
            out.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&out)
    }
}

impl<'de> Deserialize<'de> for HexBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        if s.len() % 2 != 0 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(serde::de::Error::custom(
                "expected an even-length hex string",
            ));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map(HexBytes)
            .map_err(serde::de::Error::custom)
    }
}

/// What the trainer needs besides tensors to continue a run bit for bit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainerState {
    /// Optimizer step count (AdamW's `t`).
    pub optimizer_step: u64,
    /// Hash of the run configuration, to refuse resuming a different run.
    pub config_hash: Option<String>,
    /// Data-loader position (free-form; e.g. `{"epoch": 0, "offset": 123}`).
    pub data_position: Option<Value>,
    /// RNG states by name (e.g. `"rank3/dropout"`), as raw bytes.
    pub rng: BTreeMap<String, HexBytes>,
    /// Loss-scaler state (e.g. a serialized `weft_numerics::LossScalerState`).
    pub loss_scaler: Option<Value>,
    /// Anything else.
    pub extra: BTreeMap<String, Value>,
}

/// Whether `name` is a valid shard file name: `rank-` then at least five
/// decimal digits then `.safetensors`. Nothing else is accepted, so no
/// manifest can point outside its folder.
pub fn valid_file_name(name: &str) -> bool {
    name.len() <= 64
        && name
            .strip_prefix("rank-")
            .and_then(|r| r.strip_suffix(".safetensors"))
            .is_some_and(|d| d.len() >= 5 && d.bytes().all(|c| c.is_ascii_digit()))
}

/// The shard file name of `rank`.
pub fn file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Number of checksum chunks of a shard of `len` bytes.
pub(crate) fn chunk_count(len: u64, chunk: u64) -> u64 {
    len.div_ceil(chunk)
}

/// Checks that `regions` (each within `global`, none empty) cover `global`
/// exactly once. Works on the grid of all cut points, so the cost is the
/// number of grid cells (equal to the shard count for row, column and
/// 2-D grid shardings).
pub(crate) fn check_tiling(
    global: &[u64],
    regions: &[Region],
    budget: &mut u64,
) -> std::result::Result<(), String> {
    let total = global
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or("volume overflows")?;
    if total == 0 {
        return if regions.is_empty() {
            Ok(())
        } else {
            Err("tensor is empty but has shards".into())
        };
    }
    if regions.is_empty() {
        return Err("no shards".into());
    }
    let n = global.len();
    let mut cuts: Vec<Vec<u64>> = vec![Vec::new(); n];
    for (d, c) in cuts.iter_mut().enumerate() {
        c.push(0);
        c.push(global[d]);
        for r in regions {
            c.push(r.offsets[d]);
            c.push(r.offsets[d] + r.shape[d]);
        }
        c.sort_unstable();
        c.dedup();
    }
    let cells = cuts
        .iter()
        .try_fold(1u64, |a, c| a.checked_mul(c.len() as u64 - 1))
        .filter(|&c| c <= MAX_TILING_CELLS && c <= *budget)
        .ok_or("shard boundaries form too irregular a grid to check")?;
    *budget -= cells;
    let mut seen = vec![false; cells as usize];
    let mut marked = 0u64;
    for (i, r) in regions.iter().enumerate() {
        let pos = |d: usize, x: u64| cuts[d].binary_search(&x).unwrap_or(0);
        let lo: Vec<usize> = (0..n).map(|d| pos(d, r.offsets[d])).collect();
        let hi: Vec<usize> = (0..n).map(|d| pos(d, r.offsets[d] + r.shape[d])).collect();
        for_each_index(&lo, &hi, |idx| {
            let mut cell = 0usize;
            for d in 0..n {
                cell = cell * (cuts[d].len() - 1) + idx[d];
            }
            if std::mem::replace(&mut seen[cell], true) {
                return Err(format!(
                    "shard {i} (offsets {:?}, shape {:?}) overlaps another shard",
                    r.offsets, r.shape
                ));
            }
            marked += 1;
            Ok(())
        })?;
    }
    if marked != cells {
        let mut rest = seen.iter().position(|s| !s).unwrap_or(0);
        let mut coords = vec![0u64; n];
        for d in (0..n).rev() {
            let k = cuts[d].len() - 1;
            coords[d] = cuts[d][rest % k];
            rest /= k;
        }
        return Err(format!("shards leave a gap at index {coords:?}"));
    }
    Ok(())
}

/// Calls `f` for every index in the box `lo..hi` (row-major order).
fn for_each_index(
    lo: &[usize],
    hi: &[usize],
    mut f: impl FnMut(&[usize]) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let mut idx = lo.to_vec();
    loop {
        f(&idx)?;
        let mut d = idx.len();
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

impl Manifest {
    /// Parses and validates manifest JSON. `path` is used in errors only.
    /// Every field read is checked: names, bounds, byte counts, checksum
    /// counts, and that each tensor's shards tile it exactly once. This is
    /// the function the fuzz target exercises.
    ///
    /// # Errors
    /// [`Error::Manifest`] naming the field and what was expected.
    pub fn from_json(bytes: &[u8], path: &Path) -> Result<Manifest> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| Error::Manifest {
            path: path.to_owned(),
            field: format!("line {} column {}", e.line(), e.column()),
            reason: e.to_string(),
        })?;
        m.validate(path)?;
        if let Some(claimed) = &m.manifest_crc32c {
            let actual = m.self_checksum();
            if *claimed != actual {
                return Err(Error::Manifest {
                    path: path.to_owned(),
                    field: "manifest_crc32c".into(),
                    reason: format!(
                        "the manifest does not match its checksum ({claimed} written, {actual} now): it was changed after it was saved"
                    ),
                });
            }
        }
        Ok(m)
    }

    /// The checksum [`manifest_crc32c`](Self::manifest_crc32c) holds: of
    /// the pretty JSON of this manifest with that field left out.
    fn self_checksum(&self) -> String {
        let mut bare = self.clone();
        bare.manifest_crc32c = None;
        let json = serde_json::to_vec_pretty(&bare).unwrap_or_default();
        format!("{:08x}", crate::checksum::crc32c(&json))
    }

    /// Reads and validates `dir/manifest.json`, refusing files larger than
    /// [`MAX_MANIFEST_BYTES`].
    ///
    /// # Errors
    /// [`Error::Io`] if unreadable, [`Error::Manifest`] if invalid.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let f = std::fs::File::open(&path).ctx("open", &path)?;
        let mut buf = Vec::new();
        f.take(MAX_MANIFEST_BYTES + 1)
            .read_to_end(&mut buf)
            .ctx("read", &path)?;
        if buf.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(Error::Manifest {
                path,
                field: String::new(),
                reason: format!("larger than the {MAX_MANIFEST_BYTES}-byte limit"),
            });
        }
        Manifest::from_json(&buf, &path)
    }

    /// Serializes to pretty JSON, with [`manifest_crc32c`](Self::manifest_crc32c)
    /// set to the checksum of the rest.
    ///
    /// # Panics
    /// Never: every field serializes (strings, integers, JSON values).
    pub fn to_json(&self) -> Vec<u8> {
        let mut sealed = self.clone();
        sealed.manifest_crc32c = Some(self.self_checksum());
        let mut v = serde_json::to_vec_pretty(&sealed).expect("manifest serializes");
        v.push(b'\n');
        v
    }

    /// The size of a file, by name.
    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors
            .values()
            .flat_map(|t| &t.shards)
            .map(|s| s.byte_len)
            .sum()
    }

    /// Checks every invariant of the format (see [`Manifest::from_json`]).
    ///
    /// # Errors
    /// [`Error::Manifest`] naming the first offending field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let err = |field: String, reason: String| Error::Manifest {
            path: path.to_owned(),
            field,
            reason,
        };
        if self.format != FORMAT_NAME {
            return Err(err(
                "format".into(),
                format!("expected {FORMAT_NAME:?}, found {:?}", self.format),
            ));
        }
        if self.version != FORMAT_VERSION {
            return Err(err(
                "version".into(),
                format!(
                    "this reader understands version {FORMAT_VERSION}, found {}",
                    self.version
                ),
            ));
        }
        if self.checksum.algorithm != "crc32c" {
            return Err(err(
                "checksum.algorithm".into(),
                format!("expected \"crc32c\", found {:?}", self.checksum.algorithm),
            ));
        }
        let chunk = self.checksum.chunk_bytes;
        if !(CHUNK_BYTES_RANGE.0..=CHUNK_BYTES_RANGE.1).contains(&chunk) {
            return Err(err(
                "checksum.chunk_bytes".into(),
                format!(
                    "{chunk} is outside {}..={}",
                    CHUNK_BYTES_RANGE.0, CHUNK_BYTES_RANGE.1
                ),
            ));
        }
        let ws = self.layout.world_size;
        if ws == 0 || ws > MAX_WORLD_SIZE {
            return Err(err(
                "layout.world_size".into(),
                format!("{ws} is outside 1..={MAX_WORLD_SIZE}"),
            ));
        }
        if !self.layout.mesh.is_empty() {
            let prod = self
                .layout
                .mesh
                .iter()
                .try_fold(1u64, |a, d| a.checked_mul(u64::from(d.size)));
            if prod != Some(u64::from(ws)) {
                return Err(err(
                    "layout.mesh".into(),
                    format!("sizes do not multiply to world_size {ws}"),
                ));
            }
        }
        let mut names = HashSet::new();
        for (i, f) in self.files.iter().enumerate() {
            if !valid_file_name(&f.name) {
                return Err(err(
                    format!("files[{i}].name"),
                    format!(
                        "{:?} is not of the form rank-NNNNN.safetensors",
                        f.name.chars().take(80).collect::<String>()
                    ),
                ));
            }
            if !names.insert(f.name.as_str()) {
                return Err(err(
                    format!("files[{i}].name"),
                    format!("{:?} listed twice", f.name),
                ));
            }
            if f.rank >= ws {
                return Err(err(
                    format!("files[{i}].rank"),
                    format!("rank {} >= world_size {ws}", f.rank),
                ));
            }
        }
        let mut cells_budget = 1u64 << 28;
        for (name, t) in &self.tensors {
            let field = |s: &str| {
                format!(
                    "tensors[{:?}]{s}",
                    name.chars().take(80).collect::<String>()
                )
            };
            if name.is_empty() || name.len() > MAX_NAME_BYTES || name == "__metadata__" {
                return Err(err(
                    field(""),
                    format!("tensor names must be 1..={MAX_NAME_BYTES} bytes and not __metadata__"),
                ));
            }
            if t.shape.len() > MAX_DIMS {
                return Err(err(
                    field(".shape"),
                    format!("{} dimensions (at most {MAX_DIMS})", t.shape.len()),
                ));
            }
            t.shape
                .iter()
                .try_fold(t.dtype.size_bytes() as u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| err(field(".shape"), "byte size overflows u64".into()))?;
            let mut regions = Vec::with_capacity(t.shards.len());
            for (j, s) in t.shards.iter().enumerate() {
                let sf = |x: &str| field(&format!(".shards[{j}]{x}"));
                let Some(fe) = self.file(&s.file) else {
                    return Err(err(
                        sf(".file"),
                        format!(
                            "{:?} is not in `files`",
                            s.file.chars().take(80).collect::<String>()
                        ),
                    ));
                };
                let r = s.region();
                if !r.within(&t.shape) {
                    return Err(err(
                        sf(""),
                        format!(
                            "offsets {:?} shape {:?} outside global shape {:?}",
                            s.offsets, s.shape, t.shape
                        ),
                    ));
                }
                let vol = r.volume().unwrap_or(0);
                if vol == 0 {
                    return Err(err(sf(".shape"), "empty shards are not stored".into()));
                }
                let need = vol.checked_mul(t.dtype.size_bytes() as u64);
                if Some(s.byte_len) != need {
                    return Err(err(
                        sf(".byte_len"),
                        format!(
                            "{} bytes, but shape {:?} of {} needs {}",
                            s.byte_len,
                            s.shape,
                            t.dtype,
                            need.map_or("more than 2^64".to_owned(), |n| n.to_string())
                        ),
                    ));
                }
                if s.byte_offset
                    .checked_add(s.byte_len)
                    .is_none_or(|e| e > fe.bytes)
                {
                    return Err(err(
                        sf(".byte_offset"),
                        format!(
                            "bytes {}+{} run past the {}-byte file {}",
                            s.byte_offset, s.byte_len, fe.bytes, fe.name
                        ),
                    ));
                }
                if s.crc32c.len() as u64 != chunk_count(s.byte_len, chunk) {
                    return Err(err(
                        sf(".crc32c"),
                        format!(
                            "{} checksums, expected {} for {} bytes in {chunk}-byte chunks",
                            s.crc32c.len(),
                            chunk_count(s.byte_len, chunk),
                            s.byte_len
                        ),
                    ));
                }
                regions.push(r);
            }
            check_tiling(&t.shape, &regions, &mut cells_budget)
                .map_err(|r| err(field(".shards"), r))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec())
    }

    #[test]
    fn tiling_accepts_rows_columns_and_grids() {
        let mut b = u64::MAX;
        let g = [4u64, 6];
        assert!(check_tiling(&g, &[r(&[0, 0], &[2, 6]), r(&[2, 0], &[2, 6])], &mut b).is_ok());
        assert!(check_tiling(&g, &[r(&[0, 0], &[4, 3]), r(&[0, 3], &[4, 3])], &mut b).is_ok());
        let grid: Vec<Region> = (0..2)
            .flat_map(|i| (0..3).map(move |j| r(&[2 * i, 2 * j], &[2, 2])))
            .collect();
        assert!(check_tiling(&g, &grid, &mut b).is_ok());
        assert!(check_tiling(&[], &[r(&[], &[])], &mut b).is_ok());
        assert!(check_tiling(&[0, 3], &[], &mut b).is_ok());
    }

    #[test]
    fn tiling_rejects_overlap_gap_and_duplicates() {
        let mut b = u64::MAX;
        let g = [4u64, 6];
        let e = check_tiling(&g, &[r(&[0, 0], &[3, 6]), r(&[2, 0], &[2, 6])], &mut b).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
        let e = check_tiling(&g, &[r(&[0, 0], &[2, 6]), r(&[3, 0], &[1, 6])], &mut b).unwrap_err();
        assert!(e.contains("gap at index [2, 0]"), "{e}");
        // A replicated tensor saved by two ranks.
        let e = check_tiling(&g, &[r(&[0, 0], &[4, 6]), r(&[0, 0], &[4, 6])], &mut b).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
        assert!(check_tiling(&g, &[], &mut b).is_err());
        let mut small = 3;
        let e = check_tiling(&g, &[r(&[0, 0], &[2, 6]), r(&[2, 0], &[2, 6])], &mut small);
        assert!(e.is_ok(), "two cells fit a budget of three");
        assert!(check_tiling(&g, &[r(&[0, 0], &[2, 6]), r(&[2, 0], &[2, 6])], &mut small).is_err());
    }

    #[test]
    fn file_names_cannot_escape() {
        assert!(valid_file_name("rank-00000.safetensors"));
        assert!(valid_file_name("rank-1234567.safetensors"));
        for bad in [
            "../rank-00000.safetensors",
            "rank-0000.safetensors",
            "rank-00000.safetensors/..",
            "rank-0000a.safetensors",
            "/etc/passwd",
            "",
        ] {
            assert!(!valid_file_name(bad), "{bad}");
        }
        assert_eq!(file_name(7), "rank-00007.safetensors");
    }

    #[test]
    fn hex_bytes_round_trip() {
        let h = HexBytes(vec![0, 1, 0xab, 0xff]);
        let j = serde_json::to_string(&h).unwrap();
        assert_eq!(j, "\"0001abff\"");
        assert_eq!(serde_json::from_str::<HexBytes>(&j).unwrap(), h);
        assert!(serde_json::from_str::<HexBytes>("\"abc\"").is_err());
        assert!(serde_json::from_str::<HexBytes>("\"zz\"").is_err());
    }
}
