//! A job of one process per rank, as an MPI launcher (`mpirun`, `mpiexec`,
//! `srun`) starts it: what the launcher said ([`LauncherEnv`]), and this
//! process's place in the job ([`Processes`]): the world communicator
//! (MPI, or NCCL across the GPUs) and the host of every rank.
//!
//! Ranks on one host form one domain of the collectives' topology when
//! every host runs consecutive ranks, and [`Processes::connect`] makes
//! them so: a launcher's round-robin mapping (`--map-by node`) is
//! renumbered host by host ([`placement`]), so that groups of consecutive
//! ranks — a tensor-parallel group, innermost on a mesh — stay inside a
//! host whenever the ranks per host are a multiple of the group's size
//! ([`split_groups`] names those that do not).
//!
//! ```
//! use weft_collectives::processes::{node_map, placement, rank_ranges};
//!
//! // a round-robin launch over two hosts
//! let hosts: Vec<String> = ["a", "b", "a", "b"].map(String::from).to_vec();
//! assert_eq!(placement(&hosts), [0, 2, 1, 3]); // each host's ranks made consecutive
//! let nodes = node_map(&hosts);
//! assert_eq!(nodes[0], ("a".to_owned(), vec![0, 2]));
//! assert_eq!(rank_ranges(&[0, 1, 2, 3, 6]), "0-3, 6");
//! ```

use std::time::Duration;

use crate::{Backend, Communicator, Disagreement};

/// The tag of the host-name exchange of [`Processes::connect`].
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
const HOSTS_TAG: u64 = 0x5748_5300; // "WHS"

/// What an MPI launcher (`mpirun`, `mpiexec`, `srun`) told this process,
/// read from the environment it sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LauncherEnv {
    /// The launcher, by the variables found (`Open MPI`, `PMI`, `PMIx`,
    /// `Slurm`).
    pub launcher: &'static str,
    /// This process's rank.
    pub rank: usize,
    /// Processes in the job.
    pub size: usize,
}

impl LauncherEnv {
    /// The launcher's variables, if this process was started by one:
    /// Open MPI's `OMPI_COMM_WORLD_{RANK,SIZE}`, MPICH/Hydra's
    /// `PMI_{RANK,SIZE}`, PMIx's `PMIX_RANK` (with the size from the
    /// others), or Slurm's `SLURM_{PROCID,NTASKS}` under `srun`.
    #[must_use]
    pub fn detect() -> Option<Self> {
        let var = |k: &str| std::env::var(k).ok()?.trim().parse::<usize>().ok();
        let found = |launcher, rank: Option<usize>, size: Option<usize>| {
            Some(LauncherEnv {
                launcher,
                rank: rank?,
                size: size?,
            })
        };
        found(
            "Open MPI",
            var("OMPI_COMM_WORLD_RANK"),
            var("OMPI_COMM_WORLD_SIZE"),
        )
        .or_else(|| found("PMI", var("PMI_RANK"), var("PMI_SIZE")))
        .or_else(|| {
            found(
                "PMIx",
                var("PMIX_RANK"),
                var("OMPI_COMM_WORLD_SIZE").or_else(|| var("PMI_SIZE")),
            )
        })
        .or_else(|| {
            // `srun` of an MPI program sets these; a Slurm batch script
            // outside srun sets SLURM_NTASKS too, but not SLURM_PROCID
            found("Slurm", var("SLURM_PROCID"), var("SLURM_NTASKS"))
                .filter(|_| std::env::var_os("SLURM_STEP_ID").is_some())
        })
    }
}

/// This process's place in a job of one process per rank: the world
/// communicator and where every rank runs. Built by [`Processes::connect`]
/// (feature `mpi`).
pub struct Processes {
    #[cfg(feature = "mpi")]
    mpi: crate::MpiComm,
    // with NCCL: the NCCL world; else the MPI world
    world: Box<dyn Communicator>,
    backend: Backend,
    library: String,
    hosts: Vec<String>,
    renumbered: bool,
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processes")
            .field("backend", &self.backend)
            .field("rank", &self.world.rank())
            .field("size", &self.world.size())
            .finish_non_exhaustive()
    }
}

