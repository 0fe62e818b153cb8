//! Step time of one model on layouts of 1, 2, 4 and 8 thread ranks at the
//! same global batch, through `ParallelGpt`'s step (what `weft train`
//! runs), with where the communication goes.
//!
//! `cargo bench -p weft-model --bench layouts [-- --steps N --embd C --layers L --reproducible]`
//! (`--reproducible`: the exact sums `weft train` runs by default; plain
//! f32 sums otherwise)
//!
//! Columns: the slowest rank's median step time and the tokens per second
//! of the global batch (ratio to one rank); bytes each rank sends per step
//! (rank 0); the share of rank 0's step inside tensor-parallel collectives
//! (which on threads includes waiting for the slowest peer); FSDP's
//! communication time on rank 0 and the part of it the step waited for
//! (hidden = 1 − exposed / comm); the measured pipeline bubble. Every rank
//! is a thread of this process, so with more ranks than cores the ratios
//! show the cores being shared as much as the layout's communication:
//! compare layouts of the same world size.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_precision_loss,
    missing_docs
)]

use std::sync::Arc;
use std::time::Instant;

use weft_collectives::{Communicator, LocalCluster, Topology};
use weft_fsdp::{FsdpConfig, Strategy, Track};
use weft_kernels::AdamW;
use weft_model::tp::TpOptions;
use weft_model::{GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan, partition_layers};
use weft_parallel::ParallelDims;
use weft_pipeline::{Measured, ScheduleKind};

const B: usize = 2;
const GLOBAL: usize = 8;

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

struct Row {
    name: String,
    world: usize,
    step: f64,
    sent_mb: f64,
    tp_share: f64,
    fsdp: Option<(f64, f64)>,
    bubble: Option<f64>,
}

/// Per measured step on rank 0: (step s, sent bytes, tp comm s, fsdp
/// (comm s, wait s), bubble); every rank's step time.
type Sample = (f64, u64, f64, Option<(f64, f64)>, Option<f64>);

