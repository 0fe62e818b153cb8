//! The ranks of a run and how they start: threads of this process, or one
//! process per rank under an MPI launcher.
//!
//! Every rank runs the same training loop (SPMD, as torchtitan does); the
//! ranks differ only in their coordinates on the mesh, which the model's
//! parallelization plan turns into the part of the model and of the batch
//! each computes. Rank 0 alone writes the run folder's metrics, summary and
//! trace and reports to the [`Observer`]; every rank writes its own
//! checkpoint shards.
//!
//! # Threads
//! [`train`](crate::train::train) runs a job of `N` ranks as `N` threads
//! over `weft-collectives`' local backend. Rank 0's reports cross to the
//! calling thread over a channel, so the terminal observer never leaves
//! the main thread. Each rank computes in a kernel thread pool of its own,
//! the machine's cores shared out over the ranks (at least one thread
//! each), as each would on its own device: a stage waiting in a pipeline's
//! bubble lends no threads to a busy one. Measured on 2 cores (AMD EPYC)
//! against one pool shared by all ranks: dp=2 +20 % tokens/s, dp=2
//! fsdp=full +19 %, dp=2 tp=2 +16 %, pp=2 (8 micro-batches) +28 %, tp=2
//! −3 % (noise).
//!
//! # Processes
//! Under `mpirun` (or `srun`, or any launcher that sets the MPI
//! environment) each process is one rank: [`Processes::connect`] joins the
//! MPI world (feature `mpi`), and
//! [`train_processes`](crate::train::train_processes) runs this process's
//! rank. The world size comes from the launcher and must equal the
//! layout's `dp · tp · pp`. Ranks on one node (same host name) form one
//! domain of the collectives' topology — the hierarchical collectives'
//! intra-node level — and share the node's cores out between their kernel
//! pools. Rank order is the launcher's: with the default by-slot mapping
//! consecutive ranks fill a node first, so the tensor-parallel group
//! (consecutive ranks, innermost on the mesh) lands inside a node whenever
//! the ranks per node are a multiple of `tp`; the start-up report prints
//! the node of every rank and warns when a tensor-parallel group spans
//! nodes.
//!
//! Set-up failures (a bad configuration, a missing data file, a run folder
//! that exists) are agreed on by every rank before any of them goes on
//! ([`Processes::agree`]): rank 0 reports them once, naming the ranks they happened
//! on, and every process exits with an error — none is left waiting.

use std::sync::{Mutex, mpsc};

use std::time::Duration;

use weft_collectives::{Communicator, LocalCluster, Topology};

use crate::train::{
    EvalReport, HealthEvent, Observer, RunInfo, Silent, StepReport, Summary, TrainError,
};

/// An observer report crossing from rank 0 to the calling thread.
enum Report {
    Start(RunInfo),
    Step(StepReport),
    Eval(EvalReport),
    Event(HealthEvent),
    Resumed(u64, Vec<String>),
    Finish(Summary),
}

impl Report {
    /// Hands the report to `observer`.
    fn deliver(self, observer: &mut dyn Observer) {
        match self {
            Report::Start(i) => observer.start(&i),
            Report::Step(s) => observer.step(&s),
            Report::Eval(e) => observer.eval(&e),
            Report::Event(e) => observer.event(&e),
            Report::Resumed(step, skipped) => observer.resumed(step, &skipped),
            Report::Finish(s) => observer.finish(&s),
        }
    }
}

/// Rank 0's observer: forwards every report over a channel and waits
/// until the caller's observer has taken it, so the observer sees the run
/// as if it ran on the rank's own thread. If the observer is gone (it
/// panicked), rank 0 stops here: a run whose observer crashed does not go
/// on training and checkpointing behind its back.
struct Forward<'a> {
    reports: mpsc::Sender<Report>,
    taken: &'a Mutex<mpsc::Receiver<()>>,
}

impl Forward<'_> {
    fn send(&self, report: Report) {
        let taken = self.reports.send(report).is_ok()
            && self.taken.lock().is_ok_and(|rx| rx.recv().is_ok());
        if !taken {
            std::panic::resume_unwind(Box::new("the run's observer panicked; rank 0 stops"));
        }
    }
}

