//! The training loop.
//!
//! [`train`] runs a job described by a [`Config`] on one rank, or on
//! `parallel.dp` data-parallel ranks (threads; see [`crate::parallel`]). It
//! opens the data, builds
//! and initialises the model, and for each optimizer step accumulates
//! gradients over the micro-batches, checks them (a non-finite loss or
//! gradient skips the update), clips the global norm, and takes an AdamW
//! step at the scheduled learning rate. It evaluates on the validation split
//! periodically and writes the run folder:
//!
//! * `config.toml` — the resolved configuration;
//! * `metrics.jsonl` — one [`MetricsRecord`] per step, plus event lines
//!   (`{"step":…, "event":"skip"|"spike"|"eval", …}`) for health events and
//!   evaluations;
//! * `summary.json` — the final figures.
//!
//! The library never prints: progress goes to an [`Observer`], which the
//! `weft` binary renders as a progress bar or log lines.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use weft_collectives::CommunicatorExt;
use weft_kernels::{AdamW, Mode, matmul_forward};
use weft_model::{AdamWState, Gpt, GptConfig};
use weft_trace::MetricsRecord;

use crate::config::Config;
use crate::data::{Batch, Data, DataError};
use crate::net::{Net, NetActs};
use crate::parallel::{Dp, Forward, GradAccum};
use crate::schedule::lr_at;

