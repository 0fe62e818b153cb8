//! The tools that need no run: `weft data`, `weft ckpt`, `weft
//! pipeline`, `weft moe audit`, `weft eval`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;

use super::check_output;
use crate::progress;

#[derive(Subcommand, Debug)]
pub(crate) enum MoeCommand {
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
pub(crate) enum DataCommand {
    /// Tokenize text once into token shards for training (GPT-2 BPE, or a
    /// Hugging Face tokenizer.json; in parallel over the cores; ids in 16
    /// bits, or 32 for vocabularies over 65,536): .txt files (one document each), .jsonl
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
        /// `gpt2`, or a Hugging Face tokenizer.json (copied into --out).
        #[arg(long, value_name = "FILE", default_value = "gpt2")]
        tokenizer: String,
        /// The token appended after every document (a tokenizer.json's;
        /// default: the first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` it has).
        #[arg(long, value_name = "TOKEN")]
        eot: Option<String>,
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
pub(crate) enum CkptCommand {
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
    /// Write a consolidated Hugging Face folder (config.json +
    /// safetensors) that `transformers` loads: GPT-2, or the Llama family
    /// the run's `[model]` table describes.
    Export {
        /// A `step-NNNNNNNN` folder.
        dir: PathBuf,
        /// Output folder.
        #[arg(long)]
        hf: PathBuf,
        /// Replace the model a folder already holds.
        #[arg(long)]
        overwrite: bool,
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

/// `weft pipeline`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct PipelineArgs {
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
    /// Costs of unequal layers, e.g. 1,1,1,1,1,3 (layer i's F, B and W:
    /// its cost times --forward, --backward-input, --backward-weight):
    /// also print the split by cost against the equal split.
    #[arg(long, value_delimiter = ',', value_name = "COSTS")]
    layer_costs: Vec<f64>,
    /// Write the Chrome trace here (e.g. trace.json).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `weft eval`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct EvalArgs {
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
}

/// `weft moe`.
pub(crate) fn moe(command: MoeCommand) -> Result<()> {
    let MoeCommand::Audit {
        experts,
        top_k,
        trials,
        seed,
    } = command;

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

/// `weft pipeline`.
pub(crate) fn pipeline(a: PipelineArgs) -> Result<()> {
    let PipelineArgs {
        schedule,
        stages,
        microbatches,
        chunks,
        forward,
        backward_input,
        backward_weight,
        latency,
        layer_costs,
        out,
    } = a;

    let kind: weft_pipeline::ScheduleKind = schedule.parse()?;
    let mut req = weft_pipeline::PlanRequest::new(kind, stages, microbatches);
    req.chunks = chunks;
    req.forward = forward;
    req.backward_input = backward_input;
    req.backward_weight = backward_weight;
    req.p2p_latency = latency;
    let plan = weft_pipeline::plan(&req)?;
    progress::out(&plan.table());
    if !layer_costs.is_empty() {
        let costs = (forward, backward_input, backward_weight);
        let layers = weft_pipeline::layer_profiles(&layer_costs, costs);
        let cmp = weft_pipeline::compare_splits(&plan.schedule, &layers, latency)?;
        progress::out(&format!(
            "\n{} layers over {} chunks:\n{cmp}",
            layers.len(),
            plan.schedule.placement().virtual_stages()
        ));
    }
    if let Some(out) = out {
        let file =
            std::fs::File::create(&out).with_context(|| format!("creating {}", out.display()))?;
        serde_json::to_writer(std::io::BufWriter::new(file), &plan.trace)
            .with_context(|| format!("writing {}", out.display()))?;
        progress::say(&format!("trace written to {}", out.display()));
    }
    Ok(())
}

/// `weft eval`.
pub(crate) fn eval(a: EvalArgs) -> Result<()> {
    let EvalArgs {
        hf_model,
        tokens,
        dump_grads,
        overwrite,
    } = a;

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

/// `weft data`.
pub(crate) fn data(command: DataCommand) -> Result<()> {
    use std::ops::ControlFlow;
    match command {
        DataCommand::Prepare {
            inputs,
            out,
            shard_tokens,
            text_key,
            threads,
            tokenizer,
            eot,
        } => {
            if eot.is_some() && tokenizer == weft_data::tokenizer::GPT2 {
                anyhow::bail!(
                    "--eot names a tokenizer.json's end-of-text token: give --tokenizer FILE"
                );
            }
            let opts = weft_data::PrepareOptions {
                shard_tokens,
                text_key,
                threads,
                tokenizer: weft_data::TokenizerSpec::named(&tokenizer, eot.as_deref()),
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

/// `weft ckpt`.
pub(crate) fn ckpt(command: CkptCommand) -> Result<()> {
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
        CkptCommand::Export { dir, hf, overwrite } => {
            let held = [
                "config.json",
                "model.safetensors",
                "model.safetensors.index.json",
            ]
            .iter()
            .find(|f| hf.join(f).exists());
            if let (Some(f), false) = (held, overwrite) {
                anyhow::bail!(
                    "{} already holds a model ({f}); pass --overwrite to replace it",
                    hf.display()
                );
            }
            let ckpt = open(&dir)?;
            let model = ckpt.state().extra.get("model").cloned().unwrap_or_default();
            let opts: Option<weft_model::ModelOptions> =
                serde_json::from_value(model["options"].clone()).ok();
            if let Some(o) = opts.filter(|o| o.arch != weft_model::Arch::Gpt2) {
                let vocab = model["vocab_size"].as_u64().unwrap_or(0) as usize;
                let mut read = |name: &str, _: &[usize]| -> Result<Vec<f32>, String> {
                    let b = ckpt.read_tensor(name).map_err(|e| e.to_string())?;
                    Ok(b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect())
                };
                weft_model::hf::export_with(&o, vocab, &mut read, &hf)
                    .with_context(|| format!("exporting to {}", hf.display()))?;
                progress::say(&format!(
                    "wrote {} ({}) and config.json",
                    hf.display(),
                    o.arch.name()
                ));
                return Ok(());
            }
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
            target.check_against(&ckpt)?;
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
