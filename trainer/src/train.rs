//! The training loop.
//!
//! [`train`] runs a job described by a [`Config`] on the ranks of its
//! mesh (`parallel.{pp,dp,tp,ep}`; one rank by default, else one thread
//! per rank, rank 0 reporting). Every layout runs the same loop: build the mesh
//! (`weft_parallel::ParallelDims::build`), apply the model's
//! parallelization plan (`weft_model::ParallelGpt`: tensor- and
//! expert-parallel sharding of the blocks, pipeline stages, replicas or
//! FSDP over the data-parallel group), and per optimizer step run this
//! rank's micro-batches through it — forward and backward (through the
//! pipeline executor when `pp > 1`), the gradient reduction, the exact
//! global norm, a check (a non-finite loss or gradient skips the update),
//! clipping, and AdamW at the scheduled learning rate. It evaluates on the
//! validation split periodically and writes the run folder:
//!
//! * `config.toml` — the resolved configuration;
//! * `metrics.jsonl` — one [`MetricsRecord`] per step, plus event lines
//!   (`{"step":…, "event":"skip"|"spike"|"eval", …}`) for health events and
//!   evaluations;
//! * `summary.json` — the final figures;
//! * `checkpoints/` — every rank's part of the model, each element
//!   written once, by its owner ([`crate::ckpt`]); a checkpoint loads on
//!   any layout;
//! * `expert_load.jsonl` (mixture of experts) and `trace.json` (pipeline
//!   timelines, FSDP's compute and communication tracks).
//!
//! The library never prints: progress goes to an [`Observer`], which the
//! `weft` binary renders as a progress bar or log lines.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp};
use weft_kernels::{Mode, Precision, matmul_forward};
use weft_model::{FeedForward, GptConfig, Init, MoeFfn, ParallelGpt, ParallelPlan};
use weft_numerics::DynamicLossScaler;
use weft_trace::MetricsRecord;

pub use weft_model::RankMemory;

use crate::config::Config;
use crate::ranks::agree;
use crate::schedule::lr_at;
use weft_data::{DataError, Dataset};

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
    /// Saving or restoring a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] crate::ckpt::CkptError),
    /// The mixture-of-experts balancer rejected the load statistics.
    #[error("mixture of experts: {0}")]
    Moe(#[from] weft_moe::Error),
    /// A mixture-of-experts block logged statistics for a layer the model
    /// does not have.
    #[error("mixture of experts: statistics logged for layer {layer} of a {layers}-layer model")]
    MoeLayer {
        /// The layer logged.
        layer: usize,
        /// Layers of the model.
        layers: usize,
    },
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
    /// A stop was asked for (SIGINT or SIGTERM, see [`crate::stop`]): the
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
        "the layout needs {layout} ranks (parallel.dp · tp · pp = {dp} · {tp} · {pp}) but {launcher} started {launched} process(es): launch with `mpirun -np {layout}` or change [parallel]"
    )]
    WorldSize {
        /// `dp · tp · pp`.
        layout: usize,
        /// `parallel.dp`.
        dp: usize,
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
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The linear layers' arithmetic (`train.precision`), the one
    /// [`peak_flops`](Self::peak_flops) was measured in.
    pub precision: Precision,
    /// Model parameters (tied embedding counted once).
    pub params: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens per optimizer step.
    pub tokens_per_step: usize,
    /// Training FLOPs per token: 6·N for the matmuls (N: the parameters a
    /// token is multiplied by — not the position table, and only the k of E
    /// routed experts) plus 6·L·T·C for causal attention (forward and
    /// backward).
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

/// A health event.
#[derive(Clone, Debug, PartialEq)]
pub enum HealthEvent {
    /// A non-finite loss or gradient: the update was skipped.
    Skipped {
        /// Step (from 1).
        step: u64,
        /// The step's loss.
        loss: f64,
        /// The gradient norm.
        grad_norm: f64,
    },
    /// fp16 with dynamic loss scaling: the gradients of the loss times
    /// `scale` overflowed, the update was skipped and the scale backed off
    /// to `next_scale` (expected now and then: the scaler probes upwards).
    Overflow {
        /// Step (from 1).
        step: u64,
        /// The step's loss (finite: the forward did not overflow).
        loss: f64,
        /// The loss scale of the step's backward.
        scale: f64,
        /// The scale of the next step.
        next_scale: f64,
    },
    /// The loss jumped above `factor` × the rolling median.
    Spike {
        /// Step (from 1).
        step: u64,
        /// The step's loss.
        loss: f64,
        /// Median of the recent window.
        median: f64,
        /// Position of the step's data: (the 0-based step that reads it in
        /// a run without skips, micro-batches).
        batch: (u64, usize),
    },
    /// A rank's work time over the last two windows of
    /// `train.straggler_window` steps was more than `train.straggler_factor`
    /// times the median of the ranks of its pipeline stage.
    Straggler {
        /// The step (from 1) that ended the second window.
        step: u64,
        /// The world rank.
        rank: usize,
        /// Its work time over the last window divided by the median.
        ratio: f64,
    },
    /// Rewind and skip (`train.rewind`): the run goes back to the
    /// checkpoint of step `to` (0: the start) and leaves `batches` out.
    Rewind {
        /// The step (from 1) that made the rewind.
        step: u64,
        /// What was wrong.
        reason: String,
        /// The step of the checkpoint it goes back to (0: the start).
        to: u64,
        /// The batches left out from now on, by the step (1-based) that
        /// reads them in a run without skips.
        batches: Vec<u64>,
    },
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

/// The outcome of a run.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    /// The run folder.
    pub run_dir: PathBuf,
    /// Steps taken.
    pub steps: u64,
    /// Steps whose update was skipped.
    pub skipped_steps: u64,
    /// Mean training loss of the last step.
    pub final_train_loss: f64,
    /// Validation loss at the end.
    pub final_eval_loss: f64,
    /// First validation loss (before training).
    pub initial_eval_loss: f64,
    /// The data's loss floor, if known.
    pub floor: Option<f64>,
    /// Mean training throughput, tokens per second.
    pub tokens_per_s: f64,
    /// Mean model FLOP/s.
    pub flops_per_s: f64,
    /// Mean utilisation of the measured matmul peak.
    pub utilisation: f64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// MaxVio of the last step (mixture-of-experts models).
    pub final_max_vio: Option<f64>,
    /// Pipeline runs: the bubble fraction measured over the traced steps
    /// (after the first), and the simulator's prediction for the same
    /// schedule with the measured mean action costs. Also in `trace.json`'s
    /// `otherData` (`bubble_fraction`, `bubble_steps`, per step
    /// `step_bubble_fractions`), where `weft viz` shows it.
    pub pipeline_bubble: Option<PipelineBubble>,
    /// Layouts of several ranks: the bytes a step sends on each parallel
    /// axis, every rank's together, as the collectives' per-group traffic
    /// counters counted them (mean over the steps of this run). The
    /// volumes follow the textbook formulas (ring all-reduce `2(k−1)/k`
    /// of the buffer per rank, `(k−1)/k` for a reduce-scatter or an
    /// all-gather, activations point to point); `weft-model`'s
    /// `tests/measured.rs` checks them layout by layout.
    pub traffic_per_step: Option<StepTraffic>,
    /// Mixed precision: bytes this process's threads hold at the end in
    /// the products' rounded operand copies
    /// ([`weft_kernels::operand_copy_bytes`]; every rank of a thread job
    /// together), which the memory report does not count; 0 in fp32.
    pub operand_copy_bytes: usize,
    /// Memory of one rank (rank 0) by category, counted from the buffers
    /// it allocated ([`RunInfo::memory`]), so `weft compare` can set runs
    /// side by side.
    pub memory: RankMemory,
}

/// Bytes per step of a run, by parallel axis ([`Summary::traffic_per_step`]).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct StepTraffic {
    /// Activations and their gradients (tp, pp, ep), gradients and
    /// parameters (dp: the gradient sums, FSDP's gathers and
    /// reduce-scatters), the tied embedding (pp).
    pub payload: AxisBytes,
    /// The step's scalars: the losses and the gradient norm's exact
    /// partial sums.
    pub scalars: AxisBytes,
}

