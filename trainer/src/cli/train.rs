//! `weft train`: the options, and how the job starts — supervised as
//! child process(es), as this process's rank of a launcher's job, as
//! threads of this process, or once per seed.

use std::path::PathBuf;

use anyhow::{Context, Result};
use weft_trainer::config::Config;
use weft_trainer::train::{RunOptions, TrainError};

use super::{Reported, say_error, toml_string};
use crate::progress;

/// `weft train`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct TrainArgs {
    /// A TOML job file; keys it leaves out keep their defaults.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one key, e.g. `--set optim.lr=1e-3` (repeatable; applied
    /// after the file). Keys: run.{name,dir,trace_steps};
    /// model.{arch,n_layer,n_head,n_embd,block_size,n_kv_head,head_dim,
    /// ffn_hidden,rope_theta,sliding_window,global_every,tied_embeddings,
    /// norm_eps,vocab_size,init_from,first_dense}; model.moe.{experts,top_k,
    /// gate,normalize,balance,aux_coef,bias_rate,expert_hidden,shared_experts,
    /// routed_scale,capacity_factor,drop}; data.{source,val_fraction,doc_mask,
    /// synthetic.*}; train.{steps,batch_size,micro_batch_size,seed,
    /// eval_every,eval_sequences,spike_factor,spike_window,
    /// straggler_factor,straggler_window,rewind,nonfinite_limit,
    /// max_rewinds,skip_batches,precision,device,loss_scale.*};
    /// optim.{name,lr,min_lr_ratio,warmup_steps,schedule,decay_shape,
    /// decay_fraction,decay_steps,weight_decay,beta1,beta2,eps,grad_clip,
    /// muon_lr,muon_weight_decay,muon_momentum,muon_nesterov,muon_ns_steps,
    /// muon_scale}; checkpoint.{every,keep_last,
    /// keep_every,background}; parallel.{dp,fsdp,hybrid_shard,tp,sequence_parallel,
    /// ep,cp,pp,pp_schedule,pp_chunks,reproducible,grad_wire,backend,
    /// timeout_s,threads}
    /// (ranks are threads, or processes under `mpirun`;
    /// `--print-config` shows every key with its default).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Train on text (a .txt file or a folder of them, tokenized with
    /// GPT-2 BPE at the start) or on token data (a folder of `weft
    /// data prepare`, a Megatron-LM .bin/.idx pair, llm.c shards);
    /// shorthand for `--set data.source=PATH`.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Start from a Hugging Face folder (GPT-2 or the Llama family:
    /// config.json and safetensors weights, sharded or not): its
    /// config.json sets the model's shape and its weights are the initial
    /// parameters, on any layout; shorthand for `--set model.init_from=DIR`.
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// Where the model computes: `cpu`, `cuda` (GPU 0) or `cuda:N`;
    /// shorthand for `--set train.device=DEVICE`. A GPU trains one
    /// rank of a dense model (weft built with `--features cuda`).
    #[arg(long, value_name = "DEVICE")]
    device: Option<String>,
    /// Print the resolved configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// Continue a run from its newest valid checkpoint: the run named by
    /// run.dir/run.name, or the run folder given. Its config.toml is the
    /// base configuration (unless --config is given).
    #[arg(long, value_name = "RUN_DIR", num_args = 0..=1)]
    resume: Option<Option<PathBuf>>,
    /// Start a new run (run.dir/run.name) as a branch of another run's
    /// checkpoint, `RUN_DIR/checkpoints/step-NNNNNNNN`: its parameters,
    /// optimizer state and step, and the source run's logs up to it; the
    /// source's config.toml is the base configuration (unless --config
    /// is given). A WSD run's stable-phase checkpoint branches into a
    /// decay, e.g. --set train.steps=1200 --set optim.decay_steps=200.
    #[arg(long, value_name = "CHECKPOINT", conflicts_with_all = ["resume", "seeds"])]
    branch: Option<PathBuf>,
    /// Run the job as a child process and restart it from its newest
    /// checkpoint that verifies when it fails (exits in error, is
    /// killed, or its heartbeat stops); events go to
    /// `<run>/events.jsonl`.
    #[arg(long)]
    supervise: bool,
    /// With --supervise: restarts allowed.
    #[arg(long, value_name = "N", default_value_t = 3)]
    max_restarts: u32,
    /// With --supervise: seconds without a finished step (or, at the
    /// start, without the run starting) that count as a hang.
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0)]
    heartbeat_timeout: f64,
    /// With --supervise: seconds before the first restart (doubled
    /// after each).
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    restart_backoff: f64,
    /// A fault for tests and drills (repeatable):
    /// `KIND:step=N[,rank=R][,count=C][,factor=F]` with KIND kill (the
    /// rank's process is killed as step N begins), hang (the rank stops
    /// making progress), nan (the batches of C steps from N make the
    /// gradients non-finite), spike (the batch of step N is garbage),
    /// slow (the rank computes F times slower from step N),
    /// corrupt-checkpoint (a byte of checkpoint N flips after its
    /// commit) or crash-during-save (the rank dies while saving
    /// checkpoint N). With --supervise, only the first attempt gets
    /// them.
    #[arg(long, value_name = "FAULT")]
    inject: Vec<weft_supervise::Fault>,
    /// With --supervise: run the job under a launcher, `{n}` standing
    /// for the number of processes, e.g. --launch 'mpirun -np {n}'
    /// (the trainer must be built with --features mpi).
    #[arg(long, value_name = "COMMAND")]
    launch: Option<String>,
    /// With --supervise: the launcher's hostfile; `{hostfile}` in
    /// --launch stands for it less the hosts of failed ranks, so spare
    /// nodes listed in it take over.
    #[arg(long, value_name = "FILE")]
    hostfile: Option<PathBuf>,
    /// With --supervise: spare ranks; each failure is taken over by
    /// one with the layout unchanged (without --spares every restart
    /// keeps the layout).
    #[arg(long, value_name = "K")]
    spares: Option<u32>,
    /// With --supervise: when no spare is left, continue on fewer
    /// data-parallel replicas (the largest parallel.dp below the
    /// current one that the configuration allows), keeping the global
    /// batch through more gradient accumulation.
    #[arg(long)]
    shrink: bool,
    /// Train the job N times, with train.seed = SEED, SEED + 1, ...
    /// (initialization and data order; the corpus stays the same),
    /// into `<run.dir>/<run.name>/seed-<S>/`: a group of seeds that
    /// `weft compare` takes as one, with error bars.
    #[arg(long, value_name = "N")]
    seeds: Option<u64>,
}

