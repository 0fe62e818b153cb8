//! `weft`: the command-line entry point of the weft trainer.
//!
//! `main` only turns [`run`] into an exit code; the work lives in the
//! libraries. The training loop arrives with the trainer issue; until then
//! `weft train` says so plainly instead of pretending.

use std::process::ExitCode;

use anyhow::{Result, bail};
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
    /// Run a training job (not available yet in this build).
    Train,
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train => bail!(
            "`weft train` is not available yet: the training loop lands with the trainer issue.\n\
             What works today: the numerics crate. Try\n  \
             cargo run --release -p weft-numerics --example drift"
        ),
    }
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
