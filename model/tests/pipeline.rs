//! `weft-pipeline`'s executor over GPT stages on a `LocalCluster` against
//! the whole model run serially: per-micro-batch losses and accumulated
//! gradients bitwise, for GPipe, 1F1B, interleaved 1F1B and ZB-H1 at
//! pp = 2 and 4, tied (the shared-parameter hook) and untied embeddings,
//! in-place accumulation and the per-micro-batch hook; the forward-only
//! schedule's losses; a failing stage.

use std::ops::Range;

use weft_collectives::{Communicator, LocalCluster};
use weft_model::{Gpt, GptConfig, GptStage, MicroBatch, pipeline_stages};
use weft_pipeline::{ExecError, Executor, Measured, RankTimeline, Schedule, ScheduleKind, Stage};

fn executor(
    full: &Gpt,
    schedule: &Schedule,
    rank: usize,
    layers: &[usize],
) -> Result<Executor<GptStage>, ExecError> {
    let stages = pipeline_stages(full, schedule, rank, layers, B, T)
        .map_err(|e| ExecError::Stage(Box::new(e)))?;
    Executor::new(schedule.clone(), rank, stages)
}

const B: usize = 2;
const T: usize = 8;
const V: usize = 40;

fn model(tied: bool) -> Gpt {
    let cfg = GptConfig {
        n_layer: 4,
        n_head: 2,
        n_embd: 16,
        vocab_size: V,
        block_size: T,
        tied_embeddings: tied,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut m = Gpt::new(cfg).unwrap();
    m.init_gpt2(7);
    m
}

fn data(m: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        u32::try_from(s % V as u64).unwrap()
    };
    (0..m)
        .map(|_| {
            let x = (0..B * T).map(|_| next()).collect();
            let y = (0..B * T).map(|_| next()).collect();
            (x, y)
        })
        .collect()
}

