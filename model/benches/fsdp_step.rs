//! Step time of ZeRO-3 against DDP and a single rank at the same per-rank
//! batch, on the thread backend, and how much communication is hidden.
//!
//! `cargo bench -p weft-model --bench fsdp_step [-- --steps N --ranks N --layers L --embd C --micro M --bf16 --only NAME,...]`
//!
//! `--bf16`: every row trains in bf16 mixed precision (the linear layers'
//! products on bf16 operands); the "bf16 weight gathers" row then gathers
//! the products' weights in bf16 and the rest in f32, the same bits as
//! the f32 gathers of "ZeRO-3, prefetch 1" in fewer bytes.
//!
//! Every row runs the same per-rank work through [`ParallelGpt`]'s step:
//! `--micro` micro-batches (default 1) of B·T tokens per rank per step. "comm" is the time
//! FSDP's collectives were in flight (summed over operations), "exposed"
//! the time the training thread was blocked on them; hidden = 1 − exposed
//! / comm (replicas reduce their gradients after the backward, all of it
//! exposed, and have no FSDP spans: "-"). Each step's time is the slowest
//! rank's; a round runs every configuration for `--steps` steps (after two
//! warm-up steps) and takes the median; the table shows the median over
//! `--rounds` rounds, so that load on a shared machine hits every row
//! alike.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_precision_loss,
    missing_docs
)]

use std::sync::Arc;

use std::time::Instant;

use weft_collectives::{Communicator, LocalCluster};
use weft_fsdp::{FsdpConfig, Precision, Strategy, Track};
use weft_kernels::AdamW;
use weft_model::tp::TpOptions;
use weft_model::{Gpt, GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan};
use weft_parallel::ParallelDims;

