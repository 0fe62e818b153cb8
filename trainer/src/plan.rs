//! `weft plan`: the command-line side of [`weft_plan`] — the model from a
//! job configuration or from dimensions, the cluster from a preset, a file
//! or this machine ([`weft_plan::machine::MachineProfile`]), and the
//! table, JSON, explanation, budget and SVG plots — and `weft plan
//! --calibrate` ([`weft_plan::calibrate`]), whose layouts run here as
//! `weft train` jobs ([`Calibrator`]).

use std::path::{Path, PathBuf};

use weft_plan::calibrate::{self, Calibration, Job, Measured, Runner, Trial};
use weft_plan::launch::Launched;
use weft_plan::machine::MachineProfile;
use weft_plan::memory::Memory;
use weft_plan::search::{Constraints, search};
use weft_plan::{
    Accounting, Cluster, Layout, ModelSpec, Precision, Recipe, Request, ScheduleKind, Strategy,
};

use crate::config::{Config, ConfigError};
use crate::train::{Observer, RunInfo, StepReport, TrainError};

/// Errors of `weft plan`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The planner refused the request.
    #[error(transparent)]
    Plan(#[from] weft_plan::Error),
    /// The job configuration is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A calibration run failed.
    #[error("calibration run {layout}: {source}")]
    Train {
        /// The layout being run.
        layout: String,
        /// Why.
        source: Box<TrainError>,
    },
    /// Reading or writing a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Flags that do not go together, or a value out of range.
    #[error("{0}")]
    Usage(String),
}

