//! Training: [`train`] runs a job described by a [`Config`] on the ranks
//! of its mesh and reports to an [`Observer`]; the run folder it writes
//! and the loop itself are described in the crate's `run` module.
//!
//! The ranks are threads of this process (`parallel.backend =
//! "threads"`, or `"auto"` outside an MPI launcher), or — under
//! `mpirun`/`srun`, or with `"mpi"`/`"nccl"` — this process is one rank
//! of the launcher's job ([`connect`](crate::ranks::connect),
//! then [`train_processes`]). With `train.device = "cuda"` (feature
//! `cuda`) the job runs on one GPU as one rank, in this process. The
//! library never prints: progress goes to the [`Observer`], which the
//! `weft` binary renders as a progress bar or log lines.

use std::path::PathBuf;

use weft_data::DataError;
use weft_kernels::Precision;
use weft_trace::{EventKind, MetricsEvent, MetricsRecord};

pub use weft_model::RankMemory;
pub use weft_trace::Summary;

use crate::config::Config;
pub use crate::run::saving::{CkptError, check_branch_from};

/// Errors that stop a training run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The data could not be opened or read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The model or its parallelization plan rejected the configuration,
    /// a batch or a checkpoint's state; or a step failed (names the stage,
    /// the collective or the kernel).
    #[error("model: {0}")]
    Model(#[from] weft_model::Error),
    /// The mesh's degrees do not fit together.
    #[error("parallel layout: {0}")]
    Mesh(#[from] weft_parallel::Error),
    /// The configuration is invalid (a value out of range, or a batch that
    /// does not split over the layout).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The run folder already exists: runs are never overwritten.
    #[error("run folder {0} already exists: pick another run.name (or remove the folder)")]
    RunExists(PathBuf),
    /// Another process is writing the run folder.
    #[error(transparent)]
    RunInUse(#[from] weft_supervise::lock::LockError),
    /// Saving or restoring a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CkptError),
    /// The mixture-of-experts block rejected its settings.
    #[error("mixture of experts: {0}")]
    Moe(#[from] weft_moe::Error),
    /// `--resume` named a run folder that does not exist.
    #[error("cannot resume: run folder {0} does not exist")]
    NothingToResume(PathBuf),
    /// The run needs more memory than the machine has available (checked
    /// before anything is allocated).
    #[error(
        "the run needs {needed} across its {ranks} rank(s) but this machine has {available} available ({detail}); the largest part is {dominant}"
    )]
    OutOfMemory {
        /// Bytes needed by all ranks of this process, formatted.
        needed: String,
        /// Bytes available, formatted.
        available: String,
        /// Ranks in this process.
        ranks: usize,
        /// What was counted: rank 0's prediction by category, or the
        /// parameters' floor.
        detail: String,
        /// The dominant category and the settings that size it.
        dominant: String,
    },
    /// A collective operation between ranks failed.
    #[error("communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// The pipeline's measured timeline could not be simulated or exported.
    #[error("pipeline timeline: {0}")]
    Timeline(#[from] weft_pipeline::Error),
    /// The pipeline executor failed gathering the stages' timelines.
    #[error("pipeline: {0}")]
    Pipeline(#[from] weft_pipeline::ExecError),
    /// `--resume` of a run whose newest checkpoint is already at
    /// `train.steps`: nothing is trained and nothing is rewritten.
    #[error(
        "{run} already finished: its newest checkpoint is step {step}, train.steps = {step}; nothing to do (raise train.steps to train it further)"
    )]
    AlreadyFinished {
        /// The run folder.
        run: PathBuf,
        /// The checkpoint's step.
        step: u64,
    },
    /// `train.max_rewinds` rewinds were made and another was needed.
    #[error(
        "{run}: step {step} needs a rewind ({reason}), but the run has made train.max_rewinds = {max} already (skipped batches in {run}/skip.json)"
    )]
    TooManyRewinds {
        /// The run folder.
        run: PathBuf,
        /// The step that needed it.
        step: u64,
        /// Why.
        reason: String,
        /// `train.max_rewinds`.
        max: u32,
    },
    /// A stop was asked for (SIGINT or SIGTERM, see [`weft_supervise::stop`]): the
    /// run saved a checkpoint after `step` and can be resumed.
    #[error(
        "stopped after step {step} as asked; checkpoint saved: continue with `weft train --resume {}`",
        run.display()
    )]
    Stopped {
        /// The last step taken (and saved).
        step: u64,
        /// The run folder.
        run: PathBuf,
    },
    /// A rank's trace events could not be gathered for `trace.json`.
    #[error("trace: {0}")]
    Trace(String),
    /// No rank returned a result (the launcher failed).
    #[error("no rank returned a result")]
    NoRanks,
    /// The ranks' backend cannot run here: no MPI support in this build,
    /// MPI failed to start, or no GPU / NCCL library for `nccl`.
    #[error("parallel.backend: {0}")]
    Backend(String),
    /// The launcher started another number of processes than the layout
    /// has ranks.
    #[error(
        "the layout needs {layout} ranks (parallel.dp · cp · tp · pp = {dp} · {cp} · {tp} · {pp}) but {launcher} started {launched} process(es): launch with `mpirun -np {layout}` or change [parallel]"
    )]
    WorldSize {
        /// `dp · cp · tp · pp`.
        layout: usize,
        /// `parallel.dp`.
        dp: usize,
        /// `parallel.cp`.
        cp: usize,
        /// `parallel.tp`.
        tp: usize,
        /// `parallel.pp`.
        pp: usize,
        /// Processes in the MPI world.
        launched: usize,
        /// Who started them (`mpirun`, or the MPI library alone).
        launcher: String,
    },
    /// A set-up step failed on some ranks (each distinct error with the
    /// ranks it happened on); reported by rank 0.
    #[error("{}", on_ranks(.0))]
    OnRanks(Vec<(Vec<usize>, String)>),
    /// A set-up step outside the trainer failed (the launcher reading the
    /// configuration, say).
    #[error("{0}")]
    Setup(String),
    /// A set-up step failed on another rank; rank 0 reports it (this rank
    /// prints nothing).
    #[error("stopped: another rank failed (rank 0 reports why)")]
    ReportedByRankZero,
    /// Writing the run folder failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