/// Bytes on each parallel axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct AxisBytes {
    /// The tensor-parallel groups.
    pub tp: f64,
    /// The data-parallel groups (and FSDP's shard and replica groups).
    pub dp: f64,
    /// The pipeline groups.
    pub pp: f64,
    /// The expert groups.
    pub ep: f64,
    /// Groups of several axes (the norm's merges; sequence parallelism's
    /// layernorm gradients over dp × tp).
    pub other: f64,
}

/// Measured and predicted pipeline bubble (fractions of the makespan).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PipelineBubble {
    /// The schedule.
    pub schedule: &'static str,
    /// Mean measured bubble fraction: the plain mean over the steps of
    /// each step's `weft_pipeline::Timeline::bubble_fraction` (the stages'
    /// idle time within that step's window, over `p × makespan`), so the
    /// time between steps is not bubble.
    pub measured: f64,
    /// Mean bubble fraction the simulator predicts from the measured costs.
    pub predicted: f64,
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

/// Measures this machine's matmul throughput in `precision` (the run's
/// `train.precision`: utilisation is against the arithmetic it runs) with
/// the kernels' GEMM on a GPT-2-sized product (1024×768 · 768×3072), the
/// best of three to ten runs (as many as fit in 0.3 s; the best, because a
/// shared machine only ever makes a run slower).
pub fn measure_matmul_peak(precision: Precision) -> f64 {
    let (m, k, n) = (1024, 768, 3072);
    let a = vec![0.5f32; m * k];
    let w = vec![0.25f32; k * n];
    let mut out = vec![0f32; m * n];
    let mut best = f64::INFINITY;
    // at least three runs, and more (up to ten) while under 0.3 s: a
    // restart pays for this too
    let began = Instant::now();
    for i in 0..10 {
        if i >= 3 && began.elapsed().as_secs_f64() > 0.3 {
            break;
        }
        let t = Instant::now();
        // Shapes are consistent by construction; an error would mean a bug.
        if matmul_forward(
            &mut out,
            &a,
            &w,
            None,
            1,
            m,
            k,
            n,
            Mode::Throughput,
            precision,
        )
        .is_err()
        {
            return f64::NAN;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * k * n) as f64 / best
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_owned(),
        source,
    }
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

/// The model configuration a job trains.
pub fn model_config(config: &Config, vocab: usize) -> GptConfig {
    GptConfig {
        n_layer: config.model.n_layer,
        n_head: config.model.n_head,
        n_embd: config.model.n_embd,
        vocab_size: vocab,
        block_size: config.model.block_size,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
    }
}

/// The mixture-of-experts side of a rank's model: its statistics handle
/// and balancing settings.
struct MoeRun {
    stats: weft_model::MoeStats,
    layers: usize,
    experts: usize,
    bias_rate: Option<f64>,
}

/// The mixture-of-experts block of a job per `[model.moe]`, or `None`
/// for a dense model.
pub(crate) fn moe_config(
    config: &Config,
    cfg: &GptConfig,
) -> Result<Option<weft_moe::MoeConfig>, TrainError> {
    Ok(config.model.moe.config(cfg.n_embd, 4 * cfg.n_embd)?)
}

/// This rank's feed-forward block: GPT-2's MLP, or the mixture of experts
/// (its experts shared out over the mesh's expert group with `ep > 1`)
/// with its statistics handle.
fn rank_ffn(
    config: &Config,
    cfg: &GptConfig,
    mesh: &weft_parallel::ParallelMesh,
) -> Result<(Arc<dyn FeedForward>, Option<MoeRun>), TrainError> {
    let Some(moe_cfg) = moe_config(config, cfg)? else {
        return Ok((Arc::new(weft_model::Mlp), None));
    };
    let m = &config.model.moe;
    let (ffn, stats) = if mesh.dims().ep > 1 {
        MoeFfn::with_expert_parallel(moe_cfg, weft_model::expert_group(mesh))?
    } else {
        MoeFfn::new(moe_cfg)?
    };
    let run = MoeRun {
        stats,
        layers: cfg.n_layer,
        experts: m.experts,
        bias_rate: (m.balance == weft_moe::Balance::Bias).then_some(m.bias_rate),
    };
    Ok((Arc::new(ffn), Some(run)))
}

/// The configuration's batch split (validated with the configuration).
pub(crate) fn batch_split(config: &Config) -> Result<weft_parallel::BatchSplit, TrainError> {
    Ok(config.batch_split()?)
}

/// The model's parallelization plan for this job
/// ([`ParallelPlan::new`] of its `[parallel]` layout).
fn plan(config: &Config, cfg: &GptConfig) -> Result<ParallelPlan, TrainError> {
    let m = &config.model.moe;
    let moe = (m.experts > 0).then_some((m.experts, m.active_experts()));
    Ok(ParallelPlan::new(
        cfg,
        &config.parallel,
        moe,
        batch_split(config)?,
        config.train.precision,
        config.data.doc_boundary(),
    )?)
}

/// Every layer's expert-load statistics (`experts` per layer), summed over
/// the data-parallel group and then over the pipeline group (a layer this
/// rank does not hold counts as zero here), so that every rank balances
/// (and rank 0 logs) every layer over the whole global batch. The
/// tensor-parallel ranks of a layer route the same tokens: not summed.
fn sum_load_stats(
    mesh: &weft_parallel::ParallelMesh,
    per_layer: Vec<Option<weft_moe::LoadStats>>,
    experts: usize,
) -> Result<Vec<weft_moe::LoadStats>, TrainError> {
    let mut per_layer: Vec<_> = per_layer
        .into_iter()
        .map(|s| {
            s.unwrap_or_else(|| weft_moe::LoadStats {
                tokens_per_expert: vec![0; experts],
                dropped: 0,
                tokens: 0,
                entropy_sum: 0.0,
            })
        })
        .collect();
    let mut flat = Vec::new();
    for s in &per_layer {
        flat.extend(s.tokens_per_expert.iter().map(|&x| x as f64));
        flat.extend([s.dropped as f64, s.tokens as f64, s.entropy_sum]);
    }
    // Counts are small integers, exact in f64 in any order.
    for group in [mesh.dp(), mesh.pp()] {
        if group.size() > 1 {
            group.all_reduce(&mut flat, ReduceOp::Sum)?;
        }
    }
    let mut it = flat.into_iter();
    for s in &mut per_layer {
        for x in &mut s.tokens_per_expert {
            *x = it.next().unwrap_or(0.0) as u64;
        }
        s.dropped = it.next().unwrap_or(0.0) as u64;
        s.tokens = it.next().unwrap_or(0.0) as u64;
        s.entropy_sum = it.next().unwrap_or(0.0);
    }
    Ok(per_layer)
}

/// Runs the job. Creates `<run.dir>/<run.name>/` (never overwriting one),
/// reports progress to `observer`, and returns the summary. With `resume`,
/// continues that existing run from its newest valid checkpoint instead:
/// `metrics.jsonl` is cut back to the checkpoint's step and the run goes on
/// exactly as if it had never stopped.
///
/// The ranks are threads of this process (`parallel.backend = "threads"`,
/// or `"auto"` outside an MPI launcher), or — under `mpirun`/`srun`, or with
/// `"mpi"`/`"nccl"` — this process is one rank of the launcher's job
/// ([`Processes::connect`](crate::ranks::Processes::connect), then
/// [`train_processes`]). With `train.device = "cuda"` (feature `cuda`) the
/// job runs on one GPU as one rank, in this process (`crate::gpu`).
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
    use weft_collectives::Backend;
    #[cfg(feature = "cuda")]
    if config.train.device != crate::config::Device::Cpu {
        return crate::gpu::train(config, resume, observer);
    }
    let launcher = crate::ranks::LauncherEnv::detect();
    match (config.parallel.backend, launcher) {
        (Backend::Threads, Some(env)) if env.size > 1 => Err(TrainError::Backend(format!(
            "\"threads\" runs every rank in one process, but {} started {} processes: \
             use \"auto\" or \"mpi\", or start weft once without the launcher",
            env.launcher, env.size
        ))),
        (Backend::Threads, _) | (Backend::Auto, None) => train_threads(config, resume, observer),
        _ => {
            let mut procs = crate::ranks::Processes::connect()?;
            train_processes(&mut procs, config, resume, observer)
        }
    }
}

