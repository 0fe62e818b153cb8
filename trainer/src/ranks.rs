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
//! environment) each process is one rank: [`connect`] joins the MPI world
//! (`weft-collectives`' [`Processes`], feature `mpi`), and
//! [`train_processes`](crate::train::train_processes) runs this process's
//! rank. The world size comes from the launcher and must equal the
//! layout's `dp · cp · tp · pp`. Ranks on one node (same host name) form one
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
//! ([`agree_processes`]): rank 0 reports them once, naming the ranks they happened
//! on, and every process exits with an error — none is left waiting.

use std::sync::{Mutex, mpsc};

use std::time::Duration;

use weft_collectives::processes::{LauncherEnv, Processes};
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
    weft_collectives::agree(world, result).map_err(|d| trainer_error(d, |e| e))
}

/// A [`Disagreement`](weft_collectives::Disagreement) as the trainer's
/// error, a rank's own error made one by `own`.
fn trainer_error<E>(
    d: weft_collectives::Disagreement<E>,
    own: impl FnOnce(E) -> TrainError,
) -> TrainError {
    use weft_collectives::Disagreement;
    match d {
        Disagreement::Own(e) => own(e),
        Disagreement::OnRanks(f) => TrainError::OnRanks(f),
        Disagreement::Elsewhere => TrainError::ReportedByRankZero,
        Disagreement::Comm(e) => TrainError::Comm(e),
    }
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

/// Joins the job's processes ([`Processes::connect`]) with this host's
/// name.
///
/// # Errors
/// [`TrainError::Backend`] when this build has no MPI support (feature
/// `mpi`, with how to build it) or MPI cannot start; [`TrainError::Comm`]
/// if the host exchange fails.
pub fn connect() -> Result<Processes, TrainError> {
    if !cfg!(feature = "mpi") {
        let launched = LauncherEnv::detect()
            .map(|e| {
                format!(
                    "started by {} as rank {} of {}, but ",
                    e.launcher, e.rank, e.size
                )
            })
            .unwrap_or_default();
        return Err(TrainError::Backend(format!(
            "{launched}this weft was built without MPI support: build it with \
             `cargo build --release -p weft-trainer --features mpi` \
             (needs an MPI library, e.g. Debian's libopenmpi-dev)"
        )));
    }
    Processes::connect(&weft_supervise::host_name()).map_err(|e| match e {
        weft_collectives::Error::BackendUnavailable { .. } => TrainError::Backend(e.to_string()),
        e => TrainError::Comm(e),
    })
}

/// Switches the processes' world to NCCL (`parallel.backend = "nccl"`,
/// [`Processes::use_nccl`]). Collective.
///
/// # Errors
/// [`TrainError::Backend`] when this build has no NCCL support (feature
/// `nccl`, with how to build it), or no GPU or NCCL library is found.
pub fn use_nccl(procs: &mut Processes) -> Result<(), TrainError> {
    if !cfg!(feature = "nccl") {
        return agree(
            procs.world(),
            Err(TrainError::Backend(
                "\"nccl\": this weft was built without NCCL support: build it with \
                 `--features nccl` and run it where a GPU and libnccl are"
                    .into(),
            )),
        );
    }
    procs
        .use_nccl()
        .map_err(|d| trainer_error(d, |e| TrainError::Backend(e.to_string())))
}

/// Agrees on a set-up step's outcome over the processes
/// ([`weft_collectives::agree`]), for the launcher's own steps such as
/// reading the configuration: every rank gets `result` back when it holds
/// on every rank.
///
/// # Errors
/// On rank 0 its own error, or [`TrainError::OnRanks`] naming each
/// distinct error's ranks; [`TrainError::ReportedByRankZero`] on the
/// others; [`TrainError::Comm`] when the exchange fails.
pub fn agree_processes<T>(
    procs: &Processes,
    result: Result<T, TrainError>,
) -> Result<T, TrainError> {
    agree(procs.world(), result)
}

/// The hand-over of a failure report: rank 0, once it has printed its
/// error, tells every other rank; a rank whose failure rank 0 reports
/// (`waiting`) waits for that word (at most the watchdog's timeout), so
/// that no process ends — and makes the launcher stop the job — before
/// the report is out. Failures to send or receive are ignored: the job
/// is ending.
pub fn reported(procs: &Processes, waiting: bool) {
    let world = procs.world();
    if world.rank() == 0 {
        for peer in 1..world.size() {
            let _ = world.send_bytes(peer, tags::REPORTED, &[1]);
        }
    } else if waiting {
        let _ = world.recv_bytes(0, tags::REPORTED, &mut [0u8]);
    }
}

/// Sizes this process's kernel pool (the global one) once: `threads`
/// (`parallel.threads`) threads, or with 0 its share of its host's cores.
/// A pool already started keeps its size.
pub fn size_pool(procs: &Processes, threads: usize) {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads_per_rank(procs.ranks_on_host(), threads))
        .thread_name(|i| format!("weft-kernel-{i}"))
        .build_global();
}

/// The machine's cores.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_read_well() {
        assert_eq!(rank_list(&[2], Some(4)), "rank 2");
        assert_eq!(rank_list(&[1, 3], Some(4)), "ranks 1, 3");
        assert_eq!(rank_list(&[0, 1], Some(2)), "every rank");
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