impl Processes {
    /// Joins the job's MPI world and learns every rank's host (`host` is
    /// this process's), renumbering the ranks host by host where the
    /// launcher did not ([`placement`]). Call once per process.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`](crate::Error::BackendUnavailable)
    /// when this build has no MPI support (feature `mpi`) or MPI cannot
    /// start; a communication error if the host exchange fails.
    pub fn connect(host: &str) -> crate::Result<Self> {
        #[cfg(feature = "mpi")]
        {
            Self::connect_mpi(host)
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = host;
            Err(crate::Error::BackendUnavailable {
                backend: "mpi",
                reason: "built without the `mpi` feature".into(),
            })
        }
    }

    #[cfg(feature = "mpi")]
    fn connect_mpi(host: &str) -> crate::Result<Self> {
        let mpi = crate::MpiComm::builder().init()?;
        let launched: Vec<String> = crate::all_gather_bytes(&mpi, HOSTS_TAG, host.as_bytes())?
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect();
        let order = placement(&launched);
        let renumbered = order.iter().enumerate().any(|(i, &r)| i != r);
        let mpi = if renumbered {
            let key = u32::try_from(order[mpi.rank()]).unwrap_or(u32::MAX);
            mpi.split_mpi(0, key)?
        } else {
            mpi
        };
        let mut hosts = launched.clone();
        for (w, &r) in order.iter().enumerate() {
            hosts[r].clone_from(&launched[w]);
        }
        Ok(Processes {
            world: Box::new(mpi.clone()),
            library: mpi.library_version(),
            mpi,
            backend: Backend::Mpi,
            hosts,
            renumbered,
        })
    }

    /// Switches the world to NCCL across the GPUs: rank 0 creates the
    /// communicator id and broadcasts it over MPI, and each rank takes
    /// the GPU of its place on its host. Every rank first learns whether
    /// every rank can ([`crate::agree`]), so none enters NCCL's
    /// rendezvous alone. Collective.
    ///
    /// # Errors
    /// A [`Disagreement`] of
    /// [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) when
    /// this build has no NCCL support (feature `nccl`) or no GPU or NCCL
    /// library is found on some rank.
    pub fn use_nccl(&mut self) -> Result<(), Disagreement<crate::Error>> {
        #[cfg(feature = "nccl")]
        {
            let me = self.world.rank();
            let local = self.hosts[..me]
                .iter()
                .filter(|h| **h == self.hosts[me])
                .count();
            crate::agree(self.world(), crate::nccl_available().map(|_| ()))?;
            let nccl = crate::agree(self.world(), crate::NcclComm::over(self.world(), local))?;
            self.world = Box::new(nccl);
            self.backend = Backend::Nccl;
            Ok(())
        }
        #[cfg(not(feature = "nccl"))]
        {
            crate::agree(
                self.world(),
                Err(crate::Error::BackendUnavailable {
                    backend: "nccl",
                    reason: "built without the `nccl` feature".into(),
                }),
            )
        }
    }

    /// Sets the watchdog of the MPI world: a rank waits at most `timeout`
    /// for its peers in any operation. (NCCL's has its own.)
    pub fn set_timeout(&mut self, timeout: Duration) {
        #[cfg(feature = "mpi")]
        if self.backend == Backend::Mpi {
            self.world = Box::new(self.mpi.clone().with_timeout(timeout));
        }
        #[cfg(not(feature = "mpi"))]
        let _ = timeout;
    }

    /// The world communicator.
    #[must_use]
    pub fn world(&self) -> &dyn Communicator {
        &*self.world
    }

    /// This process's rank.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The backend in use (`Mpi` or `Nccl`).
    #[must_use]
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The host of every rank, in rank order.
    #[must_use]
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The ranks on this process's host (this one included).
    #[must_use]
    pub fn ranks_on_host(&self) -> usize {
        let me = self.hosts.get(self.world.rank());
        self.hosts.iter().filter(|h| Some(*h) == me).count()
    }