/// `train.device`: a run on a device that cannot be used here stops
/// before anything starts, with what is missing named
/// ([`Device::check`](crate::config::Device::check)).
pub(crate) fn check_device(config: &Config) -> Result<(), TrainError> {
    config.train.device.check().map_err(device_error)
}

/// A configuration error of `train.device` saying `message`.
pub(crate) fn device_error(message: String) -> TrainError {
    TrainError::Config(crate::config::ConfigError {
        origin: "config".into(),
        position: None,
        key: Some("train.device".into()),
        message,
    })
}

/// The watchdog's timeout, `parallel.timeout_s` (the default for a value
/// out of range, which validation reports).
fn timeout(config: &Config) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(config.parallel.timeout_s)
        .unwrap_or(weft_collectives::DEFAULT_TIMEOUT)
}

/// The job as threads of this process, one per rank.
fn train_threads(
    config: &Config,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    config.validate()?;
    check_device(config)?;
    let dims = config.parallel.dims();
    dims.validate()?;
    check_model_floor(config)?;
    // The machine's peak, measured on every core before the ranks start
    // (each rank then computes on its own share of them).
    let peak = measure_matmul_peak(config.train.precision);
    // Read (and tokenize) the data once, for every rank.
    let data = Dataset::open(&config.data, &config.dataset_options())?;
    let job = Job {
        config,
        resume,
        peak,
        data: &data,
        processes: None,
    };
    crate::ranks::launch(
        dims.world_size(),
        config.parallel.threads,
        dims.tp,
        timeout(config),
        observer,
        |world, obs| run_rank(&job, world, obs),
    )
}

/// This process's rank of a job of one process per rank (see
/// [`Processes`](crate::ranks::Processes)): the same training loop as the
/// thread ranks run, over the processes' communicator. Rank 0 reports to
/// `observer` and writes the run folder; the others report nothing. Every
/// set-up failure is agreed on by all ranks and reported once, by rank 0
/// ([`TrainError::ReportedByRankZero`] on the others).
///
/// # Errors
/// As [`train`]; [`TrainError::WorldSize`] when the launcher started
/// another number of processes than the layout has ranks.
pub fn train_processes(
    procs: &mut crate::ranks::Processes,
    config: &Config,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    use weft_collectives::Backend;
    let backend = match config.parallel.backend {
        Backend::Threads if procs.world().size() > 1 => Err(TrainError::Backend(format!(
            "\"threads\" runs every rank in one process, but this job has {} processes: use \"auto\" or \"mpi\"",
            procs.world().size()
        ))),
        b => Ok(b),
    };
    if procs.agree(backend)? == Backend::Nccl && procs.backend() != Backend::Nccl {
        procs.use_nccl()?;
    }
    procs.set_timeout(timeout(config));
    procs.size_pool(config.parallel.threads);
    let procs = &*procs;
    let world = procs.world();
    let dims = config.parallel.dims();
    let setup = (|| {
        config.validate()?;
        check_device(config)?;
        dims.validate()?;
        if dims.world_size() != world.size() {
            return Err(TrainError::WorldSize {
                layout: dims.world_size(),
                dp: dims.dp,
                tp: dims.tp,
                pp: dims.pp,
                launched: world.size(),
                launcher: crate::ranks::LauncherEnv::detect()
                    .map_or_else(|| "the MPI library".into(), |e| e.launcher.to_owned()),
            });
        }
        check_model_floor(config)
    })();
    agree(world, setup)?;
    let hosts = procs.hosts();
    let peak = node_peak(world, hosts, config.train.precision)?;
    let data = open_data_once(world, hosts, config)?;
    let job = Job {
        config,
        resume,
        peak,
        data: &data,
        processes: Some(procs),
    };
    if world.rank() == 0 {
        run_rank(&job, world, observer)
    } else {
        run_rank(&job, world, &mut Silent)
    }
}

/// Whether world rank `me` is the first rank on its host.
fn first_on_host(hosts: &[String], me: usize) -> bool {
    hosts.iter().position(|h| *h == hosts[me]) == Some(me)
}

/// The job's peak: measured on every core of each host by the host's first
/// rank while the others wait, summed over the hosts. Collective.
fn node_peak(
    world: &dyn Communicator,
    hosts: &[String],
    precision: Precision,
) -> Result<f64, TrainError> {
    world.barrier()?;
    let mine = if first_on_host(hosts, world.rank()) {
        match rayon::ThreadPoolBuilder::new()
            .num_threads(crate::ranks::cores())
            .build()
        {
            Ok(pool) => pool.install(|| measure_matmul_peak(precision)),
            Err(_) => measure_matmul_peak(precision),
        }
    } else {
        0.0
    };
    let mut total = [mine];
    world.all_reduce(&mut total, ReduceOp::Sum)?;
    Ok(total[0])
}

/// Opens the data on every rank, tokenizing text once: the first rank of
/// each host opens it (tokenizing into the token cache, or mapping the
/// cache), the others wait and then map the cache file it names, without
/// reading the text. Collective; failures are agreed on.
fn open_data_once(
    world: &dyn Communicator,
    hosts: &[String],
    config: &Config,
) -> Result<Dataset, TrainError> {
    let open = || Dataset::open(&config.data, &config.dataset_options()).map_err(TrainError::from);
    // Only text is tokenized; the synthetic corpus is generated and token
    // data mapped, by each rank for itself.
    let weft_data::Source::Text(path) = &config.data.source else {
        return agree(world, open());
    };
    if world.size() == 1 {
        return agree(world, open());
    }
    let me = world.rank();
    let builder = first_on_host(hosts, me);
    let built = agree(world, if builder { open().map(Some) } else { Ok(None) })?;
    let cache = built
        .as_ref()
        .and_then(|d| match d {
            Dataset::Text(t) => t.cache_file(),
            Dataset::Synthetic(_) | Dataset::Tokens(_) => None,
        })
        .and_then(|p| p.to_str())
        .unwrap_or("");
    let caches = crate::ranks::all_gather_bytes(world, crate::ranks::tags::DATA, cache.as_bytes())?;
    let data = match built {
        Some(d) => Ok(d),
        None => {
            let first = hosts.iter().position(|h| *h == hosts[me]).unwrap_or(0);
            let file = String::from_utf8_lossy(&caches[first]).into_owned();
            if file.is_empty() {
                // the builder could not write the cache: read the text here
                open()
            } else {
                weft_data::TextData::open_cache(
                    path,
                    Path::new(&file),
                    config.model.block_size,
                    config.data.val_fraction,
                    config.train.seed,
                )
                .map(Dataset::Text)
                .map_err(TrainError::from)
            }
        }
    };
    agree(world, data)
}

/// What every rank of a job shares: the configuration, the machine's
/// peak, the data, and (a job of processes) where the ranks run.
struct Job<'a> {
    config: &'a Config,
    resume: bool,
    peak: f64,
    data: &'a Dataset,
    processes: Option<&'a crate::ranks::Processes>,
}

