//! The commands about runs that already exist: `weft sample`, `weft viz`,
//! `weft compare`, and the drill `weft chaos`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::Reported;
use crate::progress;

/// `weft sample`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct SampleArgs {
    /// The run folder (e.g. runs/NAME), with config.toml and checkpoints/.
    #[arg(long, value_name = "DIR", required_unless_present = "hf_model")]
    run: Option<PathBuf>,
    /// A Hugging Face folder (GPT-2 or the Llama family) instead of a run.
    #[arg(long, value_name = "DIR", conflicts_with = "run")]
    hf_model: Option<PathBuf>,
    /// With --hf-model: its tokenizer.json (default: the folder's own,
    /// else GPT-2's BPE for a 50,257-token model).
    #[arg(long, value_name = "FILE", requires = "hf_model")]
    tokenizer: Option<PathBuf>,
    /// What to continue: text, or for a synthetic run token ids separated
    /// by spaces or commas (default: <|endoftext|>, or token 0). At most
    /// model.block_size tokens.
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// Tokens to generate (past block_size the context slides by half a
    /// block; at most 2^20).
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 20))]
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
}

/// `weft viz`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct VizArgs {
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
}

/// `weft chaos`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct ChaosArgs {
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
    #[arg(long, value_name = "COMMAND", conflicts_with = "cluster")]
    launch: Option<String>,
    /// Run every job on the cluster of network namespaces NAME made by
    /// `scripts/cluster.sh up --name NAME` (its first nodes hold the job,
    /// one node spare), and draw node-kill and link-flap faults too.
    #[arg(long, value_name = "NAME")]
    cluster: Option<String>,
    /// Draw only these kinds of fault (comma-separated: kill, hang, nan,
    /// spike, corrupt-checkpoint, crash-during-save, node-kill,
    /// link-flap; default: every kind that can happen).
    #[arg(long, value_name = "KINDS", value_delimiter = ',')]
    faults: Vec<String>,
}

/// `weft compare`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct CompareArgs {
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
    metric: weft_compare::Metric,
    /// Welch's interval for groups that ran the same seeds too (by
    /// default their runs are paired by seed: the same initialisation and
    /// data order on both sides, whose shared noise pairing takes out).
    #[arg(long)]
    unpaired: bool,
}

/// `weft sample`.
pub(crate) fn sample(a: SampleArgs) -> Result<()> {
    let SampleArgs {
        run,
        hf_model,
        tokenizer,
        prompt,
        tokens,
        temperature,
        top_k,
        seed,
    } = a;

    use weft_trainer::sample::{SampleOptions, Sampler};
    let (sampler, source) = match (run, hf_model) {
        (Some(run), _) => {
            let s = Sampler::open(&run)?;
            let source = format!("{}: step {} checkpoint", run.display(), s.step());
            (s, source)
        }
        (None, Some(dir)) => (
            Sampler::open_hf(&dir, tokenizer.as_deref())?,
            dir.display().to_string(),
        ),
        (None, None) => anyhow::bail!("give --run DIR or --hf-model DIR"),
    };
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
        "{source}, {} prompt tokens, {} generated (temperature {temperature}{}); \
         key/value cache {:.1} KiB, decoder {:.1} KiB",
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

/// `weft chaos`.
pub(crate) fn chaos(a: ChaosArgs) -> Result<()> {
    let ChaosArgs {
        trials,
        seed,
        sets,
        dir,
        heartbeat_timeout,
        launch,
        cluster,
        faults,
    } = a;

    let heartbeat = std::time::Duration::try_from_secs_f64(heartbeat_timeout)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| {
            format!("--heartbeat-timeout {heartbeat_timeout}: a number of seconds > 0")
        })?;
    let dir = dir.unwrap_or_else(|| {
        PathBuf::from("runs").join(format!("chaos-{}", weft_trainer::train::timestamp_name()))
    });
    let cluster = cluster
        .map(|name| weft_supervise::DrillCluster::open(&name))
        .transpose()?;
    let launch = match &cluster {
        Some(c) => Some(c.launch()?),
        None => launch,
    };
    let mut drill = weft_supervise::Drill {
        weft: std::env::current_exe()?,
        sets,
        dir: dir.clone(),
        trials,
        seed,
        heartbeat_timeout: heartbeat,
        launch,
        job: weft_supervise::DrillJob {
            steps: 0,
            every: 0,
            ranks: 1,
            nonfinite_limit: 1,
        },
        kinds: faults,
        cluster,
    };
    // the drill's job, for where its faults can happen
    let config = weft_trainer::config::Config::load(None, &drill.job_sets())?;
    drill.job = weft_supervise::DrillJob {
        steps: config.train.steps,
        every: config.checkpoint.every,
        ranks: config.parallel.world_size(),
        nonfinite_limit: config.train.nonfinite_limit,
    };
    progress::say(&format!(
        "chaos         {trials} trial(s), seed {seed}, runs in {}",
        dir.display()
    ));
    let started = std::time::Instant::now();
    progress::say(&weft_supervise::table_header());
    let results = drill.run(|i, t| progress::say(&weft_supervise::table_row(i, t)))?;
    // the fault-free run's seconds per step
    let wall_s = std::fs::read_to_string(dir.join("reference/summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<weft_trace::Summary>(&t).ok())
        .map_or(0.0, |s| s.wall_s);
    #[allow(clippy::cast_precision_loss)]
    let step_s = wall_s / config.train.steps.max(1) as f64;
    progress::say(&weft_supervise::table_totals(
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

/// `weft viz`.
pub(crate) fn viz(a: VizArgs) -> Result<()> {
    let VizArgs { runs, port, assets } = a;

    let assets = assets
        .or_else(|| std::env::var_os("WEFT_VIZ_ASSETS").map(PathBuf::from))
        .map_or(weft_viz::serve::Assets::Embedded, |d| {
            weft_viz::serve::Assets::Dir(d)
        });
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let server = weft_viz::serve::Server::bind(&runs, &assets, addr)?;
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

/// `weft compare`.
pub(crate) fn compare(a: CompareArgs) -> Result<()> {
    use weft_compare as compare;
    if let Some(t) = a.tolerance
        && !(t.is_finite() && t >= 0.0)
    {
        anyhow::bail!("--tolerance {t}: a finite number >= 0");
    }
    let groups = a.runs.iter().map(|r| compare::load_group(r));
    let groups = groups.collect::<Result<Vec<_>, _>>()?;
    let options = compare::Options {
        tolerance: a.tolerance,
        metric: a.metric,
        unpaired: a.unpaired,
    };
    let report = compare::Report::new(&groups, &options);
    if a.json {
        progress::say(&report.to_json());
    } else {
        progress::say(report.to_string().trim_end());
    }
    if let Some(dir) = a.plot {
        for f in compare::write_plots(&report, &dir)? {
            progress::say(&format!("wrote {}", f.display()));
        }
    }
    Ok(())
}