impl Observer for Forward<'_> {
    fn start(&mut self, info: &RunInfo) {
        self.send(Report::Start(info.clone()));
    }
    fn step(&mut self, report: &StepReport) {
        self.send(Report::Step(*report));
    }
    fn eval(&mut self, report: &EvalReport) {
        self.send(Report::Eval(*report));
    }
    fn event(&mut self, event: &HealthEvent) {
        self.send(Report::Event(event.clone()));
    }
    fn resumed(&mut self, step: u64, skipped: &[String]) {
        self.send(Report::Resumed(step, skipped.to_vec()));
    }
    fn finish(&mut self, summary: &Summary) {
        self.send(Report::Finish(summary.clone()));
    }
}

/// Runs `rank` on each of `world` thread ranks (rank 0 reporting to
/// `observer`, through the calling thread) and returns rank 0's summary,
/// or the most telling error. Consecutive ranks of `domain` form one
/// domain of the collectives' topology (the tensor-parallel group: the
/// fastest links; hierarchical algorithms and the traffic counters' link
/// classes follow it). Each rank runs on one thread of its own pool of
/// [`threads_per_rank`] threads (`threads`: `parallel.threads`), so its
/// kernels' parallel calls start without a hand-over to another thread;
/// a world of one rank too (1.05× faster than from the calling thread
/// over the global pool: the default job on 2 cores).
pub(crate) fn launch<F>(
    world: usize,
    threads: usize,
    domain: usize,
    timeout: Duration,
    observer: &mut dyn Observer,
    rank: F,
) -> Result<Summary, TrainError>
where
    F: Fn(&dyn Communicator, &mut dyn Observer) -> Result<Summary, TrainError> + Send + Sync,
{
    let (tx, rx) = mpsc::channel();
    let (taken_tx, taken_rx) = mpsc::channel();
    let taken_rx = Mutex::new(taken_rx);
    std::thread::scope(|s| {
        // owned here, so that an observer's panic drops both channels'
        // ends before the scope waits for the ranks: rank 0 then stops
        let (rx, taken_tx) = (rx, taken_tx);
        let taken_rx = &taken_rx;
        let ranks = s.spawn(move || {
            let tx = tx;
            let topology = if domain > 1 {
                Topology::new(domain)
            } else {
                Topology::flat()
            };
            LocalCluster::builder(world)
                .topology(topology)
                .timeout(timeout)
                .run_each(|comm| {
                    let run = || {
                        if comm.rank() == 0 {
                            rank(
                                &comm,
                                &mut Forward {
                                    reports: tx.clone(),
                                    taken: taken_rx,
                                },
                            )
                        } else {
                            rank(&comm, &mut Silent)
                        }
                    };
                    // each rank computes on its own share of the cores, as
                    // on its own device: an idle stage lends no threads to
                    // a busy one, so the bubble is the schedule's
                    match rayon::ThreadPoolBuilder::new()
                        .num_threads(threads_per_rank(world, threads))
                        .thread_name(move |i| format!("weft-rank-{i}"))
                        .build()
                    {
                        Ok(pool) => pool.install(run),
                        Err(_) => run(),
                    }
                })
        });
        for report in rx {
            report.deliver(observer);
            let _ = taken_tx.send(());
        }
        let results = ranks.join().unwrap_or_else(|_| {
            vec![Err(weft_collectives::Error::RankPanicked {
                rank: 0,
                message: "the rank launcher panicked".into(),
            })]
        });
        pick_result(results)
    })
}

/// A rank's kernel threads: `threads` (`parallel.threads`) if set, else
/// the cores shared out over `ranks` ranks, at least one.
pub(crate) fn threads_per_rank(ranks: usize, threads: usize) -> usize {
    if threads > 0 {
        threads
    } else {
        (cores() / ranks.max(1)).max(1)
    }
}

/// Rank 0's summary, or the most telling error: a rank's own failure
/// before the "peer lost" errors it caused in the others.
fn pick_result(
    results: Vec<weft_collectives::Result<Result<Summary, TrainError>>>,
) -> Result<Summary, TrainError> {
    let mut first_err: Option<TrainError> = None;
    let mut summary = None;
    for r in results {
        let e = match r {
            Ok(Ok(s)) => {
                summary.get_or_insert(s);
                continue;
            }
            Ok(Err(e)) => e,
            Err(e) => TrainError::Comm(e),
        };
        match &first_err {
            None => first_err = Some(e),
            Some(f) if f.is_secondary() && !e.is_secondary() => first_err = Some(e),
            Some(_) => {}
        }
    }
    match (first_err, summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(TrainError::NoRanks),
    }
}

