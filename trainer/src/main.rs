//! `weft`: the command-line entry point of the weft trainer.
//!
//! `main` only turns [`run`] into an exit code; the work lives in the
//! libraries (`weft_trainer` and below).

mod progress;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// weft: distributed LLM pretraining.
#[derive(Parser, Debug)]
#[command(name = "weft", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum MoeCommand {
    /// Check routers for causality: perturb or remove the tokens after
    /// position n (and other sequences of the batch) and count how often
    /// token n's experts or gate weights change. Prints the violation rate
    /// of each router; causal routers must show 0.
    Audit {
        /// Experts E.
        #[arg(long, default_value_t = 8)]
        experts: usize,
        /// Experts per token k.
        #[arg(long, default_value_t = 2)]
        top_k: usize,
        /// Random trials per perturbation.
        #[arg(long, default_value_t = 200)]
        trials: usize,
        /// RNG seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Tokenize text once into token shards for training (GPT-2 BPE, in
    /// parallel over the cores): .txt files (one document each), .jsonl
    /// files (one document per line), either gzip-compressed, and folders
    /// of them (recursively, in path order). Resumes an interrupted run;
    /// the same inputs always give the same bytes. Train on the result
    /// with `weft train --data DIR`.
    Prepare {
        /// Input files and folders.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Output folder (created; an unfinished one is resumed).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Shard size bound, in tokens.
        #[arg(long, value_name = "N", default_value_t = 1 << 27)]
        shard_tokens: u64,
        /// The .jsonl field holding a document's text.
        #[arg(long, value_name = "FIELD", default_value = "text")]
        text_key: String,
        /// Tokenizer threads (0: every core).
        #[arg(long, value_name = "N", default_value_t = 0)]
        threads: usize,
    },
    /// Describe token data (a prepared folder, a Megatron-LM .bin/.idx
    /// pair, llm.c shards) and check every checksum and every id.
    Verify {
        /// The data.
        path: PathBuf,
        /// The validation fraction to show the split for.
        #[arg(long, value_name = "F", default_value_t = 0.1)]
        val_fraction: f64,
    },
}