/// Runs `weft train`.
pub(crate) fn run(a: TrainArgs) -> Result<()> {
    // the first Ctrl-C (or SIGTERM) saves and stops; a second stops
    weft_supervise::stop::install().context("installing the signal handlers")?;
    let mut a = a;
    if let Some(d) = a.device.take() {
        a.sets.push(format!("train.device={}", toml_string(&d)));
    }
    if let Some(n) = a.seeds {
        if n == 0 {
            anyhow::bail!("--seeds 0: give at least one seed");
        }
        let with = [
            (a.supervise, "--supervise"),
            (a.resume.is_some(), "--resume"),
            (
                weft_collectives::processes::LauncherEnv::detect().is_some(),
                "a launcher (mpirun)",
            ),
        ];
        if let Some((_, what)) = with.iter().find(|w| w.0) {
            anyhow::bail!(
                "--seeds cannot be combined with {what}: run one `weft train` per seed (--set train.seed=S --set run.name=seed-S) instead"
            );
        }
    }
    if let Some(ckpt) = a.branch.take() {
        branch(&mut a, &ckpt)?;
    }
    if a.supervise {
        return supervise(a);
    }
    let opts = |resume| RunOptions {
        resume,
        faults: a.inject.clone(),
    };
    let load = || {
        load_train_config(
            a.config.clone(),
            a.sets.clone(),
            a.data.clone(),
            a.init_from.clone(),
            a.resume.clone(),
        )
    };
    let Some(env) = weft_collectives::processes::LauncherEnv::detect() else {
        let (cfg, resuming) = load()?;
        if a.print_config {
            progress::out(&cfg.to_toml());
            return Ok(());
        }
        match a.seeds {
            None => {
                weft_trainer::train::train_with(
                    &cfg,
                    &opts(resuming),
                    &mut progress::Terminal::new(),
                )?;
            }
            Some(n) => train_seeds(&cfg, n)?,
        }
        return Ok(());
    };
    // one rank of a launcher's job of processes
    let mut procs = match weft_trainer::ranks::connect() {
        Ok(p) => p,
        Err(e) => {
            // the same failure on every process, and no communicator to
            // agree over: rank 0 says it, the others give it a moment to
            if env.rank == 0 {
                say_error(&format!("error: {e}"));
            } else {
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            return Err(Reported.into());
        }
    };
    let loaded = load().map_err(|e| TrainError::Setup(format!("{e:#}")));
    let (cfg, resuming) = match weft_trainer::ranks::agree_processes(&procs, loaded) {
        Ok(c) => c,
        Err(e) => return Err(rank_failed(procs, &e)),
    };
    if a.print_config {
        if procs.rank() == 0 {
            progress::out(&cfg.to_toml());
        }
        return Ok(());
    }
    let mut terminal = progress::Terminal::new();
    match weft_trainer::train::train_processes(&mut procs, &cfg, &opts(resuming), &mut terminal) {
        Ok(_) => Ok(()),
        Err(e) => Err(rank_failed(procs, &e)),
    }
}

/// `weft train --supervise`: the job as child process(es) of this one,
/// restarted from its newest valid checkpoint when it fails.
fn supervise(a: TrainArgs) -> Result<()> {
    let seconds = |what: &str, s: f64| {
        std::time::Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| format!("{what} {s}: a number of seconds > 0"))
    };
    let (heartbeat, backoff) = (
        seconds("--heartbeat-timeout", a.heartbeat_timeout)?,
        seconds("--restart-backoff", a.restart_backoff)?,
    );
    let resuming = a.resume.is_some();
    let (mut cfg, _) = load_train_config(
        a.config.clone(),
        a.sets.clone(),
        a.data.clone(),
        a.init_from.clone(),
        a.resume,
    )?;
    if cfg.run.name.is_empty() {
        cfg.run.name = weft_trainer::train::timestamp_name();
    }
    let dir = cfg.run.dir.to_str().context("run.dir is not valid UTF-8")?;
    let mut command: Vec<std::ffi::OsString> =
        vec![std::env::current_exe()?.into(), "train".into()];
    if let Some(c) = a.config {
        command.extend(["--config".into(), c.into_os_string()]);
    }
    for s in a.sets {
        command.extend(["--set".into(), s.into()]);
    }
    if let Some(d) = a.data {
        command.extend(["--data".into(), d.into_os_string()]);
    }
    if let Some(d) = a.init_from {
        command.extend(["--init-from".into(), d.into_os_string()]);
    }
    command.extend([
        "--set".into(),
        format!("run.dir={}", toml_string(dir)).into(),
        "--set".into(),
        format!("run.name={}", toml_string(&cfg.run.name)).into(),
    ]);
    let run_dir = cfg.run.dir.join(&cfg.run.name);
    if resuming && !run_dir.is_dir() {
        anyhow::bail!(
            "cannot resume: run folder {} does not exist",
            run_dir.display()
        );
    }
    progress::say(&format!(
        "supervising   {} (up to {} restarts; a hang is {} s without a step)",
        run_dir.display(),
        a.max_restarts,
        heartbeat.as_secs_f64()
    ));
    let launch: Vec<String> = a
        .launch
        .as_deref()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    if launch.first().is_some_and(|w| w.contains("{n}")) {
        anyhow::bail!("--launch {launch:?}: the first word must be the launcher");
    }
    let templated = launch.iter().any(|w| w.contains("{hostfile}"));
    match (&a.hostfile, templated) {
        (Some(h), true) if !h.is_file() => {
            anyhow::bail!("--hostfile {}: no such file", h.display())
        }
        (Some(_), false) => anyhow::bail!(
            "--hostfile is given but --launch has no {{hostfile}} to pass it (e.g. --launch 'mpirun -np {{n}} --hostfile {{hostfile}}')"
        ),
        (None, true) => {
            anyhow::bail!("--launch uses {{hostfile}} but no --hostfile is given")
        }
        _ => {}
    }
    let elastic = elastic(&cfg, a.spares, a.shrink)?;
    let outcome = weft_supervise::Supervisor {
        command,
        launch,
        hostfile: a.hostfile,
        run_dir: run_dir.clone(),
        max_restarts: a.max_restarts,
        backoff,
        heartbeat_timeout: heartbeat,
        inject: a.inject,
        elastic,
    }
    .run()?;
    progress::say(&format!(
        "supervised    {} restart(s), ending on parallel.dp = {}; events in {}",
        outcome.restarts,
        outcome.dp,
        run_dir.join("events.jsonl").display()
    ));
    if outcome.code != Some(0) {
        return Err(Reported.into());
    }
    Ok(())
}