/// `weft plan`'s options.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct PlanArgs {
    /// A `weft train` job file: the model, batch and precision come from it
    /// (flags below override them).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a key of the job, as `weft train --set` does.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The model's family (gpt2, llama, qwen3, mistral, qwen3-moe), whose
    /// defaults the dimension flags override, as `--set model.arch=...`
    /// with the flags as `model.*` keys would (default: GPT-2).
    #[arg(long)]
    pub arch: Option<String>,
    /// Key/value heads (grouped-query attention: a family other than GPT-2).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Transformer layers, L.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Channels, C.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Tokens per sequence, T.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Vocabulary, V.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Feed-forward width (default 4·hidden).
    #[arg(long, value_name = "F")]
    pub ffn_hidden: Option<usize>,
    /// Experts per layer (mixture of experts; 0: dense).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts per token.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Global batch, sequences per step.
    #[arg(long, value_name = "N")]
    pub global_batch: Option<usize>,
    /// GPUs (ranks) to plan for (default: the cluster file's count, 8 for
    /// a preset, the job's ranks on this machine).
    #[arg(long)]
    pub gpus: Option<usize>,
    /// The cluster: a preset (a100-80gb, a100-40gb, h100, h200), a TOML
    /// file, or `this-machine` (measured now).
    #[arg(long, value_name = "PRESET|FILE|this-machine", default_value = "h100")]
    pub cluster: String,
    /// What the ranks hold and compute: `mixed` (mixed precision on GPUs)
    /// or `weft` (weft's own run; the default on this machine).
    #[arg(long, value_name = "weft|mixed")]
    pub recipe: Option<String>,
    /// Arithmetic of the products: fp32, bf16, fp16 (default: bf16 on
    /// GPUs, the job's train.precision with `weft`).
    #[arg(long)]
    pub precision: Option<String>,
    /// GPU recipe: the attention scores are materialized (no fused flash
    /// attention), as in Megatron-LM 2021.
    #[arg(long)]
    pub materialized_attention: bool,
    /// Pin the data-parallel degree.
    #[arg(long)]
    pub dp: Option<usize>,
    /// Pin the tensor-parallel degree.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pin the pipeline stages.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Pin the expert-parallel degree.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pin the context-parallel degree (each sequence split over cp ranks).
    #[arg(long)]
    pub cp: Option<usize>,
    /// Pin the sharding: none, optimizer, grad_op, full, hybrid.
    #[arg(long)]
    pub fsdp: Option<String>,
    /// Ranks per sharding group with `--fsdp hybrid`.
    #[arg(long, value_name = "N")]
    pub hybrid_shard: Option<usize>,
    /// Pin the pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per stage for the interleaved schedule.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Pin the micro-batch size.
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Pin sequence parallelism on (`true`) or off (`false`).
    #[arg(long, value_name = "BOOL")]
    pub sp: Option<bool>,
    /// Pin activation recomputation: `none`, `selective`, `full` or `every:K`
    /// (`train.recompute`; default: try none, selective and full).
    #[arg(long, value_name = "POLICY")]
    pub recompute: Option<weft_model::Recompute>,
    /// Pin the loss in chunks of N tokens (`train.loss_chunk`; a multiple
    /// of 1024; 0: the whole micro-batch; default: try the whole
    /// micro-batch and, where a micro-batch holds more tokens, chunks of
    /// 1024).
    #[arg(long, value_name = "N")]
    pub loss_chunk: Option<usize>,
    /// Layouts to show (0: all).
    #[arg(long, default_value_t = 8)]
    pub top: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Walk the chain for this model: where plain data parallelism stops
    /// fitting, FSDP against it, the communication crossover and how batch
    /// and sparsity move it, tensor parallelism inside against across nodes.
    #[arg(long)]
    pub explain: bool,
    /// Write SVG plots (step time and its parts against GPUs per strategy;
    /// memory per GPU by layout) into this folder.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
    /// A compute budget in FLOPs: the Chinchilla-optimal size and tokens,
    /// and how long the best layout takes.
    #[arg(long, value_name = "FLOPS")]
    pub budget_flops: Option<f64>,
    /// A compute budget in GPU-hours of this cluster at the best layout's
    /// predicted throughput.
    #[arg(long, value_name = "HOURS")]
    pub budget_gpu_hours: Option<f64>,
    /// Measure this machine, predict the step time and memory of several
    /// `weft train` layouts of the job and run them: predicted against
    /// measured.
    #[arg(long)]
    pub calibrate: bool,
    /// Steps per calibration run (the first fifth is not timed).
    #[arg(long, default_value_t = 40)]
    pub calibrate_steps: u64,
    /// Calibration rounds: each measures the machine and runs every
    /// layout; the prediction uses the best measurement, the comparison
    /// each layout's quietest round.
    #[arg(long, default_value_t = 3)]
    pub calibrate_rounds: usize,
    /// With `--calibrate`: run the layouts as MPI jobs (`PREFIX -np N
    /// --map-by ppr:P:node weft train`, Open MPI) on the nodes of
    /// `scripts/cluster.sh`, which share this machine's cores, and measure
    /// their links (weft built `--features mpi`).
    #[arg(long, value_name = "PREFIX", requires = "calibrate")]
    pub launch: Option<String>,
    /// With `--launch`: the cluster's nodes (the crossover runs pure FSDP
    /// on 1, 2, 4 … of them).
    #[arg(long, default_value_t = 2, requires = "launch", value_parser = clap::value_parser!(u64).range(2..))]
    pub nodes: u64,
    /// Print the link between the two ranks of this MPI job as JSON
    /// (what `--calibrate --launch` starts).
    #[arg(long, hide = true)]
    pub probe_link: bool,
    /// Print the published Megatron-LM runs (Narayanan et al. 2021, Table 1)
    /// against the planner's predictions.
    #[arg(long)]
    pub published: bool,
}