fn micro_batches(d: &[(Vec<u32>, Vec<u32>)]) -> Vec<MicroBatch<'_>> {
    d.iter()
        .map(|(x, y)| MicroBatch {
            tokens: x,
            targets: y,
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The serial reference: losses, in-place accumulated gradients, and each
/// micro-batch's own gradients.
fn reference(tied: bool, d: &[(Vec<u32>, Vec<u32>)]) -> (Vec<f64>, Vec<f32>, Vec<Vec<f32>>) {
    let mut full = model(tied);
    let mut acts = full.activations(B, T).unwrap();
    let mut losses = Vec::new();
    let mut per_mb = Vec::new();
    let mut acc = vec![0.0f32; full.params.len()];
    full.zero_grad();
    for (x, y) in d {
        losses.push(full.forward(&mut acts, x, Some(y)).unwrap().unwrap());
        full.backward(&mut acts).unwrap();
        acc.clone_from(&full.grads);
        // This micro-batch alone, from zero.
        let mut solo = model(tied);
        let mut a2 = solo.activations(B, T).unwrap();
        solo.forward(&mut a2, x, Some(y)).unwrap();
        solo.backward(&mut a2).unwrap();
        per_mb.push(solo.grads.clone());
    }
    (losses, acc, per_mb)
}

/// What one rank reports: its losses, its stages' gradients as (global
/// range, values), hook pieces as (micro-batch, global range, values),
/// and its timeline.
type RankOut = (
    Vec<Option<f64>>,
    Vec<(Range<usize>, Vec<f32>)>,
    Vec<(usize, Range<usize>, Vec<f32>)>,
    RankTimeline,
);

fn run(
    kind: ScheduleKind,
    p: usize,
    v: usize,
    tied: bool,
    hook: bool,
    d: &[(Vec<u32>, Vec<u32>)],
) -> Vec<RankOut> {
    let full = model(tied);
    let m = d.len();
    let schedule = kind.generate(p, m, v).unwrap();
    let nvs = schedule.placement().virtual_stages();
    let layers: Vec<usize> = weft_pipeline::equal_split(4, nvs)
        .windows(2)
        .map(|w| w[1] - w[0])
        .collect();
    let mbs = micro_batches(d);
    LocalCluster::run(p, |comm| -> Result<RankOut, ExecError> {
        let mut ex = executor(&full, &schedule, comm.rank(), &layers)?;
        let mut pieces: Vec<(usize, usize, Range<usize>, Vec<f32>)> = Vec::new();
        let mut f = |e: weft_pipeline::GradEvent<'_>| {
            pieces.push((e.microbatch, e.chunk, e.range.clone(), e.grads.to_vec()));
        };
        let report = ex.step(
            &comm,
            &mbs,
            if hook {
                Some(&mut f as &mut dyn FnMut(weft_pipeline::GradEvent<'_>))
            } else {
                None
            },
        )?;
        // Map local ranges to the full layout.
        let to_global = |chunk: usize, r: Range<usize>| -> Vec<(Range<usize>, Range<usize>)> {
            ex.stages()[chunk]
                .segments()
                .iter()
                .filter_map(|(l, g)| {
                    let (a, b) = (r.start.max(l.start), r.end.min(l.end));
                    (a < b).then(|| (a..b, g.start + (a - l.start)..g.start + (b - l.start)))
                })
                .collect()
        };
        let mut grads = Vec::new();
        for (c, st) in ex.stages().iter().enumerate() {
            for (l, g) in to_global(c, 0..st.grads().len()) {
                grads.push((g, st.grads()[l].to_vec()));
            }
        }
        let mut global_pieces = Vec::new();
        for (mb, c, r, vals) in pieces {
            for (l, g) in to_global(c, r.clone()) {
                global_pieces.push((mb, g, vals[l.start - r.start..l.end - r.start].to_vec()));
            }
        }
        Ok((report.losses, grads, global_pieces, report.timeline))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

fn check(kind: ScheduleKind, p: usize, v: usize) {
    let m = 6;
    let d = data(m);
    for tied in [true, false] {
        let (want_loss, want_acc, want_mb) = reference(tied, &d);
        for hook in [false, true] {
            let what = format!("{} p={p} v={v} tied={tied} hook={hook}", kind.name());
            let out = run(kind, p, v, tied, hook, &d);
            // Losses: exactly one rank holds each micro-batch's.
            let mut losses = vec![None; m];
            for (l, ..) in &out {
                for (k, x) in l.iter().enumerate() {
                    if let Some(x) = x {
                        assert!(losses[k].is_none(), "{what}: two losses for {k}");
                        losses[k] = Some(x.to_bits());
                    }
                }
            }
            let want: Vec<_> = want_loss.iter().map(|x| Some(x.to_bits())).collect();
            assert_eq!(losses, want, "{what}: losses");
            if hook {
                // Each micro-batch's pieces, summed per element in f64 (no
                // element gets two pieces except a tied wte never split
                // here), equal its serial gradient bitwise.
                let mut seen = vec![vec![false; want_acc.len()]; m];
                for (_, _, pieces, _) in &out {
                    for (mb, g, vals) in pieces {
                        assert_eq!(
                            bits(vals),
                            bits(&want_mb[*mb][g.clone()]),
                            "{what}: mb {mb} {g:?}"
                        );
                        for i in g.clone() {
                            assert!(!seen[*mb][i], "{what}: element {i} of mb {mb} twice");
                            seen[*mb][i] = true;
                        }
                    }
                }
                assert!(
                    seen.iter().all(|s| s.iter().all(|&x| x)),
                    "{what}: every gradient delivered"
                );
                // And the stages' buffers are left zero.
                for (_, grads, ..) in &out {
                    assert!(
                        grads.iter().all(|(_, v)| v.iter().all(|&x| x == 0.0)),
                        "{what}"
                    );
                }
            } else {
                let mut got = vec![f32::NAN; want_acc.len()];
                for (_, grads, ..) in &out {
                    for (g, vals) in grads {
                        got[g.clone()].copy_from_slice(vals);
                    }
                }
                assert_eq!(bits(&got), bits(&want_acc), "{what}: accumulated gradients");
            }
            // The measured timeline assembles, exports and has a bubble.
            let schedule = kind.generate(p, m, v).unwrap();
            let measured =
                Measured::new(&schedule, out.iter().map(|o| o.3.clone()).collect()).unwrap();
            let bubble = measured.timeline.bubble_fraction();
            assert!((0.0..1.0).contains(&bubble), "{what}: bubble {bubble}");
            measured.to_trace().check().unwrap();
            // The prediction is the schedule simulated with the measured
            // mean cost of each stage's actions: each stage's busy time is
            // the measured one (the means times their counts), and no
            // stage of either finishes before its own work is done.
            let predicted = measured.predicted(&schedule).unwrap();
            for s in 0..p {
                let (got, want) = (measured.timeline.busy(s), predicted.busy(s));
                assert!(
                    (got - want).abs() <= 1e-9 * want.max(1e-12),
                    "{what}: stage {s} busy {got} measured vs {want} predicted"
                );
                assert!(measured.timeline.makespan() >= got, "{what}: stage {s}");
                assert!(predicted.makespan() >= want, "{what}: stage {s}");
            }
        }
    }
}

#[test]
fn gpipe_pp2() {
    check(ScheduleKind::GPipe, 2, 1);
}

#[test]
fn one_f_one_b_pp2_and_pp4() {
    check(ScheduleKind::OneFOneB, 2, 1);
    check(ScheduleKind::OneFOneB, 4, 1);
}

#[test]
fn interleaved_pp2_v2() {
    check(ScheduleKind::Interleaved, 2, 2);
}

#[test]
fn zb_h1_pp2_and_pp4() {
    check(ScheduleKind::ZbH1, 2, 1);
    check(ScheduleKind::ZbH1, 4, 1);
}

#[test]
fn bad_setups_are_typed_errors() {
    let full = model(true);
    let s = ScheduleKind::OneFOneB.generate(2, 4, 1).unwrap();
    // Layer counts that do not sum to n_layer, a rank outside the schedule.
    assert!(pipeline_stages(&full, &s, 0, &[1, 1], B, T).is_err());
    assert!(pipeline_stages(&full, &s, 2, &[2, 2], B, T).is_err());
    // Stages planned without the split backward under a split schedule.
    let zb = ScheduleKind::ZbH1.generate(2, 4, 1).unwrap();
    let plain = pipeline_stages(&full, &s, 0, &[2, 2], B, T).unwrap();
    assert!(Executor::new(zb, 0, plain).is_err());
}

#[test]
fn a_forward_only_schedule_gives_the_training_forwards_losses() {
    let full = model(true);
    let m = 5;
    let d = data(m);
    let (want, ..) = reference(true, &d);
    let mbs = micro_batches(&d);
    for (p, v) in [(2, 1), (2, 2)] {
        let train = ScheduleKind::Interleaved.generate(p, 2 * p, v).unwrap();
        let eval = Schedule::forward_only(train.placement(), m).unwrap();
        let layers = vec![4 / (p * v); p * v];
        let out = LocalCluster::run(p, |comm| -> Result<Vec<Option<f64>>, ExecError> {
            // stages planned for training run the evaluation schedule too
            let mut ex = executor(&full, &train, comm.rank(), &layers)?;
            ex.set_schedule(eval.clone())?;
            Ok(ex.step(&comm, &mbs, None)?.losses)
        })
        .unwrap();
        let last = eval.placement().location(p * v - 1).0;
        let got: Vec<u64> = out[last]
            .as_ref()
            .unwrap()
            .iter()
            .flatten()
            .map(|l| l.to_bits())
            .collect();
        assert_eq!(
            got,
            want.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            "p={p} v={v}"
        );
    }
}

#[test]
fn a_failing_stage_fails_its_peers_instead_of_hanging() {
    let full = model(false);
    let s = ScheduleKind::OneFOneB.generate(2, 3, 1).unwrap();
    let mut d = data(3);
    d[1].0[5] = 1000; // a token outside the vocabulary, seen by stage 0 only
    let mbs = micro_batches(&d);
    let r = LocalCluster::builder(2)
        .timeout(std::time::Duration::from_secs(20))
        .run_each(|comm| {
            let mut ex = executor(&full, &s, comm.rank(), &[2, 2]).unwrap();
            ex.step(&comm, &mbs, None)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
    let errs: Vec<String> = r.into_iter().map(|x| x.unwrap().unwrap_err()).collect();
    assert!(
        errs[0].contains("rank 0") && errs[0].contains("F1"),
        "stage 0 names its action: {}",
        errs[0]
    );
    assert!(errs[1].contains("rank 1"), "stage 1 fails too: {}", errs[1]);
}