/// `--branch CHECKPOINT`: makes the new run's folder — the source run's
/// configuration with this command's changes, the checkpoint linked in,
/// the source's logs up to its step — and turns the command into a
/// `--resume` of it.
fn branch(a: &mut TrainArgs, ckpt: &std::path::Path) -> Result<()> {
    if weft_collectives::processes::LauncherEnv::detect().is_some() {
        anyhow::bail!(
            "--branch makes the run folder: run it once without a launcher (or with --supervise --launch)"
        );
    }
    let step = ckpt
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(weft_checkpoint::parse_step_dir);
    let source = ckpt.parent().and_then(std::path::Path::parent);
    let (Some(step), Some(source)) = (step, source) else {
        anyhow::bail!(
            "--branch {}: expected a checkpoint folder RUN_DIR/checkpoints/step-NNNNNNNN",
            ckpt.display()
        );
    };
    let base = a
        .config
        .take()
        .unwrap_or_else(|| source.join("config.toml"));
    let cfg = Config::load(Some(&base), &a.sets)?;
    if cfg.run.name.is_empty() {
        anyhow::bail!("--branch needs the new run's name (--set run.name=NAME)");
    }
    let run = cfg.run.dir.join(&cfg.run.name);
    if run.exists() {
        anyhow::bail!("--branch: run folder {} exists already", run.display());
    }
    weft_trainer::train::check_branch_from(ckpt, &cfg)?;
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    weft_checkpoint::link_checkpoint(ckpt, &run.join("checkpoints"))
        .with_context(|| format!("--branch {}", ckpt.display()))?;
    for log in ["metrics.jsonl", "expert_load.jsonl"] {
        let Ok(text) = std::fs::read_to_string(source.join(log)) else {
            continue;
        };
        let upto = |l: &&str| {
            let v = serde_json::from_str::<serde_json::Value>(l);
            v.is_ok_and(|v| v["step"].as_u64().is_some_and(|s| s <= step))
        };
        let kept: String = text
            .lines()
            .filter(upto)
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(run.join(log), kept).with_context(|| format!("writing {log}"))?;
    }
    let config = run.join("config.toml");
    std::fs::write(&config, cfg.to_toml())
        .with_context(|| format!("writing {}", config.display()))?;
    progress::say(&format!(
        "branched      {} from {} (step {step})",
        run.display(),
        ckpt.display()
    ));
    a.sets.clear();
    a.resume = Some(Some(run));
    Ok(())
}