/// Refuses, before anything is built, a model whose parameters alone
/// cannot fit: every parameter is held somewhere with its two AdamW
/// moments (12 bytes, however it is sharded), and a GPT-2 block has
/// `12·C² + 13·C` of them (a mixture of experts more), so the run needs at
/// least `12 · (L·(12·C² + 13·C) + (T + 2)·C)` bytes. Computed without
/// overflow, so sizes no machine has are an error, not a crash. The exact
/// per-rank prediction follows once the layout is built
/// ([`check_memory`]).
pub(crate) fn check_model_floor(config: &Config) -> Result<(), TrainError> {
    let m = &config.model;
    let (l, c, t) = (m.n_layer as u128, m.n_embd as u128, m.block_size as u128);
    let (blocks, rest) = (l * (12 * c * c + 13 * c), (t + 2) * c);
    let params = blocks + rest;
    let needed = 12 * params;
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if needed <= u128::from(available) {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let (needed, params) = (needed as f64, params as f64);
    Err(TrainError::OutOfMemory {
        needed: gib(needed),
        #[allow(clippy::cast_precision_loss)]
        available: gib(available as f64),
        ranks: config.parallel.world_size(),
        detail: format!(
            "at least {params:.3e} parameters at 12 bytes each (the weights and their two AdamW moments), however they are sharded"
        ),
        dominant: if blocks >= rest {
            format!(
                "the blocks' parameters: model.n_layer ({}) × 12 × model.n_embd² ({}²) — a smaller model",
                m.n_layer, m.n_embd
            )
        } else {
            format!(
                "the position table: model.block_size ({}) × model.n_embd ({}) — a shorter context",
                m.block_size, m.n_embd
            )
        },
    })
}

/// Refuses the run (collective over `world`) when the ranks of one
/// machine together — the threads of this process, or the processes on
/// this host (`hosts`, a job of processes) — need more than the memory
/// available there.
fn check_memory(
    config: &Config,
    world: &dyn Communicator,
    hosts: Option<&[String]>,
    mine: &RankMemory,
) -> Result<(), TrainError> {
    #[allow(clippy::cast_precision_loss)]
    let me = mine.total() as f64;
    let all = crate::ranks::all_gather_bytes(world, crate::ranks::tags::MEMORY, &me.to_le_bytes())?;
    let on_this_machine = |r: usize| hosts.is_none_or(|h| h[r] == h[world.rank()]);
    let total = [all
        .iter()
        .enumerate()
        .filter(|&(r, _)| on_this_machine(r))
        .map(|(_, b)| b.first_chunk::<8>().map_or(0.0, |b| f64::from_le_bytes(*b)))
        .sum::<f64>()];
    let ranks = (0..world.size()).filter(|&r| on_this_machine(r)).count();
    let Some(available) = available_memory() else {
        return Ok(());
    };
    #[allow(clippy::cast_precision_loss)]
    if total[0] <= available as f64 {
        return Ok(());
    }
    let (name, _) = mine.largest();
    let m = &config.model;
    let settings = match name {
        "activations" => format!(
            "activations: train.micro_batch_size ({}) × model.block_size ({}) × model.n_embd ({}) per layer, and the attention's micro_batch_size × n_head ({}) × block_size² per layer — lower train.micro_batch_size or model.block_size",
            batch_split(config).map_or(0, |s| s.micro),
            m.block_size,
            m.n_embd,
            m.n_head
        ),
        _ => format!(
            "{name}: model.n_layer ({}) × model.n_embd ({})² — a smaller model, or shard it (parallel.fsdp, parallel.tp, parallel.pp)",
            m.n_layer, m.n_embd
        ),
    };
    Err(TrainError::OutOfMemory {
        needed: gib(total[0]),
        #[allow(clippy::cast_precision_loss)]
        available: gib(available as f64),
        ranks,
        detail: format!("per rank: {mine}"),
        dominant: settings,
    })
}

pub(crate) fn gib(b: f64) -> String {
    format!("{:.2} GiB", b / f64::from(1u32 << 30))
}

/// Bytes of memory available to this process (`MemAvailable` of
/// `/proc/meminfo`), if the system says.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `dp=2 tp=2 ...` for the degrees above 1.
pub(crate) fn layout_name(config: &Config) -> String {
    let ranks = config.parallel.to_string();
    match config.train.precision {
        Precision::F32 => ranks,
        Precision::F16 => format!(
            "{ranks}, fp16 mixed precision (dynamic loss scale from {})",
            config.train.loss_scale.init
        ),
        p => {
            let gathered = config
                .parallel
                .fsdp
                .is_some_and(weft_parallel::Strategy::shards_params);
            format!(
                "{ranks}, {p} mixed precision{}",
                if gathered {
                    " (weights gathered in bf16)"
                } else {
                    ""
                }
            )
        }
    }
}

/// How an attempt at the run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    /// A new run folder.
    New,
    /// From the newest checkpoint that verifies (`--resume`).
    Resume,
    /// Rewound: from the newest checkpoint that verifies, or from the
    /// start when none was saved (`checkpoint = false`).
    Rewind {
        /// Whether a checkpoint was saved to go back to.
        checkpoint: bool,
    },
}

/// How an attempt ended.
enum Attempt {
    /// The run trained to its last step.
    Finished(Box<Summary>),
    /// A rewind: go back to the checkpoint of `to` (0: none).
    Rewind {
        /// The step of the newest checkpoint saved (0: none).
        to: u64,
    },
}

/// The batches a run leaves out and the rewinds it made: the config's
/// `train.skip_batches` and, resuming, the run's `skip.json`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Skips {
    /// Steps (1-based) whose batch, in a run without skips, is left out:
    /// sorted, each once.
    batches: Vec<u64>,
    /// Rewinds made.
    rewinds: u32,
}

impl Skips {
    /// The batches a run in `run_dir` leaves out: `skip_batches` (the
    /// config's), and, resuming, those its `skip.json` records.
    /// Collective over `world`.
    pub(crate) fn for_run(
        world: &dyn Communicator,
        run_dir: &Path,
        resume: bool,
        skip_batches: &[u64],
    ) -> Result<Skips, TrainError> {
        let mut s = if resume {
            agree(world, Skips::read(run_dir))?
        } else {
            Skips::default()
        };
        s.add(skip_batches);
        Ok(s)
    }

    /// The skips recorded in `run_dir/skip.json` (none without one).
    fn read(run_dir: &Path) -> Result<Skips, TrainError> {
        let path = run_dir.join("skip.json");
        match std::fs::read_to_string(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Skips::default()),
            Err(e) => Err(io_err(&path)(e)),
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                TrainError::Setup(format!("{}: not a skip list: {e}", path.display()))
            }),
        }
    }

    /// Adds `batches`, keeping the list sorted and each batch once.
    fn add(&mut self, batches: &[u64]) {
        self.batches.extend_from_slice(batches);
        self.batches.sort_unstable();
        self.batches.dedup();
    }

    /// The batch (0-based) that optimizer step `step` (0-based) reads: the
    /// batches in order, those left out passed over.
    pub(crate) fn batch_of(&self, step: u64) -> u64 {
        let mut b = step;
        for &s in &self.batches {
            if s - 1 <= b {
                b += 1;
            } else {
                break;
            }
        }
        b
    }
}

/// One rank's run on world communicator `world`: its share of the job,
/// rewound (`train.rewind`) as often as it needs and may. Only world rank
/// 0 writes the run folder and checkpoints.
fn run_rank(
    job: &Job<'_>,
    world: &dyn Communicator,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    let mut start = if job.resume {
        Start::Resume
    } else {
        Start::New
    };
    let mut skips = None;
    loop {
        match run_attempt(job, world, observer, start, &mut skips)? {
            Attempt::Finished(summary) => return Ok(*summary),
            Attempt::Rewind { to } => start = Start::Rewind { checkpoint: to > 0 },
        }
    }
}