/// Errors that stop a training run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The data could not be opened.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The model rejected its configuration or a batch.
    #[error("model: {0}")]
    Model(#[from] weft_model::Error),
    /// The run folder already exists: runs are never overwritten.
    #[error("run folder {0} already exists: pick another run.name (or remove the folder)")]
    RunExists(PathBuf),
    /// Saving or restoring a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] crate::ckpt::CkptError),
    /// The mixture-of-experts balancer failed.
    #[error("mixture of experts: {0}")]
    Moe(String),
    /// `--resume` named a run folder that does not exist.
    #[error("cannot resume: run folder {0} does not exist")]
    NothingToResume(PathBuf),
    /// A collective operation between ranks failed.
    #[error("communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// The pipeline executor failed (names the stage, step and action).
    #[error("pipeline: {0}")]
    Pipeline(#[from] weft_pipeline::ExecError),
    /// A kernel rejected its arguments.
    #[error("kernel: {0}")]
    Kernel(#[from] weft_kernels::Error),
    /// The sharded data-parallel runner failed.
    #[error("fsdp: {0}")]
    Fsdp(#[from] weft_fsdp::Error),
    /// The tensor-parallel model failed.
    #[error(transparent)]
    TensorParallel(weft_model::tp::Error),
    /// The configuration asks for a parallel layout `weft train` cannot run.
    #[error("{0}")]
    Unsupported(String),
    /// Writing the run folder failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// What a run is about to do, reported once at the start.
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    /// The run folder.
    pub run_dir: PathBuf,
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
    /// The machine's measured f32 matmul throughput (FLOP/s), the
    /// denominator of utilisation.
    pub peak_flops: f64,
    /// Best achievable validation loss, when the data has one.
    pub floor: Option<f64>,
    /// Optimizer steps.
    pub steps: u64,
    /// Bytes of activations planned for one micro-batch.
    pub activation_bytes: usize,
    /// The split over ranks, e.g. `dp=2 tp=2` (`single rank` alone).
    pub layout: String,
    /// Memory of one rank (rank 0), from the buffers it allocated.
    pub memory: RankMemory,
}

/// Bytes one rank holds, by category — counted from the buffers actually
/// allocated, so sharding shows: with `parallel.tp = N` the split layers'
/// parameters, gradients and moments are `1/N` of the model's, with
/// `parallel.ep = N` the experts'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// Parameters (f32).
    pub params: usize,
    /// Gradients (f32).
    pub grads: usize,
    /// AdamW moments (two f32 per parameter).
    pub optimizer: usize,
    /// Activations planned for one micro-batch.
    pub activations: usize,
}

impl RankMemory {
    /// All categories together.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer + self.activations
    }
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
    /// The loss jumped above `factor` × the rolling median.
    Spike {
        /// Step (from 1).
        step: u64,
        /// The step's loss.
        loss: f64,
        /// Median of the recent window.
        median: f64,
        /// Position of the step's data: (step, micro-batches).
        batch: (u64, usize),
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

/// Measures this machine's f32 matmul throughput with the kernels' GEMM on
/// a GPT-2-sized product (1024×768 · 768×3072), best of ten runs (the
/// best, because a shared machine only ever makes a run slower).
pub fn measure_matmul_peak() -> f64 {
    let (m, k, n) = (1024, 768, 3072);
    let a = vec![0.5f32; m * k];
    let w = vec![0.25f32; k * n];
    let mut out = vec![0f32; m * n];
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = Instant::now();
        // Shapes are consistent by construction; an error would mean a bug.
        if matmul_forward(&mut out, &a, &w, None, 1, m, k, n, Mode::Throughput).is_err() {
            return f64::NAN;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * k * n) as f64 / best
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A run name from the current UTC time, `YYYYMMDD-HHMMSS`.
fn timestamp_name() -> String {
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

/// The mixture-of-experts side of a model: its statistics handle and
/// balancing settings.
struct MoeRun {
    stats: weft_model::MoeStats,
    layers: usize,
    experts: usize,
    bias_rate: Option<f64>,
}

/// The mixture-of-experts block of a job per `[model.moe]` (router, gate,
/// capacity, shared expert, auxiliary loss), or `None` for a dense model.
pub(crate) fn moe_config(config: &Config, cfg: &GptConfig) -> Option<weft_moe::MoeConfig> {
    use weft_moe::{AuxLoss, AuxScope, DropPolicy, Gate, MoeConfig, Router};
    let m = &config.model.moe;
    if m.experts == 0 {
        return None;
    }
    let gate = if m.gate == "sigmoid" {
        Gate::Sigmoid
    } else {
        Gate::Softmax
    };
    let mut router = Router::top_k(m.experts, m.top_k)
        .with_gate(gate)
        .with_normalize(m.normalize);
    if m.capacity_factor > 0.0 {
        let drop = if m.drop == "score" {
            DropPolicy::ByScore
        } else {
            DropPolicy::ByPosition
        };
        router = router.with_capacity(m.capacity_factor, drop);
    }
    Some(MoeConfig {
        channels: cfg.n_embd,
        hidden: 4 * cfg.n_embd,
        router,
        shared_expert: m.shared_expert,
        aux: (m.balance == "aux").then_some(AuxLoss {
            coef: m.aux_coef,
            scope: AuxScope::Batch,
        }),
    })
}

/// The model of one rank: with `ep`, its mixture-of-experts blocks hold
/// this rank's share of the experts.
fn build_model(
    config: &Config,
    cfg: &GptConfig,
    ep: Option<&crate::parallel::Ep>,
) -> Result<(Gpt, Option<MoeRun>), TrainError> {
    let Some(moe_cfg) = moe_config(config, cfg) else {
        return Ok((Gpt::new(cfg.clone())?, None));
    };
    let m = &config.model.moe;
    let (ffn, stats) = match ep {
        Some(ep) => weft_model::MoeFfn::with_expert_parallel(moe_cfg, ep.group.clone())?,
        None => weft_model::MoeFfn::new(moe_cfg)?,
    };
    let model = Gpt::with_ffn(cfg.clone(), Box::new(ffn))?;
    let bias_rate = (m.balance == "bias").then_some(m.bias_rate);
    Ok((
        model,
        Some(MoeRun {
            stats,
            layers: cfg.n_layer,
            experts: m.experts,
            bias_rate,
        }),
    ))
}

/// Mean validation loss over `batches`. With `dp`, each rank evaluates a
/// contiguous share of the batches and the per-batch figures are gathered
/// and summed in batch order — the same sum, bit for bit, as one rank's.
fn eval_loss(model: &mut Net, batches: &[Batch], dp: Option<&Dp>) -> Result<f64, TrainError> {
    let (rank, ranks) = dp.map_or((0, 1), |d| (d.rank(), d.size()));
    let per = batches.len().div_ceil(ranks);
    let mine = (rank * per).min(batches.len())..((rank + 1) * per).min(batches.len());
    let mut local = vec![0.0; per];
    let mut acts: Option<NetActs> = None;
    // With expert parallelism forwards are collective over the expert
    // group: a rank short of batches runs (and discards) stand-ins so that
    // every rank runs `per` forwards.
    let collective = dp.is_some_and(|d| d.ep().is_some()) || matches!(model, Net::Fsdp(_));
    for (i, slot) in local.iter_mut().enumerate() {
        let (b, real) = match batches[mine.clone()].get(i) {
            Some(b) => (b, true),
            None if collective && !batches.is_empty() => (&batches[0], false),
            None => break,
        };
        if acts.as_ref().is_none_or(|a| a.batch() != b.batch) {
            acts = Some(model.activations(b.batch, b.seq)?);
        }
        let a = acts.as_mut().expect("just planned");
        let loss = model.eval_batch(dp, a, b)?;
        if real {
            *slot = loss * (b.batch * b.seq) as f64;
        }
    }
    let all = match dp {
        Some(d) => d.gather(&local)?,
        None => local,
    };
    let (mut total, mut tokens) = (0.0, 0usize);
    for (x, b) in all.iter().zip(batches) {
        total += x;
        tokens += b.batch * b.seq;
    }
    Ok(total / tokens.max(1) as f64)
}

/// Mean validation loss: [`eval_loss`], or for a pipeline the whole model
/// assembled on rank 0, evaluated there and broadcast (the stages hold no
/// forward-only schedule).
fn evaluate(
    model: &mut Net,
    full: &mut Option<Gpt>,
    full_layout: &weft_model::ParamLayout,
    batches: &[Batch],
    dp: Option<&Dp>,
) -> Result<f64, TrainError> {
    let Some(comm) = dp.and_then(Dp::pp).filter(|_| matches!(model, Net::Pp(_))) else {
        return eval_loss(model, batches, dp);
    };
    let no_moments = AdamWState {
        m: Vec::new(),
        v: Vec::new(),
        step: 0,
    };
    let mut loss = [f64::NAN];
    match full.take() {
        Some(mut whole) => {
            let mut moments = whole.adamw_state();
            model.assemble(
                dp,
                &no_moments,
                full_layout,
                Some((&mut whole, &mut moments)),
            )?;
            let mut net = Net::Whole(whole);
            let r = eval_loss(&mut net, batches, None);
            if let Net::Whole(w) = net {
                *full = Some(w);
            }
            loss[0] = r?;
        }
        None => model.assemble(dp, &no_moments, full_layout, None)?,
    }
    comm.broadcast(&mut loss, 0)?;
    Ok(loss[0])
}

/// Every layer's expert-load statistics (`experts` per layer), summed over
/// the data-parallel group and gathered over the pipeline group (a layer
/// this rank does not hold counts as zero here), so that every rank
/// balances (and rank 0 logs) every layer over the whole global batch.
fn sum_load_stats(
    dp: &Dp,
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
    dp.sum_counts(&mut flat)?;
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
/// # Errors
/// [`TrainError`] if the data cannot be opened, the model rejects the
/// configuration, the run folder exists (or, resuming, does not), a
/// checkpoint cannot be saved or restored, or writing the folder fails.
///
/// # Panics
/// Never: internal invariants only.
pub fn train(
    config: &Config,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    let p = &config.parallel;
    let unsupported = |what: &str| {
        Err(TrainError::Unsupported(format!(
            "{what} is not available in weft train yet; run with parallel.dp only"
        )))
    };
    if p.tp > 1 && config.model.moe.experts > 0 {
        return unsupported(
            "tensor parallelism of mixture-of-experts models (parallel.tp > 1 with model.moe.experts > 0)",
        );
    }
    if p.pp > 1 && (p.dp > 1 || p.tp > 1 || p.ep > 1 || sharded_cfg(config)) {
        return unsupported(
            "pipeline parallelism combined with other axes (parallel.pp > 1 with dp, tp, ep or fsdp)",
        );
    }
    let sharded = p.fsdp != "none";
    if sharded && (p.tp > 1 || p.ep > 1 || config.model.moe.experts > 0) {
        return unsupported(
            "parallel.fsdp other than \"none\" with tensor parallelism, expert parallelism or a mixture-of-experts model",
        );
    }
    let world = p.world_size();
    if world == 1 && !sharded {
        return run_rank(config, resume, None, observer);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let ranks = s.spawn(move || {
            let tx = tx;
            weft_collectives::LocalCluster::builder(world).run_each(|comm| {
                let dp = match Dp::new(Box::new(comm), p.ep, p.tp, p.pp) {
                    Ok(dp) => dp,
                    Err(e) => return Err(e),
                };
                if dp.world_rank() == 0 {
                    run_rank(config, resume, Some(&dp), &mut Forward(tx.clone()))
                } else {
                    run_rank(config, resume, Some(&dp), &mut Silent)
                }
            })
        });
        for report in rx {
            report.deliver(observer);
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

fn sharded_cfg(config: &Config) -> bool {
    config.parallel.fsdp != "none"
}

/// The configured pipeline schedule's name.
fn pp_schedule_name(config: &Config) -> &'static str {
    match config.parallel.pp_schedule.as_str() {
        "gpipe" => "gpipe",
        "interleaved" => "interleaved",
        "zb-h1" => "zb-h1",
        _ => "1f1b",
    }
}

/// The pipeline schedule of a run — `parallel.pp` stages, the global
/// batch's `train.grad_accum` micro-batches, `parallel.pp_chunks` chunks
/// per stage for the interleaved schedule — and the layers of each virtual
/// stage, chosen by `weft-pipeline`'s partitioner to minimise the simulated
/// makespan. Per-layer costs are the model's FLOPs per token (a block:
/// 24·C² for its matmuls plus 2·T·C for causal attention, forward;
/// backward-for-input and backward-for-weights each as much); the head's
/// 2·C·V is charged to the last block and the embedding's lookup is free,
/// so the last stage takes fewer blocks when the vocabulary is large.
fn pp_plan(
    config: &Config,
    vocab: usize,
) -> Result<(weft_pipeline::Schedule, Vec<usize>), TrainError> {
    let p = &config.parallel;
    let kind: weft_pipeline::ScheduleKind = pp_schedule_name(config)
        .parse()
        .map_err(|e: weft_pipeline::Error| TrainError::Unsupported(e.to_string()))?;
    let chunks = if p.pp_schedule == "interleaved" {
        p.pp_chunks
    } else {
        1
    };
    let schedule = kind
        .generate(p.pp, config.train.grad_accum, chunks)
        .map_err(|e| TrainError::Unsupported(format!("parallel.pp_schedule: {e}")))?;
    let nvs = p.pp * chunks;
    let l = config.model.n_layer;
    if l < nvs {
        return Err(TrainError::Unsupported(format!(
            "parallel.pp = {} with {chunks} chunks needs at least {nvs} layers (model.n_layer = {l})",
            p.pp
        )));
    }
    let (c, t, v) = (
        config.model.n_embd as f64,
        config.model.block_size as f64,
        vocab as f64,
    );
    // Forward FLOPs per token: attention's projections 8C², its scores
    // 2TC, and the feed-forward block's 16C² per active expert (top-k plus
    // a shared one) and 2CE for the router — or 16C² dense.
    let m = &config.model.moe;
    let ffn = if m.experts == 0 {
        16.0 * c * c
    } else {
        let active = (m.top_k + usize::from(m.shared_expert)) as f64;
        16.0 * c * c * active + 2.0 * c * m.experts as f64
    };
    let block = 8.0 * c * c + ffn + 2.0 * t * c;
    let profiles: Vec<weft_pipeline::LayerProfile> = (0..l)
        .map(|i| {
            let f = if i + 1 == l {
                block + 2.0 * c * v
            } else {
                block
            };
            weft_pipeline::LayerProfile {
                forward: f,
                backward_input: f,
                backward_weight: f,
                activation: 1.0,
                weight_grad_memory: 1.0,
                static_memory: 0.0,
            }
        })
        .collect();
    let part = weft_pipeline::partition(
        &schedule,
        &profiles,
        &weft_pipeline::PartitionOptions {
            p2p_latency: 0.0,
            memory_limit: None,
        },
    )
    .map_err(|e| TrainError::Unsupported(format!("pipeline partition: {e}")))?;
    let layers = part.layers_per_chunk();
    if layers.contains(&0) {
        return Err(TrainError::Unsupported(format!(
            "pipeline partition left a stage without layers ({layers:?}); use fewer stages"
        )));
    }
    Ok((schedule, layers))
}

/// `dp=2 tp=2 ...` for the degrees above 1.
fn layout_name(config: &Config) -> String {
    let p = &config.parallel;
    let mut parts: Vec<String> = [("dp", p.dp), ("tp", p.tp), ("pp", p.pp), ("ep", p.ep)]
        .iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    if p.tp > 1 && p.sequence_parallel {
        parts.push("sequence-parallel".into());
    }
    if p.pp > 1 {
        parts.push(format!("schedule {}", pp_schedule_name(config)));
    }
    if p.world_size() > 1 {
        parts.push(if p.reproducible {
            "reproducible sums".into()
        } else {
            "plain f32 sums".into()
        });
    }
    if parts.is_empty() {
        "single rank".into()
    } else {
        parts.join(" ")
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
        let secondary = matches!(
            e,
            TrainError::Comm(weft_collectives::Error::PeerLost { .. })
        );
        match &first_err {
            None => first_err = Some(e),
            Some(TrainError::Comm(weft_collectives::Error::PeerLost { .. })) if !secondary => {
                first_err = Some(e);
            }
            Some(_) => {}
        }
    }
    match (first_err, summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(TrainError::Unsupported("no rank returned a result".into())),
    }
}

/// One rank's run: the whole job with `dp` absent, else this rank's share
/// of it. Only the rank with `dp` rank 0 (or the single rank) writes the
/// run folder and checkpoints.
fn run_rank(
    config: &Config,
    resume: bool,
    dp: Option<&Dp>,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    let writer = dp.is_none_or(|d| d.world_rank() == 0);
    let data = Data::open(config)?;
    let vocab = data.vocab_size();
    let cfg = model_config(config, vocab);
    let ep = dp.and_then(Dp::ep);
    let tp = dp.and_then(Dp::tp).map(|c| (c.size(), c.rank()));
    let (whole_model, mut moe) = build_model(config, &cfg, ep)?;
    // With expert or tensor parallelism every rank starts from its share
    // of the unsharded model's initialisation (the same as one rank's); the
    // writer keeps the unsharded model to assemble checkpoints in.
    let mut full = None;
    let sharded = config.parallel.fsdp != "none";
    let pp = dp.and_then(Dp::pp).is_some();
    let mut model = if ep.is_some() || tp.is_some() || sharded || pp {
        let (mut whole, whole_moe) = build_model(config, &cfg, None)?;
        whole.init_gpt2(config.train.seed);
        let net = match tp {
            None if pp => {
                // The stages run the whole model's feed-forward blocks.
                moe = whole_moe;
                let (schedule, layers) = pp_plan(config, vocab)?;
                let rank = dp.map_or(0, Dp::world_rank);
                let t = &config.train;
                Net::Pp(Box::new(crate::net::Pipe::new(
                    &whole,
                    schedule,
                    rank,
                    &layers,
                    t.batch_size / t.grad_accum,
                    config.model.block_size,
                    config.parallel.reproducible,
                )?))
            }
            None if sharded => {
                let d = dp.ok_or_else(|| TrainError::Unsupported("fsdp needs its group".into()))?;
                let p = &config.parallel;
                let o = &config.optim;
                let fc = weft_fsdp::FsdpConfig {
                    strategy: p.fsdp.parse()?,
                    reproducible: p.reproducible,
                    hybrid_shard: p.hybrid_shard,
                    adamw: AdamW {
                        lr: 0.0,
                        beta1: o.beta1 as f32,
                        beta2: o.beta2 as f32,
                        eps: o.eps as f32,
                        weight_decay: o.weight_decay as f32,
                    },
                    max_grad_norm: (o.grad_clip > 0.0).then_some(o.grad_clip as f32),
                    ..Default::default()
                };
                let ffn: std::sync::Arc<dyn weft_model::FeedForward> =
                    std::sync::Arc::new(weft_model::Mlp);
                Net::Fsdp(Box::new(weft_fsdp::Fsdp::new(
                    d.comm(),
                    cfg.clone(),
                    ffn,
                    fc,
                    &whole.params,
                )?))
            }
            Some((size, rank)) => {
                let opts = weft_model::tp::TpOptions {
                    sequence_parallel: config.parallel.sequence_parallel,
                    reproducible: config.parallel.reproducible,
                    ..Default::default()
                };
                Net::Tp(
                    weft_model::tp::TpGpt::from_full(&whole, size, rank, opts)
                        .map_err(TrainError::TensorParallel)?,
                )
            }
            None => {
                let mut m = whole_model;
                let ep_rank = dp.and_then(Dp::ep_rank).unwrap_or(0);
                weft_model::MoeFfn::shard_params(&whole, &mut m, ep_rank, config.parallel.ep)?;
                Net::Whole(m)
            }
        };
        full = Some(whole);
        net
    } else {
        let mut m = whole_model;
        m.init_gpt2(config.train.seed);
        Net::Whole(m)
    };

    let name = if config.run.name.is_empty() {
        timestamp_name()
    } else {
        config.run.name.clone()
    };
    let run_dir = config.run.dir.join(name);
    let metrics_path = run_dir.join("metrics.jsonl");
    let mut opt = model.adamw_state();
    let ckpt_root = run_dir.join("checkpoints");
    // Resuming: the state, and the metrics lines up to the checkpoint.
    let mut kept_lines: Vec<String> = Vec::new();
    let mut start_step = 0;
    if resume {
        if !run_dir.is_dir() {
            return Err(TrainError::NothingToResume(run_dir));
        }
        let restored = match (full.as_mut(), &mut model) {
            (None, Net::Whole(m)) => crate::ckpt::restore(&ckpt_root, config, m, &mut opt)?,
            (Some(whole), _) => {
                // The checkpoint is unsharded: restore it whole, then take
                // this rank's share (parameters and moments).
                let mut whole_opt = whole.adamw_state();
                let r = crate::ckpt::restore(&ckpt_root, config, whole, &mut whole_opt)?;
                model.take_share(dp, whole, &whole_opt, &mut opt)?;
                r
            }
            (None, _) => unreachable!("a sharded rank keeps the whole model"),
        };
        start_step = restored.step;
        observer.resumed(start_step, &restored.skipped);
        let text = std::fs::read_to_string(&metrics_path).map_err(io_err(&metrics_path))?;
        kept_lines = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= start_step)
            })
            .map(str::to_owned)
            .collect();
    } else if writer {
        if run_dir.exists() {
            return Err(TrainError::RunExists(run_dir));
        }
        std::fs::create_dir_all(&run_dir).map_err(io_err(&run_dir))?;
        let config_path = run_dir.join("config.toml");
        std::fs::write(&config_path, config.to_toml()).map_err(io_err(&config_path))?;
    }
    // Only the writer's logs reach the disk.
    let mut metrics: BufWriter<Box<dyn Write>> = if writer {
        // (Re)write the metrics file with the kept lines, atomically.
        let tmp = run_dir.join("metrics.jsonl.tmp");
        let kept: String = kept_lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&tmp, kept).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &metrics_path).map_err(io_err(&metrics_path))?;
        let file = std::fs::OpenOptions::new().append(true).open(&metrics_path);
        BufWriter::new(Box::new(file.map_err(io_err(&metrics_path))?))
    } else {
        BufWriter::new(Box::new(std::io::sink()))
    };
    let mut saver = if writer && config.checkpoint.every > 0 {
        Some(crate::ckpt::Saver::new(&ckpt_root, config)?)
    } else {
        None
    };
    // Map the saver's host buffers now, not inside the first save's step.
    if let Some(saver) = saver.as_mut() {
        match (&full, &model) {
            (Some(f), _) => saver.reserve(f, &f.adamw_state())?,
            (None, Net::Whole(m)) => saver.reserve(m, &opt)?,
            _ => {}
        }
    }

    let t = &config.train;
    let micro = t.batch_size / t.grad_accum;
    let seq = config.model.block_size;
    let mut acts = model.activations(micro, seq)?;
    let full_layout = match (&full, &model) {
        (Some(f), _) => f.layout().clone(),
        (None, Net::Whole(m)) => m.layout().clone(),
        (None, Net::Tp(m)) => m.full_layout().clone(),
        (None, Net::Fsdp(_) | Net::Pp(_)) => unreachable!("a sharded rank keeps the whole model"),
    };
    // The unsharded model's buffers stay on the writer only.
    if !writer {
        full = None;
    }

    let val = data.val_batches(t.eval_sequences, micro);
    let floor = data.val_floor(t.eval_sequences);
    let (l, c) = (cfg.n_layer, cfg.n_embd);
    // Parameters each token multiplies by: not the position table, and of
    // the routed experts only the k of E a token is sent to.
    let moe_active = |name: &str| {
        let m = &config.model.moe;
        if m.experts > 0 && name.contains(".mlp.experts.") {
            m.top_k as f64 / m.experts as f64
        } else {
            1.0
        }
    };
    let matmul_params: f64 = full_layout
        .specs()
        .iter()
        .filter(|p| p.name != "transformer.wpe.weight")
        .map(|p| p.numel() as f64 * moe_active(&p.name))
        .sum();
    let flops_per_token = 6.0 * matmul_params + 6.0 * (l * seq * c) as f64;
    let info = RunInfo {
        run_dir: run_dir.clone(),
        params: full_layout.len(),
        vocab,
        tokens_per_step: t.batch_size * seq,
        flops_per_token,
        // Measured by the writer alone: ranks measuring at once would
        // share the cores and report a fraction of the peak.
        peak_flops: if writer {
            measure_matmul_peak()
        } else {
            f64::NAN
        },
        floor,
        steps: t.steps,
        activation_bytes: acts.bytes(),
        layout: layout_name(config),
        memory: model.memory(&opt, &acts),
    };
    observer.start(&info);

    let write_line = |w: &mut BufWriter<Box<dyn Write>>, line: String| -> Result<(), TrainError> {
        writeln!(w, "{line}").map_err(io_err(&metrics_path))
    };
    let log_eval = |w: &mut BufWriter<Box<dyn Write>>,
                    obs: &mut dyn Observer,
                    step: u64,
                    loss: f64| {
        let report = EvalReport { step, loss, floor };
        obs.eval(&report);
        let line =
            serde_json::json!({ "step": step, "event": "eval", "val_loss": loss, "floor": floor });
        write_line(w, line.to_string())
    };

    let start = Instant::now();
    let parse = |l: &String| serde_json::from_str::<serde_json::Value>(l).ok();
    let initial_eval = if resume {
        kept_lines
            .iter()
            .filter_map(parse)
            .find(|v| v["event"] == "eval" && v["step"] == 0)
            .and_then(|v| v["val_loss"].as_f64())
            .unwrap_or(f64::NAN)
    } else {
        let e = evaluate(&mut model, &mut full, &full_layout, &val, dp)?;
        log_eval(&mut metrics, observer, 0, e)?;
        e
    };
    let mut last_eval = initial_eval;
    let (mut skipped, mut last_loss) = (0u64, f64::NAN);
    let (mut sum_tps, mut sum_flops) = (0.0, 0.0);
    // The spike detector's window, refilled from the kept lines on resume.
    let mut recent: Vec<f64> = kept_lines
        .iter()
        .filter_map(parse)
        .filter(|v| v.get("event").is_none())
        .filter_map(|v| v["loss"].as_f64())
        .filter(|l| l.is_finite())
        .collect();
    let excess = recent.len().saturating_sub(t.spike_window.max(1));
    recent.drain(..excess);
    let share = dp.map_or(0..t.grad_accum, |d| d.share(t.grad_accum));
    // Gradients of the mean over the global batch's micro-batches.
    let experts = match (&model, ep) {
        (Net::Whole(m), Some(_)) => Some(m.layout().clone()),
        _ => None,
    };
    let mut accum = GradAccum::new(
        model.grads().len(),
        config.parallel.reproducible,
        experts.as_ref(),
    );
    let mut last_max_vio = None;
    let expert_path = run_dir.join("expert_load.jsonl");
    let mut expert_log: Option<BufWriter<Box<dyn Write>>> = match &moe {
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
    };
    let mut trace = weft_trace::Trace::new();
    let mut bubble_sum: Option<(f64, f64, usize)> = None;
    // Every traced pipeline step: (step number, measured bubble, makespan
    // in µs, whether it is in `bubble_sum`), for trace.json's otherData.
    let mut step_bubbles: Vec<(u64, f64, f64, bool)> = Vec::new();
    for step in start_step..t.steps {
        let step_start = Instant::now();
        let lr = lr_at(&config.optim, step, t.steps);
        if let Some(moe) = &moe {
            moe.stats.take(); // forget evaluation forwards
        }
        let hp = AdamW {
            lr: lr as f32,
            beta1: config.optim.beta1 as f32,
            beta2: config.optim.beta2 as f32,
            eps: config.optim.eps as f32,
            weight_decay: config.optim.weight_decay as f32,
        };
        let out = model.train_step(
            dp,
            &data,
            step,
            share.clone(),
            micro,
            &mut acts,
            &mut accum,
            &mut opt,
            &hp,
            config.optim.grad_clip,
            t.grad_accum,
        )?;
        let (loss, grad_norm, applied) = (out.loss, out.grad_norm, out.applied);
        if !applied {
            skipped += 1;
            let event = HealthEvent::Skipped {
                step: step + 1,
                loss,
                grad_norm,
            };
            observer.event(&event);
            let line = serde_json::json!({ "step": step + 1, "event": "skip", "loss": loss, "grad_norm": grad_norm });
            write_line(&mut metrics, line.to_string())?;
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
                        return Err(TrainError::Moe(format!(
                            "statistics logged for layer {l} of a {}-layer model",
                            moe.layers
                        )));
                    }
                }
            }
            let per_layer = match dp {
                Some(dp) => sum_load_stats(dp, per_layer, moe.experts)?,
                None => per_layer.into_iter().flatten().collect(),
            };
            let mut vios = Vec::new();
            for (l, st) in per_layer.iter().enumerate() {
                let rec = st.to_record(step + 1, l as u32);
                let line = serde_json::to_string(&rec).unwrap_or_default();
                writeln!(expert_log.as_mut().expect("opened with MoE"), "{line}")
                    .map_err(io_err(&expert_path))?;
                vios.extend(st.max_vio());
                if let (Some(rate), true) = (moe.bias_rate, applied) {
                    let name = format!("transformer.h.{l}.mlp.router.selection_bias");
                    if let Some(bias) = model.param_mut(&name) {
                        weft_moe::BiasBalancer::new(rate)
                            .update(bias, &st.tokens_per_expert)
                            .map_err(|e| TrainError::Moe(e.to_string()))?;
                    }
                }
            }
            if !vios.is_empty() {
                max_vio = Some(vios.iter().sum::<f64>() / vios.len() as f64);
            }
        }
        last_max_vio = max_vio;
        if loss.is_finite() {
            let window = t.spike_window.max(1);
            if recent.len() >= window.min(10) {
                let mut sorted = recent.clone();
                sorted.sort_by(f64::total_cmp);
                let median = sorted[sorted.len() / 2];
                if loss > t.spike_factor * median {
                    let event = HealthEvent::Spike {
                        step: step + 1,
                        loss,
                        median,
                        batch: (step, t.grad_accum),
                    };
                    observer.event(&event);
                    let line = serde_json::json!({ "step": step + 1, "event": "spike", "loss": loss, "median": median,
                        "batch": { "step": step, "micro_batches": t.grad_accum } });
                    write_line(&mut metrics, line.to_string())?;
                }
            }
            recent.push(loss);
            if recent.len() > window {
                recent.remove(0);
            }
        }
        last_loss = loss;
        // The sharded runner's compute and communication tracks, for the
        // first `run.trace_steps` steps.
        let traced = step < start_step + config.run.trace_steps;
        if traced {
            let events = model.take_trace_events(0, trace.trace_events.is_empty());
            if writer && !events.is_empty() {
                if trace.trace_events.is_empty() {
                    let name = format!("rank 0 (fsdp {})", config.parallel.fsdp);
                    trace.push(weft_trace::TraceEvent::process_name(0, name));
                }
                trace.trace_events.extend(events);
            }
        } else {
            let _ = model.take_trace_events(0, false);
        }
        // A pipeline's measured timeline (rank 0 gathers every stage's),
        // and its bubble beside the simulator's prediction.
        if traced
            && let (Net::Pp(pipe), Some(comm)) = (&mut model, dp.and_then(Dp::pp))
            && let Some(local) = pipe.timeline.take()
            && let Some(ranks) = pipe.ex.gather_timelines(comm, &local)?
        {
            let schedule = pipe.ex.schedule();
            let measured = weft_pipeline::Measured::new(schedule, ranks)
                .map_err(|e| TrainError::Unsupported(format!("pipeline timeline: {e}")))?;
            let bubble = measured.timeline.bubble_fraction();
            let averaged = step > start_step;
            step_bubbles.push((
                step + 1,
                bubble,
                measured.timeline.makespan() * 1e6,
                averaged,
            ));
            if averaged {
                let predicted = measured
                    .predicted(schedule)
                    .map_err(|e| TrainError::Unsupported(format!("pipeline simulation: {e}")))?;
                let (m, p, n) = bubble_sum.get_or_insert((0.0, 0.0, 0));
                *m += bubble;
                *p += predicted.bubble_fraction();
                *n += 1;
            }
            let offset = step_start.duration_since(start).as_secs_f64() * 1e6;
            // Stage names, sort order and the schedule once, from the first
            // traced step; every slice carries its step number (the
            // viewer's step windows).
            let first = step == start_step;
            let exported = measured.to_trace();
            if first {
                for key in ["schedule", "stages", "microbatches", "chunks"] {
                    if let Some(v) = exported.other_data.get(key) {
                        trace.other_data.insert(key.to_owned(), v.clone());
                    }
                }
            }
            for mut e in exported.trace_events {
                let metadata = e.ph != weft_trace::Phase::Complete;
                if metadata && !first {
                    continue;
                }
                if !metadata {
                    e.ts += offset;
                }
                if e.ph == weft_trace::Phase::Complete {
                    e.args.insert("step".to_owned(), (step + 1).into());
                }
                trace.trace_events.push(e);
            }
        }
        let dt = step_start.elapsed().as_secs_f64();
        let tps = info.tokens_per_step as f64 / dt;
        let flops = tps * flops_per_token;
        sum_tps += tps;
        sum_flops += flops;
        let record = MetricsRecord {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tps,
            time_s: start.elapsed().as_secs_f64(),
        };
        let line = serde_json::to_string(&record).unwrap_or_default();
        write_line(&mut metrics, line)?;
        observer.step(&StepReport {
            record,
            flops_per_s: flops,
            utilisation: flops / info.peak_flops,
            applied,
            max_vio,
        });
        let done = step + 1 == t.steps;
        if done || (t.eval_every > 0 && (step + 1) % t.eval_every == 0) {
            last_eval = evaluate(&mut model, &mut full, &full_layout, &val, dp)?;
            log_eval(&mut metrics, observer, step + 1, last_eval)?;
        }
        let save_now = config.checkpoint.every > 0
            && (done || (step + 1).is_multiple_of(config.checkpoint.every));
        // Sharded models are assembled whole on the writer first: a
        // collective, so every rank of the group joins.
        let mut whole_opt = None;
        if save_now && (ep.is_some() || tp.is_some() || sharded || pp) {
            let mut o = full.as_ref().map(Gpt::adamw_state);
            let dest = full.as_mut().zip(o.as_mut());
            model.assemble(dp, &opt, &full_layout, dest)?;
            whole_opt = o;
        }
        if let Some(saver) = saver.as_mut()
            && save_now
        {
            // Everything logged so far belongs to the checkpoint.
            metrics.flush().map_err(io_err(&metrics_path))?;
            if let Some(log) = expert_log.as_mut() {
                log.flush().map_err(io_err(&expert_path))?;
            }
            match (&full, &whole_opt, &model) {
                (Some(f), Some(o), _) => saver.save(step + 1, f, o)?,
                (_, _, Net::Whole(m)) => saver.save(step + 1, m, &opt)?,
                (_, _, Net::Tp(_) | Net::Fsdp(_) | Net::Pp(_)) => {
                    unreachable!("the writer keeps the whole model")
                }
            }
        }
    }
    metrics.flush().map_err(io_err(&metrics_path))?;
    if let Some(log) = expert_log.as_mut() {
        log.flush().map_err(io_err(&expert_path))?;
    }
    if let Some(saver) = saver.as_mut() {
        saver.finish()?;
    }
    let n = t.steps.saturating_sub(start_step).max(1) as f64;
    let summary = Summary {
        run_dir: run_dir.clone(),
        steps: t.steps,
        skipped_steps: skipped,
        final_train_loss: last_loss,
        final_eval_loss: last_eval,
        initial_eval_loss: initial_eval,
        floor,
        tokens_per_s: sum_tps / n,
        flops_per_s: sum_flops / n,
        utilisation: sum_flops / n / info.peak_flops,
        wall_s: start.elapsed().as_secs_f64(),
        final_max_vio: last_max_vio,
        pipeline_bubble: bubble_sum.and_then(|(m, p, n)| {
            (n > 0).then(|| PipelineBubble {
                schedule: pp_schedule_name(config),
                measured: m / n as f64,
                predicted: p / n as f64,
            })
        }),
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
    if writer {
        let summary_path = run_dir.join("summary.json");
        let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
        std::fs::write(&summary_path, json + "\n").map_err(io_err(&summary_path))?;
    }
    observer.finish(&summary);
    Ok(summary)
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
    fn pipeline_stages_are_partitioned_by_cost() {
        let sets = [
            "model.n_layer=8",
            "model.n_embd=64",
            "parallel.pp=2",
            "train.grad_accum=8",
        ];
        let c = Config::load(None, &sets.map(String::from)).unwrap();
        // A small vocabulary: the blocks dominate, an even split.
        let (_, even) = pp_plan(&c, 256).unwrap();
        assert_eq!(even, [4, 4]);
        // GPT-2's vocabulary: the head costs several blocks, so the last
        // stage gets fewer of them.
        let (_, skewed) = pp_plan(&c, 50257).unwrap();
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
