//! Building a rank's model for each attempt at a run — the CPU's
//! [`ParallelGpt`] on the job's mesh, or (feature `cuda`) the GPU's
//! `CudaGpt` — and what the start-up report says about it; then the
//! attempts themselves, rewound as often as the run needs and may.

use std::path::Path;
use std::sync::Arc;

use weft_collectives::Communicator;
use weft_kernels::Precision;
use weft_model::{FeedForward, GptConfig, Init, ParallelGpt, ParallelPlan, TrainModel};

use crate::config::Config;
use crate::ranks::agree;
use crate::run::experts::MoeRun;
use crate::run::setup::{Job, check_memory};
use crate::run::{Attempt, Start};
use crate::train::{Observer, RunInfo, Summary, TrainError};

/// A rank's model, built for one attempt, and what the start-up report
/// says about where it runs.
pub(crate) struct Built<M> {
    /// The model.
    pub model: M,
    /// Its shape (recorded in checkpoints).
    pub gpt: GptConfig,
    /// Its mixture of experts, if any.
    pub moe: Option<MoeRun>,
    /// The first of this rank's micro-batches of a step's batch.
    pub first_micro: usize,
    /// The report's lines about the layout, the device and the memory
    /// predicted (the rest of the report is filled by [`Self::info`]).
    pub report: RunInfo,
}

impl<M: TrainModel> Built<M> {
    /// The start-up report of the run in `run_dir`.
    pub(crate) fn info(&self, job: &Job<'_>, run_dir: &Path) -> RunInfo {
        let config = job.config;
        let t = &config.train;
        let layout = self.model.whole_layout();
        let memory = self.model.memory();
        RunInfo {
            run_dir: run_dir.to_owned(),
            precision: t.precision,
            arch: arch_name(config),
            params: layout.len(),
            vocab: model_config(config, job.data.vocab_size()).vocab_size,
            tokens_per_step: t.batch_size * config.model.block_size,
            micro_batches: config
                .batch_split()
                .map(|b| b.describe())
                .unwrap_or_default(),
            flops_per_token: flops_per_token(config, layout),
            floor: job.data.val_floor(t.eval_sequences),
            steps: t.steps,
            activation_bytes: memory.activations,
            data_shares: job.data.shares(t.steps * t.batch_size as u64),
            doc_mask: config.data.doc_mask,
            checkpoint_every: config.checkpoint.every,
            checkpoint_background: config.checkpoint.background,
            checkpoint_bytes: self.model.owned_bytes().unwrap_or(0),
            memory,
            ..self.report.clone()
        }
    }
}

/// Training FLOPs per token of a model with parameter layout `layout`
/// ([`RunInfo::flops_per_token`]): 6 per parameter a token is multiplied
/// by — not the position table, and of the routed experts only the k of
/// E a token is sent to — plus `6·L·T·Cq` for causal attention (`Cq`
/// the query width, `C` but for a head size set apart; a sliding-window
/// layer counts the `W − W²/(2T)` keys a query sees instead of `T/2`).
#[allow(clippy::cast_precision_loss)]
fn flops_per_token(config: &Config, layout: &weft_model::ParamLayout) -> f64 {
    let m = &config.model;
    let moe_active = |name: &str| {
        if m.moe.experts > 0 && name.contains(".mlp.experts.") {
            m.moe.top_k as f64 / m.moe.experts as f64
        } else {
            1.0
        }
    };
    let matmul_params: f64 = layout
        .specs()
        .iter()
        .filter(|p| p.name != "transformer.wpe.weight")
        .map(|p| p.numel() as f64 * moe_active(&p.name))
        .sum();
    // 12·Cq per key a query attends to (T/2 causal; fewer in a window)
    let cfg = model_config(config, 1);
    let keys: f64 = (0..m.n_layer)
        .map(|l| weft_pipeline::attended_keys(m.block_size, cfg.window(l)))
        .sum();
    6.0 * matmul_params + 12.0 * cfg.q_dim() as f64 * keys
}

/// The model configuration a job trains.
#[must_use]
pub fn model_config(config: &Config, vocab: usize) -> GptConfig {
    config.model.gpt_config(vocab)
}

