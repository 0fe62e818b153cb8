//! Integration tests of the sharded training step over the thread backend.

use std::sync::Arc;

use weft_collectives::{LocalCluster, OpKind, Topology};
use weft_fsdp::{Category, Fsdp, FsdpConfig, MicroBatch, Precision, Strategy, Track};
use weft_kernels::AdamW;
use weft_model::{FeedForward, Gpt, GptConfig, Mlp};

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

fn ffn() -> Arc<dyn FeedForward> {
    Arc::new(Mlp)
}

#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<u64>,
    norms: Vec<u64>,
    params: Vec<u32>,
}

/// Runs `steps` steps of a global batch of `global_m` micro-batches over
/// `n` ranks; returns rank 0's losses, norms and final parameters (bits),
/// after checking every rank agrees.
fn run(c: &GptConfig, n: usize, fc: &FsdpConfig, global_m: usize, steps: usize) -> Run {
    let p0 = init(c);
    let per = global_m / n;
    let fc = &FsdpConfig {
        hybrid_shard: if n.is_multiple_of(fc.hybrid_shard) {
            fc.hybrid_shard
        } else {
            1
        },
        ..fc.clone()
    };
    let out = LocalCluster::builder(n)
        .topology(Topology::new(2))
        .run_each(|comm| {
            let mut f = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0).unwrap();
            let mut losses = Vec::new();
            let mut norms = Vec::new();
            for s in 0..steps {
                let data: Vec<_> = (0..per)
                    .map(|j| batch(c, s, f.dp_rank() * per + j))
                    .collect();
                let mbs: Vec<_> = data
                    .iter()
                    .map(|(a, b)| MicroBatch {
                        tokens: a,
                        targets: b,
                    })
                    .collect();
                let r = f.step(B, T, &mbs, 3e-3).unwrap();
                losses.push(r.loss.to_bits());
                norms.push(r.grad_norm.to_bits());
            }
            let params = f.full_params().unwrap();
            Run {
                losses,
                norms,
                params: params.iter().map(|x| x.to_bits()).collect(),
            }
        });
    let mut runs: Vec<Run> = out.into_iter().map(|r| r.unwrap()).collect();
    let first = runs.remove(0);
    for r in &runs {
        assert_eq!(r, &first, "ranks disagree");
    }
    first
}

fn fcfg(strategy: Strategy) -> FsdpConfig {
    FsdpConfig {
        strategy,
        hybrid_shard: 2,
        adamw: AdamW {
            weight_decay: 0.1,
            ..AdamW::default()
        },
        // small enough that clipping is active
        max_grad_norm: Some(0.5),
        ..FsdpConfig::default()
    }
}

#[test]
fn one_rank_one_micro_batch_is_bitwise_the_serial_model() {
    for tied in [true, false] {
        let c = cfg(tied, 2);
        let fc = FsdpConfig {
            max_grad_norm: None,
            ..fcfg(Strategy::Full)
        };
        let got = run(&c, 1, &fc, 1, 3);
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
            g.adamw_step(
                &mut st,
                &AdamW {
                    lr: 3e-3,
                    ..fc.adamw
                },
            )
            .unwrap();
        }
        assert_eq!(got.losses, losses, "tied = {tied}");
        let want: Vec<u32> = g.params.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got.params, want, "tied = {tied}");
    }
}

#[test]
fn every_strategy_and_group_size_is_bitwise_one_rank() {
    let c = cfg(true, 2);
    let reference = run(&c, 1, &fcfg(Strategy::Full), 4, 3);
    // the clipping threshold is active and the loss moves
    assert!(f64::from_bits(reference.norms[0]) > 0.5);
    for n in [1, 2, 4] {
        for s in Strategy::ALL {
            let got = run(&c, n, &fcfg(s), 4, 3);
            assert_eq!(got, reference, "strategy {s}, n = {n}");
        }
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
    let hp = AdamW {
        lr: 3e-3,
        ..fcfg(Strategy::Full).adamw
    };
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
        g.adamw_step(&mut st, &hp).unwrap();
    }
    let want: Vec<u32> = g.params.iter().map(|x| x.to_bits()).collect();
    for s in Strategy::ALL {
        let fc = FsdpConfig {
            max_grad_norm: None,
            ..fcfg(s)
        };
        for n in [1, 3] {
            let got = run(&c, n, &fc, m, 2);
            assert_eq!(got.losses, losses, "{s}, n = {n}");
            assert_eq!(got.params, want, "{s}, n = {n}");
        }
    }
}

