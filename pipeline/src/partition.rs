//! The stage partitioner: which layers go to which chunk.

use crate::error::{Error, Result};
use crate::schedule::Schedule;
use crate::simulate::{ChunkCost, Costs, simulate};

/// Measured (or given) cost of one layer for one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerProfile {
    /// Forward time.
    pub forward: f64,
    /// Input-gradient backward time.
    pub backward_input: f64,
    /// Weight-gradient backward time.
    pub backward_weight: f64,
    /// Activation memory kept from forward to backward.
    pub activation: f64,
    /// Memory still held after `B` until `W`.
    pub weight_grad_memory: f64,
    /// Memory held all the time: parameters, gradients, optimizer state.
    pub static_memory: f64,
}

/// What [`partition`] optimises under.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartitionOptions {
    /// Point-to-point latency between stages.
    pub p2p_latency: f64,
    /// Memory limit per stage (static plus peak activations); `None` for no
    /// limit.
    pub memory_limit: Option<f64>,
}

/// A split of the layers over the chunks, with its simulated result.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// `p·v + 1` cut points: virtual stage `s` holds layers
    /// `boundaries[s]..boundaries[s + 1]`. Which stage and chunk holds
    /// virtual stage `s` is the schedule's [`Placement`](crate::Placement).
    pub boundaries: Vec<usize>,
    /// Simulated makespan of one iteration.
    pub makespan: f64,
    /// Peak memory of each stage: static memory of its layers plus the
    /// simulated peak of activations.
    pub peak_memory: Vec<f64>,
}