/// The model a job trains (every `model.arch`: the Llama-like families'
/// grouped-query heads, head size, SwiGLU width, QK-norm and windows).
///
/// # Errors
/// [`PlanError::Config`] when the synthetic corpus' settings are wrong.
pub fn model_of(config: &Config) -> Result<ModelSpec, PlanError> {
    let vocab = match config.data.token_ids() {
        Ok(ids) => ids.vocab_size,
        Err(weft_data::DataError::Synthetic(e)) => {
            let key = format!("data.synthetic.{}", e.field);
            return Err(ConfigError::key(&key, e.problem).into());
        }
        Err(e) => return Err(ConfigError::key("data", e.to_string()).into()),
    };
    let m = &config.model;
    let cfg = m.gpt_config(vocab);
    let mut spec = ModelSpec::gpt(m.n_layer, m.n_embd, m.n_head, m.block_size, cfg.vocab_size);
    if let Some(gated) = m.swiglu() {
        spec = spec.with_llama_block(cfg.n_kv_head(), gated.hidden);
        (spec.head_dim, spec.qk_norm) = (m.head_dim, cfg.arch.qk_norm);
    }
    spec.tied_embeddings = cfg.tied_embeddings;
    if let Some(w) = cfg.arch.sliding_window {
        spec = spec.with_window(w.window, w.global_every.unwrap_or(0));
    }
    if m.moe.experts > 0 {
        spec = spec.with_moe(m.moe.experts, m.moe.top_k);
        spec.shared_experts = m.moe.shared_experts;
        spec.expert_hidden = m.moe.expert_hidden;
        spec.first_dense = m.first_dense;
    }
    Ok(spec)
}

/// The feed-forward blocks a job's pipeline partition costs
/// (`weft_model::partition_layers`, whose stages `weft plan` predicts).
#[must_use]
pub fn feed_forwards(config: &Config) -> weft_pipeline::FeedForwards {
    use weft_pipeline::FfnShape;
    let (m, e) = (&config.model, &config.model.moe);
    let dense = m.swiglu().map(|s| FfnShape::swiglu(s.hidden));
    // experts as wide as the dense block unless set apart (0: GPT-2's 4·C)
    let width = if e.expert_hidden > 0 {
        e.expert_hidden
    } else {
        dense.map_or(0, |d| d.hidden)
    };
    let expert = if dense.is_some() {
        FfnShape::swiglu(width)
    } else {
        FfnShape::mlp(width)
    };
    weft_pipeline::FeedForwards {
        dense,
        moe: (e.experts > 0).then(|| expert.experts(e.experts, e.active_experts())),
        first_dense: m.first_dense,
    }
}

/// The layout a job runs: its `[parallel]` table and micro-batch size.
///
/// # Errors
/// [`PlanError::Config`] when the batch does not split over the layout.
pub fn layout_of(config: &Config) -> Result<Layout, PlanError> {
    Ok(Layout {
        parallel: config.parallel,
        micro_batch_size: config.batch_split()?.micro,
        recompute: config.train.recompute,
        loss_chunk: config.train.loss_chunk,
    })
}

/// What a job's ranks hold and compute.
#[must_use]
pub fn recipe_of(config: &Config) -> Recipe {
    let mut r = Recipe::weft(config.train.precision);
    r.bf16_grad_wire = config.parallel.grad_wire == weft_numerics::Dtype::BF16;
    r.muon = config.optim.name == weft_kernels::Optimizer::Muon;
    r
}

/// Collects a run's start-up report and step times.
#[derive(Default)]
struct Recorder {
    info: Option<RunInfo>,
    steps: Vec<f64>,
}

impl Observer for Recorder {
    fn start(&mut self, info: &RunInfo) {
        self.info = Some(info.clone());
    }
    fn step(&mut self, report: &StepReport) {
        if let Some(info) = &self.info {
            self.steps
                .push(info.tokens_per_step as f64 / report.record.tokens_per_s);
        }
    }
}

/// Runs `config` for `steps` steps in a scratch folder under `dir` and
/// measures its step time and memory.
///
/// # Errors
/// [`PlanError::Train`] if the run fails.
pub fn run_layout(config: &Config, steps: u64, dir: &Path) -> Result<Measured, PlanError> {
    let mut cfg = config.clone();
    cfg.train.steps = steps;
    cfg.train.eval_every = 0;
    cfg.train.eval_sequences = 1;
    cfg.checkpoint.every = 0;
    cfg.run.dir = dir.to_owned();
    cfg.run.name = format!("calibrate-{}", layout_name(config));
    cfg.run.trace_steps = 0;
    let mut rec = Recorder::default();
    let layout = layout_name(config);
    crate::train::train(&cfg, false, &mut rec).map_err(|e| PlanError::Train {
        layout: layout.clone(),
        source: Box::new(e),
    })?;
    let _ = std::fs::remove_dir_all(dir.join(&cfg.run.name));
    let info = rec
        .info
        .ok_or_else(|| PlanError::Usage(format!("{layout}: no start-up report")))?;
    let m = info.memory;
    let memory = Memory {
        params: m.params as u64,
        grads: m.grads as u64,
        optimizer: m.optimizer as u64,
        activations: m.activations as u64,
        buffers: m.comm as u64,
    };
    Measured::of_run(&rec.steps, memory)
        .ok_or_else(|| PlanError::Usage(format!("{layout}: no step was timed")))
}