fn on_ranks(failures: &[(Vec<usize>, String)]) -> String {
    failures
        .iter()
        .map(|(r, m)| format!("on {}: {m}", crate::ranks::rank_list(r, None)))
        .collect::<Vec<_>>()
        .join("; ")
}

impl TrainError {
    /// Whether this error only follows from another rank's: a peer that
    /// left, or a failure rank 0 reports. A job of many processes prints
    /// it nowhere (the first error is printed where it happened).
    pub fn is_secondary(&self) -> bool {
        matches!(
            self,
            TrainError::ReportedByRankZero
                | TrainError::Comm(weft_collectives::Error::PeerLost { .. })
        )
    }
}

/// What a run is about to do, reported once at the start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunInfo {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The linear layers' arithmetic (`train.precision`), the one
    /// [`peak_flops`](Self::peak_flops) was measured in.
    pub precision: Precision,
    /// The model's family and block, e.g. `gpt2` or `llama (GQA 4/2,
    /// SwiGLU 352)`.
    pub arch: String,
    /// Model parameters (tied embedding counted once).
    pub params: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens per optimizer step.
    pub tokens_per_step: usize,
    /// How the step's batch is cut ([`weft_parallel::BatchSplit::describe`]).
    pub micro_batches: String,
    /// Training FLOPs per token: 6·N for the matmuls (N: the parameters a
    /// token is multiplied by — not the position table, and only the k of E
    /// routed experts) plus 6·L·T·Cq for causal attention (forward and
    /// backward; fewer keys in sliding-window layers).
    pub flops_per_token: f64,
    /// The machine's matmul throughput (FLOP/s) in
    /// [`precision`](Self::precision), the denominator of utilisation:
    /// measured on the CPU; on a GPU its datasheet's dense peak, NaN when
    /// the GPU is not in the table.
    pub peak_flops: f64,
    /// Where [`peak_flops`](Self::peak_flops) comes from, e.g. `measured
    /// on this machine`, or the GPU's name and datasheet (or that its peak
    /// is unknown).
    pub peak_source: String,
    /// Best achievable validation loss, when the data has one.
    pub floor: Option<f64>,
    /// Optimizer steps.
    pub steps: u64,
    /// Bytes of activations planned for one micro-batch.
    pub activation_bytes: usize,
    /// In a bf16 run, the bytes the same layout plans for them in fp32:
    /// the difference is what keeping the products' inputs in bf16
    /// saves. `None` in other precisions (and on the GPU).
    pub fp32_activation_bytes: Option<usize>,
    /// With `train.recompute`, the policy and the bytes the same layout
    /// plans for the activations without it. `None` otherwise.
    pub without_recompute: Option<(weft_model::Recompute, usize)>,
    /// With `train.loss_chunk`: the tokens per chunk, and the head's
    /// activation bytes per micro-batch with and without the chunk.
    pub loss_chunk: Option<(usize, usize, usize)>,
    /// The split over ranks, e.g. `dp=2 tp=2` (`single rank` alone).
    pub layout: String,
    /// The mesh's shape, e.g. `pp=1 × edp=2 × ep=1 × tp=2 (tp innermost)`.
    pub mesh: String,
    /// Every rank's coordinates on the mesh, in rank order
    /// (`rank 3: pp 0, dp 1, tp 1`, with ` on HOST` in a job of processes).
    pub coords: Vec<String>,
    /// How the ranks run: `4 ranks, threads of this process, 1 kernel
    /// thread each`, or the processes' backend, its library and every node with its ranks (and a warning
    /// for a tensor-parallel group that spans nodes).
    pub backend: String,
    /// Memory of one rank (rank 0) predicted from the layout before
    /// anything was allocated (`ParallelGpt::predict_memory`).
    pub predicted_memory: RankMemory,
    /// Prepared token data: what each dataset (of a blend) gives over the
    /// run's `steps × batch_size` sequences — the realized proportions.
    /// Empty for the synthetic corpus and for text.
    pub data_shares: Vec<weft_data::Share>,
    /// Whether documents are masked from each other (`data.doc_mask`).
    pub doc_mask: bool,
    /// Steps between checkpoints (0: only when stopped by a signal).
    pub checkpoint_every: u64,
    /// Whether checkpoints are written in the background.
    pub checkpoint_background: bool,
    /// Bytes of the host copy each save of rank 0 takes (its parameters
    /// and optimizer state to write), counted from the layout.
    pub checkpoint_bytes: usize,
    /// With `optim.name = "muon"`: what Muon costs each step.
    pub muon: Option<weft_parallel::MuonCost>,
    /// Memory of one rank (rank 0), counted from the buffers it allocated,
    /// so sharding shows: with `parallel.tp = N` the split layers'
    /// parameters, gradients and moments are `1/N` of the model's, with
    /// `parallel.ep = N` the experts', with FSDP the shards.
    pub memory: RankMemory,
}

