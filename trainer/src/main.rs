//! `weft`: the command-line entry point of the weft trainer.
//!
//! `main` only turns [`run`] into an exit code; each command is a module
//! of `cli` (`weft train` in `cli::train`, the commands about existing
//! runs in `cli::runs`, the tools in `cli::tools`), and the work lives in
//! the libraries (`weft_trainer` and below).

mod cli;
mod progress;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use cli::{Reported, chain_text, runs, say_error, tools, train};

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
    /// built-in synthetic corpus (about three minutes on 2 cores), its loss
    /// printed beside the corpus' exact floor.
    Train(train::TrainArgs),
    /// Generate from the last saved weights of a run folder. Decodes
    /// incrementally with a key/value cache whose logits are bitwise the
    /// training forward's. Text runs read and print text (GPT-2 BPE);
    /// synthetic-corpus runs read and print token ids, markers as `<M0>`,
    /// `<M1>`, ...
    Sample(runs::SampleArgs),
    /// Serve run folders to the browser visualizer on 127.0.0.1: pipeline
    /// timeline, expert load, metrics. With several runs the metrics are
    /// overlaid (the folder names as legend) and each run's loss is shown
    /// step by step against the first run's. The page is built into weft;
    /// a page built from changed sources (`bash viz-web/build.sh`) is
    /// served with `--assets viz-web/dist`.
    Viz(runs::VizArgs),
    /// A drill of the survival kit: a small job run fault-free, then
    /// `--trials` times supervised with a random fault each (kill, hang,
    /// non-finite gradients, a garbage batch, a rotten checkpoint before a
    /// kill, a crash while saving), drawn from `--seed`; prints per trial
    /// whether the fault was detected and how soon, whether the run
    /// recovered, restarts, rewinds, steps and seconds lost, the restart's
    /// cost and whether the final state is bitwise the fault-free run's.
    /// Exits non-zero unless every fault is detected and recovered from
    /// with the bits kept.
    Chaos(runs::ChaosArgs),
    /// Compare runs with a baseline (the first): configuration
    /// differences, training and validation loss aligned by step (or by
    /// tokens), their per-step difference (largest, mean, first differing
    /// step, bitwise-equal span), final loss and its gap to the floor,
    /// throughput, memory, pipeline bubble, MaxVio, health events, and a
    /// verdict: bitwise identical, equal within --tolerance, better or
    /// worse by X ± Y (a 95% interval over seeds: paired by seed where
    /// both sides ran the same seeds, Welch's otherwise), or not
    /// distinguishable. A folder of runs (as `weft train --seeds N` writes)
    /// counts as one group of seeds.
    Compare(runs::CompareArgs),
    /// Mixture-of-experts tools.
    Moe {
        #[command(subcommand)]
        command: tools::MoeCommand,
    },
    /// Prepare token data for training, and check it.
    Data {
        #[command(subcommand)]
        command: tools::DataCommand,
    },
    /// Inspect and convert checkpoints (`<run>/checkpoints/step-NNNNNNNN`).
    Ckpt {
        #[command(subcommand)]
        command: tools::CkptCommand,
    },
    /// Generate a pipeline schedule, validate and simulate it: prints the
    /// bubble, makespan and per-stage memory, and writes a Chrome trace
    /// (open it in Perfetto).
    Pipeline(tools::PipelineArgs),
    /// Plan a run before spending the cluster: every layout weft can run
    /// for a model (`--config` or `--layers --hidden --heads --seq
    /// --vocab`), a global batch and a cluster (`--cluster` preset, file
    /// or this-machine), with memory per GPU by category, step time by
    /// part, tokens/s and MFU, best first; `--explain` walks the chain
    /// (plain DP, FSDP, the communication crossover); `--calibrate`
    /// checks the predictions against `weft train` runs on this machine.
    Plan(Box<weft_trainer::plan::PlanArgs>),
    /// Loss (and optionally every gradient) of a Hugging Face folder (GPT-2 or the Llama family) on
    /// a token file; prints `{"loss": …}` as JSON.
    Eval(tools::EvalArgs),
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Sample(a) => runs::sample(a),
        Command::Viz(a) => runs::viz(a),
        Command::Chaos(a) => runs::chaos(a),
        Command::Compare(a) => runs::compare(a),
        Command::Moe { command } => tools::moe(command),
        Command::Data { command } => tools::data(command),
        Command::Ckpt { command } => tools::ckpt(command),
        Command::Pipeline(a) => tools::pipeline(a),
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
        Command::Eval(a) => tools::eval(a),
    }
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