/// `--calibrate`'s runner: each layout a `weft train` job over `base`,
/// run in-process in a scratch folder.
pub struct Calibrator {
    /// The job the layouts' settings apply to.
    pub base: Config,
    /// Where the runs' folders go (each removed after its run).
    pub dir: PathBuf,
}

impl Runner for Calibrator {
    type Error = PlanError;

    fn job(&mut self, trial: &Trial) -> Result<Job, PlanError> {
        job_of(&self.base, trial)
    }

    fn run(&mut self, job: &Job, steps: u64) -> Result<Measured, PlanError> {
        let mut cfg = self.base.clone();
        for s in &job.sets {
            cfg = cfg.with_override(s)?;
        }
        run_layout(&cfg, steps, &self.dir)
    }
}

/// The job `trial` makes of `base`, checked: on nodes, every rank's pool
/// is its share of this machine's cores (the nodes' ranks share them).
fn job_of(base: &Config, trial: &Trial) -> Result<Job, PlanError> {
    let mut cfg = base.clone();
    for s in &trial.sets {
        cfg = cfg.with_override(s)?;
    }
    cfg.validate()?;
    let layout = layout_of(&cfg)?;
    let threads = if trial.per_node > 0 && cfg.parallel.threads == 0 {
        (crate::ranks::cores() / layout.world()).max(1)
    } else {
        crate::ranks::threads_per_rank(layout.world(), cfg.parallel.threads)
    };
    Ok(Job {
        sets: trial.sets.clone(),
        threads,
        layout,
        batch: cfg.train.batch_size,
        recipe: recipe_of(&cfg),
        per_node: trial.per_node,
    })
}

/// `weft plan --probe-link`: the link between the two ranks of this MPI
/// job, as JSON on rank 0's standard output.
///
/// # Errors
/// No MPI job, or not of two ranks; the measurement's collectives.
pub fn probe_link(reproducible: bool) -> Result<String, PlanError> {
    let procs = crate::ranks::connect().map_err(|e| usage(e.to_string()))?;
    let link = weft_plan::machine::link_between(procs.world(), reproducible)
        .map_err(|e| usage(format!("measuring the link: {e}")))?;
    let json = serde_json::to_string(&link).unwrap_or_default();
    Ok(if procs.rank() == 0 {
        json
    } else {
        String::new()
    })
}

/// `weft plan --calibrate` of the job `base`: [`weft_plan::calibrate`]
/// over [`calibrate::layouts`], each run [`Calibrator`]'s way; with a
/// launcher `prefix`, over [`calibrate::node_layouts`] of `nodes` nodes,
/// each an MPI job ([`Launched`]).
///
/// # Errors
/// The job's or a layout's configuration; the planner's; a run's.
pub fn calibrate(
    base: &Config,
    steps: u64,
    rounds: usize,
    launch: Option<(&str, usize)>,
    say: &mut dyn FnMut(&str),
) -> Result<Calibration, PlanError> {
    let model = model_of(base)?;
    let tokens = base
        .batch_split()
        .map_or(model.seq, |b| b.micro * model.seq);
    let plan = calibrate::Plan {
        model,
        tokens,
        reproducible: base.parallel.reproducible,
        layouts: match launch {
            Some((_, nodes)) => calibrate::node_layouts(nodes),
            None => calibrate::layouts(),
        },
        steps,
        rounds,
    };
    let dir = std::env::temp_dir().join(format!("weft-plan-calibrate-{}", std::process::id()));
    let cal = if let Some((prefix, _)) = launch {
        let tokens = (base.train.batch_size * base.model.block_size) as f64;
        let job = |t: &Trial| job_of(base, t).map_err(|e| weft_plan::Error::Launch(e.to_string()));
        let (toml, exact) = (base.to_toml(), base.parallel.reproducible);
        let r = Launched::new(prefix, &dir, &toml, tokens, exact, job);
        r.and_then(|mut r| calibrate::calibrate(&mut r, &plan, say))
            .map_err(PlanError::from)
    } else {
        let mut runner = Calibrator {
            base: base.clone(),
            dir: dir.clone(),
        };
        calibrate::calibrate(&mut runner, &plan, say)
    };
    let _ = std::fs::remove_dir_all(&dir);
    cal
}