/// One optimizer step, as reported to the observer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The record written to `metrics.jsonl`.
    pub record: MetricsRecord,
    /// Model FLOP/s achieved over the step.
    pub flops_per_s: f64,
    /// `flops_per_s / peak_flops`.
    pub utilisation: f64,
    /// Whether the update was applied (false: skipped as non-finite).
    pub applied: bool,
    /// Mixture-of-experts load imbalance of the step, MaxVio =
    /// (max − mean)/mean tokens per expert, averaged over layers.
    pub max_vio: Option<f64>,
}

/// A health event, as the run folder records it: a line of
/// `metrics.jsonl` (a skipped update, an fp16 overflow, a loss spike) or
/// of `events.jsonl` (a straggler, a rewind).
#[derive(Clone, Debug, PartialEq)]
pub enum HealthEvent {
    /// A health line of `metrics.jsonl`.
    Step(MetricsEvent),
    /// A line of `events.jsonl`.
    Run(EventKind),
}

/// An evaluation on the validation split.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalReport {
    /// After this many steps.
    pub step: u64,
    /// Mean validation loss, nats per token.
    pub loss: f64,
    /// The data's loss floor, if known.
    pub floor: Option<f64>,
}

/// Receives progress; every method has a no-op default.
pub trait Observer {
    /// Once, before the first step.
    fn start(&mut self, _info: &RunInfo) {}
    /// After every optimizer step.
    fn step(&mut self, _report: &StepReport) {}
    /// After every evaluation.
    fn eval(&mut self, _report: &EvalReport) {}
    /// On a health event.
    fn event(&mut self, _event: &HealthEvent) {}
    /// When a run resumes from a checkpoint after `step` steps; `skipped`
    /// lists newer checkpoints that failed verification.
    fn resumed(&mut self, _step: u64, _skipped: &[String]) {}
    /// Once, at the end.
    fn finish(&mut self, _summary: &Summary) {}
}