/// The model's family for the start-up report, with what sets its block
/// apart: grouped-query heads, the gated MLP's width, a window.
fn arch_name(config: &Config) -> String {
    let m = &config.model;
    let mut name = m.arch.name().to_owned();
    if let Some(dir) = &m.init_from {
        name = format!("{name} from {}", dir.display());
    }
    let Some(gated) = m.swiglu() else {
        return name;
    };
    let g = m.gpt_config(1);
    let mut parts = vec![format!("SwiGLU {}", gated.hidden)];
    if g.n_kv_head() != g.n_head {
        parts.insert(0, format!("GQA {}/{}", g.n_head, g.n_kv_head()));
    }
    if let Some(w) = g.arch.sliding_window {
        parts.push(match w.global_every {
            Some(k) => format!("window {} (every {k}th layer global)", w.window),
            None => format!("window {}", w.window),
        });
    }
    format!("{name} ({})", parts.join(", "))
}

/// The layout's name in the start-up report: the `[parallel]` layout and
/// the precision.
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

/// This rank's feed-forward block: GPT-2's MLP, or the mixture of experts
/// (its experts shared out over the mesh's expert group with `ep > 1`)
/// with its statistics handle.
fn rank_ffn(
    config: &Config,
    cfg: &GptConfig,
    mesh: &weft_parallel::ParallelMesh,
) -> Result<(Arc<dyn FeedForward>, Option<MoeRun>), TrainError> {
    let m = &config.model.moe;
    let group = (mesh.dims().ep > 1).then(|| weft_model::expert_group(mesh));
    let (ffn, stats) = config.model.ffn(group)?;
    let Some(stats) = stats else {
        return Ok((ffn, None));
    };
    let run = MoeRun {
        stats,
        layers: cfg.n_layer,
        first_dense: config.model.first_dense,
        experts: m.experts,
        balancer: m.bias_balancer(),
    };
    Ok((ffn, Some(run)))
}

/// The model's parallelization plan for this job
/// ([`ParallelPlan::new`] of its `[parallel]` layout).
fn plan(job: &Job<'_>, cfg: &GptConfig) -> Result<ParallelPlan, TrainError> {
    let config = job.config;
    Ok(ParallelPlan {
        recompute: config.train.recompute,
        loss_chunk: config.train.loss_chunk,
        ..ParallelPlan::new(
            cfg,
            &config.parallel,
            crate::plan::feed_forwards(config),
            config.batch_split()?,
            config.train.precision,
            config.data.doc_boundary(job.data.end_of_text()),
        )?
    })
}

/// How the ranks run, for the start-up report.
fn backend_line(job: &Job<'_>, dims: weft_parallel::ParallelDims) -> String {
    let pool = crate::ranks::threads_per_rank(dims.world_size(), job.config.parallel.threads);
    let kernels = format!(
        "{pool} kernel thread{} each",
        if pool == 1 { "" } else { "s" }
    );
    match job.processes {
        None if dims.world_size() == 1 => format!("one rank of this process, {kernels}"),
        None => format!(
            "{} ranks, threads of this process, {kernels}",
            dims.world_size()
        ),
        Some(p) => {
            let mut line = p.describe();
            for (first, hosts) in weft_collectives::processes::split_groups(p.hosts(), dims.tp) {
                line.push_str(&format!(
                    "; warning: the tensor-parallel group of ranks {first}-{} spans hosts {} (place {} consecutive ranks per host)",
                    first + dims.tp - 1,
                    hosts.join(", "),
                    dims.tp
                ));
            }
            line
        }
    }
}