struct Row {
    name: String,
    ranks: usize,
    step: f64,
    comm: f64,
    exposed: f64,
    sent_mb: f64,
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[allow(clippy::too_many_arguments)]
fn bench(
    name: &str,
    cfg: &GptConfig,
    params: &[f32],
    ranks: usize,
    fc: Option<&FsdpConfig>,
    reproducible: bool,
    b: usize,
    t: usize,
    micro: usize,
    warmup: usize,
    steps: usize,
    precision: weft_kernels::Precision,
) -> anyhow::Result<Row> {
    let out = LocalCluster::run(ranks, |comm| -> anyhow::Result<Vec<(f64, f64, f64, u64)>> {
        let mesh = ParallelDims {
            dp: ranks,
            ..ParallelDims::SINGLE
        }
        .build(&comm)?;
        let plan = ParallelPlan {
            precision,
            grad_wire: weft_collectives::Dtype::F32,
            doc_boundary: None,
            recompute: weft_model::Recompute::None,
            loss_chunk: 0,
            fsdp: fc.cloned(),
            pipeline: None,
            batch: b,
            seq: t,
            micro_batches: micro,
            reproducible,
            tp: TpOptions::default(),
        };
        let mut g = ParallelGpt::new(cfg.clone(), Arc::new(Mlp), Init::Whole(params), &plan, mesh)?;
        let hp = AdamW {
            lr: 1e-4,
            ..AdamW::default()
        };
        let dp_rank = g.mesh().coords().dp();
        let v = cfg.vocab_size as u32;
        let mut rows = Vec::new();
        for s in 0..warmup + steps {
            let data: Vec<(Vec<u32>, Vec<u32>)> = (0..micro)
                .map(|m| {
                    let seed = ((s * ranks + dp_rank) * micro + m) as u32;
                    let tokens: Vec<u32> = (0..(b * t) as u32)
                        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % v)
                        .collect();
                    let targets: Vec<u32> = tokens.iter().map(|x| (x * 7 + 3) % v).collect();
                    (tokens, targets)
                })
                .collect();
            let batches: Vec<MicroBatch<'_>> = data
                .iter()
                .map(|(tokens, targets)| MicroBatch { tokens, targets })
                .collect();
            let before = comm.traffic();
            let start = Instant::now();
            g.train_step(&batches, &hp, 1.0)?;
            let secs = start.elapsed().as_secs_f64();
            let sent = comm.traffic().since(&before).total_sent();
            let (c, w) = match g.stages_mut()[0].fsdp_mut() {
                Some(f) => {
                    let spans = f.spans_mut();
                    let cw = (spans.total(Track::Comm), spans.total(Track::Wait));
                    spans.clear();
                    cw
                }
                None => (f64::NAN, f64::NAN),
            };
            if s >= warmup {
                rows.push((secs, c, w, sent));
            }
        }
        Ok(rows)
    })?;
    let per_rank: Vec<Vec<(f64, f64, f64, u64)>> = out.into_iter().collect::<Result<_, _>>()?;
    // per step: the slowest rank
    let slowest = |k: usize| -> Vec<f64> {
        (0..steps)
            .map(|s| {
                per_rank
                    .iter()
                    .map(|r| match k {
                        0 => r[s].0,
                        1 => r[s].1,
                        _ => r[s].2,
                    })
                    // NaN (no FSDP spans) stays NaN
                    .fold(0.0, |m: f64, x| if x.is_nan() { x } else { m.max(x) })
            })
            .collect()
    };
    Ok(Row {
        name: name.into(),
        ranks,
        step: median(slowest(0)),
        comm: median(slowest(1)),
        exposed: median(slowest(2)),
        sent_mb: per_rank[0][0].3 as f64 / 1e6,
    })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps = arg(&args, "--steps", 4);
    let rounds = arg(&args, "--rounds", 3);
    let ranks = arg(&args, "--ranks", 2);
    let layers = arg(&args, "--layers", 6);
    let embd = arg(&args, "--embd", 192);
    let (b, t) = (arg(&args, "--batch", 4), arg(&args, "--seq", 64));
    let micro = arg(&args, "--micro", 1).max(1);
    let precision = if args.iter().any(|a| a == "--bf16") {
        weft_kernels::Precision::Bf16
    } else {
        weft_kernels::Precision::F32
    };
    let cfg = GptConfig {
        n_layer: layers,
        n_head: 6,
        n_embd: embd,
        vocab_size: 4096,
        block_size: t,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut g = Gpt::new(cfg.clone())?;
    g.init_gpt2(1);
    println!(
        "GPT L={layers} C={embd} V={} ({:.2} M params), per-rank batch {micro} x B={b} T={t}, products in {}, {rounds} rounds of {steps} steps after 2 warm-up",
        cfg.vocab_size,
        g.params.len() as f64 / 1e6,
        precision.name()
    );
    let plain = |s: Strategy| FsdpConfig {
        strategy: s,
        reproducible: false,
        ..FsdpConfig::default()
    };
    let sharded = |f: FsdpConfig| Some(f);
    let runs: Vec<(&str, usize, Option<FsdpConfig>)> = vec![
        ("single rank", 1, None),
        ("DDP", ranks, None),
        ("ZeRO-3, prefetch 1", ranks, sharded(plain(Strategy::Full))),
        (
            "ZeRO-3, prefetch 0",
            ranks,
            sharded(FsdpConfig {
                prefetch: 0,
                ..plain(Strategy::Full)
            }),
        ),
        (
            "ZeRO-3, prefetch 2",
            ranks,
            sharded(FsdpConfig {
                prefetch: 2,
                ..plain(Strategy::Full)
            }),
        ),
        (
            "ZeRO-3, bf16 weight gathers",
            ranks,
            sharded(FsdpConfig {
                precision: Precision::BF16_PARAMS,
                ..plain(Strategy::Full)
            }),
        ),
        (
            "ZeRO-3, bf16 params+grads",
            ranks,
            sharded(FsdpConfig {
                precision: Precision::BF16,
                ..plain(Strategy::Full)
            }),
        ),
        ("ZeRO-2", ranks, sharded(plain(Strategy::GradOp))),
        ("DDP, reproducible", ranks, None),
        (
            "ZeRO-3, reproducible",
            ranks,
            sharded(FsdpConfig {
                reproducible: true,
                ..plain(Strategy::Full)
            }),
        ),
    ];
    // `--only a,b`: the rows whose names contain one of these (the single
    // rank and DDP always run: the ratios are against DDP)
    let only: Vec<String> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let runs: Vec<_> = runs
        .into_iter()
        .enumerate()
        .filter(|(i, (name, _, _))| {
            *i < 2 || only.is_empty() || only.iter().any(|o| name.contains(o.as_str()))
        })
        .map(|(_, r)| r)
        .collect();
    let mut per_round: Vec<Vec<Row>> = runs.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, (name, n, fc)) in runs.iter().enumerate() {
            eprintln!("round {round}: {name} on {n} rank(s)");
            let reproducible = name.contains("reproducible");
            per_round[i].push(bench(
                name,
                &cfg,
                &g.params,
                *n,
                fc.as_ref(),
                reproducible,
                b,
                t,
                micro,
                2,
                steps,
                precision,
            )?);
        }
    }
    let rows: Vec<Row> = per_round
        .into_iter()
        .map(|rs| Row {
            name: rs[0].name.clone(),
            ranks: rs[0].ranks,
            step: median(rs.iter().map(|r| r.step).collect()),
            comm: median(rs.iter().map(|r| r.comm).collect()),
            exposed: median(rs.iter().map(|r| r.exposed).collect()),
            sent_mb: rs[0].sent_mb,
        })
        .collect();
    let ddp = rows[1].step;
    println!("\n| run | ranks | step ms | vs DDP | comm ms | exposed ms | hidden | sent MB/step |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let ms = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{:.1}", x * 1e3)
            }
        };
        let hidden = if r.comm > 0.0 {
            format!("{:.0}%", 100.0 * (1.0 - r.exposed / r.comm).max(0.0))
        } else {
            "-".into()
        };
        println!(
            "| {} | {} | {:.1} | {:.2}× | {} | {} | {} | {:.2} |",
            r.name,
            r.ranks,
            r.step * 1e3,
            r.step / ddp,
            ms(r.comm),
            ms(r.exposed),
            hidden,
            r.sent_mb
        );
    }
    Ok(())
}