/// Point-to-point tags of the trainer's own exchanges (below every MPI
/// library's tag bound, apart from weft-collectives' own
/// [`AGREE_TAG`](weft_collectives::AGREE_TAG)).
pub(crate) mod tags {
    /// The trace events gathered for `trace.json`.
    pub const TRACE: u64 = 0x5754_5200; // "WTR"
    /// Host names at start-up.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub const HOSTS: u64 = 0x5748_5300; // "WHS"
    /// The token cache's name, shared by the rank that built it.
    pub const DATA: u64 = 0x5744_5400; // "WDT"
    /// Every rank's predicted memory.
    pub const MEMORY: u64 = 0x574d_4500; // "WME"
    /// Rank 0 has reported a failure.
    pub const REPORTED: u64 = 0x5752_5000; // "WRP"
    /// The run's name, picked by rank 0.
    pub const NAME: u64 = 0x574e_4d00; // "WNM"
}

pub(crate) use weft_collectives::{all_gather_bytes, gather_bytes};

/// Agrees on a set-up step's outcome across the ranks
/// ([`weft_collectives::agree`]), as the trainer's errors: every rank gets
/// `result` back when it holds on every rank; otherwise rank 0 gets the
/// report — its own error, or [`TrainError::OnRanks`] listing each
/// distinct error with the ranks it happened on — and the other ranks
/// [`TrainError::ReportedByRankZero`]. Collective over `world`.
///
/// # Errors
/// As described; a failed exchange is [`TrainError::Comm`].
pub(crate) fn agree<T>(
    world: &dyn Communicator,
    result: Result<T, TrainError>,
) -> Result<T, TrainError> {
    use weft_collectives::Disagreement;
    weft_collectives::agree(world, result).map_err(|d| match d {
        Disagreement::Own(e) => e,
        Disagreement::OnRanks(f) => TrainError::OnRanks(f),
        Disagreement::Elsewhere => TrainError::ReportedByRankZero,
        Disagreement::Comm(e) => TrainError::Comm(e),
    })
}

