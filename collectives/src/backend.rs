//! Which backend a job's ranks communicate over.

use std::fmt;

/// How the ranks of a job run and communicate: the choice a job file
/// makes (`parallel.backend` in `weft train`; with the `serde` feature it
/// (de)serializes as `"auto"`, `"threads"`, `"mpi"` or `"nccl"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Backend {
    /// MPI processes when an MPI launcher started this process, else
    /// threads.
    #[default]
    Auto,
    /// Threads of one process ([`LocalCluster`](crate::LocalCluster)).
    Threads,
    /// One MPI process per rank (`MpiComm`, feature `mpi`).
    Mpi,
    /// One process per GPU, the communicator id broadcast over MPI
    /// (`NcclComm`, feature `nccl`).
    Nccl,
}

impl Backend {
    /// The name a job file uses.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Threads => "threads",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