/// The configuration of `weft train`: the file (or, resuming, the run's
/// own `config.toml`), then the `--set` overrides; and whether it resumes.
fn load_train_config(
    config: Option<PathBuf>,
    sets: Vec<String>,
    data: Option<PathBuf>,
    init_from: Option<PathBuf>,
    resume: Option<Option<PathBuf>>,
) -> Result<(Config, bool)> {
    let mut sets = sets;
    if let Some(d) = data {
        let path = d.to_str().context("--data: the path is not valid UTF-8")?;
        sets.push(format!("data.source={}", toml_string(path)));
    }
    if let Some(d) = init_from {
        let path = d
            .to_str()
            .context("--init-from: the path is not valid UTF-8")?;
        sets.push(format!("model.init_from={}", toml_string(path)));
    }
    let resuming = resume.is_some();
    let cfg = match resume {
        None => Config::load(config.as_deref(), &sets)?,
        Some(dir) => {
            // Find the run folder, then load its config (or --config)
            // and pin run.dir/run.name to that folder.
            let run_dir = match dir {
                Some(d) => d,
                None => {
                    let c = Config::load(config.as_deref(), &sets)?;
                    if c.run.name.is_empty() {
                        anyhow::bail!(
                            "--resume without a folder needs run.name (e.g. --set run.name=NAME)"
                        );
                    }
                    c.run.dir.join(&c.run.name)
                }
            };
            if !run_dir.is_dir() {
                anyhow::bail!(
                    "cannot resume: run folder {} does not exist",
                    run_dir.display()
                );
            }
            // `.` or `..` name no folder: resolve them
            let run_dir = run_dir
                .canonicalize()
                .with_context(|| format!("--resume {}", run_dir.display()))?;
            let base = config.unwrap_or_else(|| run_dir.join("config.toml"));
            let name = run_dir
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("--resume {}: not a run folder", run_dir.display()))?;
            let parent = run_dir
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default();
            let parent = parent
                .to_str()
                .context("--resume: the path is not valid UTF-8")?;
            sets.push(format!(
                "run.dir={}",
                toml_string(if parent.is_empty() { "." } else { parent })
            ));
            sets.push(format!("run.name={}", toml_string(name)));
            Config::load(Some(&base), &sets)?
        }
    };
    Ok((cfg, resuming))
}