fn layout_name(config: &Config) -> String {
    layout_of(config).map_or_else(
        |_| "layout".into(),
        |l| l.to_string().replace([' ', '/'], "_"),
    )
}

fn usage(msg: impl Into<String>) -> PlanError {
    PlanError::Usage(msg.into())
}

/// With `--arch` (or `--kv-heads`), the dimension flags as the job's
/// `model.*` keys: the family's defaults fill in the rest.
fn arch_sets(args: &PlanArgs) -> Vec<String> {
    if args.arch.is_none() && args.kv_heads.is_none() {
        return Vec::new();
    }
    let gpt2 = args.arch.as_deref().is_none_or(|a| a == "gpt2");
    let flags = [
        ("n_layer", args.layers),
        ("n_embd", args.hidden),
        ("n_head", args.heads),
        ("block_size", args.seq),
        ("vocab_size", args.vocab),
        ("n_kv_head", args.kv_heads),
        // GPT-2's MLP width is no key of the job (the flag sets it below)
        ("ffn_hidden", args.ffn_hidden.filter(|_| !gpt2)),
        ("moe.experts", args.experts),
        ("moe.top_k", args.top_k),
    ];
    let arch = args.arch.iter().map(|a| format!("model.arch={a:?}"));
    let keys = flags.map(|(k, v)| v.map(|v| format!("model.{k}={v}")));
    arch.chain(keys.into_iter().flatten()).collect()
}