    /// The processes in a line: the backend and its library, and every
    /// node with its ranks.
    #[must_use]
    pub fn describe(&self) -> String {
        // "Open MPI v4.1.4, package: …": the name and version
        let lib = self.library.split([',', '\n']).next().unwrap_or("").trim();
        let nodes = node_map(&self.hosts);
        format!(
            "{} processes over {} ({lib}), {} node{}: {}{}",
            self.hosts.len(),
            self.backend.name(),
            nodes.len(),
            if nodes.len() == 1 { "" } else { "s" },
            nodes
                .iter()
                .map(|(h, r)| format!("{h} [{}]", rank_ranges(r)))
                .collect::<Vec<_>>()
                .join(", "),
            if self.renumbered {
                " (renumbered from the launcher's order: each node holds consecutive ranks)"
            } else {
                ""
            }
        )
    }
}

/// Each host with its ranks, in order of first appearance.
#[must_use]
pub fn node_map(hosts: &[String]) -> Vec<(String, Vec<usize>)> {
    let mut nodes: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match nodes.iter_mut().find(|(n, _)| n == h) {
            Some((_, ranks)) => ranks.push(r),
            None => nodes.push((h.clone(), vec![r])),
        }
    }
    nodes
}

/// The job's rank of each launcher rank, given the launcher ranks' hosts:
/// hosts in order of their first rank, each host's ranks consecutive in
/// launcher order. The identity when every host's ranks are already
/// consecutive.
#[must_use]
pub fn placement(hosts: &[String]) -> Vec<usize> {
    let mut order = vec![0; hosts.len()];
    let mut next = 0;
    for (_, ranks) in node_map(hosts) {
        for r in ranks {
            order[r] = next;
            next += 1;
        }
    }
    order
}

/// `0-3, 6` for ranks 0, 1, 2, 3, 6.
#[must_use]
pub fn rank_ranges(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The groups of `size` consecutive ranks (a tensor-parallel group, say)
/// whose ranks are on more than one host: `(first rank, hosts)`.
#[must_use]
pub fn split_groups(hosts: &[String], size: usize) -> Vec<(usize, Vec<String>)> {
    if size <= 1 {
        return Vec::new();
    }
    hosts
        .chunks(size)
        .enumerate()
        .filter_map(|(g, group)| {
            let mut names: Vec<String> = Vec::new();
            for h in group {
                if !names.contains(h) {
                    names.push(h.clone());
                }
            }
            (names.len() > 1).then_some((g * size, names))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn ranks_are_placed_host_by_host() {
        // by slot already: unchanged
        let h = hosts(&["a", "a", "b", "b"]);
        assert_eq!(placement(&h), [0, 1, 2, 3]);
        // round-robin over two hosts: each host's ranks made consecutive
        let h = hosts(&["a", "b", "a", "b"]);
        assert_eq!(placement(&h), [0, 2, 1, 3]);
        let h = hosts(&["b", "a", "c", "a", "b", "c"]);
        assert_eq!(placement(&h), [0, 2, 4, 3, 1, 5]);
        // then groups of 2 stay on one host
        let mut placed = vec![String::new(); h.len()];
        for (w, &r) in placement(&h).iter().enumerate() {
            placed[r].clone_from(&h[w]);
        }
        assert!(split_groups(&placed, 2).is_empty());
        assert_eq!(
            split_groups(&hosts(&["a", "b", "a", "b"]), 2),
            [(0, hosts(&["a", "b"])), (2, hosts(&["a", "b"]))]
        );
    }

    #[test]
    fn node_maps_and_rank_ranges_read_well() {
        assert_eq!(rank_ranges(&[0, 1, 2, 3, 6]), "0-3, 6");
        assert_eq!(rank_ranges(&[5]), "5");
        let m = node_map(&hosts(&["x", "y", "x"]));
        assert_eq!(m, [("x".to_owned(), vec![0, 2]), ("y".to_owned(), vec![1])]);
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn without_mpi_connecting_says_so() {
        let e = Processes::connect("h").unwrap_err().to_string();
        assert!(e.contains("mpi") && e.contains("feature"), "{e}");
    }
}
