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
        /// n_embd,block_size}; data.{source,val_fraction,synthetic.*};
        /// train.{steps,batch_size,grad_accum,seed,eval_every,eval_sequences,
        /// spike_factor,spike_window}; optim.{lr,min_lr_ratio,warmup_steps,
        /// weight_decay,beta1,beta2,eps,grad_clip}.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Train on text: a .txt file or a folder of them (GPT-2 BPE);
        /// shorthand for `--set data.source=PATH`.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        /// Print the resolved configuration and exit.
        #[arg(long)]
        print_config: bool,
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
    /// Loss (and optionally every gradient) of a Hugging Face GPT-2 folder on
    /// a token file; prints `{"loss": …}` as JSON.
    Eval {
        /// Folder with config.json and model.safetensors.
        #[arg(long)]
        hf_model: PathBuf,
        /// JSON file `{"inputs": [[ids…], …], "targets": [[ids…], …]}`.
        #[arg(long)]
        tokens: PathBuf,
        /// Also write every parameter's gradient (Hugging Face names) here.
        #[arg(long)]
        dump_grads: Option<PathBuf>,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            config,
            sets,
            data,
            print_config,
        } => {
            let mut sets = sets;
            if let Some(d) = data {
                let path = d.to_str().context("--data: the path is not valid UTF-8")?;
                sets.push(format!("data.source={}", toml_string(path)));
            }
            let cfg = weft_trainer::config::Config::load(config.as_deref(), &sets)?;
            if print_config {
                #[allow(clippy::print_stdout)]
                {
                    print!("{}", cfg.to_toml());
                }
                return Ok(());
            }
            weft_trainer::train::train(&cfg, &mut progress::Terminal::new())?;
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
            #[allow(clippy::print_stdout)]
            {
                print!("{}", plan.table());
            }
            if let Some(out) = out {
                let file = std::fs::File::create(&out)
                    .with_context(|| format!("creating {}", out.display()))?;
                serde_json::to_writer(std::io::BufWriter::new(file), &plan.trace)
                    .with_context(|| format!("writing {}", out.display()))?;
                #[allow(clippy::print_stdout)]
                {
                    println!("trace written to {}", out.display());
                }
            }
            Ok(())
        }
        Command::Eval {
            hf_model,
            tokens,
            dump_grads,
        } => {
            let batch = weft_model::eval::read_tokens(&tokens)?;
            let loss = weft_model::eval::eval_hf(&hf_model, &batch, dump_grads.as_deref())
                .with_context(|| format!("evaluating {}", hf_model.display()))?;
            #[allow(clippy::print_stdout)]
            {
                println!("{}", serde_json::json!({ "loss": loss }));
            }
            Ok(())
        }
    }
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

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}