/// The request `args` describe (the model, batch, cluster and recipe),
/// and the job configuration when one is given.
///
/// # Errors
/// A bad configuration, cluster file or preset, or a missing dimension.
pub fn request(args: &PlanArgs) -> Result<(Request, Option<Config>), PlanError> {
    let job = args.config.is_some() || !args.sets.is_empty();
    let family = args.arch.is_some() || args.kv_heads.is_some();
    // without a job, the dimensions are required (any family)
    let need = |v: Option<usize>, flag: &str| {
        v.ok_or_else(|| usage(format!("{flag} is required without --config (the model's dimensions: --layers --hidden --heads --seq --vocab)")))
    };
    let dims = if job {
        None
    } else {
        Some(ModelSpec::gpt(
            need(args.layers, "--layers")?,
            need(args.hidden, "--hidden")?,
            need(args.heads, "--heads")?,
            need(args.seq, "--seq")?,
            need(args.vocab, "--vocab")?,
        ))
    };
    let sets: Vec<String> = args.sets.iter().cloned().chain(arch_sets(args)).collect();
    let config = if job || family {
        Some(Config::load(args.config.as_deref(), &sets)?)
    } else {
        None
    };
    let mut model = match (&config, dims) {
        (Some(c), _) => model_of(c)?,
        (None, d) => d.ok_or_else(|| usage("--config or the model's dimensions"))?,
    };
    if let Some(v) = args.layers {
        model.layers = v;
    }
    if let Some(v) = args.hidden {
        model.hidden = v;
        if !model.swiglu {
            model.ffn_hidden = 4 * v;
        }
    }
    if let Some(v) = args.heads {
        model.heads = v;
    }
    if let Some(v) = args.seq {
        model.seq = v;
    }
    if let Some(v) = args.vocab {
        model.vocab = v;
    }
    if let Some(v) = args.ffn_hidden {
        model.ffn_hidden = v;
    }
    if let Some(e) = args.experts {
        model.experts = e;
        if model.top_k == 0 && e > 0 {
            model.top_k = 2;
        }
    }
    if let Some(k) = args.top_k {
        model.top_k = k;
    }
    model.validate()?;
    // with --arch alone, nothing but the model comes from a job
    let config = config.filter(|_| job);
    let batch = match (args.global_batch, &config) {
        (Some(b), _) => b,
        (None, Some(c)) => c.train.batch_size,
        (None, None) => return Err(usage("--global-batch is required without --config")),
    };
    if args.gpus == Some(0) {
        return Err(usage("--gpus 0: plan for at least 1 GPU (rank)"));
    }
    let this_machine = args.cluster == "this-machine";
    let cluster = if this_machine {
        let ranks = args
            .gpus
            .or_else(|| config.as_ref().map(|c| c.parallel.world_size()))
            .unwrap_or(1);
        let reproducible = config.as_ref().is_none_or(|c| c.parallel.reproducible);
        // the products of this model, at a micro-batch of one rank's share
        let tokens = (batch / ranks).clamp(1, 16) * model.seq;
        MachineProfile::measure(&model, tokens.min(4096), reproducible).cluster(ranks)
    } else if args.cluster.ends_with(".toml") || Path::new(&args.cluster).is_file() {
        let c = Cluster::from_file(Path::new(&args.cluster))?;
        match args.gpus {
            Some(g) => c.with_gpus(g),
            None => c,
        }
    } else {
        Cluster::preset(&args.cluster, args.gpus.unwrap_or(8))?
    };
    let accounting = match args.recipe.as_deref() {
        Some("weft") => Accounting::Weft,
        Some("mixed") => Accounting::Mixed,
        Some(other) => return Err(usage(format!("--recipe {other}: expected weft or mixed"))),
        None if cluster.device.shares_machine() => Accounting::Weft,
        None => Accounting::Mixed,
    };
    let mut recipe = match accounting {
        Accounting::Weft => config
            .as_ref()
            .map_or(Recipe::weft(Precision::F32), recipe_of),
        Accounting::Mixed => Recipe {
            // a job file's optimizer counts on any cluster
            muon: config.as_ref().is_some_and(|c| recipe_of(c).muon),
            ..Recipe::mixed()
        },
    };
    if let Some(p) = &args.precision {
        recipe.precision = p
            .parse()
            .map_err(|_| usage(format!("--precision {p}: expected fp32, bf16 or fp16")))?;
    }
    if args.materialized_attention {
        recipe.flash_attention = false;
    }
    Ok((
        Request {
            model,
            batch,
            cluster,
            recipe,
        },
        config,
    ))
}

fn constraints(args: &PlanArgs) -> Result<Constraints, PlanError> {
    let fsdp = match args.fsdp.as_deref() {
        None => None,
        Some("none") => Some(None),
        Some(name) => {
            let s: Strategy = name.parse().map_err(|_| {
                usage(format!(
                    "--fsdp {name}: expected none, optimizer, grad_op, full or hybrid"
                ))
            })?;
            if s == Strategy::Hybrid && args.hybrid_shard.is_none() {
                return Err(usage("--fsdp hybrid needs --hybrid-shard N"));
            }
            Some(Some(s))
        }
    };
    let schedule = match args.schedule.as_deref() {
        None => None,
        Some(name) => Some(name.parse::<ScheduleKind>().map_err(|_| {
            usage(format!(
                "--schedule {name}: expected gpipe, 1f1b, interleaved, zb-h1, zb-h2 or zb-v"
            ))
        })?),
    };
    if let Some(n) = args.loss_chunk
        && let Err(e) = weft_model::GptBlocks::check_loss_chunk(n)
    {
        return Err(usage(format!("--loss-chunk {n}: {e}")));
    }
    Ok(Constraints {
        dp: args.dp,
        tp: args.tp,
        pp: args.pp,
        ep: args.ep,
        cp: args.cp,
        fsdp,
        hybrid_shard: args.hybrid_shard,
        schedule,
        pp_chunks: args.chunks,
        micro_batch_size: args.micro_batch,
        sequence_parallel: args.sp,
        recompute: args.recompute,
        loss_chunk: args.loss_chunk,
        max_micro_batch: None,
    })
}

