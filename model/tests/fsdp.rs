//! weft's GPT fully sharded with `weft-fsdp` (its stages' FSDP hooks in
//! the one block loop), through [`ParallelGpt`]'s training step, against
//! the serial model and one rank: bitwise for every strategy and group
//! size in reproducible mode; memory and traffic from the buffers and the
//! byte counters; spans; checkpoint round trip; errors.

use std::sync::Arc;

use weft_collectives::{Communicator, LocalCluster, OpKind, Topology, Traffic};
use weft_fsdp::{Category, FsdpConfig, Precision, Strategy, Track};
use weft_kernels::AdamW;
use weft_model::tp::TpOptions;
use weft_model::{Gpt, GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan};
use weft_parallel::ParallelDims;

const B: usize = 2;
const T: usize = 8;

fn cfg(tied: bool, n_layer: usize) -> GptConfig {
    GptConfig {
        n_layer,
        n_head: 2,
        n_embd: 16,
        vocab_size: 37,
        block_size: T,
        tied_embeddings: tied,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

fn init(c: &GptConfig) -> Vec<f32> {
    let mut g = Gpt::new(c.clone()).unwrap();
    g.init_gpt2(7);
    g.params.clone()
}

/// Tokens and targets of global micro-batch `g` of step `s`.
fn batch(c: &GptConfig, s: usize, g: usize) -> (Vec<u32>, Vec<u32>) {
    let v = c.vocab_size as u64;
    let seq: Vec<u32> = (0..B * T + 1)
        .map(|i| {
            let x = (s as u64 * 1_000_003 + g as u64 * 7919 + i as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((x >> 33) % v) as u32
        })
        .collect();
    (seq[..B * T].to_vec(), seq[1..].to_vec())
}

fn hp() -> AdamW {
    AdamW {
        lr: 3e-3,
        weight_decay: 0.1,
        ..AdamW::default()
    }
}

/// A GPT on `n` data-parallel ranks, sharded with `fsdp` (or replicas).
fn model(
    c: &GptConfig,
    comm: &dyn Communicator,
    n: usize,
    fsdp: Option<FsdpConfig>,
    per: usize,
    p0: &[f32],
) -> weft_model::Result<ParallelGpt> {
    model_in(c, comm, n, fsdp, per, p0, weft_kernels::Precision::F32)
}

/// [`model`] with its products in `precision`.
fn model_in(
    c: &GptConfig,
    comm: &dyn Communicator,
    n: usize,
    fsdp: Option<FsdpConfig>,
    per: usize,
    p0: &[f32],
    precision: weft_kernels::Precision,
) -> weft_model::Result<ParallelGpt> {
    let mesh = ParallelDims {
        dp: n,
        ..ParallelDims::SINGLE
    }
    .build(comm)?;
    let plan = ParallelPlan {
        precision,
        grad_wire: weft_collectives::Dtype::F32,
        doc_boundary: None,
        recompute: weft_model::Recompute::None,
        loss_chunk: 0,
        reproducible: fsdp.as_ref().is_none_or(|f| f.reproducible),
        fsdp,
        pipeline: None,
        batch: B,
        seq: T,
        micro_batches: per,
        tp: TpOptions::default(),
    };
    ParallelGpt::new(c.clone(), Arc::new(Mlp), Init::Whole(p0), &plan, mesh)
}

#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<u64>,
    norms: Vec<u64>,
    params: Vec<u32>,
}

/// Runs `steps` steps of a global batch of `global_m` micro-batches over
/// `n` ranks; returns the losses, norms and final parameters (bits), after
/// checking every rank's losses agree.
fn run(
    c: &GptConfig,
    n: usize,
    fc: Option<&FsdpConfig>,
    global_m: usize,
    steps: usize,
    clip: f64,
) -> Run {
    let p0 = init(c);
    let per = global_m / n;
    let fc = fc.map(|f| FsdpConfig {
        hybrid_shard: if n.is_multiple_of(f.hybrid_shard) {
            f.hybrid_shard
        } else {
            1
        },
        ..f.clone()
    });
    let out = LocalCluster::builder(n)
        .topology(Topology::new(2))
        .run_each(|comm| {
            let mut g = model(c, &comm, n, fc.clone(), per, &p0).unwrap();
            let dp_rank = g.mesh().coords().dp();
            let mut losses = Vec::new();
            let mut norms = Vec::new();
            for s in 0..steps {
                let data: Vec<_> = (0..per).map(|j| batch(c, s, dp_rank * per + j)).collect();
                let mbs: Vec<_> = data
                    .iter()
                    .map(|(a, b)| MicroBatch {
                        tokens: a,
                        targets: b,
                    })
                    .collect();
                let r = g.train_step(&mbs, &hp(), clip).unwrap();
                losses.push(r.loss.to_bits());
                norms.push(r.grad_norm.to_bits());
            }
            let len = p0.len();
            let mut bufs = [vec![0.0f32; len], vec![0.0; len], vec![0.0; len]];
            let root = comm.rank() == 0;
            {
                let [a, b, c] = &mut bufs;
                g.gather_whole(root.then_some([&mut a[..], &mut b[..], &mut c[..]]))
                    .unwrap();
            }
            Run {
                losses,
                norms,
                params: bufs[0].iter().map(|x| x.to_bits()).collect(),
            }
        });
    let runs: Vec<Run> = out.into_iter().map(|r| r.unwrap()).collect();
    for r in &runs[1..] {
        assert_eq!(r.losses, runs[0].losses, "ranks disagree");
        assert_eq!(r.norms, runs[0].norms, "ranks disagree");
    }
    runs.into_iter().next().unwrap()
}

fn fcfg(strategy: Strategy) -> FsdpConfig {
    FsdpConfig {
        strategy,
        hybrid_shard: 2,
        ..FsdpConfig::default()
    }
}

#[test]
fn one_rank_one_micro_batch_is_bitwise_the_serial_model() {
    for tied in [true, false] {
        let c = cfg(tied, 2);
        let got = run(&c, 1, Some(&fcfg(Strategy::Full)), 1, 3, 0.0);
        // the serial model, PyTorch-checked in weft-model's tests
        let mut g = Gpt::new(c.clone()).unwrap();
        g.params = init(&c);
        let mut acts = g.activations(B, T).unwrap();
        let mut st = g.adamw_state();
        let mut losses = Vec::new();
        for s in 0..3 {
            let (x, y) = batch(&c, s, 0);
            let l = g.forward(&mut acts, &x, Some(&y)).unwrap().unwrap();
            losses.push(l.to_bits());
            g.zero_grad();
            g.backward(&mut acts).unwrap();
            g.adamw_step(&mut st, &hp()).unwrap();
        }
        assert_eq!(got.losses, losses, "tied = {tied}");
        let want: Vec<u32> = g.params.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got.params, want, "tied = {tied}");
    }
}

#[test]
fn every_strategy_and_group_size_is_bitwise_one_rank() {
    let c = cfg(true, 2);
    // small enough that clipping is active
    let reference = run(&c, 1, Some(&fcfg(Strategy::Full)), 4, 3, 0.5);
    assert!(f64::from_bits(reference.norms[0]) > 0.5);
    for n in [1, 2, 4] {
        for s in Strategy::ALL {
            let got = run(&c, n, Some(&fcfg(s)), 4, 3, 0.5);
            assert_eq!(got, reference, "strategy {s}, n = {n}");
        }
        // and replicas reduced by the GradReducer
        assert_eq!(run(&c, n, None, 4, 3, 0.5), reference, "replicas, n = {n}");
    }
}

#[test]
fn three_micro_batches_are_the_serial_model_with_an_exact_mean() {
    // M = 3: dividing by M rounds, so the mean must be the exact sum / 3
    // rounded once, as a single model accumulating in an ExactPartial does
    let c = cfg(true, 2);
    let m = 3;
    let mut g = Gpt::new(c.clone()).unwrap();
    g.params = init(&c);
    let mut acts = g.activations(B, T).unwrap();
    let mut st = g.adamw_state();
    let mut losses = Vec::new();
    for s in 0..2 {
        let mut acc = weft_collectives::repro::ExactPartial::new(g.params.len());
        let mut sum = 0.0;
        for j in 0..m {
            let (x, y) = batch(&c, s, j);
            sum += g.forward(&mut acts, &x, Some(&y)).unwrap().unwrap();
            g.zero_grad();
            g.backward(&mut acts).unwrap();
            acc.add(&g.grads).unwrap();
        }
        losses.push((sum / m as f64).to_bits());
        acc.mean_to(&mut g.grads).unwrap();
        g.adamw_step(&mut st, &hp()).unwrap();
    }
    let want: Vec<u32> = g.params.iter().map(|x| x.to_bits()).collect();
    for s in Strategy::ALL {
        for n in [1, 3] {
            let got = run(&c, n, Some(&fcfg(s)), m, 2, 0.0);
            assert_eq!(got.losses, losses, "{s}, n = {n}");
            assert_eq!(got.params, want, "{s}, n = {n}");
        }
    }
}

#[test]
fn untied_bf16_and_no_prefetch_settings_agree_across_group_sizes() {
    let c = cfg(false, 3);
    let f32_one = run(&c, 1, Some(&fcfg(Strategy::Full)), 4, 2, 0.5);
    for (name, fc) in [
        (
            "bf16 params+grads",
            FsdpConfig {
                precision: Precision::BF16,
                ..fcfg(Strategy::Full)
            },
        ),
        (
            "zero-1, bf16 params, f32 reduction",
            FsdpConfig {
                precision: Precision::BF16_PARAMS,
                ..fcfg(Strategy::Optimizer)
            },
        ),
        (
            "no prefetch, keep after forward",
            FsdpConfig {
                prefetch: 0,
                reshard_after_forward: false,
                ..fcfg(Strategy::GradOp)
            },
        ),
        (
            "deep prefetch",
            FsdpConfig {
                prefetch: 3,
                ..fcfg(Strategy::Hybrid)
            },
        ),
    ] {
        let one = run(&c, 1, Some(&fc), 4, 2, 0.5);
        if name.contains("bf16") {
            // the bf16 path is taken: it rounds differently from f32
            assert_ne!(one.params, f32_one.params, "{name}");
        }
        for n in [2, 4] {
            assert_eq!(run(&c, n, Some(&fc), 4, 2, 0.5), one, "{name}, n = {n}");
        }
    }
}

#[test]
fn plain_reduction_trains_like_the_reproducible_one() {
    let c = cfg(true, 2);
    let exact = run(&c, 2, Some(&fcfg(Strategy::Full)), 4, 3, 0.5);
    let plain_cfg = FsdpConfig {
        reproducible: false,
        ..fcfg(Strategy::Full)
    };
    let plain = run(&c, 2, Some(&plain_cfg), 4, 3, 0.5);
    for (a, b) in exact.losses.iter().zip(&plain.losses) {
        let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
        assert!((a - b).abs() < 1e-4 * a.abs(), "{a} vs {b}");
    }
}

/// What [`one_step`] measures on a rank.
type StepFigures = (
    Traffic,
    Vec<(usize, usize)>,
    Option<weft_fsdp::MemoryReport>,
    usize,
);

/// One step of `fc` on `n` ranks, one micro-batch each: the step's
/// traffic, the units' (padded, shard) lengths, the FSDP memory report
/// after the step (peaks over the step) and the model's parameter count.
fn one_step(c: &GptConfig, n: usize, fc: Option<&FsdpConfig>) -> Vec<StepFigures> {
    let p0 = init(c);
    LocalCluster::run(n, |comm| {
        let mut g = model(c, &comm, n, fc.cloned(), 1, &p0).unwrap();
        if let Some(f) = g.stages_mut()[0].fsdp_mut() {
            // start-up: resident state and planned activations
            let m0 = f.memory();
            assert!(m0.current(Category::Activations) > 0);
            assert_eq!(m0.current(Category::GatheredParams), 0);
            assert_eq!(m0.current(Category::Gradients), 0);
            assert!(m0.current(Category::OptimizerState) > 0);
            f.reset_memory_peaks();
        }
        let (x, y) = batch(c, 0, g.mesh().coords().dp());
        let mb = [MicroBatch {
            tokens: &x,
            targets: &y,
        }];
        let before = comm.traffic();
        g.train_step(&mb, &hp(), 0.0).unwrap();
        let traffic = comm.traffic().since(&before);
        let units = g.stages()[0]
            .fsdp()
            .map(|f| {
                f.plan()
                    .units()
                    .iter()
                    .map(|u| (u.padded_len(n), u.shard_len))
                    .collect()
            })
            .unwrap_or_default();
        let mem = g.stages()[0].fsdp().map(|f| f.memory().clone());
        (traffic, units, mem, p0.len())
    })
    .unwrap()
}

#[test]
fn zero3_memory_is_14_bytes_per_parameter_over_n_plus_the_prefetch_window() {
    let c = cfg(true, 8);
    let n = 4;
    let fc = FsdpConfig {
        precision: Precision::BF16,
        reproducible: false,
        prefetch: 1,
        ..fcfg(Strategy::Full)
    };
    for (_, units, mem, num_params) in one_step(&c, n, Some(&fc)) {
        let mem = mem.unwrap();
        let shard: usize = units.iter().map(|u| u.1).sum();
        // f32 master + m + v (the bf16 parameters are rounded from the
        // master as they are gathered); the bf16 gradient shard (2 B) is
        // freed after the update
        assert_eq!(mem.current(Category::ParamShards), 0);
        assert_eq!(mem.current(Category::OptimizerState), 12 * shard);
        assert_eq!(mem.current(Category::Gradients), 0);
        assert!(mem.peak(Category::Gradients) >= 2 * shard);
        // 14 bytes per parameter over N, padding at most n-1 per unit
        assert!(shard * n >= num_params && shard * n - num_params < n * units.len());
        // Gathered: at most (prefetch + current + kept unit) units, each as
        // the bf16 gather (with its input shard) plus its f32 widening.
        let per_unit = units.iter().map(|&(p, s)| 6 * p + 2 * s).max().unwrap();
        let peak = mem.peak(Category::GatheredParams);
        assert!(peak > 0 && peak <= (fc.prefetch + 2) * per_unit, "{peak}");
        // ... far below the whole model gathered
        let whole: usize = units.iter().map(|u| 4 * u.0).sum();
        assert!(peak < whole / 2, "{peak} vs {whole}");
        // nothing stays gathered after the step
        assert_eq!(mem.current(Category::GatheredParams), 0);
        assert!(mem.current(Category::Activations) > 0);
    }
}

/// bf16 mixed precision with bf16 parameters (`Precision::BF16_PARAMS`):
/// the products' weights travel as bf16 words and the layernorms, biases
/// and (tied) embeddings as f32, so the run is bitwise the one that
/// gathers everything in f32 — the products round their operands to the
/// same bits — while each gather moves `shard + max kept` words per rank.
#[test]
#[allow(clippy::print_stdout)] // the measured ratio
fn bf16_parameters_gather_the_products_weights_in_bf16_and_change_no_bit() {
    let n = 2;
    for tied in [true, false] {
        let c = cfg(tied, 3);
        let p0 = init(&c);
        let go = |precision: Precision| {
            let fc = FsdpConfig {
                precision,
                reproducible: true,
                ..fcfg(Strategy::Full)
            };
            LocalCluster::run(n, |comm| {
                let mut g = model_in(
                    &c,
                    &comm,
                    n,
                    Some(fc.clone()),
                    1,
                    &p0,
                    weft_kernels::Precision::Bf16,
                )
                .unwrap();
                let before = comm.traffic();
                let mut losses = Vec::new();
                for s in 0..3 {
                    let (x, y) = batch(&c, s, g.mesh().coords().dp());
                    let mb = [MicroBatch {
                        tokens: &x,
                        targets: &y,
                    }];
                    losses.push(g.train_step(&mb, &hp(), 1.0).unwrap().loss.to_bits());
                }
                let gathered = comm.traffic().since(&before).sent_by(OpKind::AllGather);
                let f = g.stages()[0].fsdp().unwrap();
                // the words a rank sends per gather of each unit: its shard,
                // one more per element kept in f32, as many as the rank
                // keeping the most
                let words: Vec<usize> = f
                    .plan()
                    .units()
                    .iter()
                    .map(|u| u.bf16_words(n) / n)
                    .collect();
                let params = f.full_params().unwrap();
                (
                    losses,
                    gathered,
                    words,
                    params.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                )
            })
            .unwrap()
        };
        let wide = go(Precision::F32);
        let narrow = go(Precision::BF16_PARAMS);
        for ((l32, ag32, _, p32), (l16, ag16, words, p16)) in wide.iter().zip(&narrow) {
            assert_eq!(l32, l16, "tied={tied}: the losses change");
            assert_eq!(p32, p16, "tied={tied}: the parameters change");
            let units = words.len();
            let gathers = |u: usize| {
                if u + 1 == units || (tied && u == 0) {
                    1
                } else {
                    2
                }
            };
            // per step: each unit's gathers and the all-gather of the loss
            let want: usize = (0..units)
                .map(|u| gathers(u) * (n - 1) * words[u] * 2)
                .sum();
            assert_eq!(*ag16 as usize, 3 * (want + (n - 1) * 8), "tied={tied}");
            let ratio = *ag16 as f64 / *ag32 as f64;
            println!("tied={tied}: bf16 parameters gather {ratio:.3}x the f32 bytes");
            assert!(
                ratio < if tied { 0.75 } else { 0.6 },
                "tied={tied}: {ratio}"
            );
        }
    }
}

#[test]
fn traffic_per_step_matches_the_formula() {
    for tied in [true, false] {
        let c = cfg(tied, 3);
        let len = init(&c).len();
        for n in [2usize, 4] {
            let plain = FsdpConfig {
                reproducible: false,
                ..fcfg(Strategy::Full)
            };
            let zero3 = one_step(&c, n, Some(&plain));
            let units = &zero3[0].1;
            let nu = units.len();
            // every unit is gathered for its forward and again for its
            // backward, except the last (its backward follows at once) and,
            // with tied embeddings, the embedding (kept for the head)
            let gathers = |u: usize| {
                if u + 1 == nu || (tied && u == 0) {
                    1
                } else {
                    2
                }
            };
            let losses = (n - 1) * 8; // the all-gather of one f64 loss per rank
            let ag: usize = (0..nu).map(|u| gathers(u) * (n - 1) * units[u].1 * 4).sum();
            let rs: usize = units.iter().map(|u| (n - 1) * u.1 * 4).sum();
            for (t, ..) in &zero3 {
                assert_eq!(t.sent_by(OpKind::AllGather) as usize, ag + losses);
                assert_eq!(t.sent_by(OpKind::ReduceScatter) as usize, rs);
                assert_eq!(t.sent_by(OpKind::AllReduce), 0);
            }
            // replicas: one ring all-reduce of the (unpadded) gradients
            let ddp = {
                let c2 = c.clone();
                let p0 = init(&c2);
                LocalCluster::run(n, |comm| {
                    let mut g = model(&c2, &comm, n, None, 1, &p0).unwrap();
                    let (x, y) = batch(&c2, 0, g.mesh().coords().dp());
                    let mb = [MicroBatch {
                        tokens: &x,
                        targets: &y,
                    }];
                    let before = comm.traffic();
                    g.train_step(&mb, &hp(), 0.0).unwrap();
                    comm.traffic().since(&before)
                })
                .unwrap()
            };
            // (the replicas run the reproducible mode: exact partials travel
            // in the all-reduce's reduce-scatter, about 2x the f32 bytes)
            for t in &ddp {
                assert_eq!(t.sent_by(OpKind::ReduceScatter), 0);
                assert!(t.sent_by(OpKind::AllReduce) as usize >= 2 * (n - 1) * len * 4 / n);
            }
            let ar = 2 * (n - 1) * len * 4 / n;
            // ≈ 3× the parameter bytes against 2× (less the units gathered once)
            let ratio = (ag + rs) as f64 / ar as f64;
            assert!(ratio > 1.3 && ratio <= 1.6, "ratio {ratio}");
        }
    }
}

#[test]
fn spans_show_prefetch_overlapping_compute_and_export_to_chrome() {
    let c = cfg(true, 3);
    let fc = FsdpConfig {
        prefetch: 1,
        ..fcfg(Strategy::Full)
    };
    let p0 = init(&c);
    LocalCluster::run(2, |comm| {
        let mut g = model(&c, &comm, 2, Some(fc.clone()), 1, &p0).unwrap();
        let (x, y) = batch(&c, 0, g.mesh().coords().dp());
        let mb = [MicroBatch {
            tokens: &x,
            targets: &y,
        }];
        g.train_step(&mb, &hp(), 0.0).unwrap();
        let f = g.stages_mut()[0].fsdp_mut().unwrap();
        let spans = f.spans().spans();
        let fwd = |u: usize| {
            spans
                .iter()
                .find(|s| s.track == Track::Compute && s.op == "forward" && s.unit == Some(u))
                .unwrap()
        };
        for u in 1..4 {
            // unit u+1's gather was issued before unit u computed
            let gather = spans
                .iter()
                .find(|s| s.track == Track::Comm && s.op == "all_gather" && s.unit == Some(u + 1))
                .unwrap();
            assert!(gather.start <= fwd(u).start, "unit {}", u + 1);
        }
        // every unit's gradients were reduce-scattered
        let rs = spans
            .iter()
            .filter(|s| s.track == Track::Comm && s.op == "reduce_scatter")
            .count();
        assert_eq!(rs, 5);
        assert!(f.spans().total(Track::Comm) > 0.0);
        let mut trace = weft_trace::Trace::new();
        for e in f.spans().trace_events(1, 0.0) {
            trace.push(e);
        }
        trace.check().unwrap();
        assert!(trace.complete_events().count() >= spans.len());
        f.spans_mut().clear();
        assert!(f.spans().spans().is_empty());
    })
    .unwrap();
}

#[test]
fn the_whole_state_round_trips_through_a_checkpoint() {
    let c = cfg(false, 2);
    let fc = fcfg(Strategy::Full);
    let straight = run(&c, 2, Some(&fc), 2, 3, 0.5);
    let p0 = init(&c);
    let out = LocalCluster::run(2, |comm| {
        let step = |g: &mut ParallelGpt, s: usize| {
            let (x, y) = batch(&c, s, g.mesh().coords().dp());
            let mb = [MicroBatch {
                tokens: &x,
                targets: &y,
            }];
            g.train_step(&mb, &hp(), 0.5).unwrap().loss.to_bits()
        };
        let mut a = model(&c, &comm, 2, Some(fc.clone()), 1, &p0).unwrap();
        let mut losses = vec![step(&mut a, 0), step(&mut a, 1)];
        // "save" the whole model on rank 0, "load" it on every rank
        let len = p0.len();
        let mut bufs = [vec![0.0f32; len], vec![0.0; len], vec![0.0; len]];
        let root = comm.rank() == 0;
        let k = {
            let [x, y, z] = &mut bufs;
            a.gather_whole(root.then_some([&mut x[..], &mut y[..], &mut z[..]]))
                .unwrap()
        };
        drop(a);
        // the checkpoint reaches every rank (each reads it from disk)
        for b in &mut bufs {
            weft_collectives::CommunicatorExt::broadcast(&comm, b, 0).unwrap();
        }
        let zeros = vec![0.0; len];
        let mut b = model(&c, &comm, 2, Some(fc.clone()), 1, &zeros).unwrap();
        b.load_whole(&bufs[0], &bufs[1], &bufs[2], k).unwrap();
        losses.push(step(&mut b, 2));
        losses
    })
    .unwrap();
    for losses in out {
        assert_eq!(losses, straight.losses);
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let c = cfg(true, 2);
    let p0 = init(&c);
    LocalCluster::run(2, |comm| {
        let bad = model(
            &c,
            &comm,
            2,
            Some(FsdpConfig {
                hybrid_shard: 3,
                ..fcfg(Strategy::Hybrid)
            }),
            1,
            &p0,
        );
        let e = bad.unwrap_err().to_string();
        assert!(e.contains("hybrid_shard"), "{e}");
        let short = model(&c, &comm, 2, Some(fcfg(Strategy::Full)), 1, &p0[1..]);
        assert!(short.is_err());
        let mut g = model(&c, &comm, 2, Some(fcfg(Strategy::Full)), 1, &p0).unwrap();
        let x = vec![0u32; B * T - 1];
        let e = g
            .train_step(
                &[MicroBatch {
                    tokens: &x,
                    targets: &x,
                }],
                &hp(),
                0.0,
            )
            .unwrap_err();
        assert!(e.to_string().contains("tokens"), "{e}");
    })
    .unwrap();
}

#[test]
fn a_lost_rank_is_an_error_not_a_hang() {
    let c = cfg(true, 2);
    let p0 = init(&c);
    let out = LocalCluster::builder(2)
        .timeout(std::time::Duration::from_secs(20))
        // rank 1 fails a few collectives into the first step
        .fail_rank_at(1, 40)
        .run_each(|comm| {
            let mut g = model(&c, &comm, 2, Some(fcfg(Strategy::Full)), 1, &p0)?;
            let (x, y) = batch(&c, 0, g.mesh().coords().dp());
            let mb = [MicroBatch {
                tokens: &x,
                targets: &y,
            }];
            g.train_step(&mb, &hp(), 0.0)?;
            g.train_step(&mb, &hp(), 0.0)?;
            Ok::<_, weft_model::Error>(())
        });
    for r in out {
        let e = r.unwrap().unwrap_err().to_string();
        assert!(
            e.contains("lost") || e.contains("fault injection") || e.contains("aborted"),
            "{e}"
        );
    }
}

#[test]
fn eval_loss_is_the_serial_forward_and_three_ranks_agree() {
    let c = cfg(true, 2);
    let fc = fcfg(Strategy::Full);
    // a group size that does not divide the units: padding in every unit
    let three = run(&c, 3, Some(&fc), 3, 2, 0.5);
    assert_eq!(three, run(&c, 1, Some(&fc), 3, 2, 0.5));
    let p0 = init(&c);
    let data: Vec<_> = (0..4).map(|k| batch(&c, 9, k)).collect();
    let mut g = Gpt::new(c.clone()).unwrap();
    g.params = p0.clone();
    let mut acts = g.activations(B, T).unwrap();
    let mut total = 0.0;
    for (x, y) in &data {
        total += g.forward(&mut acts, x, Some(y)).unwrap().unwrap() * (B * T) as f64;
    }
    let want = total / (4 * B * T) as f64;
    let got = LocalCluster::run(3, |comm| {
        let mut m = model(&c, &comm, 3, Some(fc.clone()), 1, &p0).unwrap();
        let mbs: Vec<_> = data
            .iter()
            .map(|(a, b)| MicroBatch {
                tokens: a,
                targets: b,
            })
            .collect();
        let l = m.eval_loss(&mbs).unwrap();
        let f = m.stages()[0].fsdp().unwrap();
        assert_eq!(f.memory().current(Category::GatheredParams), 0);
        l
    })
    .unwrap();
    for l in got {
        assert_eq!(l.to_bits(), want.to_bits());
    }
}