impl Partition {
    /// Number of layers of each virtual stage.
    #[must_use]
    pub fn layers_per_chunk(&self) -> Vec<usize> {
        self.boundaries.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// The naive split: `layers` layers into `chunks` contiguous pieces whose
/// sizes differ by at most one (the larger ones first).
#[must_use]
pub fn equal_split(layers: usize, chunks: usize) -> Vec<usize> {
    let chunks = chunks.max(1);
    let (q, r) = (layers / chunks, layers % chunks);
    let mut b = vec![0];
    for s in 0..chunks {
        b.push(b[s] + q + usize::from(s < r));
    }
    b
}

fn check_inputs(schedule: &Schedule, layers: &[LayerProfile], latency: f64) -> Result<()> {
    let n = schedule.placement().virtual_stages();
    if layers.len() < n {
        return Err(Error::InvalidParameter {
            name: "layers",
            value: layers.len().to_string(),
            expected: format!("at least one layer per chunk ({n} = stages × chunks)"),
        });
    }
    for (i, l) in layers.iter().enumerate() {
        for x in [
            l.forward,
            l.backward_input,
            l.backward_weight,
            l.activation,
            l.weight_grad_memory,
            l.static_memory,
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(Error::InvalidParameter {
                    name: "layer profile",
                    value: format!("layer {i}: {x}"),
                    expected: "finite, non-negative costs".into(),
                });
            }
        }
    }
    if !(latency.is_finite() && latency >= 0.0) {
        return Err(Error::InvalidParameter {
            name: "p2p_latency",
            value: latency.to_string(),
            expected: "a finite, non-negative number".into(),
        });
    }
    Ok(())
}

/// Simulate `schedule` with the layers split at `boundaries`.
///
/// # Errors
/// [`Error::InvalidParameter`] when `boundaries` is not `p·v + 1`
/// increasing cut points from 0 to `layers.len()` with no empty chunk, or a
/// profile is not finite and non-negative; whatever
/// [`simulate`] reports.
pub fn evaluate(
    schedule: &Schedule,
    layers: &[LayerProfile],
    boundaries: &[usize],
    p2p_latency: f64,
) -> Result<Partition> {
    check_inputs(schedule, layers, p2p_latency)?;
    let placement = schedule.placement();
    let n = placement.virtual_stages();
    let ok = boundaries.len() == n + 1
        && boundaries[0] == 0
        && boundaries[n] == layers.len()
        && boundaries.windows(2).all(|w| w[0] < w[1]);
    if !ok {
        return Err(Error::InvalidParameter {
            name: "boundaries",
            value: format!("{boundaries:?}"),
            expected: format!(
                "{} strictly increasing cut points from 0 to {}",
                n + 1,
                layers.len()
            ),
        });
    }
    let mut chunks = Vec::with_capacity(n);
    let mut static_mem = vec![0.0; placement.stages()];
    for vs in 0..n {
        let part = &layers[boundaries[vs]..boundaries[vs + 1]];
        let sum = |f: fn(&LayerProfile) -> f64| part.iter().map(f).sum::<f64>();
        chunks.push(ChunkCost {
            forward: sum(|l| l.forward),
            backward_input: sum(|l| l.backward_input),
            backward_weight: sum(|l| l.backward_weight),
            activation: sum(|l| l.activation),
            weight_grad_memory: sum(|l| l.weight_grad_memory),
        });
        static_mem[placement.location(vs).0] += sum(|l| l.static_memory);
    }
    let t = simulate(
        schedule,
        &Costs {
            chunks,
            p2p_latency,
        },
    )?;
    let peak_memory = t
        .peak_memory()
        .iter()
        .zip(&static_mem)
        .map(|(a, s)| a + s)
        .collect();
    Ok(Partition {
        boundaries: boundaries.to_vec(),
        makespan: t.makespan(),
        peak_memory,
    })
}

/// The split minimising the largest per-chunk compute time (F + B + W),
/// by dynamic programming over prefix sums.
fn balanced_split(layers: &[LayerProfile], chunks: usize) -> Vec<usize> {
    let l = layers.len();
    let mut prefix = vec![0.0; l + 1];
    for (i, x) in layers.iter().enumerate() {
        prefix[i + 1] = prefix[i] + x.forward + x.backward_input + x.backward_weight;
    }
    // best[k][j]: min over splits of the first j layers into k chunks of the max chunk cost.
    let mut best = vec![vec![f64::INFINITY; l + 1]; chunks + 1];
    let mut arg = vec![vec![0usize; l + 1]; chunks + 1];
    best[0][0] = 0.0;
    for k in 1..=chunks {
        for j in k..=l {
            for i in (k - 1)..j {
                let c = best[k - 1][i].max(prefix[j] - prefix[i]);
                if c < best[k][j] {
                    best[k][j] = c;
                    arg[k][j] = i;
                }
            }
        }
    }
    let mut b = vec![l];
    let mut j = l;
    for k in (1..=chunks).rev() {
        j = arg[k][j];
        b.push(j);
    }
    b.reverse();
    b
}

/// Number of ways to cut `l` layers into `k` non-empty pieces, capped.
fn splits(l: usize, k: usize, cap: usize) -> usize {
    // C(l-1, k-1)
    let (n, r) = (l - 1, k - 1);
    let r = r.min(n - r);
    let mut c: usize = 1;
    for i in 0..r {
        c = c.saturating_mul(n - i) / (i + 1);
        if c > cap {
            return cap + 1;
        }
    }
    c
}

/// Score: memory excess over the limit first, then makespan.
fn score(p: &Partition, limit: Option<f64>) -> (f64, f64) {
    let worst = p.peak_memory.iter().copied().fold(0.0, f64::max);
    let excess = limit.map_or(0.0, |lim| (worst - lim).max(0.0));
    (excess, p.makespan)
}

fn better(a: (f64, f64), b: (f64, f64)) -> bool {
    a.0 < b.0 - 1e-12 || (a.0 <= b.0 + 1e-12 && a.1 < b.1 - 1e-12)
}

/// Choose the contiguous split of `layers` into the schedule's `p·v`
/// chunks (and so, through its placement, the chunk assignment of
/// interleaved and V schedules) that minimises the simulated makespan of
/// `schedule` while every stage's peak memory stays within the limit.
///
/// Small problems (at most 20 000 possible splits) are solved exactly by
/// trying every split. Larger ones start from the equal-layer split and
/// from the split that balances per-chunk compute, and improve each by
/// moving one cut point at a time while the simulated makespan drops; the
/// result is never worse than either start.
///
/// # Errors
/// [`Error::InvalidParameter`] for fewer layers than chunks or bad
/// profiles; [`Error::Infeasible`] when no split found fits the memory
/// limit.
pub fn partition(
    schedule: &Schedule,
    layers: &[LayerProfile],
    options: &PartitionOptions,
) -> Result<Partition> {
    check_inputs(schedule, layers, options.p2p_latency)?;
    let n = schedule.placement().virtual_stages();
    let l = layers.len();
    let lat = options.p2p_latency;
    let limit = options.memory_limit;
    let eval = |b: &[usize]| evaluate(schedule, layers, b, lat);
    const EXHAUSTIVE: usize = 20_000;
    let mut best: Option<(Partition, (f64, f64))> = None;
    let consider = |p: Partition, best: &mut Option<(Partition, (f64, f64))>| {
        let s = score(&p, limit);
        if best.as_ref().is_none_or(|(_, bs)| better(s, *bs)) {
            *best = Some((p, s));
        }
    };
    if splits(l, n, EXHAUSTIVE) <= EXHAUSTIVE {
        // Enumerate cut points in lexicographic order.
        let mut cuts: Vec<usize> = (1..n).collect();
        loop {
            let mut b = vec![0];
            b.extend_from_slice(&cuts);
            b.push(l);
            consider(eval(&b)?, &mut best);
            // next combination of n-1 cuts from 1..l
            let k = cuts.len();
            let mut i = k;
            while i > 0 && cuts[i - 1] == l - k + i - 1 {
                i -= 1;
            }
            if i == 0 {
                break;
            }
            cuts[i - 1] += 1;
            for j in i..k {
                cuts[j] = cuts[j - 1] + 1;
            }
        }
    } else {
        for start in [equal_split(l, n), balanced_split(layers, n)] {
            let mut cur = eval(&start)?;
            let mut cur_s = score(&cur, limit);
            for _ in 0..10 * l {
                let mut step: Option<(Partition, (f64, f64))> = None;
                for cut in 1..n {
                    for delta in [-2isize, -1, 1, 2] {
                        let Some(pos) = cur.boundaries[cut].checked_add_signed(delta) else {
                            continue;
                        };
                        if pos <= cur.boundaries[cut - 1] || pos >= cur.boundaries[cut + 1] {
                            continue;
                        }
                        let mut b = cur.boundaries.clone();
                        b[cut] = pos;
                        let cand = eval(&b)?;
                        let s = score(&cand, limit);
                        if better(s, step.as_ref().map_or(cur_s, |x| x.1)) {
                            step = Some((cand, s));
                        }
                    }
                }
                match step {
                    Some((c, s)) => {
                        cur = c;
                        cur_s = s;
                    }
                    None => break,
                }
            }
            consider(cur, &mut best);
        }
    }
    let Some((best, (excess, _))) = best else {
        return Err(Error::InvalidParameter {
            name: "layers",
            value: l.to_string(),
            expected: format!("at least {n} layers"),
        });
    };
    if excess > 0.0 {
        let needed = best.peak_memory.iter().copied().fold(0.0, f64::max);
        return Err(Error::Infeasible {
            layers: l,
            chunks: n,
            limit: limit.unwrap_or(f64::INFINITY),
            needed,
        });
    }
    Ok(best)
}

/// The shape of a GPT-style decoder, as [`transformer_profiles`] costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransformerShape {
    /// Blocks.
    pub layers: usize,
    /// Model width `C`.
    pub hidden: usize,
    /// Sequence length `T`.
    pub seq: usize,
    /// Vocabulary `V` (the head's product, on the last layer).
    pub vocab: usize,
    /// `Some((experts, active))` for a mixture-of-experts feed-forward
    /// block: `experts` routed, `active` run per token (top-k plus any
    /// shared expert); `None` for the dense `4C` MLP.
    pub experts: Option<(usize, usize)>,
}