/// One attempt at the run, from `start`; `skips` is loaded by the first
/// and carried over rewinds.
fn run_attempt(
    job: &Job<'_>,
    world: &dyn Communicator,
    observer: &mut dyn Observer,
    start_from: Start,
    skips: &mut Option<Skips>,
) -> Result<Attempt, TrainError> {
    let Job {
        config,
        peak,
        data,
        processes,
        ..
    } = *job;
    let resume = start_from != Start::New;
    let dims = config.parallel.dims();
    let mesh = dims.build(world)?;
    let writer = world.rank() == 0;
    let vocab = data.vocab_size();
    let cfg = model_config(config, vocab);
    let t = &config.train;
    let split = batch_split(config)?;
    let (micro, per_rank) = (split.micro, split.per_rank);
    let seq = config.model.block_size;
    let first_micro = mesh.coords().dp() * per_rank;
    let host_of = |r: usize| {
        processes
            .and_then(|p| p.hosts().get(r))
            .map_or_else(String::new, |h| format!(" on {h}"))
    };
    let coords: Vec<String> = (0..dims.world_size())
        .map(|r| format!("rank {r}: {}{}", dims.coords_of(r), host_of(r)))
        .collect();
    let pool = crate::ranks::threads_per_rank(dims.world_size(), config.parallel.threads);
    let kernels = format!(
        "{pool} kernel thread{} each",
        if pool == 1 { "" } else { "s" }
    );
    let backend = match processes {
        None if dims.world_size() == 1 => format!("one rank of this process, {kernels}"),
        None => format!(
            "{} ranks, threads of this process, {kernels}",
            dims.world_size()
        ),
        Some(p) => {
            let mut line = p.describe();
            for (first, hosts) in crate::ranks::split_tp_groups(p.hosts(), dims.tp) {
                line.push_str(&format!(
                    "; warning: the tensor-parallel group of ranks {first}-{} spans hosts {} (place {} consecutive ranks per host)",
                    first + dims.tp - 1,
                    hosts.join(", "),
                    dims.tp
                ));
            }
            line
        }
    };
    let shape: Vec<String> = dims
        .mesh_dims()
        .iter()
        .map(|(n, s)| format!("{n}={s}"))
        .collect();
    let mesh_shape = format!("{} (tp innermost)", shape.join(" × "));

    // Every rank initialises only its part of the model: the values the
    // whole model has there, as one rank's run starts from.
    let (ffn, moe) = agree(world, rank_ffn(config, &cfg, &mesh))?;
    let init = Init::Gpt2 {
        seed: config.train.seed,
    };
    let plan = agree(world, plan(config, &cfg))?;
    // What every rank will hold, before any of it is allocated: a run
    // that cannot fit is refused here, with what dominates.
    let predicted = agree(
        world,
        ParallelGpt::predict_memory(&cfg, ffn.clone(), &plan, &mesh).map_err(TrainError::from),
    )?;
    // in bf16, the activations the same layout would plan in fp32
    let fp32_activations = if plan.precision == Precision::Bf16 {
        let fp32 = ParallelPlan {
            precision: Precision::F32,
            ..plan.clone()
        };
        let m = agree(
            world,
            ParallelGpt::predict_memory(&cfg, ffn.clone(), &fp32, &mesh).map_err(TrainError::from),
        )?;
        Some(m.activations)
    } else {
        None
    };
    let hosts = processes.map(crate::ranks::Processes::hosts);
    agree(world, check_memory(config, world, hosts, &predicted))?;
    let mut model = agree(
        world,
        ParallelGpt::new(cfg.clone(), ffn, init, &plan, mesh).map_err(TrainError::from),
    )?;

    let run_dir = crate::run::open_run_dir(config, world, resume)?;
    let ckpt_root = run_dir.join("checkpoints");
    // Resuming: every rank loads its part of the checkpoint (saved by any
    // layout); and the metrics lines up to the checkpoint.
    let mut kept = crate::run::Kept::default();
    let mut start_step = 0;
    let mut restored_scale = None;
    if resume {
        if start_from != (Start::Rewind { checkpoint: false }) {
            let restored = agree(
                world,
                crate::ckpt::restore_sharded(world, &ckpt_root, config, &mut model)
                    .map_err(TrainError::from),
            )?;
            start_step = crate::run::resume_step(config, &run_dir, &restored, observer)?;
            restored_scale = restored.loss_scale;
        }
        kept = crate::run::Kept::read(world, &run_dir, start_step)?;
    }
    if skips.is_none() {
        *skips = Some(Skips::for_run(world, &run_dir, resume, &t.skip_batches)?);
    }
    let skips = skips.get_or_insert_with(Skips::default);
    // A rewind goes back to the newest checkpoint saved (0: the start).
    let mut last_saved = start_step;
    // Steps in a row whose update was skipped as non-finite.
    let mut nonfinite_run = 0u64;
    // fp16: dynamic loss scaling, continued from the checkpoint's state
    let mut scaler = match t.precision {
        Precision::F16 => {
            let c = t.loss_scale.scaler();
            let s = match restored_scale {
                Some(state) => DynamicLossScaler::from_state(c, state),
                None => DynamicLossScaler::new(c),
            };
            Some(s.map_err(|e| {
                TrainError::Config(crate::config::ConfigError {
                    origin: "config".into(),
                    position: None,
                    key: Some("train.loss_scale".into()),
                    message: e.to_string(),
                })
            })?)
        }
        _ => None,
    };
    let full_layout = model.whole_layout().clone();
    // Only the writer's logs reach the disk.
    let floor = data.val_floor(t.eval_sequences);
    let mut metrics = crate::run::Metrics::open(world, &run_dir, &kept, floor)?;

    let val = agree(
        world,
        data.val_batches(t.eval_sequences, micro)
            .map_err(TrainError::from),
    )?;
    let val_mbs = crate::run::micro_batches(&val);
    let flops_per_token = crate::run::flops_per_token(config, &full_layout);
    let memory = model.memory();
    let info = RunInfo {
        predicted_memory: predicted,
        run_dir: run_dir.clone(),
        precision: t.precision,
        params: full_layout.len(),
        vocab,
        tokens_per_step: t.batch_size * seq,
        flops_per_token,
        peak_flops: if writer { peak } else { f64::NAN },
        peak_source: if processes.is_some_and(|p| crate::ranks::node_map(p.hosts()).len() > 1) {
            "measured on every node".into()
        } else {
            "measured on this machine".into()
        },
        floor,
        steps: t.steps,
        activation_bytes: memory.activations,
        fp32_activation_bytes: fp32_activations,
        layout: layout_name(config),
        mesh: mesh_shape,
        coords,
        backend,
        memory,
        data_shares: data.shares(t.steps * t.batch_size as u64),
        doc_mask: config.data.doc_mask,
    };
    observer.start(&info);

    // one time origin for every rank's trace
    world.barrier()?;
    let start = Instant::now();
    if !resume {
        let e = model.eval_loss(&val_mbs)?;
        metrics.eval(observer, 0, e)?;
    }
    // The spike detector, its window refilled from the kept lines on resume.
    let mut spikes = crate::run::Spikes::new(config, &kept);
    let mut last_max_vio = None;
    let expert_path = run_dir.join("expert_load.jsonl");
    let expert_log = (|| -> Result<Option<BufWriter<Box<dyn Write>>>, TrainError> {
        Ok(match &moe {
            None => None,
            Some(_) if !writer => Some(BufWriter::new(Box::new(std::io::sink()))),
            Some(_) => {
                // Keep the records up to a resumed checkpoint.
                let kept: String = std::fs::read_to_string(&expert_path)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<weft_trace::ExpertLoadRecord>(l)
                            .is_ok_and(|r| r.step <= start_step)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect();
                std::fs::write(&expert_path, kept).map_err(io_err(&expert_path))?;
                let f = std::fs::OpenOptions::new().append(true).open(&expert_path);
                Some(BufWriter::new(Box::new(f.map_err(io_err(&expert_path))?)))
            }
        })
    })();
    let mut expert_log = agree(world, expert_log)?;
    let mut trace = weft_trace::Trace::new();
    let mut bubble_sum: Option<(f64, f64, usize)> = None;
    // Every traced pipeline step: (step number, measured bubble, makespan
    // in µs, whether it is in `bubble_sum`), for trace.json's otherData.
    let mut step_bubbles: Vec<(u64, f64, f64, bool)> = Vec::new();
    // Bytes this rank sent per axis over the steps (payload, then scalars).
    let mut traffic_sum = [0.0f64; 10];
    // every rank beats, for a supervisor to see which one stopped
    crate::supervise::heartbeat(&run_dir, world.rank(), start_step);
    if writer && matches!(start_from, Start::Rewind { .. }) {
        // rebuilt and restored: the rewind's cost ends here
        let _ = crate::supervise::append_event(
            &run_dir,
            &serde_json::json!({
                "time": crate::supervise::unix_now(), "event": "rewound", "step": start_step,
            }),
        );
    }
    // the last step's time without an injected slowdown (`slow` faults)
    let mut last_step_time = std::time::Duration::ZERO;
    // the straggler detector: this rank's work over the window, and each
    // rank's windows in a row above the factor
    let mut work_sum = 0.0f64;
    let mut slow_windows = vec![0u32; dims.world_size()];
    for step in start_step..t.steps {
        crate::supervise::before_step(&run_dir, step + 1, world.rank());
        let step_start = Instant::now();
        let lr = lr_at(&config.optim, step, t.steps);
        if let Some(moe) = &moe {
            moe.stats.take(); // forget evaluation forwards
        }
        let hp = crate::run::adamw(&config.optim, lr);
        // This data-parallel rank's share of the global batch (the next
        // batch not left out).
        let batch = skips.batch_of(step);
        let micros = first_micro..first_micro + per_rank;
        let writes = writer.then_some(run_dir.as_path());
        let batches = crate::run::read_batches(data, batch, micros, micro, writes)?;
        let slow = crate::supervise::slowdown(step + 1, world.rank());
        let slept = last_step_time.mul_f64(slow - 1.0);
        std::thread::sleep(slept);
        let poisoned = if let Some(f) = crate::supervise::nan_at(batch + 1) {
            if writer && batch + 1 == f.step {
                crate::supervise::fired(&run_dir, &f, 0);
            }
            poison(&mut model, &full_layout)?
        } else {
            None
        };
        let mbs = crate::run::micro_batches(&batches);
        let in_step = Instant::now();
        let loss_scale = scaler.as_ref().map(DynamicLossScaler::scale);
        let out = model.train_step_scaled(
            &mbs,
            &hp,
            config.optim.grad_clip,
            loss_scale.unwrap_or(1.0),
        )?;
        let in_step = in_step.elapsed().as_secs_f64();
        if let Some((name, values)) = poisoned {
            model.write_param(&name, &values)?;
        }
        let (loss, grad_norm, applied) = (out.loss, out.grad_norm, out.applied);
        if let Some(tr) = model.last_traffic() {
            for (i, a) in weft_parallel::TrafficAxis::ALL.into_iter().enumerate() {
                traffic_sum[i] += tr.payload.sent(a) as f64;
                traffic_sum[5 + i] += tr.scalars.sent(a) as f64;
            }
        }
        // fp16: an overflow backs the scale off; it counts towards a
        // rewind only when that cannot help (the loss itself not finite, or
        // the scale at its floor)
        let mut scale_helps = false;
        if let (Some(sc), Some(used)) = (scaler.as_mut(), loss_scale) {
            sc.update(!applied);
            scale_helps = !applied && loss.is_finite() && used > sc.config().min_scale;
        }
        if !applied {
            let event = match (loss_scale, &scaler) {
                (Some(used), Some(sc)) if scale_helps => (
                    HealthEvent::Overflow {
                        step: step + 1,
                        loss,
                        scale: f64::from(used),
                        next_scale: f64::from(sc.scale()),
                    },
                    serde_json::json!({ "step": step + 1, "event": "overflow", "loss": loss,
                        "loss_scale": used, "next_loss_scale": sc.scale() }),
                ),
                _ => crate::run::skip_event(step + 1, loss, grad_norm),
            };
            metrics.health(observer, event)?;
        }
        let mut max_vio = None;
        if let Some(moe) = &moe {
            // One record per layer per forward (a pipeline stage logs its
            // own layers only): merge the micro-batches per layer.
            let mut per_layer: Vec<Option<weft_moe::LoadStats>> = vec![None; moe.layers];
            for (l, f) in moe.stats.take() {
                match per_layer.get_mut(l) {
                    Some(Some(s)) => s.merge(&f.stats),
                    Some(slot @ None) => *slot = Some(f.stats),
                    None => {
                        return Err(TrainError::MoeLayer {
                            layer: l,
                            layers: moe.layers,
                        });
                    }
                }
            }
            let per_layer = sum_load_stats(model.mesh(), per_layer, moe.experts)?;
            let mut vios = Vec::new();
            for (l, st) in per_layer.iter().enumerate() {
                let rec = st.to_record(step + 1, l as u32);
                let line = serde_json::to_string(&rec).unwrap_or_default();
                if let Some(log) = expert_log.as_mut() {
                    writeln!(log, "{line}").map_err(io_err(&expert_path))?;
                }
                vios.extend(st.max_vio());
                if let (Some(rate), true) = (moe.bias_rate, applied) {
                    let name = format!("transformer.h.{l}.mlp.router.selection_bias");
                    if let Some(mut bias) = model.read_param(&name)? {
                        weft_moe::BiasBalancer::new(rate)
                            .update(&mut bias, &st.tokens_per_expert)?;
                        model.write_param(&name, &bias)?;
                    }
                }
            }
            if !vios.is_empty() {
                max_vio = Some(vios.iter().sum::<f64>() / vios.len() as f64);
            }
        }
        last_max_vio = max_vio;
        nonfinite_run = match (applied, scale_helps) {
            (true, _) => 0,
            (false, true) => nonfinite_run,
            (false, false) => nonfinite_run + 1,
        };
        // what makes a rewind, and the steps whose batches it leaves out
        let mut rewind: Option<(String, Vec<u64>)> = None;
        if t.rewind && nonfinite_run >= t.nonfinite_limit {
            rewind = Some((
                format!("{nonfinite_run} non-finite steps in a row"),
                (step + 1 - nonfinite_run..=step).collect(),
            ));
        }
        if let Some(median) = spikes.check(loss) {
            let event = crate::run::spike_event(step + 1, loss, median, (batch, split.global));
            metrics.health(observer, event)?;
            if t.rewind {
                rewind = Some((
                    format!(
                        "loss {loss:.4} > train.spike_factor {} × rolling median {median:.4}",
                        t.spike_factor
                    ),
                    vec![step],
                ));
            }
        }
        if let Some((reason, steps)) = rewind {
            // the batches of the offending steps after the checkpoint
            // (0-based steps in, 1-based batches out)
            let left_out: Vec<u64> = steps
                .iter()
                .filter(|&&s| s >= last_saved)
                .map(|&s| skips.batch_of(s) + 1)
                .collect();
            if skips.rewinds >= t.max_rewinds {
                return Err(TrainError::TooManyRewinds {
                    run: run_dir,
                    step: step + 1,
                    reason,
                    max: t.max_rewinds,
                });
            }
            skips.add(&left_out);
            skips.rewinds += 1;
            metrics.flush()?;
            if let Some(log) = expert_log.as_mut() {
                log.flush().map_err(io_err(&expert_path))?;
            }
            let recorded = if writer {
                record_rewind(&run_dir, skips, step + 1, &reason, last_saved, &left_out)
            } else {
                Ok(())
            };
            agree(world, recorded)?;
            observer.event(&HealthEvent::Rewind {
                step: step + 1,
                reason,
                to: last_saved,
                batches: left_out,
            });
            return Ok(Attempt::Rewind { to: last_saved });
        }
        let traced = step < start_step + config.run.trace_steps;
        // Every rank's lanes for the first `run.trace_steps` steps (its
        // pipeline actions and receive waits, FSDP's compute, communication
        // and wait tracks), gathered on rank 0; a pipeline's bubble beside
        // the simulator's prediction.
        let timeline = model.take_timeline();
        // this rank's work: the step less its time in train_step outside
        // the compute the executor timed (the waits of collectives between
        // actions)
        let compute: f64 = timeline
            .as_ref()
            .map_or(in_step, |tl| tl.slots.iter().map(|s| s.end - s.start).sum());
        // a sharded stage's waits (inside its actions too) are its own
        // record of the time it was blocked, beside the pipeline's receives
        let mut fsdp_wait = None;
        for st in model.stages_mut() {
            if let Some(f) = st.fsdp_mut() {
                let w: f64 = f
                    .spans()
                    .spans()
                    .iter()
                    .filter(|s| s.track == weft_fsdp::Track::Wait)
                    .map(|s| s.end - s.start)
                    .sum();
                *fsdp_wait.get_or_insert(0.0) += w;
            }
        }
        let blocked = match fsdp_wait {
            Some(w) => {
                w + timeline
                    .as_ref()
                    .map_or(0.0, |tl| tl.waits.iter().map(|(a, b)| b - a).sum())
            }
            None => in_step - compute.min(in_step),
        };
        work_sum += step_start.elapsed().as_secs_f64() - blocked;
        let mut fsdp_events = Vec::new();
        for (c, st) in model.stages_mut().iter_mut().enumerate() {
            if let Some(f) = st.fsdp_mut() {
                if traced {
                    fsdp_events.extend(fsdp_lanes(f.spans(), c, start, step + 1));
                }
                f.spans_mut().clear();
            }
        }
        let lanes = dims.world_size() > 1 || !fsdp_events.is_empty();
        if traced
            && lanes
            && let Some(local) = timeline
        {
            let world = model.mesh().world();
            let timelines = model.executor().gather_timelines(world, &local)?;
            let fsdp_all = gather_events(world, &fsdp_events)?;
            if let (Some(timelines), Some(fsdp_all)) = (timelines, fsdp_all) {
                let offset = step_start.duration_since(start).as_secs_f64() * 1e6;
                let first = step == start_step;
                let schedule = model.schedule();
                let per_stage = dims.world_size() / dims.pp;
                let mut by_rank: Vec<Option<weft_pipeline::RankTimeline>> =
                    timelines.into_iter().map(Some).collect();
                // one pipeline per coordinate off the pp axis: world rank
                // `s · world/pp + q` holds stage `s` of pipeline `q`
                for q in 0..per_stage {
                    let ranks: Vec<usize> = (0..dims.pp).map(|s| s * per_stage + q).collect();
                    let stages = ranks
                        .iter()
                        .map(|&r| by_rank[r].take())
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| TrainError::Trace("a rank's timeline is missing".into()))?;
                    let measured = weft_pipeline::Measured::new(schedule, stages)?;
                    if q == 0 && dims.pp > 1 {
                        let bubble = measured.timeline.bubble_fraction();
                        let averaged = step > start_step;
                        step_bubbles.push((
                            step + 1,
                            bubble,
                            measured.timeline.makespan() * 1e6,
                            averaged,
                        ));
                        if averaged {
                            let predicted = measured.predicted(schedule)?;
                            let (m, p, n) = bubble_sum.get_or_insert((0.0, 0.0, 0));
                            *m += bubble;
                            *p += predicted.bubble_fraction();
                            *n += 1;
                        }
                    }
                    let exported = measured.to_trace();
                    if first && q == 0 && dims.pp > 1 {
                        for key in ["schedule", "stages", "microbatches", "chunks"] {
                            if let Some(v) = exported.other_data.get(key) {
                                trace.other_data.insert(key.to_owned(), v.clone());
                            }
                        }
                    }
                    for mut e in exported.trace_events {
                        let rank = ranks[usize::try_from(e.pid).unwrap_or(0).min(ranks.len() - 1)];
                        e.pid = rank as u64;
                        if e.ph == weft_trace::Phase::Complete {
                            e.ts += offset;
                            e.args.insert("step".to_owned(), (step + 1).into());
                        } else if !first {
                            continue;
                        } else if e.name == "process_name" {
                            e = weft_trace::TraceEvent::process_name(
                                e.pid,
                                format!("rank {rank}: {}", dims.coords_of(rank)),
                            );
                        } else if e.name == "process_sort_index" {
                            // ranks in mesh order: pp, then dp, then tp
                            e = weft_trace::TraceEvent::process_sort_index(
                                e.pid,
                                i64::try_from(rank).unwrap_or(i64::MAX),
                            );
                            trace.push(weft_trace::TraceEvent::process_labels(
                                e.pid,
                                format!("pp {}", dims.coords_of(rank).pp),
                            ));
                        }
                        trace.trace_events.push(e);
                    }
                }
                for (rank, events) in fsdp_all.into_iter().enumerate() {
                    for mut e in events {
                        if e.ph != weft_trace::Phase::Complete && !first {
                            continue;
                        }
                        e.pid = rank as u64;
                        trace.trace_events.push(e);
                    }
                }
            }
        }
        last_step_time = step_start.elapsed().saturating_sub(slept);
        let times = (step_start.elapsed(), start.elapsed());
        let report = metrics.step(&info, step + 1, lr, &out, loss_scale, times, max_vio)?;
        crate::supervise::heartbeat(&run_dir, world.rank(), step + 1);
        if t.straggler_factor > 0.0 && (step + 1).is_multiple_of(t.straggler_window) {
            let w = model.mesh().world();
            let mut all = vec![0.0f64; w.size()];
            w.all_gather(&[work_sum], &mut all)?;
            work_sum = 0.0;
            for (rank, ratio) in stragglers(&all, |r| dims.coords_of(r).pp, t.straggler_factor)
                .into_iter()
                .enumerate()
            {
                slow_windows[rank] = if ratio.is_some() {
                    slow_windows[rank] + 1
                } else {
                    0
                };
                if let (Some(ratio), 2) = (ratio, slow_windows[rank]) {
                    observer.event(&HealthEvent::Straggler {
                        step: step + 1,
                        rank,
                        ratio,
                    });
                    // timing, not the computation: in events.jsonl, which
                    // a rerun need not reproduce
                    if writer {
                        let line = serde_json::json!({
                            "time": crate::supervise::unix_now(), "event": "straggler",
                            "step": step + 1, "rank": rank, "ratio": ratio,
                            "window_steps": t.straggler_window,
                        });
                        crate::supervise::append_event(&run_dir, &line)
                            .map_err(io_err(&run_dir.join("events.jsonl")))?;
                    }
                }
            }
        }
        observer.step(&report);
        let done = step + 1 == t.steps;
        if crate::run::eval_due(config, step + 1, done) {
            let e = model.eval_loss(&val_mbs)?;
            metrics.eval(observer, step + 1, e)?;
        }
        // a stop asked for on any rank: every rank saves after this step
        let stop = !done && crate::stop::agreed(model.mesh().world())?;
        if crate::run::save_due(config, step + 1, done, stop) {
            // Everything logged so far belongs to the checkpoint.
            metrics.flush()?;
            if let Some(log) = expert_log.as_mut() {
                log.flush().map_err(io_err(&expert_path))?;
            }
            // Each rank writes its own parts; rank 0 commits.
            let (parts, opt_step) = model.owned_parts()?;
            crate::ckpt::save_sharded(
                world,
                &ckpt_root,
                config,
                step + 1,
                &parts,
                opt_step,
                scaler.as_ref().map(DynamicLossScaler::state),
                &cfg,
                &dims.mesh_dims(),
            )?;
            last_saved = step + 1;
            crate::supervise::after_save(
                &ckpt_root.join(weft_checkpoint::step_dir_name(step + 1)),
                step + 1,
                world.rank(),
            );
        }
        if stop {
            return Err(TrainError::Stopped {
                step: step + 1,
                run: run_dir,
            });
        }
    }
    metrics.flush()?;
    if let Some(log) = expert_log.as_mut() {
        log.flush().map_err(io_err(&expert_path))?;
    }
    let n = t.steps.saturating_sub(start_step).max(1) as f64;
    // every rank's bytes together (exact in f64 below 2^53)
    model
        .mesh()
        .world()
        .all_reduce(&mut traffic_sum, ReduceOp::Sum)?;
    let axis = |k: usize| {
        let [tp, dp, pp, ep, other] = std::array::from_fn(|i| traffic_sum[k + i] / n);
        AxisBytes {
            tp,
            dp,
            pp,
            ep,
            other,
        }
    };
    let summary = Summary {
        final_max_vio: last_max_vio,
        pipeline_bubble: bubble_sum.and_then(|(m, p, n)| {
            (n > 0).then(|| PipelineBubble {
                schedule: config.parallel.pp_schedule.name(),
                measured: m / n as f64,
                predicted: p / n as f64,
            })
        }),
        traffic_per_step: (dims.world_size() > 1).then(|| StepTraffic {
            payload: axis(0),
            scalars: axis(5),
        }),
        operand_copy_bytes: weft_kernels::operand_copy_bytes(),
        ..metrics.summary(&info, start.elapsed())
    };
    if !step_bubbles.is_empty() {
        bubble_other_data(
            &mut trace.other_data,
            &step_bubbles,
            summary.pipeline_bubble,
        );
    }
    if writer && !trace.trace_events.is_empty() {
        let path = run_dir.join("trace.json");
        let json = serde_json::to_string(&trace).unwrap_or_default();
        std::fs::write(&path, json).map_err(io_err(&path))?;
    }
    crate::run::finish(writer, &summary, observer)?;
    Ok(Attempt::Finished(Box::new(summary)))
}