#[allow(clippy::too_many_lines)]
fn bench(
    name: &str,
    cfg: &GptConfig,
    dims: ParallelDims,
    fsdp: Option<Strategy>,
    steps: usize,
    reproducible: bool,
) -> anyhow::Result<Row> {
    let t = cfg.block_size;
    let per = GLOBAL / dims.dp;
    let domain = if dims.tp > 1 {
        Topology::new(dims.tp)
    } else {
        Topology::flat()
    };
    let out = LocalCluster::builder(dims.world_size())
        .topology(domain)
        .run_each(|comm| -> anyhow::Result<Vec<Sample>> {
            let mesh = dims.build(&comm)?;
            let pipeline = if dims.pp > 1 {
                let s = ScheduleKind::OneFOneB.generate(dims.pp, per, 1)?;
                let layers = partition_layers(cfg, None, &s)?;
                Some((s, layers))
            } else {
                None
            };
            let plan = ParallelPlan {
                precision: weft_kernels::Precision::F32,
                grad_wire: weft_collectives::Dtype::F32,
                doc_boundary: None,
                recompute: weft_model::Recompute::None,
                loss_chunk: 0,
                fsdp: fsdp.map(|strategy| FsdpConfig {
                    strategy,
                    reproducible,
                    ..FsdpConfig::default()
                }),
                pipeline,
                batch: B,
                seq: t,
                micro_batches: per,
                reproducible,
                tp: TpOptions::default(),
            };
            let mut g = ParallelGpt::new(
                cfg.clone(),
                Arc::new(Mlp),
                Init::Gpt2 { seed: 1 },
                &plan,
                mesh,
            )?;
            let hp = AdamW {
                lr: 1e-4,
                ..AdamW::default()
            };
            let first = g.mesh().coords().dp() * per;
            let v = cfg.vocab_size as u32;
            let mut rows = Vec::new();
            for s in 0..steps + 2 {
                let data: Vec<(Vec<u32>, Vec<u32>)> = (first..first + per)
                    .map(|m| {
                        let seed = (s * GLOBAL + m) as u32;
                        let x: Vec<u32> = (0..(B * t) as u32)
                            .map(|i| {
                                (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % v
                            })
                            .collect();
                        let y = x.iter().map(|a| (a * 7 + 3) % v).collect();
                        (x, y)
                    })
                    .collect();
                let mbs: Vec<MicroBatch<'_>> = data
                    .iter()
                    .map(|(a, b)| MicroBatch {
                        tokens: a,
                        targets: b,
                    })
                    .collect();
                let tp_before = g.stages()[0].blocks().tp().map_or(0, |x| x.comm_nanos());
                let before = comm.traffic();
                let t0 = Instant::now();
                g.train_step(&mbs, &hp, 1.0)?;
                let secs = t0.elapsed().as_secs_f64();
                let sent = comm.traffic().since(&before).total_sent();
                let tp = (g.stages()[0].blocks().tp().map_or(0, |x| x.comm_nanos()) - tp_before)
                    as f64
                    * 1e-9;
                let fs = g.stages_mut()[0].fsdp_mut().map(|f| {
                    let sp = f.spans_mut();
                    let cw = (sp.total(Track::Comm), sp.total(Track::Wait));
                    sp.clear();
                    cw
                });
                let timeline = g.take_timeline();
                let bubble = match (dims.pp > 1, timeline) {
                    (true, Some(local)) => {
                        match g.executor().gather_timelines(g.mesh().pp(), &local)? {
                            Some(ranks) => Some(
                                Measured::new(g.schedule(), ranks)?
                                    .timeline
                                    .bubble_fraction(),
                            ),
                            None => None,
                        }
                    }
                    _ => None,
                };
                if s >= 2 {
                    rows.push((secs, sent, tp, fs, bubble));
                }
            }
            Ok(rows)
        });
    let per_rank: Vec<Vec<Sample>> = out
        .into_iter()
        .map(|r| r.map_err(|e| anyhow::anyhow!("{e}")).and_then(|x| x))
        .collect::<anyhow::Result<_>>()?;
    let r0 = &per_rank[0];
    let step = median(
        (0..steps)
            .map(|s| per_rank.iter().map(|r| r[s].0).fold(0.0, f64::max))
            .collect(),
    );
    let fsdp_c = r0[0].3.map(|_| {
        (
            median(r0.iter().map(|x| x.3.map_or(0.0, |c| c.0)).collect()),
            median(r0.iter().map(|x| x.3.map_or(0.0, |c| c.1)).collect()),
        )
    });
    let bubble = r0[0]
        .4
        .map(|_| median(r0.iter().map(|x| x.4.unwrap_or(0.0)).collect()));
    Ok(Row {
        name: name.into(),
        world: dims.world_size(),
        step,
        sent_mb: r0[0].1 as f64 / 1e6,
        tp_share: median(r0.iter().map(|x| x.2 / x.0).collect()),
        fsdp: fsdp_c,
        bubble,
    })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps = arg(&args, "--steps", 4);
    let embd = arg(&args, "--embd", 128);
    let layers = arg(&args, "--layers", 4);
    let reproducible = args.iter().any(|a| a == "--reproducible");
    let cfg = GptConfig {
        n_layer: layers,
        n_head: 4,
        n_embd: embd,
        vocab_size: 4096,
        block_size: 64,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let d = |pp, dp, tp| ParallelDims {
        pp,
        dp,
        tp,
        ep: 1,
        cp: 1,
    };
    let layouts: Vec<(&str, ParallelDims, Option<Strategy>)> = vec![
        ("1 rank", d(1, 1, 1), None),
        ("dp2", d(1, 2, 1), None),
        ("dp2 zero3", d(1, 2, 1), Some(Strategy::Full)),
        ("tp2", d(1, 1, 2), None),
        ("pp2", d(2, 1, 1), None),
        ("dp4", d(1, 4, 1), None),
        ("dp2 tp2", d(1, 2, 2), None),
        ("pp2 dp2", d(2, 2, 1), None),
        ("pp2 tp2", d(2, 1, 2), None),
        ("dp8", d(1, 8, 1), None),
        ("pp2 dp2 tp2", d(2, 2, 2), None),
        ("pp2 dp2 tp2 zero3", d(2, 2, 2), Some(Strategy::Full)),
    ];
    println!(
        "GPT L={layers} C={embd} V={} T={}, global batch {GLOBAL} x {B} sequences, {}, {steps} steps after 2 warm-up (medians)",
        cfg.vocab_size,
        cfg.block_size,
        if reproducible {
            "exact sums"
        } else {
            "plain f32 sums"
        }
    );
    let mut rows = Vec::new();
    for (name, dims, fsdp) in layouts {
        eprintln!("{name}");
        rows.push(bench(name, &cfg, dims, fsdp, steps, reproducible)?);
    }
    let base = rows[0].step;
    let tokens = (GLOBAL * B * cfg.block_size) as f64;
    println!(
        "\n| layout | ranks | step ms | tokens/s | vs 1 rank | sent MB/step (rank 0) | tp comm share | fsdp comm ms | exposed ms | hidden | bubble |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let (fc, fe, hidden) = match r.fsdp {
            Some((c, e)) => (
                format!("{:.1}", c * 1e3),
                format!("{:.1}", e * 1e3),
                if c > 0.0 {
                    format!("{:.0}%", 100.0 * (1.0 - e / c).max(0.0))
                } else {
                    "-".into()
                },
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.2}x | {:.2} | {:.0}% | {fc} | {fe} | {hidden} | {} |",
            r.name,
            r.world,
            r.step * 1e3,
            tokens / r.step,
            base / r.step,
            r.sent_mb,
            100.0 * r.tp_share,
            r.bubble
                .map_or("-".into(), |b| format!("{:.0}%", 100.0 * b)),
        );
    }
    Ok(())
}
