//! The crate's error type.

use std::time::Duration;

use crate::types::OpKind;

/// Why a rank is considered lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossCause {
    /// Its thread (or process) finished while peers still expected it.
    Exited,
    /// Its thread panicked.
    Panicked,
    /// A fault-injection hook told it to fail.
    Injected,
}

impl std::fmt::Display for LossCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossCause::Exited => "exited",
            LossCause::Panicked => "panicked",
            LossCause::Injected => "failed by fault injection",
        })
    }
}

/// Errors of this crate. Ranks in errors are *world* ranks (the rank in the
/// whole run, not in a sub-group), so messages from different groups can be
/// compared; `group` names the group and its members.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A peer the operation needed is gone.
    #[error("{op} in group {group}: rank {rank} is lost ({cause}); noticed by rank {noticed_by}")]
    PeerLost {
        /// The operation that was running.
        op: OpKind,
        /// The lost world rank.
        rank: usize,
        /// Why it is considered lost.
        cause: LossCause,
        /// The world rank that noticed.
        noticed_by: usize,
        /// The group (name and members).
        group: String,
    },
    /// The per-operation watchdog fired.
    #[error(
        "{op} in group {group} timed out after {after:?} on rank {rank}: ranks {missing:?} did not arrive (rank {rank} was waiting for {waiting_for:?})"
    )]
    Timeout {
        /// The operation.
        op: OpKind,
        /// The group (name and members).
        group: String,
        /// The world rank that timed out.
        rank: usize,
        /// World ranks of the group that have not yet entered this operation.
        missing: Vec<usize>,
        /// World ranks whose messages this rank was still waiting for.
        waiting_for: Vec<usize>,
        /// The timeout.
        after: Duration,
    },
    /// Ranks called different operations, or the same one with different
    /// lengths, dtypes, roots or algorithms.
    #[error(
        "mismatched calls in group {group}: rank {rank} called {ours} but rank {peer} called {theirs}"
    )]
    Mismatch {
        /// The group (name and members).
        group: String,
        /// The world rank that noticed.
        rank: usize,
        /// What it called.
        ours: String,
        /// The other world rank.
        peer: usize,
        /// What that rank called.
        theirs: String,
    },
    /// Another rank of the group found a fatal problem (a mismatch) and
    /// aborted the group; every later operation on it fails.
    #[error("{op} in group {group} aborted: {reason}")]
    Aborted {
        /// The operation that was running here.
        op: OpKind,
        /// The group (name and members).
        group: String,
        /// What the aborting rank reported.
        reason: String,
    },
    /// An argument is invalid (wrong length, bad root, counts that do not add up).
    #[error("{op}: invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The operation.
        op: OpKind,
        /// The argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// This rank was told to fail by fault injection.
    #[error("rank {rank} failed by fault injection at {op}")]
    InjectedFault {
        /// The world rank.
        rank: usize,
        /// The operation it was starting.
        op: OpKind,
    },
    /// A rank's closure panicked (reported by `LocalCluster`).
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The world rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A backend was requested that is not compiled in or whose libraries
    /// are not present.
    #[error("{backend} backend not available: {reason}")]
    BackendUnavailable {
        /// `"mpi"` or `"nccl"`.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// Bytes received in reproducible mode do not decode.
    #[error("reproducible {op}: corrupt exact encoding: {reason}")]
    Decode {
        /// The operation.
        op: OpKind,
        /// What is wrong.
        reason: String,
    },
    /// An error reported by an external backend library.
    #[error("{backend} {op}: {message}")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// The operation.
        op: OpKind,
        /// The library's message.
        message: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