#[derive(Subcommand, Debug)]
enum CkptCommand {
    /// Check every checksum of a checkpoint folder.
    Verify {
        /// A `step-NNNNNNNN` folder.
        dir: PathBuf,
    },
    /// Tensors, layout, step and sizes of a checkpoint folder.
    Info {
        /// A `step-NNNNNNNN` folder.
        dir: PathBuf,
    },
    /// Write a consolidated Hugging Face GPT-2 folder (config.json +
    /// model.safetensors) that `transformers` loads.
    Export {
        /// A `step-NNNNNNNN` folder.
        dir: PathBuf,
        /// Output folder.
        #[arg(long)]
        hf: PathBuf,
    },
    /// Rewrite a checkpoint for another layout (`N` ranks splitting rows, or
    /// `N:dimD` splitting dimension D) under a new checkpoints root.
    Reshard {
        /// A `step-NNNNNNNN` folder.
        dir: PathBuf,
        /// Target layout, e.g. `4` or `2:dim1`.
        #[arg(long)]
        to: String,
        /// Output checkpoints root.
        out: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a GPT-2-style model. With no options: a small model on the
    /// built-in synthetic corpus (about two minutes on 2 cores), its loss
    /// printed beside the corpus' exact floor.
    Train {
        /// A TOML job file; keys it leaves out keep their defaults.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Override one key, e.g. `--set optim.lr=1e-3` (repeatable; applied
        /// after the file). Keys: run.{name,dir}; model.{n_layer,n_head,
        /// n_embd,block_size}; model.moe.{experts,top_k,gate,normalize,
        /// balance,aux_coef,bias_rate,shared_expert,capacity_factor,drop};
        /// data.{source,val_fraction,synthetic.*}; train.{steps,batch_size,
        /// micro_batch_size,seed,eval_every,eval_sequences,spike_factor,
        /// spike_window,straggler_factor,straggler_window,rewind,
        /// nonfinite_limit,max_rewinds,skip_batches,precision,device}; optim.{lr,min_lr_ratio,warmup_steps,weight_decay,
        /// beta1,beta2,eps,grad_clip}; checkpoint.{every,keep_last,
        /// keep_every}; parallel.{dp,fsdp,hybrid_shard,tp,sequence_parallel,
        /// ep,pp,pp_schedule,pp_chunks,reproducible,backend,timeout_s}
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
        inject: Vec<weft_trainer::supervise::Fault>,
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
    },
    /// Generate from the last saved weights of a run folder. Decodes
    /// incrementally with a key/value cache whose logits are bitwise the
    /// training forward's. Text runs read and print text (GPT-2 BPE);
    /// synthetic-corpus runs read and print token ids, markers as `<M0>`,
    /// `<M1>`, ...
    Sample {
        /// The run folder (e.g. runs/NAME), with config.toml and checkpoints/.
        #[arg(long, value_name = "DIR")]
        run: PathBuf,
        /// What to continue: text, or for a synthetic run token ids separated
        /// by spaces or commas (default: <|endoftext|>, or token 0). At most
        /// model.block_size tokens.
        #[arg(long, value_name = "TEXT")]
        prompt: Option<String>,
        /// Tokens to generate (past block_size the context slides by half a
        /// block).
        #[arg(long, value_name = "N", default_value_t = 100)]
        tokens: usize,
        /// Softmax temperature; 0 always picks the most likely token (greedy).
        #[arg(long, value_name = "T", default_value_t = 1.0)]
        temperature: f64,
        /// Draw only among the K most likely tokens (0: all of them).
        #[arg(long, value_name = "K", default_value_t = 0)]
        top_k: usize,
        /// Seed of the sampling generator: the same seed gives the same text.
        #[arg(long, value_name = "S", default_value_t = 0)]
        seed: u64,
    },
    /// Serve run folders to the browser visualizer on 127.0.0.1: pipeline
    /// timeline, expert load, metrics. With several runs the metrics are
    /// overlaid (the folder names as legend) and each run's loss is shown
    /// step by step against the first run's. The page is built into weft;
    /// a page built from changed sources (`bash viz-web/build.sh`) is
    /// served with `--assets viz-web/dist`.
    Viz {
        /// The run folders (e.g. runs/NAME); the first is the one the
        /// others are compared with.
        #[arg(required = true, value_name = "RUN")]
        runs: Vec<PathBuf>,
        /// Port on 127.0.0.1 (0: any free port).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// A folder with a built page to serve instead of the one built into
        /// weft (default: $WEFT_VIZ_ASSETS if set).
        #[arg(long, value_name = "DIR")]
        assets: Option<PathBuf>,
    },
    /// A drill of the survival kit: a small job run fault-free, then
    /// `--trials` times supervised with a random fault each (kill, hang,
    /// non-finite gradients, a garbage batch, a rotten checkpoint before a
    /// kill, a crash while saving), drawn from `--seed`; prints per trial
    /// whether the fault was detected and how soon, whether the run
    /// recovered, restarts, rewinds, steps and seconds lost, the restart's
    /// cost and whether the final state is bitwise the fault-free run's.
    /// Exits non-zero unless every fault is detected and recovered from
    /// with the bits kept.
    Chaos {
        /// Trials.
        #[arg(long, default_value_t = 20)]
        trials: usize,
        /// Seed of the faults.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Override a setting of the drill's job (after its small
        /// defaults: 60 steps, checkpoints every 10, rewinds on), e.g.
        /// `--set parallel.dp=2`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Folder for the runs (default: runs/chaos-TIMESTAMP).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Seconds without a step that count as a hang.
        #[arg(long, value_name = "SECONDS", default_value_t = 3.0)]
        heartbeat_timeout: f64,
        /// Run every job under a launcher, e.g. --launch 'mpirun -np {n}'.
        #[arg(long, value_name = "COMMAND")]
        launch: Option<String>,
    },
    /// Compare runs with a baseline (the first): configuration
    /// differences, training and validation loss aligned by step (or by
    /// tokens), their per-step difference (largest, mean, first differing
    /// step, bitwise-equal span), final loss and its gap to the floor,
    /// throughput, memory, pipeline bubble, MaxVio, health events, and a
    /// verdict: bitwise identical, equal within --tolerance, better or
    /// worse by X ± Y (Welch's 95% interval over seeds), or not
    /// distinguishable. A folder of runs (as `weft train --seeds N` writes)
    /// counts as one group of seeds.
    Compare {
        /// Run folders or folders of seed runs; the first is the baseline.
        #[arg(required = true, num_args = 2..)]
        runs: Vec<PathBuf>,
        /// Print the comparison as JSON.
        #[arg(long)]
        json: bool,
        /// Also write SVG plots (loss.svg, loss_diff.svg, val_loss.svg)
        /// into this folder.
        #[arg(long, value_name = "DIR")]
        plot: Option<PathBuf>,
        /// Call runs whose curves and final figures differ by at most this
        /// much "equal within tolerance" (default: only bitwise identity
        /// is equal).
        #[arg(long, value_name = "T")]
        tolerance: Option<f64>,
        /// The figure the verdict is on: val_loss (the last evaluation) or
        /// train_loss (mean over the last tenth of the steps).
        #[arg(long, default_value = "val_loss")]
        metric: weft_trainer::compare::Metric,
    },
    /// Mixture-of-experts tools.
    Moe {
        #[command(subcommand)]
        command: MoeCommand,
    },
    /// Prepare token data for training, and check it.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Inspect and convert checkpoints (`<run>/checkpoints/step-NNNNNNNN`).
    Ckpt {
        #[command(subcommand)]
        command: CkptCommand,
    },
    /// Generate a pipeline schedule, validate and simulate it: prints the
    /// bubble, makespan and per-stage memory, and writes a Chrome trace
    /// (open it in Perfetto).
    Pipeline {
        /// gpipe, 1f1b, interleaved, zb-h1, zb-h2 or zb-v.
        #[arg(long)]
        schedule: String,
        /// Pipeline stages p.
        #[arg(long)]
        stages: usize,
        /// Micro-batches m.
        #[arg(long)]
        microbatches: usize,
        /// Model chunks per stage v (interleaved, zb-v).
        #[arg(long)]
        chunks: Option<usize>,
        /// Forward time of a stage per micro-batch (units).
        #[arg(long, default_value_t = 1.0)]
        forward: f64,
        /// Backward (input gradient) time.
        #[arg(long, default_value_t = 1.0)]
        backward_input: f64,
        /// Backward (weight gradient) time.
        #[arg(long, default_value_t = 1.0)]
        backward_weight: f64,
        /// Point-to-point latency between stages.
        #[arg(long, default_value_t = 0.0)]
        latency: f64,
        /// Write the Chrome trace here (e.g. trace.json).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Plan a run before spending the cluster: every layout weft can run
    /// for a model (`--config` or `--layers --hidden --heads --seq
    /// --vocab`), a global batch and a cluster (`--cluster` preset, file
    /// or this-machine), with memory per GPU by category, step time by
    /// part, tokens/s and MFU, best first; `--explain` walks the chain
    /// (plain DP, FSDP, the communication crossover); `--calibrate`
    /// checks the predictions against `weft train` runs on this machine.
    Plan(Box<weft_trainer::plan::PlanArgs>),
    /// Loss (and optionally every gradient) of a Hugging Face GPT-2 folder on
    /// a token file; prints `{"loss": …}` as JSON.
    Eval {
        /// Folder with config.json and model.safetensors.
        #[arg(long)]
        hf_model: PathBuf,
        /// JSON file `{"inputs": [[ids…], …], "targets": [[ids…], …]}`.
        #[arg(long)]
        tokens: PathBuf,
        /// Also write every parameter's gradient (Hugging Face names) here
        /// (a new file: an existing one only with --overwrite, never an
        /// input).
        #[arg(long)]
        dump_grads: Option<PathBuf>,
        /// Let --dump-grads replace an existing file.
        #[arg(long)]
        overwrite: bool,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            config,
            sets,
            data,
            device,
            print_config,
            resume,
            supervise,
            max_restarts,
            heartbeat_timeout,
            restart_backoff,
            inject,
            launch,
            hostfile,
            spares,
            shrink,
            seeds,
        } => {
            // the first Ctrl-C (or SIGTERM) saves and stops; a second stops
            weft_trainer::stop::install().context("installing the signal handlers")?;
            let mut sets = sets;
            if let Some(d) = device {
                sets.push(format!("train.device={}", toml_string(&d)));
            }
            if let Some(n) = seeds {
                if n == 0 {
                    anyhow::bail!("--seeds 0: give at least one seed");
                }
                let with = [
                    (supervise, "--supervise"),
                    (resume.is_some(), "--resume"),
                    (
                        weft_trainer::ranks::LauncherEnv::detect().is_some(),
                        "a launcher (mpirun)",
                    ),
                ];
                if let Some((_, what)) = with.iter().find(|w| w.0) {
                    anyhow::bail!(
                        "--seeds cannot be combined with {what}: run one `weft train` per seed (--set train.seed=S --set run.name=seed-S) instead"
                    );
                }
            }
            if supervise {
                let seconds = |what: &str, s: f64| {
                    std::time::Duration::try_from_secs_f64(s)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .with_context(|| format!("{what} {s}: a number of seconds > 0"))
                };
                let (heartbeat, backoff) = (
                    seconds("--heartbeat-timeout", heartbeat_timeout)?,
                    seconds("--restart-backoff", restart_backoff)?,
                );
                let resuming = resume.is_some();
                let (mut cfg, _) =
                    load_train_config(config.clone(), sets.clone(), data.clone(), resume)?;
                if cfg.run.name.is_empty() {
                    cfg.run.name = weft_trainer::train::timestamp_name();
                }
                let dir = cfg.run.dir.to_str().context("run.dir is not valid UTF-8")?;
                let mut command: Vec<std::ffi::OsString> =
                    vec![std::env::current_exe()?.into(), "train".into()];
                if let Some(c) = config {
                    command.extend(["--config".into(), c.into_os_string()]);
                }
                for s in sets {
                    command.extend(["--set".into(), s.into()]);
                }
                if let Some(d) = data {
                    command.extend(["--data".into(), d.into_os_string()]);
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
                    "supervising   {} (up to {max_restarts} restarts; a hang is {} s without a step)",
                    run_dir.display(),
                    heartbeat.as_secs_f64()
                ));
                let launch: Vec<String> = launch
                    .as_deref()
                    .map(|l| l.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default();
                if launch.first().is_some_and(|w| w.contains("{n}")) {
                    anyhow::bail!("--launch {launch:?}: the first word must be the launcher");
                }
                let templated = launch.iter().any(|w| w.contains("{hostfile}"));
                match (&hostfile, templated) {
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
                let elastic = elastic(&cfg, spares, shrink)?;
                let outcome = weft_trainer::supervise::Supervisor {
                    command,
                    launch,
                    hostfile,
                    run_dir: run_dir.clone(),
                    max_restarts,
                    backoff,
                    heartbeat_timeout: heartbeat,
                    inject,
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
                return Ok(());
            }
            weft_trainer::supervise::inject(&inject);
            let load = move || -> Result<(weft_trainer::config::Config, bool)> {
                load_train_config(config, sets, data, resume)
            };
            match weft_trainer::ranks::LauncherEnv::detect() {
                None => {
                    let (cfg, resuming) = load()?;
                    if print_config {
                        progress::out(&cfg.to_toml());
                        return Ok(());
                    }
                    match seeds {
                        None => {
                            weft_trainer::train::train(
                                &cfg,
                                resuming,
                                &mut progress::Terminal::new(),
                            )?;
                        }
                        Some(n) => train_seeds(&cfg, n)?,
                    }
                    Ok(())
                }
                // one rank of a launcher's job of processes
                Some(env) => {
                    let mut procs = match weft_trainer::ranks::Processes::connect() {
                        Ok(p) => p,
                        Err(e) => {
                            // the same failure on every process, and no
                            // communicator to agree over: rank 0 says it,
                            // the others give it a moment to
                            if env.rank == 0 {
                                say_error(&format!("error: {e}"));
                            } else {
                                std::thread::sleep(std::time::Duration::from_millis(500));
                            }
                            return Err(Reported.into());
                        }
                    };
                    let loaded = load()
                        .map_err(|e| weft_trainer::train::TrainError::Setup(format!("{e:#}")));
                    let (cfg, resuming) = match procs.agree(loaded) {
                        Ok(c) => c,
                        Err(e) => return Err(rank_failed(procs, &e)),
                    };
                    if print_config {
                        if procs.rank() == 0 {
                            progress::out(&cfg.to_toml());
                        }
                        return Ok(());
                    }
                    let mut terminal = progress::Terminal::new();
                    let result = weft_trainer::train::train_processes(
                        &mut procs,
                        &cfg,
                        resuming,
                        &mut terminal,
                    );
                    match result {
                        Ok(_) => Ok(()),
                        Err(e) => Err(rank_failed(procs, &e)),
                    }
                }
            }
        }
        Command::Plan(args) => {
            // progress to stderr: stdout is the table or the JSON
            let mut say = |l: &str| {
                let _ = std::io::Write::write_fmt(&mut std::io::stderr(), format_args!("{l}\n"));
            };
            let out = weft_trainer::plan::run(&args, &mut say)?;
            progress::out(out.trim_end());
            progress::out("\n");
            Ok(())
        }
        Command::Ckpt { command } => ckpt(command),
        Command::Data { command } => data(command),
        Command::Sample {
            run,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
        } => {
            use weft_trainer::sample::{SampleOptions, Sampler};
            let sampler = Sampler::open(&run)?;
            let prompt = sampler.encode_prompt(prompt.as_deref())?;
            let opts = SampleOptions {
                tokens,
                temperature,
                top_k,
                seed,
            };
            let out = sampler.generate(&prompt, &opts)?;
            let (kv, total) = sampler.memory();
            progress::say(&format!(
                "{}: step {} checkpoint, {} prompt tokens, {} generated (temperature {temperature}{}); \
                 key/value cache {:.1} KiB, decoder {:.1} KiB",
                run.display(),
                sampler.step(),
                prompt.len(),
                out.len(),
                if top_k > 0 {
                    format!(", top-k {top_k}")
                } else {
                    String::new()
                },
                kv as f64 / 1024.0,
                total as f64 / 1024.0
            ));
            progress::out(&format!(
                "{}{}\n",
                sampler.render(&prompt),
                sampler.render(&out)
            ));
            Ok(())
        }
        Command::Chaos {
            trials,
            seed,
            sets,
            dir,
            heartbeat_timeout,
            launch,
        } => {
            let heartbeat = std::time::Duration::try_from_secs_f64(heartbeat_timeout)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| {
                    format!("--heartbeat-timeout {heartbeat_timeout}: a number of seconds > 0")
                })?;
            let dir = dir.unwrap_or_else(|| {
                PathBuf::from("runs")
                    .join(format!("chaos-{}", weft_trainer::train::timestamp_name()))
            });
            let drill = weft_trainer::chaos::Drill {
                weft: std::env::current_exe()?,
                sets,
                dir: dir.clone(),
                trials,
                seed,
                heartbeat_timeout: heartbeat,
                launch,
            };
            let config = drill.config()?;
            progress::say(&format!(
                "chaos         {trials} trial(s), seed {seed}, runs in {}",
                dir.display()
            ));
            let started = std::time::Instant::now();
            progress::say(&weft_trainer::chaos::table_header());
            let results = drill.run(|i, t| progress::say(&weft_trainer::chaos::table_row(i, t)))?;
            // the fault-free run's seconds per step
            let summary: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("reference/summary.json")).unwrap_or_default(),
            )
            .unwrap_or_default();
            let step_s =
                summary["wall_s"].as_f64().unwrap_or(0.0) / config.train.steps.max(1) as f64;
            progress::say(&weft_trainer::chaos::table_totals(
                &results,
                step_s,
                config.checkpoint.every,
            ));
            progress::say(&format!(
                "took          {:.1} s",
                started.elapsed().as_secs_f64()
            ));
            if results
                .iter()
                .any(|t| t.hung || !t.recovered || !t.bitwise || t.detected_after_s.is_none())
            {
                return Err(Reported.into());
            }
            Ok(())
        }
        Command::Viz { runs, port, assets } => {
            let assets = assets
                .or_else(|| std::env::var_os("WEFT_VIZ_ASSETS").map(PathBuf::from))
                .map_or(weft_viz_web::serve::Assets::Embedded, |d| {
                    weft_viz_web::serve::Assets::Dir(d)
                });
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let server = weft_viz_web::serve::Server::bind(&runs, &assets, addr)?;
            let names: Vec<String> = server
                .runs()
                .iter()
                .map(|r| {
                    let path = r.dir.display().to_string();
                    if path.trim_end_matches('/').ends_with(r.name.as_str()) {
                        path
                    } else {
                        format!("{path} (as {})", r.name)
                    }
                })
                .collect();
            progress::say(&format!(
                "serving {} with {assets} at {}  (Ctrl-C to stop)",
                names.join(", "),
                server.url()?
            ));
            server.run()?;
            Ok(())
        }
        Command::Compare {
            runs,
            json,
            plot,
            tolerance,
            metric,
        } => {
            use weft_trainer::compare;
            if let Some(t) = tolerance
                && !(t.is_finite() && t >= 0.0)
            {
                anyhow::bail!("--tolerance {t}: a finite number >= 0");
            }
            let groups = runs
                .iter()
                .map(|r| compare::load(r))
                .collect::<Result<Vec<_>, _>>()?;
            let report = compare::Report::new(&groups, &compare::Options { tolerance, metric });
            if json {
                progress::say(&report.to_json());
            } else {
                progress::say(report.to_string().trim_end());
            }
            if let Some(dir) = plot {
                for f in compare::write_plots(&report, &dir)? {
                    progress::say(&format!("wrote {}", f.display()));
                }
            }
            Ok(())
        }
        Command::Moe {
            command:
                MoeCommand::Audit {
                    experts,
                    top_k,
                    trials,
                    seed,
                },
        } => {
            let opts = weft_moe::AuditOptions {
                trials,
                seed,
                ..Default::default()
            };
            for report in weft_moe::audit_suite(experts, top_k, &opts)? {
                progress::say(&report.to_string());
            }
            Ok(())
        }
        Command::Pipeline {
            schedule,
            stages,
            microbatches,
            chunks,
            forward,
            backward_input,
            backward_weight,
            latency,
            out,
        } => {
            let kind: weft_pipeline::ScheduleKind = schedule.parse()?;
            let mut req = weft_pipeline::PlanRequest::new(kind, stages, microbatches);
            req.chunks = chunks;
            req.forward = forward;
            req.backward_input = backward_input;
            req.backward_weight = backward_weight;
            req.p2p_latency = latency;
            let plan = weft_pipeline::plan(&req)?;
            progress::out(&plan.table());
            if let Some(out) = out {
                let file = std::fs::File::create(&out)
                    .with_context(|| format!("creating {}", out.display()))?;
                serde_json::to_writer(std::io::BufWriter::new(file), &plan.trace)
                    .with_context(|| format!("writing {}", out.display()))?;
                progress::say(&format!("trace written to {}", out.display()));
            }
            Ok(())
        }
        Command::Eval {
            hf_model,
            tokens,
            dump_grads,
            overwrite,
        } => {
            if let Some(out) = &dump_grads {
                check_output(
                    out,
                    &[&hf_model.join("model.safetensors"), &tokens],
                    overwrite,
                )?;
            }
            let batch = weft_model::eval::read_tokens(&tokens)?;
            let loss = weft_model::eval::eval_hf(&hf_model, &batch, dump_grads.as_deref())
                .with_context(|| format!("evaluating {}", hf_model.display()))?;
            progress::say(&serde_json::json!({ "loss": loss }).to_string());
            Ok(())
        }
    }
}

