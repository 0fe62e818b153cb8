//! Measured, not assumed: what a training step of a composed layout sends
//! on each parallel axis — counted by the collectives' per-group traffic
//! counters ([`ParallelGpt::last_traffic`]) and summed over the ranks —
//! against the textbook volumes written out here (ring and recursive
//! doubling all-reduces, `k − 1` hops per part for reduce-scatters and
//! all-gathers, point-to-point activations), layout by layout: data, FSDP
//! (ZeRO-1, -2, -3, inside pipelines), tensor (with and without sequence
//! parallelism), pipeline (1F1B and interleaved) and expert parallelism,
//! alone and together. The plain (non-reproducible) sums: the reproducible
//! mode sends exact partial sums whose encoding depends on the values.
//!
//! And the memory of each rank, by category: predicted from the layout
//! before the model is built ([`ParallelGpt::predict_memory`]) and equal
//! to what the built model allocated ([`ParallelGpt::memory`]), rank by
//! rank, for dense and mixture-of-experts models over data, FSDP (every
//! strategy), tensor, sequence, pipeline (every kind of schedule) and
//! expert parallelism; a block's activations against the count of what
//! its backward needs.

use std::sync::Arc;

use weft_collectives::{LocalCluster, OpKind};
use weft_fsdp::{FsdpConfig, Strategy};
use weft_kernels::{AdamW, Precision};
use weft_model::tp::TpOptions;
use weft_model::{
    FeedForward, GptConfig, Init, MicroBatch, Mlp, MoeFfn, ParallelGpt, ParallelPlan, RankMemory,
    Recompute, expert_group, partition_layers,
};
use weft_moe::{MoeConfig, Router};
use weft_parallel::{ParallelDims, TrafficAxis};
use weft_pipeline::ScheduleKind;

const B: usize = 2;
const T: usize = 8;
const GLOBAL: usize = 8;