/// Per-layer profiles of a GPT-style decoder for [`partition`], in
/// FLOPs per token: a block is `24·C² + 2·T·C` with the dense MLP, or
/// `8·C² + 16·C²·active + 2·C·experts + 2·T·C` with experts (attention's
/// projections, the feed-forward products, the router and the attention
/// scores); the last layer also carries the head's `2·C·V`. The backward
/// halves are as large as the forward (B and W each as many FLOPs);
/// activation and weight-gradient memory count one unit per layer.
///
/// ```
/// use weft_pipeline::{TransformerShape, transformer_profiles};
/// let shape = TransformerShape { layers: 4, hidden: 64, seq: 32, vocab: 100, experts: None };
/// let p = transformer_profiles(&shape);
/// assert_eq!(p.len(), 4);
/// assert!(p[3].forward > p[0].forward); // the head
/// ```
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn transformer_profiles(shape: &TransformerShape) -> Vec<LayerProfile> {
    let (c, t, v) = (shape.hidden as f64, shape.seq as f64, shape.vocab as f64);
    let ffn = match shape.experts {
        None => 16.0 * c * c,
        Some((experts, active)) => 16.0 * c * c * active as f64 + 2.0 * c * experts as f64,
    };
    let block = 8.0 * c * c + ffn + 2.0 * t * c;
    let l = shape.layers;
    (0..l)
        .map(|i| {
            let f = if i + 1 == l {
                block + 2.0 * c * v
            } else {
                block
            };
            LayerProfile {
                forward: f,
                backward_input: f,
                backward_weight: f,
                activation: 1.0,
                weight_grad_memory: 1.0,
                static_memory: 0.0,
            }
        })
        .collect()
}

