//! The planner's errors: each names what was wrong and where.

use std::fmt;

/// Where a value came from: a cluster file (with line and column when
/// known), a preset, or the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The file, or a description (`preset h100`, `--gpus`).
    pub source: String,
    /// 1-based line and column in the file, when known.
    pub position: Option<(usize, usize)>,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)?;
        if let Some((line, col)) = self.position {
            write!(f, ":{line}:{col}")?;
        }
        Ok(())
    }
}

/// Errors of the planner.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A cluster description is wrong: unreadable, not TOML, an unknown
    /// key, a value of the wrong type or out of range.
    #[error("{origin}: {}{message}", key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
    Cluster {
        /// The file (and position) or preset.
        origin: Origin,
        /// The dotted key, when known.
        key: Option<String>,
        /// What is wrong and what was expected.
        message: String,
    },
    /// An unknown cluster preset.
    #[error("unknown cluster preset `{name}`; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The presets there are.
        known: String,
    },
    /// A model dimension out of range.
    #[error("model: {field} = {value}: expected {expected}")]
    InvalidModel {
        /// The dimension.
        field: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: String,
    },
    /// A layout that weft cannot run for this model, batch and cluster.
    #[error("layout {layout}: {field}: {reason}")]
    InvalidLayout {
        /// The layout, as `dp=2 tp=4 pp=2 ...`.
        layout: String,
        /// The degree or setting at fault (`tp`, `pp`, `micro_batch_size`, ...).
        field: &'static str,
        /// Why, and what would work.
        reason: String,
    },
    /// A request the planner cannot answer (no layout of the GPUs, a batch
    /// of zero, ...).
    #[error("{field}: {reason}")]
    InvalidRequest {
        /// The setting at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The pipeline simulator refused a schedule.
    #[error("pipeline schedule: {0}")]
    Pipeline(#[from] weft_pipeline::Error),
    /// A calibration job on a cluster of nodes could not be started, or
    /// failed, or left no figures ([`launch`](crate::launch)).
    #[error("{0}")]
    Launch(String),
}

/// The planner's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
