//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while saving, loading or checking a
/// checkpoint. Every variant names the file (and the tensor, where there is
/// one) so that a user can find what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O call failed (or an injected fault fired).
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`"create"`, `"write"`, `"fsync"`, `"rename"`, ...).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `manifest.json` is not a valid weft manifest.
    #[error("{path}: invalid manifest: {field}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// The JSON path of the offending field (`tensors["wte.weight"].shards[1].offsets`).
        field: String,
        /// What was expected.
        reason: String,
    },
    /// A safetensors file's header is malformed or out of bounds.
    #[error("{path}: invalid safetensors header: {reason}")]
    Header {
        /// The safetensors file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The manifest and a shard file disagree (dtype, shape, offsets, size).
    #[error("{path}: tensor `{tensor}`: file does not match the manifest: {reason}")]
    Mismatch {
        /// The shard file.
        path: PathBuf,
        /// The tensor concerned (empty when the whole file is concerned).
        tensor: String,
        /// What differs.
        reason: String,
    },
    /// A shard file is shorter than the manifest says.
    #[error("{path}: truncated: manifest records {expected} bytes, file has {actual}{}",
        if tensors.is_empty() { String::new() } else { format!("; tensors cut: {}", tensors.join(", ")) })]
    Truncated {
        /// The shard file.
        path: PathBuf,
        /// Tensors whose bytes run past the end of the file (first few).
        tensors: Vec<String>,
        /// Size recorded in the manifest.
        expected: u64,
        /// Size found on disk.
        actual: u64,
    },
    /// Stored bytes do not match their checksum: the shard is corrupt.
    #[error(
        "{path}: tensor `{tensor}`: checksum mismatch in chunk {chunk} \
         (file bytes {start}..{end}): expected crc32c {expected:08x}, got {actual:08x}"
    )]
    Checksum {
        /// The shard file.
        path: PathBuf,
        /// The tensor whose bytes are corrupt.
        tensor: String,
        /// Index of the checksum chunk within the shard.
        chunk: usize,
        /// First byte of the chunk in the file.
        start: u64,
        /// One past the last byte of the chunk in the file.
        end: u64,
        /// Checksum recorded in the manifest.
        expected: u32,
        /// Checksum of the bytes read.
        actual: u32,
    },
    /// Shards handed to a save do not describe their tensor properly
    /// (overlap, gap, out of bounds, wrong byte count, conflicting dtype).
    #[error("tensor `{tensor}`: {reason}")]
    InvalidShard {
        /// The tensor concerned.
        tensor: String,
        /// What was wrong.
        reason: String,
    },
    /// The checkpoint has no tensor of this name.
    #[error("{path}: no tensor named `{tensor}`")]
    UnknownTensor {
        /// The checkpoint folder.
        path: PathBuf,
        /// The name asked for.
        tensor: String,
    },
    /// A requested region does not lie inside the tensor.
    #[error(
        "tensor `{tensor}`: region offsets {offsets:?} shape {shape:?} is outside global shape {global:?}"
    )]
    RegionOutOfBounds {
        /// The tensor.
        tensor: String,
        /// Region start.
        offsets: Vec<u64>,
        /// Region extent.
        shape: Vec<u64>,
        /// The tensor's global shape.
        global: Vec<u64>,
    },
    /// A path or name that should be a checkpoint element is not one
    /// (bad `latest` pointer, folder name, file name with path separators).
    #[error("{path}: {reason}")]
    BadName {
        /// Where the name was found.
        path: PathBuf,
        /// What was expected.
        reason: String,
    },
    /// No checkpoint under a root verified.
    #[error("no valid checkpoint in {root}{}", describe_failures(.failures))]
    NoValidCheckpoint {
        /// The checkpoints root folder.
        root: PathBuf,
        /// Each candidate tried and why it was rejected.
        failures: Vec<(PathBuf, String)>,
    },
    /// A background save ([`crate::collective::Background`]) could not run
    /// to completion.
    #[error("background save of step {step} failed: {reason}")]
    Background {
        /// The step being saved.
        step: u64,
        /// Why.
        reason: String,
    },
    /// A consolidated export could not be produced.
    #[error("export: {reason}")]
    Export {
        /// What was missing or inconsistent.
        reason: String,
    },
}

fn describe_failures(failures: &[(PathBuf, String)]) -> String {
    if failures.is_empty() {
        return " (no candidates)".to_owned();
    }
    let mut s = String::new();
    for (p, why) in failures {
        s.push_str(&format!("; {}: {why}", p.display()));
    }
    s
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches an operation and a path to an [`io::Error`].
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| Error::Io {
            op,
            path: path.into(),
            source,
        })
    }
}
