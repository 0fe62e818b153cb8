//! Step time of a tensor-parallel GPT-2 at tp = 1 vs tp = 2 (and 4 with
//! `--tp4`) on the thread backend, through `ParallelGpt`'s training step
//! (the trainer's), and the fraction of each rank's step spent inside tp
//! collectives (which on threads includes waiting for the slowest peer).
//!
//! `cargo run --release -p weft-model --example tp_step -- [steps] [--sp] [--tp4]`
//!
//! The degrees are interleaved (tp=1, tp=2, tp=1, ...) so that a noisy
//! machine affects them alike; the table reports medians.

use std::time::Instant;

use std::sync::Arc;

use weft_collectives::LocalCluster;
use weft_kernels::AdamW;
use weft_model::tp::TpOptions;
use weft_model::{Gpt, GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan};
use weft_parallel::ParallelDims;

const B: usize = 4;
const T: usize = 128;

#[allow(clippy::print_stdout, clippy::cast_precision_loss)]
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(5);
    let sp = args.iter().any(|a| a == "--sp");
    let mut degrees = vec![1usize, 2];
    if args.iter().any(|a| a == "--tp4") {
        degrees.push(4);
    }
    let cfg = GptConfig {
        n_layer: 4,
        n_head: 8,
        n_embd: 256,
        vocab_size: 8192,
        block_size: T,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut full = Gpt::new(cfg.clone())?;
    full.init_gpt2(1);
    let tokens: Vec<u32> = (0..B * T).map(|i| (i * 7919 % 8192) as u32).collect();
    let targets: Vec<u32> = (0..B * T).map(|i| ((i + 1) * 7919 % 8192) as u32).collect();
    let opts = TpOptions {
        sequence_parallel: sp,
        ..TpOptions::default()
    };
    // per degree: (step seconds, comm seconds of the slowest-communicating rank)
    let mut samples: Vec<Vec<(f64, f64)>> = vec![Vec::new(); degrees.len()];
    let mut params = vec![0usize; degrees.len()];
    for _ in 0..steps {
        for (di, &tp) in degrees.iter().enumerate() {
            let out = LocalCluster::run(tp, |comm| -> anyhow::Result<(f64, f64, usize)> {
                let mesh = ParallelDims {
                    tp,
                    ..ParallelDims::SINGLE
                }
                .build(&comm)?;
                let plan = ParallelPlan {
                    precision: weft_kernels::Precision::F32,
                    grad_wire: weft_collectives::Dtype::F32,
                    doc_boundary: None,
                    recompute: weft_model::Recompute::None,
                    loss_chunk: 0,
                    fsdp: None,
                    pipeline: None,
                    batch: B,
                    seq: T,
                    micro_batches: 1,
                    reproducible: false,
                    tp: opts,
                };
                let mut m = ParallelGpt::new(
                    cfg.clone(),
                    Arc::new(Mlp),
                    Init::Whole(&full.params),
                    &plan,
                    mesh,
                )?;
                let batch = [MicroBatch {
                    tokens: &tokens,
                    targets: &targets,
                }];
                let comm_nanos =
                    |m: &ParallelGpt| m.stages()[0].blocks().tp().map_or(0, |g| g.comm_nanos());
                // One warm-up step, then the timed one.
                m.train_step(&batch, &AdamW::default(), 1.0)?;
                let before = comm_nanos(&m);
                let t0 = Instant::now();
                m.train_step(&batch, &AdamW::default(), 1.0)?;
                let dt = t0.elapsed().as_secs_f64();
                #[allow(clippy::cast_precision_loss)]
                let comm_s = (comm_nanos(&m) - before) as f64 * 1e-9;
                Ok((dt, comm_s, m.memory().params))
            })?;
            let mut step = 0.0f64;
            let mut comm_s = 0.0f64;
            for r in out {
                let (dt, cs, bytes) = r?;
                step = step.max(dt);
                comm_s = comm_s.max(cs);
                params[di] = bytes;
            }
            samples[di].push((step, comm_s));
        }
    }
    let median = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    println!(
        "GPT-2 L={} C={} heads={} V={} B={B} T={T}, sequence parallel: {sp}, {steps} interleaved samples (medians)",
        cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size
    );
    println!("| tp | step ms | vs tp=1 | tp comm ms | comm fraction | params/rank MiB |");
    println!("|---|---|---|---|---|---|");
    let mut base = None;
    for (di, &tp) in degrees.iter().enumerate() {
        let mut st: Vec<f64> = samples[di].iter().map(|s| s.0).collect();
        let mut cm: Vec<f64> = samples[di].iter().map(|s| s.1).collect();
        let (st, cm) = (median(&mut st), median(&mut cm));
        let b = *base.get_or_insert(st);
        #[allow(clippy::cast_precision_loss)]
        let mib = params[di] as f64 / f64::from(1u32 << 20);
        println!(
            "| {tp} | {:.1} | {:.2}x | {:.1} | {:.0}% | {mib:.2} |",
            st * 1e3,
            b / st,
            cm * 1e3,
            100.0 * cm / st
        );
    }
    Ok(())
}
