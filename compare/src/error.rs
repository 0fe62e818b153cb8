//! Why a run file could not be read.

use thiserror::Error;

/// A run file that could not be loaded. Every variant names the file, and
/// the line (1-based) where one applies, so the page can say exactly what to
/// fix instead of drawing nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The text is not valid JSON (or JSON Lines) at `line`:`column`.
    #[error("{file}, line {line}, column {column}: {message}")]
    Syntax {
        /// File name as given (e.g. `trace.json`).
        file: String,
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column of the problem.
        column: usize,
        /// What the parser expected.
        message: String,
    },
    /// The JSON is well-formed but a record is not what the schema says.
    #[error("{file}, line {line}: {message}")]
    Schema {
        /// File name.
        file: String,
        /// 1-based line of the record.
        line: usize,
        /// What is wrong and what was expected.
        message: String,
    },
    /// The file as a whole is unusable (empty, no events, bad event).
    #[error("{file}: {message}")]
    Invalid {
        /// File name.
        file: String,
        /// What is wrong and what was expected.
        message: String,
    },
    /// A dropped file whose name and contents match none of the run files.
    #[error(
        "{file}: not a run file (expected trace.json or *.trace.json, metrics.jsonl, expert_load.jsonl, config.toml, summary.json or events.jsonl)"
    )]
    Unrecognized {
        /// File name.
        file: String,
    },
}

impl LoadError {
    /// The file the error is about.
    #[must_use]
    pub fn file(&self) -> &str {
        match self {
            Self::Syntax { file, .. }
            | Self::Schema { file, .. }
            | Self::Invalid { file, .. }
            | Self::Unrecognized { file } => file,
        }
    }
}

/// Something odd but recoverable in a run file, shown beside the view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// File name.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// What was skipped and why.
    pub message: String,
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, line {}: {}", self.file, self.line, self.message)
    }
}