/// This rank's part of the model on the job's mesh: built from the plan
/// after the memory it will hold was predicted and checked against the
/// machine's (every rank initialises only its part: the values the whole
/// model has there, as one rank's run starts from). Collective over
/// `world`.
///
/// # Errors
/// The model's and the plan's; [`TrainError::OutOfMemory`].
pub(crate) fn build_cpu(
    job: &Job<'_>,
    world: &dyn Communicator,
) -> Result<Built<ParallelGpt>, TrainError> {
    let config = job.config;
    let dims = config.parallel.dims();
    let mesh = dims.build(world)?;
    let cfg = model_config(config, job.data.vocab_size());
    let (ffn, moe) = agree(world, rank_ffn(config, &cfg, &mesh))?;
    let plan = agree(world, plan(job, &cfg))?;
    // What every rank will hold, before any of it is allocated: a run
    // that cannot fit is refused here, with what dominates.
    let predict = |plan: &ParallelPlan| {
        ParallelGpt::predict_memory(&cfg, ffn.clone(), plan, &mesh).map_err(TrainError::from)
    };
    let predicted = agree(world, predict(&plan))?;
    // in bf16, the activations the same layout would plan in fp32
    let fp32_activations = if plan.precision == Precision::Bf16 {
        let fp32 = ParallelPlan {
            precision: Precision::F32,
            ..plan.clone()
        };
        Some(agree(world, predict(&fp32))?.activations)
    } else {
        None
    };
    // with recomputation, the activations the same layout keeps without
    let without_recompute = if plan.recompute == weft_model::Recompute::None {
        None
    } else {
        let none = ParallelPlan {
            recompute: weft_model::Recompute::None,
            ..plan.clone()
        };
        Some((plan.recompute, agree(world, predict(&none))?.activations))
    };
    let hosts = job
        .processes
        .map(weft_collectives::processes::Processes::hosts);
    agree(world, check_memory(config, world, hosts, &predicted))?;
    let first_micro = mesh.coords().dp() * config.batch_split()?.per_rank;
    let init = match job.init {
        Some(whole) => Init::Whole(whole),
        None => Init::Gpt2 {
            seed: config.train.seed,
        },
    };
    let mut model = agree(
        world,
        ParallelGpt::new(cfg.clone(), ffn, init, &plan, mesh).map_err(TrainError::from),
    )?;
    let muon = match config.optim.name {
        weft_kernels::Optimizer::Muon => {
            let cost = model.use_muon(config.optim.muon_ns_steps);
            Some(agree(world, cost.map_err(TrainError::from))?)
        }
        weft_kernels::Optimizer::AdamW => None,
    };
    let host_of = |r: usize| {
        job.processes
            .and_then(|p| p.hosts().get(r))
            .map_or_else(String::new, |h| format!(" on {h}"))
    };
    let shape: Vec<String> = dims
        .mesh_dims()
        .iter()
        .map(|(n, s)| format!("{n}={s}"))
        .collect();
    let report = RunInfo {
        predicted_memory: predicted,
        fp32_activation_bytes: fp32_activations,
        without_recompute,
        loss_chunk: match model.stages().first().filter(|_| plan.loss_chunk > 0) {
            Some(s) => Some(s.blocks().head_bytes(plan.batch, plan.seq)?),
            None => None,
        }
        .map(|(held, whole)| (plan.loss_chunk, held, whole)),
        layout: layout_name(config),
        mesh: format!("{} (tp innermost)", shape.join(" × ")),
        coords: (0..dims.world_size())
            .map(|r| format!("rank {r}: {}{}", dims.coords_of(r), host_of(r)))
            .collect(),
        backend: backend_line(job, dims),
        muon,
        peak_flops: if world.rank() == 0 {
            job.peak
        } else {
            f64::NAN
        },
        peak_source: if job
            .processes
            .is_some_and(|p| weft_collectives::processes::node_map(p.hosts()).len() > 1)
        {
            "measured on every node".into()
        } else {
            "measured on this machine".into()
        },
        ..RunInfo::default()
    };
    Ok(Built {
        model,
        gpt: cfg,
        moe,
        first_micro,
        report,
    })
}

/// One rank's run on world communicator `world` (see [`attempts`]).
///
/// # Errors
/// As [`crate::train::train`].
pub(crate) fn run_rank(
    job: &Job<'_>,
    world: &dyn Communicator,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    attempts(job, world, observer, build_cpu)
}