/// An observer that ignores everything (for tests and embedding).
pub struct Silent;
impl Observer for Silent {}

/// How a run starts beyond its configuration.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue the run folder's run from its newest valid checkpoint
    /// (`metrics.jsonl` cut back to it), as if it had never stopped.
    pub resume: bool,
    /// Faults to drill the run with (`weft train --inject`).
    pub faults: Vec<weft_supervise::Fault>,
}

/// Runs the job. Creates `<run.dir>/<run.name>/` (never overwriting one),
/// reports progress to `observer`, and returns the summary. With `resume`,
/// continues that existing run from its newest valid checkpoint instead:
/// `metrics.jsonl` is cut back to the checkpoint's step and the run goes on
/// exactly as if it had never stopped.
///
/// # Errors
/// [`TrainError`] if the data cannot be opened, the model rejects the
/// configuration, the run folder exists (or, resuming, does not), a
/// checkpoint cannot be saved or restored, or writing the folder fails;
/// [`TrainError::Backend`] if `"threads"` is asked for in a job of several
/// processes, or the processes' backend cannot start.
pub fn train(
    config: &Config,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    train_with(
        config,
        &RunOptions {
            resume,
            faults: Vec::new(),
        },
        observer,
    )
}

/// [`train`] with every option.
///
/// # Errors
/// As [`train`].
pub fn train_with(
    config: &Config,
    opts: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    crate::run::setup::start(config, opts, observer)
}

/// This process's rank of a job of one process per rank (see
/// [`Processes`](weft_collectives::processes::Processes)): the same training loop as the
/// thread ranks run, over the processes' communicator. Rank 0 reports to
/// `observer` and writes the run folder; the others report nothing. Every
/// set-up failure is agreed on by all ranks and reported once, by rank 0
/// ([`TrainError::ReportedByRankZero`] on the others).
///
/// # Errors
/// As [`train`]; [`TrainError::WorldSize`] when the launcher started
/// another number of processes than the layout has ranks.
pub fn train_processes(
    procs: &mut weft_collectives::processes::Processes,
    config: &Config,
    opts: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    crate::run::setup::start_processes(procs, config, opts, observer)
}

/// A run name from the current UTC time, `YYYYMMDD-HHMMSS` (the default
/// when `run.name` is empty).
pub fn timestamp_name() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_names_sort_and_parse() {
        let n = timestamp_name();
        assert_eq!(n.len(), 15, "{n}");
        assert_eq!(&n[8..9], "-");
        assert!(n[..4].parse::<u32>().unwrap() >= 2024);
    }
}