#[test]
fn untied_bf16_and_no_prefetch_settings_agree_across_group_sizes() {
    let c = cfg(false, 3);
    let f32_one = run(&c, 1, &fcfg(Strategy::Full), 4, 2);
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
            "ddp, bf16 params+grads",
            FsdpConfig {
                precision: Precision::BF16,
                ..fcfg(Strategy::None)
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
        let one = run(&c, 1, &fc, 4, 2);
        if name.contains("bf16") {
            // the bf16 path is taken: it rounds differently from f32
            assert_ne!(one.params, f32_one.params, "{name}");
        }
        for n in [2, 4] {
            assert_eq!(run(&c, n, &fc, 4, 2), one, "{name}, n = {n}");
        }
    }
}

#[test]
fn plain_reduction_trains_like_the_reproducible_one() {
    let c = cfg(true, 2);
    let exact = run(&c, 2, &fcfg(Strategy::Full), 4, 3);
    let plain = run(
        &c,
        2,
        &FsdpConfig {
            reproducible: false,
            ..fcfg(Strategy::Full)
        },
        4,
        3,
    );
    for (a, b) in exact.losses.iter().zip(&plain.losses) {
        let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
        assert!((a - b).abs() < 1e-4 * a.abs(), "{a} vs {b}");
    }
}

/// A rank's step report, units' (padded, shard) lengths, memory after the
/// step and the model's parameter count.
type OneStep = (
    weft_fsdp::StepReport,
    Vec<(usize, usize)>,
    weft_fsdp::MemoryReport,
    usize,
);

/// One step of `fc` on `n` ranks, one micro-batch each.
fn one_step(c: &GptConfig, n: usize, fc: &FsdpConfig) -> Vec<OneStep> {
    let p0 = init(c);
    LocalCluster::run(n, |comm| {
        let mut f = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0).unwrap();
        // start-up report: resident state and planned activations
        f.prepare(B, T).unwrap();
        let m0 = f.memory();
        assert!(m0.current(Category::Activations) > 0);
        assert_eq!(m0.current(Category::GatheredParams), 0);
        assert_eq!(m0.current(Category::Gradients), 0);
        assert!(m0.current(Category::OptimizerState) > 0);
        assert!(f.prepare(B, T + 1).is_err());
        let (x, y) = batch(c, 0, f.dp_rank());
        let r = f
            .step(
                B,
                T,
                &[MicroBatch {
                    tokens: &x,
                    targets: &y,
                }],
                1e-3,
            )
            .unwrap();
        let units = f
            .plan()
            .units()
            .iter()
            .map(|u| (u.padded_len(n), u.shard_len))
            .collect();
        (r, units, f.memory().clone(), f.plan().num_params())
    })
    .unwrap()
}