/// The run's attempts on this rank, each with a model `build` makes: the
/// first from the job's start, then, after each rewind (`train.rewind`),
/// from the newest checkpoint saved (or the start without one), the
/// skipped batches carried over.
///
/// # Errors
/// The first attempt that fails.
pub(crate) fn attempts<M: TrainModel>(
    job: &Job<'_>,
    world: &dyn Communicator,
    observer: &mut dyn Observer,
    mut build: impl FnMut(&Job<'_>, &dyn Communicator) -> Result<Built<M>, TrainError>,
) -> Result<Summary, TrainError> {
    let mut start = if job.resume {
        Start::Resume
    } else {
        Start::New
    };
    let mut skips = None;
    loop {
        let built = build(job, world)?;
        match crate::run::attempt(job, world, built, observer, start, &mut skips)? {
            Attempt::Finished(summary) => return Ok(*summary),
            Attempt::Rewind { to } => start = Start::Rewind { checkpoint: to > 0 },
        }
    }
}

/// The GPU path (`train.device = "cuda:N"`, feature `cuda`): the dense
/// GPT-2 on one GPU as one rank of this process, through the same loop.
#[cfg(feature = "cuda")]
mod gpu {
    use weft_collectives::{Communicator, LocalCluster};
    use weft_kernels::Mode;
    use weft_kernels::cuda::Gpu;
    use weft_model::cuda::CudaGpt;
    use weft_model::{Gpt, RankMemory};

    use super::{Built, RunInfo, layout_name, model_config};
    use crate::config::{Config, Device};
    use crate::run::faults::FaultPlan;
    use crate::run::setup::{Job, check_device, check_model_floor, device_error, gib};
    use crate::train::{Observer, RunOptions, Summary, TrainError};

    /// Runs the job on GPU `N` of `train.device = "cuda:N"`, as one rank
    /// of this process.
    ///
    /// # Errors
    /// As [`crate::train::train`]; a configuration error naming the key
    /// the GPU path does not support, or `train.device` when the GPU
    /// cannot be used; [`TrainError::Backend`] under a launcher of several
    /// processes; [`TrainError::OutOfMemory`] when the model does not fit
    /// the GPU.
    pub(crate) fn start_gpu(
        config: &Config,
        opts: &RunOptions,
        observer: &mut dyn Observer,
    ) -> Result<Summary, TrainError> {
        config.validate()?;
        check_device(config)?;
        if let Some(env) = weft_collectives::processes::LauncherEnv::detect()
            && env.size > 1
        {
            return Err(TrainError::Backend(format!(
                "train.device = \"{}\" trains as one rank, but {} started {} processes: start weft once, without the launcher",
                config.train.device.name(),
                env.launcher,
                env.size
            )));
        }
        // the host holds the parameters and moments at checkpoints
        check_model_floor(config)?;
        let data = weft_data::Dataset::open(&config.data, &config.dataset_options())?;
        let init = crate::run::setup::initial_params(config, &data)?;
        let faults = FaultPlan::new(&opts.faults);
        let job = Job {
            config,
            resume: opts.resume,
            peak: f64::NAN,
            data: &data,
            faults: &faults,
            processes: None,
            init: init.as_deref(),
        };
        super::attempts(&job, &LocalCluster::single(), observer, build_gpu)
    }

    /// The model on the GPU, initialised as a single CPU rank's.
    fn build_gpu(job: &Job<'_>, _world: &dyn Communicator) -> Result<Built<CudaGpt>, TrainError> {
        let config = job.config;
        let Device::Cuda(ordinal) = config.train.device else {
            return Err(device_error("the GPU path needs a CUDA device".into()));
        };
        let gpu = Gpu::new(ordinal).map_err(|e| device_error(format!("`cuda:{ordinal}`: {e}")))?;
        let t = &config.train;
        let split = config.batch_split()?;
        let seq = config.model.block_size;
        let cfg = model_config(config, job.data.vocab_size());
        let mut host = Gpt::new(cfg.clone())?;
        match job.init {
            Some(whole) => host.params.copy_from_slice(whole),
            None => host.init_gpt2(t.seed),
        }
        let device = format!("{} ({})", t.device.name(), gpu.name());
        let (peak, peak_source) = datasheet_peak(gpu.name(), t.precision);
        let predicted = CudaGpt::predict_memory(&host, split.micro, seq, t.precision);
        check_gpu_memory(&gpu, &device, &predicted)?;
        let hp = config.optim.at(config.optim.lr);
        let model = CudaGpt::new(
            gpu,
            &host,
            split.micro,
            seq,
            hp,
            Mode::Throughput,
            t.precision,
        )?;
        let report = RunInfo {
            predicted_memory: predicted,
            layout: format!("{} on {device}", layout_name(config)),
            mesh: "one GPU".into(),
            coords: vec![format!("rank 0: {device}")],
            backend: format!("one thread of this process, computing on {device}"),
            peak_flops: peak,
            peak_source,
            ..RunInfo::default()
        };
        Ok(Built {
            model,
            gpt: cfg,
            moe: None,
            first_micro: 0,
            report,
        })
    }

    /// The datasheet's dense peak (FLOP/s) of the GPU called `name` for
    /// products in `precision`, from `weft plan`'s presets (A100: 312
    /// TFLOP/s bf16/fp16, 19.5 fp32; H100 SXM and H200: 989 and 67), and
    /// where it comes from; NaN and "unknown" for any other GPU (an H100
    /// PCIe or NVL has other clocks). f32 products run without TF32, so
    /// the f32 peak is the one without tensor cores.
    pub(crate) fn datasheet_peak(name: &str, precision: weft_kernels::Precision) -> (f64, String) {
        let upper = name.to_ascii_uppercase();
        let preset = if upper.contains("H200") {
            Some(("h200", "H200"))
        } else if upper.contains("H100") && !upper.contains("PCIE") && !upper.contains("NVL") {
            Some(("h100", "H100 SXM"))
        } else if upper.contains("A100") {
            Some(("a100", "A100"))
        } else {
            None
        };
        match preset.and_then(|(p, what)| Some((weft_plan::Cluster::preset(p, 1).ok()?, what))) {
            Some((cluster, what)) => (
                cluster.peak.of(precision),
                format!(
                    "the {what} datasheet's dense {precision} peak (weft plan's `{}` preset), for {name}",
                    cluster.name
                ),
            ),
            None => (
                f64::NAN,
                format!("unknown peak: {name} is not in the table (A100, H100 SXM, H200)"),
            ),
        }
    }

    /// Refuses a run whose model, gradients, moments and activations do
    /// not fit in the GPU's free memory, before any of it is allocated.
    fn check_gpu_memory(gpu: &Gpu, device: &str, needed: &RankMemory) -> Result<(), TrainError> {
        let (free, _) = gpu
            .memory()
            .map_err(|e| device_error(format!("{device}: {e}")))?;
        if needed.total() <= free {
            return Ok(());
        }
        let (name, bytes) = needed.largest();
        #[allow(clippy::cast_precision_loss)]
        let gib = |b: usize| gib(b as f64);
        Err(TrainError::OutOfMemory {
            needed: gib(needed.total()),
            available: format!("{} free on {device}", gib(free)),
            ranks: 1,
            detail: format!("on the GPU: {needed}"),
            dominant: format!(
                "{name} ({}) — lower train.micro_batch_size or model.block_size (activations), or train a smaller model",
                gib(bytes)
            ),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use weft_kernels::Precision;

        #[test]
        fn the_peak_is_the_datasheet_of_known_gpus_and_unknown_otherwise() {
            let (p, from) = datasheet_peak("NVIDIA H100 80GB HBM3", Precision::Bf16);
            assert_eq!(p, 989e12);
            assert!(from.contains("H100 SXM") && from.contains("bf16"), "{from}");
            assert_eq!(datasheet_peak("NVIDIA H200", Precision::Bf16).0, 989e12);
            assert_eq!(
                datasheet_peak("NVIDIA A100-SXM4-80GB", Precision::Bf16).0,
                312e12
            );
            assert_eq!(
                datasheet_peak("NVIDIA A100-SXM4-40GB", Precision::F32).0,
                19.5e12
            );
            for other in ["NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090", "Tesla T4"] {
                let (p, from) = datasheet_peak(other, Precision::Bf16);
                assert!(p.is_nan(), "{other}");
                assert!(
                    from.starts_with("unknown peak") && from.contains(other),
                    "{from}"
                );
            }
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) use gpu::start_gpu;