fn gpt_config() -> GptConfig {
    GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 32,
        vocab_size: 37,
        block_size: T,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

fn moe_config() -> MoeConfig {
    MoeConfig {
        router: Router::top_k(4, 2).with_normalize(true),
        shared_experts: 1,
        ..MoeConfig::new(32, 4, 2)
    }
}

fn batch(s: usize, g: usize) -> (Vec<u32>, Vec<u32>) {
    let v = gpt_config().vocab_size as u64;
    let seq: Vec<u32> = (0..B * T + 1)
        .map(|i| {
            let x = (s as u64 * 1_000_003 + g as u64 * 7919 + i as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((x >> 33) % v) as u32
        })
        .collect();
    (seq[..B * T].to_vec(), seq[1..].to_vec())
}

#[derive(Clone, Copy, Debug)]
struct Layout {
    dims: ParallelDims,
    schedule: Option<(ScheduleKind, usize)>,
    fsdp: Option<Strategy>,
    sp: bool,
    moe: bool,
    /// bf16 products (and the products' inputs kept in bf16)
    bf16: bool,
    recompute: Recompute,
    /// Tokens per chunk of the head's loss (0: none).
    loss_chunk: usize,
    /// Document masking (token 0 ends a document).
    docs: bool,
}

fn lay(pp: usize, dp: usize, tp: usize, ep: usize) -> Layout {
    Layout {
        dims: ParallelDims {
            pp,
            dp,
            tp,
            ep,
            cp: 1,
        },
        schedule: (pp > 1).then_some((ScheduleKind::OneFOneB, 1)),
        fsdp: None,
        sp: false,
        moe: ep > 1,
        bf16: false,
        recompute: Recompute::None,
        loss_chunk: 0,
        docs: false,
    }
}

/// Per axis, per op: bytes sent in the second step, summed over ranks.
/// FSDP's bytes for one rank's step, from its units and the order of the
/// passes its schedule runs: each unit's shard goes to the `n − 1` other
/// ranks of its group for every gather (ZeRO-3: before each forward and
/// backward that finds the unit freed — a unit stays gathered after its
/// forward when it is the stage's last or kept for a tied head, and is
/// freed after each backward; ZeRO-1/2: once after the update) and for
/// every reduce-scatter of its gradients (per micro-batch when the
/// gradients are sharded, once per step for ZeRO-1).
fn fsdp_bytes(
    strategy: Strategy,
    units: &[(usize, bool)],
    n: usize,
    passes: &[(bool, usize)],
    m: usize,
) -> u64 {
    let nu = units.len();
    let per = |u: usize| ((n - 1) * units[u].0 * 4) as u64;
    let mut total = 0;
    if strategy.shards_params() {
        let mut gathered = vec![false; nu];
        for &(forward, _) in passes {
            let order: Vec<usize> = if forward {
                (0..nu).collect()
            } else {
                (0..nu).rev().collect()
            };
            for u in order {
                if !gathered[u] {
                    total += per(u);
                    gathered[u] = true;
                }
                gathered[u] = forward && (u + 1 == nu || units[u].1);
            }
        }
    } else {
        total += (0..nu).map(per).sum::<u64>();
    }
    let reductions = if strategy.shards_grads() { m } else { 1 };
    total + reductions as u64 * (0..nu).map(per).sum::<u64>()
}

/// A rank's feed-forward block of `layout` (with its expert statistics
/// under ep) and the plan, in the plain or the reproducible sums.
fn setup(
    layout: Layout,
    reproducible: bool,
    mesh: &weft_parallel::ParallelMesh,
) -> (
    Arc<dyn FeedForward>,
    Option<weft_model::MoeStats>,
    ParallelPlan,
) {
    let dims = layout.dims;
    let moe = layout.moe;
    let mut stats = None;
    let ffn: Arc<dyn FeedForward> = match (moe, dims.ep > 1) {
        (false, _) => Arc::new(Mlp),
        (true, false) => Arc::new(MoeFfn::new(moe_config()).unwrap().0),
        (true, true) => {
            let (f, st) = MoeFfn::with_expert_parallel(moe_config(), expert_group(mesh)).unwrap();
            stats = Some(st);
            Arc::new(f)
        }
    };
    let per = GLOBAL / dims.dp;
    let pipeline = layout.schedule.map(|(kind, chunks)| {
        let s = kind.generate(dims.pp, per, chunks).unwrap();
        let layers = partition_layers(&gpt_config(), moe.then_some((4, 3)), &s).unwrap();
        (s, layers)
    });
    let plan = ParallelPlan {
        precision: if layout.bf16 {
            Precision::Bf16
        } else {
            Precision::F32
        },
        grad_wire: weft_collectives::Dtype::F32,
        doc_boundary: layout.docs.then_some(0),
        recompute: layout.recompute,
        loss_chunk: layout.loss_chunk,
        fsdp: layout.fsdp.map(|strategy| FsdpConfig {
            strategy,
            hybrid_shard: 2.min(dims.dp / dims.ep),
            reproducible,
            ..FsdpConfig::default()
        }),
        pipeline,
        batch: B,
        seq: T,
        micro_batches: per,
        reproducible,
        tp: TpOptions {
            sequence_parallel: layout.sp,
            reproducible,
            ..TpOptions::default()
        },
    };
    (ffn, stats, plan)
}

/// One AdamW step of `g` on its data-parallel share of step `s`'s batch.
fn step(g: &mut ParallelGpt, s: usize) {
    let per = GLOBAL / g.mesh().dims().dp;
    let first = g.mesh().coords().dp() * per;
    let data: Vec<_> = (first..first + per).map(|m| batch(s, m)).collect();
    let mbs: Vec<_> = data
        .iter()
        .map(|(a, b)| MicroBatch {
            tokens: a,
            targets: b,
        })
        .collect();
    g.train_step(&mbs, &AdamW::default(), 1.0).unwrap();
}

/// An axis, its bytes per op, and its scalars' bytes.
type AxisSent = (TrafficAxis, Vec<(OpKind, u64)>, u64);

/// What a step sent on each axis, summed over ranks (per op, and the
/// scalars), FSDP's bytes by the formula, and the expert group's by the
/// formula from the routing each rank logged.
fn measure(layout: Layout) -> (Vec<AxisSent>, u64, u64) {
    let dims = layout.dims;
    let out = LocalCluster::run(dims.world_size(), |comm| {
        let mesh = dims.build(&comm).unwrap();
        let (ffn, stats, plan) = setup(layout, false, &mesh);
        let per = plan.micro_batches;
        let mut g =
            ParallelGpt::new(gpt_config(), ffn, Init::Gpt2 { seed: 3 }, &plan, mesh).unwrap();
        let mut t = None;
        let mut off_rows = (0u64, 0usize);
        for s in 0..2 {
            if let Some(st) = &stats {
                st.take();
            }
            step(&mut g, s);
            t = g.last_traffic().cloned();
            if let Some(st) = &stats {
                let el = 4 / dims.ep;
                let me = g.mesh().coords().ep;
                let fw = st.take();
                off_rows = (
                    fw.iter()
                        .map(|(_, f)| {
                            f.stats
                                .tokens_per_expert
                                .iter()
                                .enumerate()
                                .filter(|(e, _)| e / el != me)
                                .map(|(_, c)| *c)
                                .sum::<u64>()
                        })
                        .sum(),
                    fw.len(),
                );
            }
        }
        // expert parallelism, per MoE layer and micro-batch: the per-expert
        // row counts exchanged twice (forward, backward: E/ep f64 to each
        // other rank); the rows routed to other ranks' experts sent three
        // times (dispatch; the backward's recomputing dispatch and the
        // output gradient's), and the rows received sent back twice (the
        // combine, the input gradient's) — 5 · C floats per routed-away row
        // over the group.
        let (off, forwards) = off_rows;
        let el = 4 / dims.ep;
        let ep_want = 5 * off * 4 * gpt_config().n_embd as u64
            + (forwards * 2 * (dims.ep - 1) * el * 8) as u64;
        // this rank's FSDP bytes by the formula
        let mut want = 0;
        if let Some(strategy) = layout.fsdp {
            let pp = g.mesh().coords().pp;
            let kind = layout.schedule.map_or(ScheduleKind::OneFOneB, |s| s.0);
            let chunks = layout.schedule.map_or(1, |s| s.1);
            let sched = kind.generate(dims.pp, per, chunks).unwrap();
            for (c, st) in g.stages().iter().enumerate() {
                let f = st.fsdp().unwrap();
                let units: Vec<(usize, bool)> = f
                    .plan()
                    .units()
                    .iter()
                    .map(|u| (u.shard_len, u.keep_gathered))
                    .collect();
                let passes: Vec<(bool, usize)> = sched
                    .stage(pp)
                    .iter()
                    .filter(|a| a.chunk == c)
                    .map(|a| (a.kind == weft_pipeline::ActionKind::Forward, a.microbatch))
                    .collect();
                want += fsdp_bytes(strategy, &units, dims.dp, &passes, per);
                // the embedding stage of a pipeline gathers its unit once
                // more after the update, for the head's copy of wte
                if dims.pp > 1 && pp == 0 && c == 0 {
                    want += ((dims.dp - 1) * units[0].0 * 4) as u64;
                }
            }
        }
        (t.unwrap(), want, ep_want)
    })
    .unwrap();
    let want: u64 = out.iter().map(|x| x.1).sum();
    let ep_want: u64 = out.iter().map(|x| x.2).sum();
    let out: Vec<_> = out.into_iter().map(|x| x.0).collect();
    let axes = TrafficAxis::ALL
        .iter()
        .map(|&a| {
            let ops = OpKind::ALL
                .iter()
                .map(|&op| (op, out.iter().map(|t| t.payload.axis(a).sent_by(op)).sum()))
                .filter(|(_, b)| *b > 0)
                .collect();
            (a, ops, out.iter().map(|t| t.scalars.sent(a)).sum())
        })
        .collect();
    (axes, want, ep_want)
}

/// Bytes a group of `k` ranks sends, in all, for an all-reduce of `bytes`
/// per rank: recursive doubling (`k·log2 k` times the buffer) for small
/// messages over a power-of-two group, else the ring (`2(k−1)` times).
fn ar(k: usize, bytes: usize) -> u64 {
    if k == 1 {
        return 0;
    }
    let (k, b) = (k as u64, bytes as u64);
    if bytes <= weft_collectives::SMALL_MESSAGE_BYTES && k.is_power_of_two() {
        k * u64::from(k.trailing_zeros()) * b
    } else {
        2 * (k - 1) * b
    }
}

/// The ring all-reduce (tensor parallelism's default algorithm).
fn ring(k: usize, bytes: usize) -> u64 {
    2 * (k as u64 - 1) * bytes as u64
}

/// A reduce-scatter's or an all-gather's bytes over `k` ranks: every part
/// travels `k − 1` hops.
fn rs(k: usize, bytes: usize) -> u64 {
    (k as u64 - 1) * bytes as u64
}

/// The formulas: bytes a step sends on each axis, summed over all ranks,
/// for a dense GPT with tied embeddings in the plain (non-reproducible)
/// mode. `N = B·T` tokens per micro-batch, `m` micro-batches per
/// pipeline, `S` (virtual) stages holding `L_s` blocks.
fn formula(layout: Layout) -> [u64; 6] {
    let c = gpt_config();
    let ParallelDims { pp, dp, tp, .. } = layout.dims;
    let (n, cc, v, t) = (B * T, c.n_embd, c.vocab_size, c.block_size);
    let m = GLOBAL / dp;
    let chunks = layout.schedule.map_or(1, |s| s.1);
    let kind = layout.schedule.map_or(ScheduleKind::OneFOneB, |s| s.0);
    let sched = kind.generate(pp, m, chunks).unwrap();
    let layers = partition_layers(&c, layout.moe.then_some((4, 3)), &sched).unwrap();
    let vs = layers.len();
    let mut axes = [0u64; 6];
    // tp: per micro-batch, an N·C all-reduce for the embedding, four per
    // block (two forward, two backward), one for the head's input
    // gradient, and the cross-entropy's 3N floats (maxima, sums), all by
    // the ring (tensor parallelism's default algorithm); under
    // sequence parallelism each N·C all-reduce is a reduce-scatter and an
    // all-gather instead. Every tp group (pp · dp of them) runs its stage's.
    // (A mixture-of-experts block runs its router and experts whole on
    // every tp rank: two all-reduces per block, the attention's.)
    let big = 4 * n * cc;
    let per_block = if layout.moe { 2 } else { 4 };
    for (s, &l) in layers.iter().enumerate() {
        let calls = per_block * l + usize::from(s == 0) + usize::from(s + 1 == vs);
        let per_mb = if layout.sp {
            calls as u64 * 2 * rs(tp, big)
        } else {
            calls as u64 * ring(tp, big)
        } + if s + 1 == vs { ring(tp, 4 * 3 * n) } else { 0 };
        axes[0] += (dp * m) as u64 * per_mb;
    }
    // dp: one all-reduce per stage of its gradients, by every (pp, tp)
    // rank's group; the parameters each tp rank holds of a block: the
    // layernorms and the row-parallel biases whole, the rest split.
    let block_sum = tp * (4 * cc + 2 * cc)
        + (3 * cc * cc + 3 * cc)
        + cc * cc
        + (4 * cc * cc + 4 * cc)
        + 4 * cc * cc;
    let block_rank = |r: usize| {
        let _ = r;
        block_sum / tp
    };
    for (s, &l) in layers.iter().enumerate() {
        for r in 0..tp {
            let rows = v / tp + usize::from(r < v % tp);
            let mut p = l * block_rank(r);
            if s == 0 {
                p += rows * cc + t * cc;
            }
            if s + 1 == vs {
                p += 2 * cc;
            }
            if layout.sp {
                // the layernorms' partial gradients travel on dp × tp
                let ln = 4 * cc * l + if s + 1 == vs { 2 * cc } else { 0 };
                p -= ln;
                if r == 0 {
                    axes[5] += ar(dp * tp, 4 * ln);
                }
            }
            axes[1] += ar(dp, 4 * p);
        }
    }
    // pp: every boundary between virtual stages carries each micro-batch's
    // activations forward and their gradient back (each tp rank its own
    // copy, or its N/tp rows under sequence parallelism); with the
    // embedding and head on different ranks, the head's wte gradient of
    // each micro-batch goes to the embedding's rank and the updated wte
    // comes back once per step (split over the tp ranks: V·C in all).
    if pp > 1 {
        let rows = if layout.sp { n / tp } else { n };
        let acts = 2 * m * (vs - 1) * tp * 4 * rows * cc;
        let tied = (m + 1) * 4 * v * cc;
        axes[2] += (dp * (acts + tied)) as u64;
    }
    axes
}

#[test]
fn each_axis_sends_what_the_formulas_say() {
    let with = |l: Layout, f: &dyn Fn(Layout) -> Layout| f(l);
    let sp = |l: Layout| Layout { sp: true, ..l };
    let inter = |l: Layout| Layout {
        schedule: Some((ScheduleKind::Interleaved, 2)),
        ..l
    };
    let layouts = [
        lay(1, 2, 1, 1),
        lay(1, 4, 1, 1),
        lay(1, 1, 2, 1),
        lay(1, 1, 4, 1),
        with(lay(1, 1, 2, 1), &sp),
        lay(2, 1, 1, 1),
        lay(4, 1, 1, 1),
        with(lay(2, 1, 1, 1), &inter),
        lay(1, 2, 2, 1),
        lay(2, 2, 1, 1),
        lay(2, 4, 1, 1),
        lay(2, 1, 2, 1),
        with(lay(2, 1, 2, 1), &sp),
        lay(2, 2, 2, 1),
        with(lay(2, 2, 2, 1), &inter),
    ];
    let fsdp = |l: Layout, s: Strategy| Layout { fsdp: Some(s), ..l };
    let mut all = layouts.to_vec();
    for s in [Strategy::Optimizer, Strategy::GradOp, Strategy::Full] {
        all.extend([
            fsdp(lay(1, 2, 1, 1), s),
            fsdp(lay(1, 4, 1, 1), s),
            fsdp(lay(2, 2, 1, 1), s),
            fsdp(lay(1, 2, 2, 1), s),
            fsdp(lay(2, 2, 2, 1), s),
            fsdp(inter(lay(2, 2, 1, 1)), s),
        ]);
    }
    all.extend([
        lay(1, 2, 1, 2),
        lay(1, 4, 1, 2),
        lay(1, 4, 1, 4),
        lay(1, 2, 2, 2),
        lay(2, 2, 1, 2),
        lay(2, 2, 2, 2),
        fsdp(lay(1, 4, 1, 2), Strategy::Full),
    ]);
    for l in all {
        let (got, fsdp, ep) = measure(l);
        let mut want = formula(l);
        if l.fsdp.is_some() {
            want[1] = fsdp;
        }
        want[4] = ep;
        for (i, (a, ops, scalars)) in got.iter().enumerate() {
            if *a == TrafficAxis::Dp {
                // the scalars on dp: every micro-batch's f64 loss gathered
                // by every data-parallel group (pp · tp of them)
                let (d, m) = (l.dims.dp as u64, (GLOBAL / l.dims.dp) as u64);
                let groups = (l.dims.pp * l.dims.tp) as u64;
                let losses = groups * d * (d - 1) * m * 8;
                if l.fsdp.is_none() {
                    assert_eq!(*scalars, losses, "{l:?}: losses");
                } else {
                    // and FSDP merges its shards' exact squared norms
                    assert!(*scalars > losses, "{l:?}: losses and norms");
                }
            }
            if l.moe && *a == TrafficAxis::Dp {
                continue; // (the formula counts the dense model's gradients)
            }
            if *a == TrafficAxis::Ep && l.fsdp.is_some() {
                // FSDP over the expert replicas pre-sums the dense
                // gradients over the expert group: the tokens are the
                // all-to-alls
                let tokens: u64 = ops
                    .iter()
                    .filter(|(op, _)| *op == OpKind::AllToAllV)
                    .map(|(_, b)| b)
                    .sum();
                assert_eq!(tokens, want[i], "{l:?}: expert tokens");
                continue;
            }
            let sent: u64 = ops.iter().map(|(_, b)| b).sum();
            assert_eq!(sent, want[i], "{l:?}: {} axis ({ops:?})", a.name());
        }
    }
}

/// Per rank: the memory predicted before building the model, counted
/// after building it, and counted after two training steps.
fn memory(layout: Layout, reproducible: bool) -> Vec<[RankMemory; 3]> {
    let dims = layout.dims;
    LocalCluster::run(dims.world_size(), |comm| {
        let mesh = dims.build(&comm).unwrap();
        let (ffn, _, plan) = setup(layout, reproducible, &mesh);
        let predicted =
            ParallelGpt::predict_memory(&gpt_config(), ffn.clone(), &plan, &mesh).unwrap();
        let mut g =
            ParallelGpt::new(gpt_config(), ffn, Init::Gpt2 { seed: 3 }, &plan, mesh).unwrap();
        let built = g.memory();
        for s in 0..2 {
            step(&mut g, s);
        }
        [predicted, built, g.memory()]
    })
    .unwrap()
}

#[test]
fn memory_is_what_the_layout_predicts() {
    let sp = |l: Layout| Layout { sp: true, ..l };
    let sched = |l: Layout, k: ScheduleKind, c: usize| Layout {
        schedule: Some((k, c)),
        ..l
    };
    let fsdp = |l: Layout, s: Strategy| Layout { fsdp: Some(s), ..l };
    let moe = |l: Layout| Layout { moe: true, ..l };
    let bf16 = |l: Layout| Layout { bf16: true, ..l };
    let full = |l: Layout| Layout {
        recompute: Recompute::Full,
        ..l
    };
    let mut layouts = vec![
        full(lay(1, 1, 1, 1)),
        Layout {
            recompute: Recompute::Every(2),
            ..bf16(sp(lay(2, 1, 2, 1)))
        },
        full(moe(lay(1, 1, 1, 1))),
        full(fsdp(
            sched(lay(2, 2, 1, 1), ScheduleKind::ZbH1, 1),
            Strategy::Full,
        )),
        Layout {
            docs: true,
            ..full(sched(lay(2, 1, 1, 1), ScheduleKind::ZbV, 2))
        },
        Layout {
            recompute: Recompute::Selective,
            ..sp(lay(2, 2, 2, 1))
        },
        Layout {
            recompute: Recompute::Selective,
            docs: true,
            ..bf16(sched(lay(2, 1, 1, 1), ScheduleKind::ZbH1, 1))
        },
        bf16(lay(1, 1, 1, 1)),
        bf16(sp(lay(2, 1, 2, 1))),
        bf16(moe(lay(1, 1, 1, 1))),
        bf16(fsdp(
            sched(lay(2, 2, 1, 1), ScheduleKind::ZbH1, 1),
            Strategy::Full,
        )),
        lay(1, 1, 1, 1),
        lay(1, 2, 1, 1),
        lay(1, 1, 2, 1),
        sp(lay(1, 1, 2, 1)),
        lay(2, 1, 1, 1),
        sched(lay(2, 1, 1, 1), ScheduleKind::GPipe, 1),
        sched(lay(2, 1, 1, 1), ScheduleKind::Interleaved, 2),
        sched(lay(2, 1, 1, 1), ScheduleKind::ZbH1, 1),
        sched(lay(2, 1, 1, 1), ScheduleKind::ZbV, 2),
        lay(2, 2, 2, 1),
        sp(lay(2, 1, 2, 1)),
        moe(lay(1, 1, 1, 1)),
        lay(1, 2, 1, 2),
        lay(2, 2, 2, 2),
    ];
    for s in Strategy::ALL {
        layouts.push(fsdp(lay(1, 2, 1, 1), s));
        layouts.push(fsdp(lay(2, 4, 1, 1), s));
        layouts.push(fsdp(lay(1, 2, 2, 1), s));
    }
    layouts.push(fsdp(lay(2, 2, 1, 2), Strategy::Full));
    layouts.push(fsdp(
        sched(lay(2, 2, 1, 1), ScheduleKind::ZbH1, 1),
        Strategy::Full,
    ));
    for l in layouts {
        for repro in [false, true] {
            for (r, [predicted, built, after]) in memory(l, repro).into_iter().enumerate() {
                let what = format!("{l:?} reproducible={repro} rank {r}");
                assert_eq!(predicted, built, "{what}: predicted vs allocated");
                assert!(built.params > 0 && built.activations > 0, "{what}");
                // between steps the same buffers are held, but FSDP's
                // gradients (allocated in the step)
                if l.fsdp.is_none() {
                    assert_eq!(after, built, "{what}: after two steps");
                }
                assert_eq!(
                    RankMemory { grads: 0, ..after },
                    RankMemory { grads: 0, ..built },
                    "{what}: after two steps"
                );
            }
        }
    }
}

#[test]
fn a_blocks_activations_are_the_textbook_count() {
    // per block and micro-batch of N = B·T tokens, C channels, H heads,
    // k tensor-parallel ranks: the two layernorm outputs (N·C each), q, k,
    // v (3·N·C/k), the attention output (N·C/k), its probabilities
    // (B·H/k·T²), the residual after attention and the block's output
    // (rows·C each), the layernorms' mean and 1/std (2·rows each), and
    // the MLP's pre- and post-GELU hidden (2·N·4C/k); rows = N, or N/k
    // under sequence parallelism
    let c = gpt_config();
    let (n, cc, h) = (B * T, c.n_embd, c.n_head);
    for (k, sp) in [(1, false), (2, false), (2, true), (4, true)] {
        let got = LocalCluster::run(k, |comm| {
            let ffn: Arc<dyn FeedForward> = Arc::new(Mlp);
            let blocks = if k > 1 {
                weft_model::GptBlocks::with_tp(
                    c.clone(),
                    ffn,
                    weft_model::tp::TensorParallel::new(
                        Arc::new(comm),
                        TpOptions {
                            sequence_parallel: sp,
                            ..TpOptions::default()
                        },
                    ),
                )
                .unwrap()
            } else {
                weft_model::GptBlocks::new(c.clone(), ffn).unwrap()
            };
            [Precision::F32, Precision::Bf16].map(|precision| {
                let mut blocks = blocks.clone();
                blocks.set_precision(precision);
                let a = blocks.block_acts(B, T).unwrap();
                (blocks.block_acts_len(B, T).unwrap(), a.bytes())
            })
        })
        .unwrap()
        .concat();
        let rows = if sp { n / k } else { n };
        let want = 2 * n * cc
            + 3 * n * cc / k
            + n * cc / k
            + B * (h / k) * T
            + 2 * rows * cc
            + 4 * rows
            + 2 * n * 4 * cc / k;
        // in bf16, the layernorms' outputs and the GELU output (the
        // products' inputs alone) take half
        let bf16_floats = want - (2 * n * cc + n * 4 * cc / k) / 2;
        for ((len, bytes), precision) in got
            .into_iter()
            .zip([Precision::F32, Precision::Bf16].repeat(k))
        {
            let want = if precision == Precision::Bf16 {
                bf16_floats
            } else {
                want
            };
            assert_eq!(len, want, "tp={k} sp={sp} {precision:?}");
            assert_eq!(bytes, 4 * want, "tp={k} sp={sp} {precision:?}: allocated");
        }
    }
}

/// Keeping the products' inputs in bf16 changes no bit of a bf16 step:
/// activations planned in f32 (the products round them as they pack)
/// and in bf16 give the same loss, logits and gradients, on one rank and
/// under tensor parallelism with sequence parallelism (whose layernorm
/// outputs are gathered, then rounded) — and the bf16 ones are smaller.
#[test]
fn bf16_activations_change_no_bit_and_take_less() {
    let c = gpt_config();
    let (tokens, targets) = batch(0, 0);
    for (k, sp) in [(1, false), (2, true), (2, false)] {
        let results = LocalCluster::run(k, |comm| {
            let mut whole = weft_model::Gpt::new(c.clone()).unwrap();
            whole.init_gpt2(7);
            let mut m = if k > 1 {
                let tp = weft_model::tp::TensorParallel::new(
                    Arc::new(comm),
                    TpOptions {
                        sequence_parallel: sp,
                        ..TpOptions::default()
                    },
                );
                weft_model::Gpt::shard_of(&whole, tp).unwrap()
            } else {
                whole
            };
            let wide = m.activations(B, T).unwrap();
            m.set_precision(Precision::Bf16);
            let narrow = m.activations(B, T).unwrap();
            let smaller = wide.bytes() - narrow.bytes();
            let mut step = |mut acts: weft_model::Activations| {
                m.zero_grad();
                let loss = m
                    .forward(&mut acts, &tokens, Some(&targets))
                    .unwrap()
                    .unwrap();
                let logits: Vec<u32> = acts.logits().iter().map(|x| x.to_bits()).collect();
                m.backward(&mut acts).unwrap();
                let grads: Vec<Vec<u32>> = m
                    .layout()
                    .specs()
                    .iter()
                    .map(|s| {
                        m.grad(&s.name)
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits())
                            .collect()
                    })
                    .collect();
                (loss.to_bits(), logits, grads)
            };
            let (a, b) = (step(wide), step(narrow));
            // bf16 activations refuse to run in another precision
            m.set_precision(Precision::F32);
            let mut acts = {
                m.set_precision(Precision::Bf16);
                let a = m.activations(B, T).unwrap();
                m.set_precision(Precision::F32);
                a
            };
            let e = m.forward(&mut acts, &tokens, Some(&targets)).unwrap_err();
            assert!(e.to_string().contains("bf16"), "{e}");
            (a == b, smaller)
        })
        .unwrap();
        let (cc, n) = (c.n_embd, B * T);
        for (same, smaller) in results {
            assert!(same, "tp={k} sp={sp}: bf16 activations changed the step");
            // 2 bytes saved per value of ln_1 and ln_2 (N·C each) and the
            // GELU output (N·4C/k), per layer
            assert_eq!(
                smaller,
                c.n_layer * 2 * (2 * n * cc + n * 4 * cc / k),
                "tp={k} sp={sp}"
            );
        }
    }
}