/// Each rank's ratio of `work` to the median of the ranks in its group
/// (`group_of`: ranks doing the same work), where it exceeds `factor`; a
/// rank alone in its group is never a straggler.
fn stragglers(work: &[f64], group_of: impl Fn(usize) -> usize, factor: f64) -> Vec<Option<f64>> {
    (0..work.len())
        .map(|r| {
            let mut peers: Vec<f64> = (0..work.len())
                .filter(|&q| group_of(q) == group_of(r))
                .map(|q| work[q])
                .collect();
            if peers.len() < 2 {
                return None;
            }
            peers.sort_by(f64::total_cmp);
            // the lower median: with two ranks, the faster one
            let median = peers[(peers.len() - 1) / 2];
            let ratio = work[r] / median;
            (median > 0.0 && ratio > factor).then_some(ratio)
        })
        .collect()
}

/// A `nan` fault: the first parameter tensor this rank holds gets a NaN
/// (collective where the model's reads are: every rank calls it); returns
/// the tensor's name and values to put back after the step.
fn poison(
    model: &mut ParallelGpt,
    layout: &weft_model::ParamLayout,
) -> Result<Option<(String, Vec<f32>)>, TrainError> {
    for spec in layout.specs() {
        if let Some(values) = model.read_param(&spec.name)? {
            let mut bad = values.clone();
            if let Some(v) = bad.first_mut() {
                *v = f32::NAN;
            }
            model.write_param(&spec.name, &bad)?;
            return Ok(Some((spec.name.clone(), values)));
        }
    }
    Ok(None)
}