/// `ranks 1, 3` / `rank 2` / `every rank`.
pub(crate) fn rank_list(ranks: &[usize], world: Option<usize>) -> String {
    if world == Some(ranks.len()) && ranks.len() > 1 {
        return "every rank".into();
    }
    let list: Vec<String> = ranks.iter().map(ToString::to_string).collect();
    match ranks {
        [_] => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

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
/// communicator and where every rank runs. Built by [`Processes::connect`].
pub struct Processes {
    #[cfg(feature = "mpi")]
    mpi: weft_collectives::MpiComm,
    // with `nccl`: the NCCL world; else the MPI world
    world: Box<dyn Communicator>,
    backend: weft_collectives::Backend,
    library: String,
    hosts: Vec<String>,
    /// Whether ranks were renumbered from the launcher's order so that each
    /// host holds consecutive ranks.
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
    /// Joins the job's MPI world, learns every rank's host (the ranks of
    /// a host form one domain of the collectives' topology when every
    /// host runs as many consecutive ranks). Call once per process; the
    /// kernel pool is sized by [`size_pool`](Self::size_pool).
    ///
    /// # Errors
    /// [`TrainError::Backend`] when this build has no MPI support (feature
    /// `mpi`) or MPI cannot start; [`TrainError::Comm`] if the host
    /// exchange fails.
    pub fn connect() -> Result<Self, TrainError> {
        Self::connect_impl()
    }

    #[cfg(not(feature = "mpi"))]
    fn connect_impl() -> Result<Self, TrainError> {
        let launched = LauncherEnv::detect()
            .map(|e| {
                format!(
                    "started by {} as rank {} of {}, but ",
                    e.launcher, e.rank, e.size
                )
            })
            .unwrap_or_default();
        Err(TrainError::Backend(format!(
            "{launched}this weft was built without MPI support: build it with \
             `cargo build --release -p weft-trainer --features mpi` \
             (needs an MPI library, e.g. Debian's libopenmpi-dev)"
        )))
    }

    #[cfg(feature = "mpi")]
    fn connect_impl() -> Result<Self, TrainError> {
        let mpi = weft_collectives::MpiComm::builder()
            .init()
            .map_err(|e| TrainError::Backend(e.to_string()))?;
        let name = weft_supervise::host_name();
        let launched: Vec<String> = all_gather_bytes(&mpi, tags::HOSTS, name.as_bytes())?
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect();
        // each host's ranks consecutive, so tensor-parallel groups (runs of
        // consecutive ranks) stay inside hosts whatever the launcher's
        // mapping (round-robin `--map-by node`, say)
        let order = placement(&launched);
        let renumbered = order.iter().enumerate().any(|(i, &r)| i != r);
        let mpi = if renumbered {
            let key = u32::try_from(order[mpi.rank()]).unwrap_or(u32::MAX);
            mpi.split_mpi(0, key)
                .map_err(|e| TrainError::Backend(e.to_string()))?
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
            backend: weft_collectives::Backend::Mpi,
            hosts,
            renumbered,
        })
    }

    /// Switches the world to NCCL across the GPUs (`parallel.backend =
    /// "nccl"`): rank 0 creates the communicator id and broadcasts it over
    /// MPI, and each rank takes the GPU of its place on its host.
    /// Collective.
    ///
    /// # Errors
    /// [`TrainError::Backend`] when this build has no NCCL support (feature
    /// `nccl`), or no GPU or NCCL library is found (the typed "not
    /// available" error of `weft-collectives`).
    pub fn use_nccl(&mut self) -> Result<(), TrainError> {
        #[cfg(feature = "nccl")]
        {
            let unavailable = |e: weft_collectives::Error| TrainError::Backend(e.to_string());
            let me = self.mpi.rank();
            let local = self.hosts[..me]
                .iter()
                .filter(|h| **h == self.hosts[me])
                .count();
            // every rank learns whether every rank can, before any of them
            // enters NCCL's rendezvous
            agree(
                &self.mpi,
                weft_collectives::nccl_available()
                    .map(|_| ())
                    .map_err(unavailable),
            )?;
            let nccl = weft_collectives::NcclComm::over(&self.mpi, local).map_err(unavailable);
            self.world = Box::new(agree(&self.mpi, nccl)?);
            self.backend = weft_collectives::Backend::Nccl;
            Ok(())
        }
        #[cfg(not(feature = "nccl"))]
        {
            agree(
                self.world(),
                Err(TrainError::Backend(
                    "\"nccl\": this weft was built without NCCL support: build it with \
                     `--features nccl` and run it where a GPU and libnccl are"
                        .into(),
                )),
            )
        }
    }

    /// Agrees on a set-up step's outcome over the processes: the result on
    /// every rank when it holds on every rank,
    /// else the report on rank 0 and [`TrainError::ReportedByRankZero`]
    /// elsewhere. For the launcher's own steps, such as reading the
    /// configuration.
    ///
    /// # Errors
    /// As described.
    pub fn agree<T>(&self, result: Result<T, TrainError>) -> Result<T, TrainError> {
        agree(self.world(), result)
    }

    /// The hand-over of a failure report: rank 0, once it has printed its
    /// error, tells every other rank; a rank whose failure rank 0 reports
    /// (`waiting`) waits for that word (at most the watchdog's timeout), so
    /// that no process ends — and makes the launcher stop the job — before
    /// the report is out. Failures to send or receive are ignored: the job
    /// is ending.
    pub fn reported(&self, waiting: bool) {
        let world = self.world();
        if world.rank() == 0 {
            for peer in 1..world.size() {
                let _ = world.send_bytes(peer, tags::REPORTED, &[1]);
            }
        } else if waiting {
            let _ = world.recv_bytes(0, tags::REPORTED, &mut [0u8]);
        }
    }

    /// Sets the watchdog: a rank waits at most `timeout` for its peers in
    /// any operation.
    pub fn set_timeout(&mut self, timeout: Duration) {
        #[cfg(feature = "mpi")]
        if self.backend == weft_collectives::Backend::Mpi {
            self.world = Box::new(self.mpi.clone().with_timeout(timeout));
        }
        #[cfg(not(feature = "mpi"))]
        let _ = timeout;
    }

    /// The world communicator.
    pub fn world(&self) -> &dyn Communicator {
        &*self.world
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The backend in use (`Mpi` or `Nccl`).
    pub fn backend(&self) -> weft_collectives::Backend {
        self.backend
    }

    /// Sizes this process's kernel pool (the global one) once:
    /// `threads` (`parallel.threads`) threads, or with 0 its share of its
    /// host's cores. A pool already started keeps its size.
    pub fn size_pool(&self, threads: usize) {
        let me = self.hosts.get(self.world.rank());
        let on_host = self.hosts.iter().filter(|h| Some(*h) == me).count();
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads_per_rank(on_host, threads))
            .thread_name(|i| format!("weft-kernel-{i}"))
            .build_global();
    }

    /// The host of every rank, in rank order.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// What the start-up report says about the processes: the backend and
    /// its library, and every node with its ranks.
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

/// The machine's cores.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// Each host with its ranks, in order of first appearance.
pub(crate) fn node_map(hosts: &[String]) -> Vec<(String, Vec<usize>)> {
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
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn placement(hosts: &[String]) -> Vec<usize> {
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
pub(crate) fn rank_ranges(ranks: &[usize]) -> String {
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

/// The tensor-parallel groups (consecutive `tp` ranks) whose ranks are on
/// more than one host: `(first rank, hosts)`.
pub(crate) fn split_tp_groups(hosts: &[String], tp: usize) -> Vec<(usize, Vec<String>)> {
    if tp <= 1 {
        return Vec::new();
    }
    hosts
        .chunks(tp)
        .enumerate()
        .filter_map(|(g, group)| {
            let mut names: Vec<String> = Vec::new();
            for h in group {
                if !names.contains(h) {
                    names.push(h.clone());
                }
            }
            (names.len() > 1).then_some((g * tp, names))
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
        // then tp groups of 2 stay on one host
        let mut placed = vec![String::new(); h.len()];
        for (w, &r) in placement(&h).iter().enumerate() {
            placed[r].clone_from(&h[w]);
        }
        assert!(split_tp_groups(&placed, 2).is_empty());
        assert_eq!(
            split_tp_groups(&hosts(&["a", "b", "a", "b"]), 2),
            [(0, hosts(&["a", "b"])), (2, hosts(&["a", "b"]))]
        );
    }

    #[test]
    fn node_maps_and_rank_lists_read_well() {
        assert_eq!(rank_ranges(&[0, 1, 2, 3, 6]), "0-3, 6");
        assert_eq!(rank_ranges(&[5]), "5");
        assert_eq!(rank_list(&[2], Some(4)), "rank 2");
        assert_eq!(rank_list(&[1, 3], Some(4)), "ranks 1, 3");
        assert_eq!(rank_list(&[0, 1], Some(2)), "every rank");
        let m = node_map(&hosts(&["x", "y", "x"]));
        assert_eq!(m, [("x".to_owned(), vec![0, 2]), ("y".to_owned(), vec![1])]);
    }

    #[test]
    fn agreement_reports_each_failure_once_on_rank_zero() {
        // every rank fails alike: rank 0's own error, the others are quiet
        let results = LocalCluster::builder(3)
            .run_each(|c| agree::<()>(&c, Err(TrainError::Backend("same".into()))).unwrap_err())
            .into_iter()
            .map(Result::unwrap)
            .collect::<Vec<_>>();
        assert!(matches!(&results[0], TrainError::Backend(m) if m == "same"));
        assert!(
            results[1..]
                .iter()
                .all(|e| matches!(e, TrainError::ReportedByRankZero))
        );
        // one rank fails: everyone stops; rank 0 names the rank
        let results = LocalCluster::builder(3)
            .run_each(|c| {
                let r = if c.rank() == 2 {
                    Err(TrainError::Backend("only here".into()))
                } else {
                    Ok(7)
                };
                agree(&c, r)
            })
            .into_iter()
            .map(Result::unwrap)
            .collect::<Vec<_>>();
        let e = results[0].as_ref().unwrap_err().to_string();
        assert_eq!(e, "on rank 2: parallel.backend: only here");
        assert!(results[1..].iter().all(Result::is_err));
        // nobody fails: the values come back
        let ok = LocalCluster::builder(2)
            .run_each(|c| agree(&c, Ok::<_, TrainError>(c.rank())))
            .into_iter()
            .map(|r| r.unwrap().unwrap())
            .collect::<Vec<_>>();
        assert_eq!(ok, [0, 1]);
    }
}