/// Runs `weft plan` and returns what it prints; `say` receives progress.
///
/// # Errors
/// Bad flags, configuration or cluster; the planner's errors; a failed
/// calibration run; a plot that cannot be written.
pub fn run(args: &PlanArgs, say: &mut dyn FnMut(&str)) -> Result<String, PlanError> {
    if args.published {
        let a100 = Cluster::preset("a100-80gb", 8)?;
        let rows = weft_plan::published::compare(&weft_plan::published::MEGATRON_2021, &a100)?;
        if args.json {
            return Ok(serde_json::to_string_pretty(&rows).unwrap_or_default());
        }
        let worst = rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
        return Ok(format!(
            "Narayanan et al. 2021 (Megatron-LM), Table 1, on the a100-80gb preset:\n\n{}\nworst error {:.1}%\n\nPublished configurations, parameters counted:\n\n{}",
            weft_plan::published::table(&rows),
            100.0 * worst,
            weft_plan::published::models_table(&weft_plan::published::models())
        ));
    }
    if args.probe_link {
        let base = Config::load(args.config.as_deref(), &args.sets)?;
        return probe_link(base.parallel.reproducible);
    }
    if args.calibrate {
        let base = Config::load(args.config.as_deref(), &args.sets)?;
        let cal = calibrate(
            &base,
            args.calibrate_steps.max(5),
            args.calibrate_rounds.max(1),
            args.launch.as_deref().map(|p| (p, args.nodes as usize)),
            say,
        )?;
        if args.json {
            return Ok(serde_json::to_string_pretty(&cal).unwrap_or_default());
        }
        return Ok(calibrate::table(&cal));
    }
    let (req, _) = request(args)?;
    let c = constraints(args)?;
    let preds = search(&req, &c)?;
    let explanation = if args.explain {
        Some(weft_plan::explain::explain(&req)?)
    } else {
        None
    };
    let best = preds.iter().find(|p| p.fits).unwrap_or(&preds[0]);
    let budget = match (args.budget_flops, args.budget_gpu_hours) {
        (Some(_), Some(_)) => {
            return Err(usage("give --budget-flops or --budget-gpu-hours, not both"));
        }
        (Some(f), None) if f.is_finite() && f > 0.0 => Some(weft_plan::budget::report(
            f,
            req.model.params(),
            best.tokens_per_s,
            req.cluster.gpus,
        )),
        (None, Some(h)) if h.is_finite() && h > 0.0 => {
            // the GPU-hours deliver the best layout's model FLOP/s per GPU
            let flops = h * 3600.0 * best.tflops_per_gpu * 1e12;
            Some(weft_plan::budget::report(
                flops,
                req.model.params(),
                best.tokens_per_s,
                req.cluster.gpus,
            ))
        }
        (None, None) => None,
        _ => return Err(usage("a budget must be a positive number")),
    };
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).map_err(|source| PlanError::Io {
            path: dir.clone(),
            source,
        })?;
        let fsdp = explanation.as_ref().map_or_else(
            || weft_plan::explain::crossover(&req, &req.model, req.batch),
            |e| e.crossover.clone(),
        );
        let top = if args.top == 0 {
            preds.len()
        } else {
            args.top.min(preds.len())
        };
        for (name, svg) in [
            (
                "step_time.svg",
                weft_plan::svg::step_time_plot(&weft_plan::svg::strategies(&req), &fsdp),
            ),
            ("memory.svg", weft_plan::svg::memory_plot(&preds[..top])),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, svg).map_err(|source| PlanError::Io {
                path: path.clone(),
                source,
            })?;
            say(&format!("wrote         {}", path.display()));
        }
    }
    if args.json {
        return Ok(weft_plan::report::json(
            &req,
            &preds,
            args.top,
            explanation.as_ref(),
            budget.as_ref(),
        ));
    }
    let mut s = weft_plan::report::table(&req, &preds, args.top);
    if let Some(e) = &explanation {
        s.push_str(&format!("\nThe chain for this model:\n{e}\n"));
    }
    if let Some(b) = &budget {
        s.push('\n');
        s.push_str(&weft_plan::report::budget_text(b, best));
    }
    Ok(s)
}
