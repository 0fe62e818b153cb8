//! Starting a run: where its ranks run (threads of this process, one
//! process each under an MPI launcher, or one GPU), what they agree on
//! before anything is built (the configuration, the machine's peak, the
//! data, the memory), and the [`Job`] every rank's loop reads.

use std::path::Path;
use std::time::Instant;

use weft_collectives::{Backend, Communicator, CommunicatorExt, ReduceOp};
use weft_data::Dataset;
use weft_kernels::{Mode, Precision, matmul_forward};
use weft_model::RankMemory;

use crate::config::Config;
use crate::ranks::agree;
use crate::run::faults::FaultPlan;
use crate::train::{Observer, RunOptions, Silent, Summary, TrainError};

/// What every rank of a job shares: the configuration, how it starts,
/// the machine's peak, the data, the faults to drill it with, and (a job
/// of processes) where the ranks run.
pub(crate) struct Job<'a> {
    pub config: &'a Config,
    pub resume: bool,
    pub peak: f64,
    pub data: &'a Dataset,
    pub faults: &'a FaultPlan,
    pub processes: Option<&'a weft_collectives::processes::Processes>,
    /// The whole model's initial parameters from `model.init_from`, read
    /// once per process (`None`: GPT-2's initialisation from the seed).
    pub init: Option<&'a [f32]>,
}

/// Runs the job ([`crate::train::train_with`]): on one GPU, as threads of
/// this process, or as this process's rank of a launcher's job.
///
/// # Errors
/// As [`crate::train::train`].
pub(crate) fn start(
    config: &Config,
    opts: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    #[cfg(feature = "cuda")]
    if config.train.device != crate::config::Device::Cpu {
        return crate::run::build::start_gpu(config, opts, observer);
    }
    let launcher = weft_collectives::processes::LauncherEnv::detect();
    match (config.parallel.backend, launcher) {
        (Backend::Threads, Some(env)) if env.size > 1 => Err(TrainError::Backend(format!(
            "\"threads\" runs every rank in one process, but {} started {} processes: \
             use \"auto\" or \"mpi\", or start weft once without the launcher",
            env.launcher, env.size
        ))),
        (Backend::Threads, _) | (Backend::Auto, None) => start_threads(config, opts, observer),
        _ => {
            let mut procs = crate::ranks::connect()?;
            start_processes(&mut procs, config, opts, observer)
        }
    }
}

/// The watchdog's timeout, `parallel.timeout_s` (the default for a value
/// out of range, which validation reports).
fn timeout(config: &Config) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(config.parallel.timeout_s)
        .unwrap_or(weft_collectives::DEFAULT_TIMEOUT)
}

/// The job as threads of this process, one per rank.
fn start_threads(
    config: &Config,
    opts: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    config.validate()?;
    check_device(config)?;
    check_model_floor(config)?;
    // The machine's peak, measured on every core before the ranks start
    // (each rank then computes on its own share of them).
    let peak = measure_matmul_peak(config.train.precision);
    // Read (and tokenize) the data once, for every rank.
    let data = Dataset::open(&config.data, &config.dataset_options())?;
    let init = initial_params(config, &data)?;
    let faults = FaultPlan::new(&opts.faults);
    let job = Job {
        config,
        resume: opts.resume,
        peak,
        data: &data,
        faults: &faults,
        processes: None,
        init: init.as_deref(),
    };
    let dims = config.parallel.dims();
    crate::ranks::launch(
        dims.world_size(),
        config.parallel.threads,
        dims.tp,
        timeout(config),
        observer,
        |world, obs| crate::run::build::run_rank(&job, world, obs),
    )
}

/// The whole model's parameters from `model.init_from`, read once per
/// process ([`weft_model::ModelOptions::initial_params`]).
pub(crate) fn initial_params(
    config: &Config,
    data: &Dataset,
) -> Result<Option<Vec<f32>>, TrainError> {
    let init = config.model.initial_params(data.vocab_size());
    Ok(init.map_err(crate::config::library_error)?)
}

/// This process's rank of a job of processes ([`crate::train::train_processes`]).
///
/// # Errors
/// As [`crate::train::train_processes`].
pub(crate) fn start_processes(
    procs: &mut weft_collectives::processes::Processes,
    config: &Config,
    opts: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    let backend = match config.parallel.backend {
        Backend::Threads if procs.world().size() > 1 => Err(TrainError::Backend(format!(
            "\"threads\" runs every rank in one process, but this job has {} processes: use \"auto\" or \"mpi\"",
            procs.world().size()
        ))),
        b => Ok(b),
    };
    if crate::ranks::agree_processes(procs, backend)? == Backend::Nccl
        && procs.backend() != Backend::Nccl
    {
        crate::ranks::use_nccl(procs)?;
    }
    procs.set_timeout(timeout(config));
    crate::ranks::size_pool(procs, config.parallel.threads);
    let procs = &*procs;
    let world = procs.world();
    let dims = config.parallel.dims();
    let setup = (|| {
        config.validate()?;
        check_device(config)?;
        if dims.world_size() != world.size() {
            return Err(TrainError::WorldSize {
                layout: dims.world_size(),
                dp: dims.dp,
                cp: dims.cp,
                tp: dims.tp,
                pp: dims.pp,
                launched: world.size(),
                launcher: weft_collectives::processes::LauncherEnv::detect()
                    .map_or_else(|| "the MPI library".into(), |e| e.launcher.to_owned()),
            });
        }
        check_model_floor(config)
    })();
    agree(world, setup)?;
    let hosts = procs.hosts();
    let peak = node_peak(world, hosts, config.train.precision)?;
    let data = open_data_once(world, hosts, config)?;
    let init = agree(world, initial_params(config, &data))?;
    let faults = FaultPlan::new(&opts.faults);
    let job = Job {
        config,
        resume: opts.resume,
        peak,
        data: &data,
        faults: &faults,
        processes: Some(procs),
        init: init.as_deref(),
    };
    if world.rank() == 0 {
        crate::run::build::run_rank(&job, world, observer)
    } else {
        crate::run::build::run_rank(&job, world, &mut Silent)
    }
}

/// Measures this machine's matmul throughput in `precision` (the run's
/// `train.precision`: utilisation is against the arithmetic it runs) with
/// the kernels' GEMM on a GPT-2-sized product (1024×768 · 768×3072), the
/// best of three to ten runs (as many as fit in 0.3 s; the best, because a
/// shared machine only ever makes a run slower).
pub(crate) fn measure_matmul_peak(precision: Precision) -> f64 {
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
    // The attention's projections, then the MLP's: GPT-2's 4·C² + 8·C²,
    // or the Llama-like families' C·(2·Cq + 2·Ckv) + 3·C·H.
    let per_block = match m.swiglu() {
        None => 12 * c * c + 13 * c,
        Some(s) => {
            let g = m.gpt_config(1);
            let (q, kv) = (g.q_dim() as u128, g.kv_dim() as u128);
            c * (2 * q + 2 * kv) + 3 * c * s.hidden as u128 + 2 * c
        }
    };
    let (blocks, rest) = (l * per_block, (t + 2) * c);
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
pub(crate) fn check_memory(
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
            config.batch_split().map_or(0, |s| s.micro),
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