/// The configuration of `weft train`: the file (or, resuming, the run's
/// own `config.toml`), then the `--set` overrides; and whether it resumes.
fn load_train_config(
    config: Option<PathBuf>,
    sets: Vec<String>,
    data: Option<PathBuf>,
    resume: Option<Option<PathBuf>>,
) -> Result<(weft_trainer::config::Config, bool)> {
    let mut sets = sets;
    if let Some(d) = data {
        let path = d.to_str().context("--data: the path is not valid UTF-8")?;
        sets.push(format!("data.source={}", toml_string(path)));
    }
    let resuming = resume.is_some();
    let cfg = match resume {
        None => weft_trainer::config::Config::load(config.as_deref(), &sets)?,
        Some(dir) => {
            // Find the run folder, then load its config (or --config)
            // and pin run.dir/run.name to that folder.
            let run_dir = match dir {
                Some(d) => d,
                None => {
                    let c = weft_trainer::config::Config::load(config.as_deref(), &sets)?;
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
            weft_trainer::config::Config::load(Some(&base), &sets)?
        }
    };
    Ok((cfg, resuming))
}

/// The supervised job's layout: its spares and the smaller data-parallel
/// degrees it may continue on (each checked against the configuration,
/// with the micro-batch size pinned so the global batch is kept).
fn elastic(
    cfg: &weft_trainer::config::Config,
    spares: Option<u32>,
    shrink: bool,
) -> Result<weft_trainer::supervise::Elastic> {
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
    Ok(weft_trainer::supervise::Elastic {
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

/// An error already printed (or left to rank 0 to print).
#[derive(Debug)]
struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reported")
    }
}

impl std::error::Error for Reported {}

/// Refuses an output path that is one of the `inputs` (the same file, by
/// any path), or that exists unless `overwrite`.
fn check_output(out: &std::path::Path, inputs: &[&std::path::Path], overwrite: bool) -> Result<()> {
    if let Ok(resolved) = out.canonicalize() {
        for input in inputs {
            if input.canonicalize().is_ok_and(|i| i == resolved) {
                anyhow::bail!(
                    "{}: the output is an input of this command ({}); write it elsewhere",
                    out.display(),
                    input.display()
                );
            }
        }
        if !overwrite {
            anyhow::bail!(
                "{} exists: refusing to overwrite it (pass --overwrite to replace it)",
                out.display()
            );
        }
    }
    Ok(())
}

/// The error and its causes, `: `-separated, each cause said once (an error
/// that already quotes its source, as many I/O errors do, is not followed
/// by it again).
fn chain_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if text.contains(&msg) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&msg);
    }
    text
}