/// weft's split of a decoder's layers over `schedule`'s virtual stages:
/// [`partition`] on [`transformer_profiles`], with no memory limit and no
/// point-to-point latency. The trainer builds its stages with it and the
/// planner predicts them with it, so both agree by construction.
///
/// # Errors
/// As [`partition`]: fewer layers than virtual stages.
pub fn partition_transformer(schedule: &Schedule, shape: &TransformerShape) -> Result<Vec<usize>> {
    let part = partition(
        schedule,
        &transformer_profiles(shape),
        &PartitionOptions {
            p2p_latency: 0.0,
            memory_limit: None,
        },
    )?;
    Ok(part.layers_per_chunk())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::ScheduleKind;

    fn layer(cost: f64, act: f64, stat: f64) -> LayerProfile {
        LayerProfile {
            forward: cost,
            backward_input: cost,
            backward_weight: cost,
            activation: act,
            weight_grad_memory: act,
            static_memory: stat,
        }
    }

    /// A GPT-like stack: a light embedding, 16 blocks where every fourth is
    /// an MoE block (2.5× the cost), and a heavy head with the loss.
    fn model() -> Vec<LayerProfile> {
        let mut v = vec![layer(0.3, 0.5, 4.0)];
        for i in 0..16 {
            v.push(if i % 4 == 3 {
                layer(2.5, 1.5, 6.0)
            } else {
                layer(1.0, 1.0, 1.0)
            });
        }
        v.push(layer(3.0, 2.0, 4.0));
        v
    }

    #[test]
    fn equal_split_spreads_the_remainder() {
        assert_eq!(equal_split(10, 4), vec![0, 3, 6, 8, 10]);
        assert_eq!(equal_split(8, 4), vec![0, 2, 4, 6, 8]);
    }

    #[test]
    fn beats_the_equal_layer_split_on_heterogeneous_layers() {
        let layers = model();
        for (kind, p, v) in [
            (ScheduleKind::OneFOneB, 4, 1),
            (ScheduleKind::ZbH1, 4, 1),
            (ScheduleKind::Interleaved, 2, 2),
        ] {
            let s = kind.generate(p, 8, v).unwrap();
            let opts = PartitionOptions {
                p2p_latency: 0.05,
                memory_limit: None,
            };
            let naive = evaluate(&s, &layers, &equal_split(layers.len(), p * v), 0.05).unwrap();
            let best = partition(&s, &layers, &opts).unwrap();
            assert!(
                best.makespan < 0.95 * naive.makespan,
                "{kind}: partitioned {} vs equal {} ({:?})",
                best.makespan,
                naive.makespan,
                best.layers_per_chunk()
            );
            // Exhaustive here (few splits): nothing beats it.
            let bal = evaluate(&s, &layers, &balanced_split(&layers, p * v), 0.05).unwrap();
            assert!(best.makespan <= bal.makespan + 1e-9);
        }
    }

    #[test]
    fn heuristic_search_on_a_large_model_beats_both_starts() {
        let mut layers = model();
        for _ in 0..2 {
            layers.extend(model());
        }
        let s = ScheduleKind::OneFOneB.generate(8, 16, 1).unwrap();
        let n = 8;
        assert!(splits(layers.len(), n, 20_000) > 20_000);
        let best = partition(
            &s,
            &layers,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: None,
            },
        )
        .unwrap();
        let eq = evaluate(&s, &layers, &equal_split(layers.len(), n), 0.0).unwrap();
        let bal = evaluate(&s, &layers, &balanced_split(&layers, n), 0.0).unwrap();
        assert!(best.makespan < eq.makespan);
        assert!(best.makespan <= bal.makespan + 1e-9);
    }

    #[test]
    fn respects_the_memory_limit_or_says_it_cannot() {
        let layers = model();
        let s = ScheduleKind::OneFOneB.generate(4, 8, 1).unwrap();
        let free = partition(
            &s,
            &layers,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: None,
            },
        )
        .unwrap();
        let worst = free.peak_memory.iter().copied().fold(0.0, f64::max);
        // A limit below the unconstrained optimum's peak: still solvable, slower or equal.
        let limit = worst - 1.0;
        let tight = partition(
            &s,
            &layers,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: Some(limit),
            },
        )
        .unwrap();
        assert!(
            tight.peak_memory.iter().all(|&m| m <= limit + 1e-9),
            "{:?}",
            tight.peak_memory
        );
        assert!(tight.makespan >= free.makespan - 1e-9);
        let err = partition(
            &s,
            &layers,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: Some(1.0),
            },
        )
        .unwrap_err();
        assert!(matches!(err, Error::Infeasible { .. }), "{err}");
        assert!(err.to_string().contains("fits in 1 per stage"), "{err}");
    }

    #[test]
    fn bad_inputs_are_named() {
        let s = ScheduleKind::OneFOneB.generate(4, 8, 1).unwrap();
        let e = partition(
            &s,
            &model()[..3],
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: None,
            },
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("at least one layer per chunk"),
            "{e}"
        );
        let e = evaluate(&s, &model(), &[0, 5, 5, 10, 18], 0.0).unwrap_err();
        assert!(e.to_string().contains("boundaries"), "{e}");
        let mut bad = model();
        bad[2].forward = -1.0;
        let e = partition(
            &s,
            &bad,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("layer 2"), "{e}");
    }

    #[test]
    fn a_decoder_s_head_moves_layers_off_the_last_stage() {
        let shape = |vocab| TransformerShape {
            layers: 8,
            hidden: 64,
            seq: 64,
            vocab,
            experts: None,
        };
        let s = crate::generate::one_f_one_b(2, 4).unwrap();
        // a tiny head: an even split; a head of 8 blocks' FLOPs: the last
        // stage gives up layers (block 24·64² + 2·64·64 = 106 496 FLOPs;
        // 2·64·V = 8 blocks at V = 6656)
        assert_eq!(partition_transformer(&s, &shape(2)).unwrap(), vec![4, 4]);
        let split = partition_transformer(&s, &shape(6656)).unwrap();
        assert_eq!(split.iter().sum::<usize>(), 8);
        assert!(split[1] < 4, "{split:?}");
        let p = transformer_profiles(&TransformerShape {
            experts: Some((8, 2)),
            ..shape(2)
        });
        let dense = transformer_profiles(&shape(2));
        let c = 64.0;
        assert_eq!(
            p[0].forward - dense[0].forward,
            16.0 * c * c + 2.0 * c * 8.0
        );
        assert!(
            partition_transformer(
                &crate::generate::one_f_one_b(4, 4).unwrap(),
                &TransformerShape {
                    layers: 3,
                    ..shape(2)
                }
            )
            .is_err()
        );
    }
}