#[test]
fn zero3_memory_is_16_bytes_per_parameter_over_n_plus_the_prefetch_window() {
    let c = cfg(true, 8);
    let n = 4;
    let fc = FsdpConfig {
        precision: Precision::BF16,
        reproducible: false,
        prefetch: 1,
        ..fcfg(Strategy::Full)
    };
    for (r, units, mem, num_params) in one_step(&c, n, &fc) {
        let shard: usize = units.iter().map(|u| u.1).sum();
        let at = &r.memory_at_update;
        // bf16 parameter shard, f32 master + m + v, bf16 gradient shard
        assert_eq!(at.current(Category::ParamShards), 2 * shard);
        assert_eq!(at.current(Category::OptimizerState), 12 * shard);
        assert_eq!(at.current(Category::Gradients), 2 * shard);
        let state = at.current(Category::ParamShards)
            + at.current(Category::OptimizerState)
            + at.current(Category::Gradients);
        assert_eq!(state, 16 * shard);
        // 16 bytes per parameter over N, padding at most n-1 per unit
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
    // DDP keeps everything: 16 bytes per parameter, f32
    let ddp = FsdpConfig {
        reproducible: false,
        ..fcfg(Strategy::None)
    };
    for (r, units, _, _) in one_step(&c, n, &ddp) {
        let padded: usize = units.iter().map(|u| u.0).sum();
        let at = &r.memory_at_update;
        assert_eq!(
            at.current(Category::ParamShards),
            0,
            "f32 params are the master"
        );
        assert_eq!(at.current(Category::OptimizerState), 12 * padded);
        assert_eq!(at.current(Category::Gradients), 4 * padded);
        assert_eq!(at.peak(Category::GatheredParams), 0);
    }
}

#[test]
fn traffic_per_step_matches_the_formula() {
    for tied in [true, false] {
        let c = cfg(tied, 3);
        for n in [2usize, 4] {
            let plain = |s| FsdpConfig {
                reproducible: false,
                max_grad_norm: None,
                ..fcfg(s)
            };
            let zero3 = one_step(&c, n, &plain(Strategy::Full));
            let ddp = one_step(&c, n, &plain(Strategy::None));
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
            let ar: usize = units.iter().map(|u| 2 * (n - 1) * u.1 * 4).sum();
            for (r, ..) in &zero3 {
                let t = &r.traffic;
                assert_eq!(t.sent_by(OpKind::AllGather) as usize, ag + losses);
                assert_eq!(t.sent_by(OpKind::ReduceScatter) as usize, rs);
                assert_eq!(t.sent_by(OpKind::AllReduce), 0);
            }
            for (r, ..) in &ddp {
                let t = &r.traffic;
                assert_eq!(t.sent_by(OpKind::AllReduce) as usize, ar);
                assert_eq!(t.sent_by(OpKind::AllGather) as usize, losses);
                assert_eq!(t.sent_by(OpKind::ReduceScatter), 0);
            }
            // ≈ 3× the parameter bytes against 2× (less the units gathered once)
            let ratio = (ag + rs) as f64 / ar as f64;
            assert!(ratio > 1.3 && ratio <= 1.5, "ratio {ratio}");
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
        let mut f = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0).unwrap();
        let (x, y) = batch(&c, 0, f.dp_rank());
        let mb = [MicroBatch {
            tokens: &x,
            targets: &y,
        }];
        let r = f.step(B, T, &mb, 1e-3).unwrap();
        let spans = f.spans().spans();
        let fwd = |u: usize| {
            spans
                .iter()
                .find(|s| s.track == Track::Compute && s.op == "forward" && s.unit == Some(u))
                .unwrap()
        };
        for u in 1..4 {
            // unit u+1's gather was issued before unit u computed
            let g = spans
                .iter()
                .find(|s| s.track == Track::Comm && s.op == "all_gather" && s.unit == Some(u + 1))
                .unwrap();
            assert!(g.start <= fwd(u).start, "unit {}", u + 1);
        }
        // every unit's gradients were reduce-scattered
        let rs = spans
            .iter()
            .filter(|s| s.track == Track::Comm && s.op == "reduce_scatter")
            .count();
        assert_eq!(rs, 5);
        assert!(r.comm_seconds > 0.0 && r.exposed_comm_seconds >= 0.0);
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
fn shard_state_round_trips_through_a_checkpoint() {
    let c = cfg(false, 2);
    let fc = fcfg(Strategy::Full);
    let straight = run(&c, 2, &fc, 2, 3);
    let p0 = init(&c);
    let out = LocalCluster::run(2, |comm| {
        let step = |f: &mut Fsdp, s: usize| {
            let (x, y) = batch(&c, s, f.dp_rank());
            let mb = [MicroBatch {
                tokens: &x,
                targets: &y,
            }];
            f.step(B, T, &mb, 3e-3).unwrap().loss.to_bits()
        };
        let mut a = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0).unwrap();
        let mut losses = vec![step(&mut a, 0), step(&mut a, 1)];
        // "save": this rank's shards; "load" into a fresh runner
        let saved: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..a.plan().units().len())
            .map(|u| {
                let (p, m, v) = a.shard_state(u);
                (p.to_vec(), m.to_vec(), v.to_vec())
            })
            .collect();
        let k = a.optimizer_step();
        drop(a);
        let zeros = vec![0.0; p0.len()];
        let mut b = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &zeros).unwrap();
        for (u, (p, m, v)) in saved.iter().enumerate() {
            b.load_shard_state(u, p, m, v, k).unwrap();
        }
        losses.push(step(&mut b, 2));
        let params: Vec<u32> = b
            .full_params()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        (losses, params)
    })
    .unwrap();
    for (losses, params) in out {
        assert_eq!(losses, straight.losses);
        assert_eq!(params, straight.params);
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let c = cfg(true, 2);
    let p0 = init(&c);
    LocalCluster::run(2, |comm| {
        let bad = Fsdp::new(
            &comm,
            c.clone(),
            ffn(),
            FsdpConfig {
                hybrid_shard: 3,
                ..fcfg(Strategy::Hybrid)
            },
            &p0,
        );
        assert!(matches!(
            bad,
            Err(weft_fsdp::Error::Config {
                field: "hybrid_shard",
                ..
            })
        ));
        let short = Fsdp::new(&comm, c.clone(), ffn(), fcfg(Strategy::Full), &p0[1..]);
        assert!(matches!(short, Err(weft_fsdp::Error::StateShape { .. })));
        let mut f = Fsdp::new(&comm, c.clone(), ffn(), fcfg(Strategy::Full), &p0).unwrap();
        let x = vec![0u32; B * T - 1];
        let e = f
            .step(
                B,
                T,
                &[MicroBatch {
                    tokens: &x,
                    targets: &x,
                }],
                1e-3,
            )
            .unwrap_err();
        assert!(matches!(e, weft_fsdp::Error::Batch { .. }), "{e}");
        assert!(matches!(
            f.step(B, T, &[], 1e-3),
            Err(weft_fsdp::Error::Batch { .. })
        ));
    })
    .unwrap();
}

#[test]
fn a_lost_rank_is_an_error_not_a_hang() {
    let c = cfg(true, 2);
    let p0 = init(&c);
    let fc = fcfg(Strategy::Full);
    let out = LocalCluster::builder(2)
        .timeout(std::time::Duration::from_secs(20))
        // rank 1 fails a few collectives into the first step
        .fail_rank_at(1, 12)
        .run_each(|comm| {
            let mut f = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0)?;
            let (x, y) = batch(&c, 0, f.dp_rank());
            let mb = [MicroBatch {
                tokens: &x,
                targets: &y,
            }];
            f.step(B, T, &mb, 1e-3)?;
            f.step(B, T, &mb, 1e-3)?;
            Ok::<_, weft_fsdp::Error>(())
        });
    for r in out {
        let e = r.unwrap().unwrap_err();
        assert!(matches!(e, weft_fsdp::Error::Collective { .. }), "{e}");
    }
}

#[test]
fn eval_loss_is_the_serial_forward_and_three_ranks_agree() {
    let c = cfg(true, 2);
    let fc = fcfg(Strategy::Full);
    // a group size that does not divide the units: padding in every unit
    let three = run(&c, 3, &fc, 3, 2);
    assert_eq!(three, run(&c, 1, &fc, 3, 2));
    let p0 = init(&c);
    let (x, y) = batch(&c, 9, 0);
    let mut g = Gpt::new(c.clone()).unwrap();
    g.params = p0.clone();
    let mut acts = g.activations(B, T).unwrap();
    let want = g.forward(&mut acts, &x, Some(&y)).unwrap().unwrap();
    let got = LocalCluster::run(3, |comm| {
        let mut f = Fsdp::new(&comm, c.clone(), ffn(), fc.clone(), &p0).unwrap();
        let mb = MicroBatch {
            tokens: &x,
            targets: &y,
        };
        let l = f.eval_loss(B, T, mb).unwrap();
        assert_eq!(f.memory().current(Category::GatheredParams), 0);
        l
    })
    .unwrap();
    for l in got {
        assert_eq!(l.to_bits(), want.to_bits());
    }
}