/// Writes `line` to stderr in one write, so that the lines of several
/// processes sharing a terminal do not interleave.
fn say_error(line: &str) {
    use std::io::Write as _;
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
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
fn rank_failed(
    procs: weft_trainer::ranks::Processes,
    e: &weft_trainer::train::TrainError,
) -> anyhow::Error {
    let (rank, size) = (procs.rank(), procs.world().size());
    if rank == 0 {
        say_error(&format!("error: {e}"));
    } else if !e.is_secondary() {
        say_error(&format!("error: rank {rank} of {size}: {e}"));
    }
    procs.reported(matches!(
        e,
        weft_trainer::train::TrainError::ReportedByRankZero
    ));
    std::mem::forget(procs);
    Reported.into()
}

fn data(command: DataCommand) -> Result<()> {
    use std::ops::ControlFlow;
    match command {
        DataCommand::Prepare {
            inputs,
            out,
            shard_tokens,
            text_key,
            threads,
        } => {
            let opts = weft_data::PrepareOptions {
                shard_tokens,
                text_key,
                threads,
            };
            let mut shown = progress::Bytes::new("preparing");
            let report = weft_data::prepare(&inputs, &out, &opts, &mut |p| {
                shown.update(p);
                ControlFlow::Continue(())
            });
            shown.finish();
            let report = report.with_context(|| format!("preparing {}", out.display()))?;
            progress::say(&format!(
                "{}{}: {} documents, {} tokens in {} shards from {} input bytes{}{}",
                if report.already_prepared {
                    "already prepared: "
                } else {
                    ""
                },
                out.display(),
                report.documents,
                report.tokens,
                report.shards,
                report.input_bytes,
                if report.empty_documents > 0 {
                    format!(" ({} empty documents left out)", report.empty_documents)
                } else {
                    String::new()
                },
                if report.resumed_shards > 0 && !report.already_prepared {
                    format!(
                        "; {} shards kept from the interrupted run",
                        report.resumed_shards
                    )
                } else {
                    String::new()
                },
            ));
        }
        DataCommand::Verify { path, val_fraction } => {
            let c = weft_data::Corpus::open(&path, val_fraction)
                .with_context(|| format!("opening {}", path.display()))?;
            c.verify()
                .with_context(|| format!("verifying {}", path.display()))?;
            let checked = if c.format == weft_data::Format::Weft {
                "every checksum and id checked"
            } else {
                "every id checked (the format has no checksums)"
            };
            progress::say(&format!(
                "ok: {} ({} format){} — {} training and {} validation tokens (val_fraction {val_fraction}, cut at a document boundary); {checked}",
                path.display(),
                c.format,
                c.documents
                    .map_or(String::new(), |d| format!(", {d} documents")),
                c.train.len(),
                c.val.len(),
            ));
        }
    }
    Ok(())
}

fn ckpt(command: CkptCommand) -> Result<()> {
    use weft_checkpoint::{
        Checkpoint, Gpt2Export, SaveOptions, TargetLayout, export_hf_gpt2, reshard,
    };
    let open = |dir: &std::path::Path| {
        Checkpoint::open(dir).with_context(|| format!("opening checkpoint {}", dir.display()))
    };
    match command {
        CkptCommand::Verify { dir } => {
            let report = open(&dir)?
                .verify()
                .with_context(|| format!("verifying {}", dir.display()))?;
            progress::say(&format!(
                "ok: {} — {} tensors, {} shards in {} files, {} bytes checksummed",
                dir.display(),
                report.tensors,
                report.shards,
                report.files,
                report.bytes
            ));
        }
        CkptCommand::Info { dir } => progress::out(&open(&dir)?.info().to_string()),
        CkptCommand::Export { dir, hf } => {
            let ckpt = open(&dir)?;
            let model = ckpt.state().extra.get("model").cloned().unwrap_or_default();
            let n_head = model["n_head"].as_u64().with_context(|| {
                format!("{}: the checkpoint does not record the model's n_head (not saved by weft train?)", dir.display())
            })?;
            let mut opts = Gpt2Export::new("transformer.", n_head);
            if let Some(eps) = model["layer_norm_epsilon"].as_f64() {
                opts.layer_norm_epsilon = eps;
            }
            let report = export_hf_gpt2(&ckpt, &hf, &opts)
                .with_context(|| format!("exporting to {}", hf.display()))?;
            progress::say(&format!(
                "wrote {} ({} tensors, {} bytes) and config.json",
                hf.join("model.safetensors").display(),
                report.tensors,
                report.bytes
            ));
        }
        CkptCommand::Reshard { dir, to, out } => {
            let target = TargetLayout::parse(&to)?;
            let ckpt = open(&dir)?;
            let committed = reshard(&ckpt, &target, &out, &SaveOptions::default())
                .with_context(|| format!("resharding {} into {}", dir.display(), out.display()))?;
            progress::say(&format!(
                "wrote {} (step {}, {} ranks)",
                committed.path.display(),
                committed.manifest.step,
                committed.manifest.layout.world_size
            ));
        }
    }
    Ok(())
}

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `weft train --seeds N`: the job once per seed, each run in its own
/// `seed-<S>` folder of the group `<run.dir>/<run.name>`.
fn train_seeds(cfg: &weft_trainer::config::Config, n: u64) -> Result<()> {
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

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<Reported>().is_none() {
                say_error(&format!("error: {}", chain_text(&e)));
            }
            ExitCode::FAILURE
        }
    }
}