/// Records a rewind: `skip.json` (atomically) and a line of
/// `events.jsonl`.
fn record_rewind(
    run_dir: &Path,
    skips: &Skips,
    step: u64,
    reason: &str,
    to: u64,
    left_out: &[u64],
) -> Result<(), TrainError> {
    let path = run_dir.join("skip.json");
    let tmp = run_dir.join("skip.json.tmp");
    let json = serde_json::to_string_pretty(skips).unwrap_or_default() + "\n";
    std::fs::write(&tmp, json).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    crate::supervise::append_event(
        run_dir,
        &serde_json::json!({
            "time": crate::supervise::unix_now(), "event": "rewind", "step": step,
            "reason": reason, "to_step": to, "skipped_batches": left_out,
            "rewinds": skips.rewinds,
        }),
    )
    .map_err(io_err(&run_dir.join("events.jsonl")))
}

/// FSDP's tracks of chunk `c` as trace events on the trainer's clock (µs
/// since `start`), threads `2 + 3c + track` of the rank's process (0 and 1
/// are the pipeline's compute and receive waits), each slice carrying its
/// `step`.
fn fsdp_lanes(
    spans: &weft_fsdp::SpanLog,
    c: usize,
    start: Instant,
    step: u64,
) -> Vec<weft_trace::TraceEvent> {
    let epoch = spans.epoch();
    let offset = if epoch >= start {
        epoch.duration_since(start).as_secs_f64()
    } else {
        -start.duration_since(epoch).as_secs_f64()
    };
    let base = 2 + 3 * c as u64;
    spans
        .trace_events(0, offset * 1e6)
        .into_iter()
        .map(|mut e| {
            e.tid += base;
            if e.ph == weft_trace::Phase::Complete {
                e.args.insert("step".to_owned(), step.into());
                e
            } else {
                let name = e
                    .args
                    .get("name")
                    .and_then(weft_trace::ArgValue::as_str)
                    .unwrap_or("track")
                    .to_owned();
                let name = if c > 0 {
                    format!("fsdp chunk {c} {name}")
                } else {
                    format!("fsdp {name}")
                };
                weft_trace::TraceEvent::thread_name(e.pid, e.tid, name)
            }
        })
        .collect()
}