/// The supervised job's layout: its spares and the smaller data-parallel
/// degrees it may continue on (each checked against the configuration,
/// with the micro-batch size pinned so the global batch is kept).
fn elastic(cfg: &Config, spares: Option<u32>, shrink: bool) -> Result<weft_supervise::Elastic> {
    let p = &cfg.parallel;
    let micro = cfg.batch_split()?.micro;
    let mut smaller = Vec::new();
    if shrink {
        for d in (1..p.dp).rev() {
            let mut c = cfg.clone();
            c.parallel.dp = d;
            c.train.micro_batch_size = micro;
            if c.validate().is_ok() {
                smaller.push(d);
            }
        }
        if smaller.is_empty() {
            anyhow::bail!(
                "--shrink: no smaller parallel.dp than {} fits this configuration (train.batch_size = {}, micro-batches of {micro})",
                p.dp,
                cfg.train.batch_size
            );
        }
    }
    Ok(weft_supervise::Elastic {
        dp: p.dp,
        replica: p.tp * p.pp,
        spares: if shrink {
            Some(spares.unwrap_or(0))
        } else {
            spares
        },
        shrink: smaller,
        micro,
    })
}

/// One rank of a job of processes failed with `e`. Rank 0 prints its
/// error (for a set-up failure, the one report every rank agreed on); any
/// other rank prints only what happened to it, prefixed with its rank, and
/// nothing for what it saw because of another rank. The ranks whose failure
/// rank 0 reports wait until it has (the launcher stops the job when the
/// first process ends). Then the process leaves without `MPI_Finalize`,
/// which waits for every peer — and a failed job's peers may never come
/// (hung, or stopped); the launcher sees a process end in error and stops
/// the others.
fn rank_failed(procs: weft_collectives::processes::Processes, e: &TrainError) -> anyhow::Error {
    let (rank, size) = (procs.rank(), procs.world().size());
    if rank == 0 {
        say_error(&format!("error: {e}"));
    } else if !e.is_secondary() {
        say_error(&format!("error: rank {rank} of {size}: {e}"));
    }
    weft_trainer::ranks::reported(&procs, matches!(e, TrainError::ReportedByRankZero));
    std::mem::forget(procs);
    Reported.into()
}

/// `weft train --seeds N`: the job once per seed, each run in its own
/// `seed-<S>` folder of the group `<run.dir>/<run.name>`.
fn train_seeds(cfg: &Config, n: u64) -> Result<()> {
    let name = if cfg.run.name.is_empty() {
        weft_trainer::train::timestamp_name()
    } else {
        cfg.run.name.clone()
    };
    let group = cfg.run.dir.join(&name);
    let first = cfg.train.seed;
    if first.checked_add(n - 1).is_none() {
        anyhow::bail!("--seeds {n} from train.seed = {first}: the seeds overflow u64");
    }
    for k in 0..n {
        let mut c = cfg.clone();
        c.train.seed = first + k;
        c.run.dir = group.clone();
        c.run.name = format!("seed-{}", c.train.seed);
        progress::say(&format!(
            "seed {}/{n}      train.seed = {} -> {}",
            k + 1,
            c.train.seed,
            group.join(&c.run.name).display()
        ));
        weft_trainer::train::train(&c, false, &mut progress::Terminal::new())?;
    }
    progress::say(&format!(
        "seeds         {n} runs in {}; compare groups with `weft compare {} OTHER_GROUP`",
        group.display(),
        group.display()
    ));
    Ok(())
}