/// Every rank's `events` on world rank 0 (in rank order; `None`
/// elsewhere), as JSON point to point. Collective over `world`.
fn gather_events(
    world: &dyn Communicator,
    events: &[weft_trace::TraceEvent],
) -> Result<Option<Vec<Vec<weft_trace::TraceEvent>>>, TrainError> {
    let bad = TrainError::Trace;
    let bytes = serde_json::to_vec(events).map_err(|e| bad(e.to_string()))?;
    let Some(all) = crate::ranks::gather_bytes(world, crate::ranks::tags::TRACE, &bytes)? else {
        return Ok(None);
    };
    all.iter()
        .enumerate()
        .map(|(rank, b)| {
            serde_json::from_slice(b).map_err(|e| bad(format!("rank {rank}'s trace events: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The pipeline bubble in `trace.json`'s `otherData`, as the summary
/// reports it (see [`Summary::pipeline_bubble`]): `bubble_fraction` and
/// `bubble_predicted`, the means over the steps listed in `bubble_steps`
/// (the traced steps after the first, which is warm-up), and
/// `step_bubble_fractions`, one `{step, bubble_fraction, makespan_us}` per
/// traced step. Each step's bubble is the `bubble_fraction` of its
/// measured `weft_pipeline::Timeline`: the stages' idle time within the
/// step's own window over `p × makespan`, so the time between steps
/// (optimizer, evaluation) is not bubble. The slices carry their step in
/// `args.step`, so a viewer can recompute it (weft viz does).
fn bubble_other_data(
    other: &mut std::collections::BTreeMap<String, weft_trace::ArgValue>,
    steps: &[(u64, f64, f64, bool)],
    mean: Option<PipelineBubble>,
) {
    use weft_trace::ArgValue;
    if let Some(b) = mean {
        other.insert("bubble_fraction".into(), b.measured.into());
        other.insert("bubble_predicted".into(), b.predicted.into());
        let averaged = steps.iter().filter(|s| s.3).map(|s| s.0.into());
        other.insert("bubble_steps".into(), ArgValue::List(averaged.collect()));
    }
    let per_step = steps.iter().map(|&(step, bubble, makespan_us, _)| {
        let fields = [
            ("step", step.into()),
            ("bubble_fraction", bubble.into()),
            ("makespan_us", makespan_us.into()),
        ];
        ArgValue::Map(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    });
    other.insert(
        "step_bubble_fractions".into(),
        ArgValue::List(per_step.collect()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_straggler_is_the_rank_slower_than_its_stage_peers() {
        // two stages of three replicas; rank 4 twice as slow as its peers
        let work = [1.0, 1.1, 0.9, 2.0, 4.0, 2.1];
        let got = stragglers(&work, |r| r / 3, 1.5);
        assert_eq!(got.iter().filter(|r| r.is_some()).count(), 1);
        assert!((got[4].unwrap() - 4.0 / 2.1).abs() < 1e-12);
        // two ranks: the slower one against the faster
        assert_eq!(stragglers(&[1.0, 3.0], |_| 0, 1.5), [None, Some(3.0)]);
        // alone in its stage: never
        assert_eq!(stragglers(&[1.0, 3.0], |r| r, 1.5), [None, None]);
    }

    proptest::proptest! {
        /// The steps read the batches in order, each once, none that is
        /// left out.
        #[test]
        fn steps_read_every_batch_not_left_out_in_order(
            left_out in proptest::collection::vec(1u64..60, 0..12),
        ) {
            let mut skips = Skips::default();
            skips.add(&left_out);
            let read: Vec<u64> = (0..40).map(|s| skips.batch_of(s) + 1).collect();
            let expected: Vec<u64> =
                (1..).filter(|b| !left_out.contains(b)).take(40).collect();
            proptest::prop_assert_eq!(read, expected);
        }
    }

    #[test]
    fn pipeline_stages_are_partitioned_by_cost() {
        let sets = [
            "model.n_layer=8",
            "model.n_embd=64",
            "parallel.pp=2",
            "train.micro_batch_size=4",
        ];
        let c = Config::load(None, &sets.map(String::from)).unwrap();
        let layers = |vocab| {
            let p = plan(&c, &model_config(&c, vocab)).unwrap();
            p.pipeline.unwrap().1
        };
        // A small vocabulary: the blocks dominate, an even split.
        assert_eq!(layers(256), [4, 4]);
        // GPT-2's vocabulary: the head costs several blocks, so the last
        // stage gets fewer of them.
        let skewed = layers(50257);
        assert_eq!(skewed.iter().sum::<usize>(), 8);
        assert!(skewed[1] < skewed[0], "{skewed:?}");
    }

    #[test]
    fn timestamp_names_sort_and_parse() {
        let n = timestamp_name();
        assert_eq!(n.len(), 15, "{n}");
        assert_eq!(&n[8..9], "-");
        assert!(n[..4].parse::<u32>().unwrap() >= 2024);
    }
}
