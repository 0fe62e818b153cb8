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
    /// Busy time of each pipeline stage over the iteration (the `F`, `B`
    /// and `W` of all its chunks and micro-batches).
    pub stage_busy: Vec<f64>,
    /// The simulated bubble: idle time over `p × makespan`.
    pub bubble_fraction: f64,
}

impl Partition {
    /// Number of layers of each virtual stage.
    #[must_use]
    pub fn layers_per_chunk(&self) -> Vec<usize> {
        self.boundaries.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Profiles of layers whose costs are `costs` times `(forward,
/// backward_input, backward_weight)` (one unit of activation and
/// weight-gradient memory each, no static memory): what `weft pipeline
/// --layer-costs` splits. [`partition`] and [`evaluate`] check them.
#[must_use]
pub fn layer_profiles(costs: &[f64], (f, b, w): (f64, f64, f64)) -> Vec<LayerProfile> {
    costs
        .iter()
        .map(|&c| LayerProfile {
            forward: c * f,
            backward_input: c * b,
            backward_weight: c * w,
            activation: 1.0,
            weight_grad_memory: 1.0,
            static_memory: 0.0,
        })
        .collect()
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
        stage_busy: (0..t.num_stages()).map(|s| t.busy(s)).collect(),
        bubble_fraction: t.bubble_fraction(),
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

/// Score: memory excess over the limit first, then makespan, then the
/// busiest stage (among splits of one makespan — with a single
/// micro-batch every split has the same — the most even one).
type Score = (f64, f64, f64);

fn score(p: &Partition, limit: Option<f64>) -> Score {
    let worst = p.peak_memory.iter().copied().fold(0.0, f64::max);
    let excess = limit.map_or(0.0, |lim| (worst - lim).max(0.0));
    let busiest = p.stage_busy.iter().copied().fold(0.0, f64::max);
    (excess, p.makespan, busiest)
}

/// `a < b` beyond rounding (sums of the same costs in another order).
fn less(a: f64, b: f64) -> bool {
    a < b - 1e-12 * b.abs().max(1.0)
}

fn better(a: Score, b: Score) -> bool {
    less(a.0, b.0) || (!less(b.0, a.0) && (less(a.1, b.1) || (!less(b.1, a.1) && less(a.2, b.2))))
}

/// Choose the contiguous split of `layers` into the schedule's `p·v`
/// chunks (and so, through its placement, the chunk assignment of
/// interleaved and V schedules) that minimises the simulated makespan of
/// `schedule` while every stage's peak memory stays within the limit.
///
/// Among splits of the same makespan it takes the one whose busiest
/// stage is least busy. Small problems (at most 20 000 possible splits) are solved exactly by
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
    let mut best: Option<(Partition, Score)> = None;
    let consider = |p: Partition, best: &mut Option<(Partition, Score)>| {
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
                let mut step: Option<(Partition, Score)> = None;
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
    let Some((best, (excess, _, _))) = best else {
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

/// The feed-forward block of one layer, as [`transformer_profiles`] costs
/// it: a dense block, or a mixture of experts of equal blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FfnShape {
    /// Weight matrices of the dense block or of one expert: 2 for GPT-2's
    /// GELU MLP (`c_fc`, `c_proj`), 3 for SwiGLU (gate, up, down).
    pub matrices: usize,
    /// Hidden width `H` of the dense block or of one expert.
    pub hidden: usize,
    /// Routed experts `E` (0: a dense block, no router).
    pub experts: usize,
    /// Blocks of width `H` each token runs through: 1 for a dense block;
    /// the top-k routed experts plus any shared experts for a mixture.
    pub active: usize,
}

impl FfnShape {
    /// GPT-2's dense GELU MLP of hidden width `hidden`.
    #[must_use]
    pub fn mlp(hidden: usize) -> Self {
        FfnShape {
            matrices: 2,
            hidden,
            experts: 0,
            active: 1,
        }
    }

    /// A dense SwiGLU block of hidden width `hidden`.
    #[must_use]
    pub fn swiglu(hidden: usize) -> Self {
        FfnShape {
            matrices: 3,
            ..Self::mlp(hidden)
        }
    }

    /// The same blocks as `experts` routed experts, `active` of them
    /// (top-k plus shared) run per token.
    #[must_use]
    pub fn experts(self, experts: usize, active: usize) -> Self {
        FfnShape {
            experts,
            active,
            ..self
        }
    }

    /// Forward FLOPs per token with `c` channels: `2·k·C·H` per active
    /// block (`k` matrices) and `2·C·E` for the router.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn flops(&self, c: usize) -> f64 {
        let c = c as f64;
        2.0 * (self.matrices * self.hidden * self.active) as f64 * c + 2.0 * c * self.experts as f64
    }
}

/// The feed-forward blocks of a whole decoder: the dense one, and a
/// mixture of experts from layer `first_dense` on.
///
/// `From<Option<(usize, usize)>>` gives GPT-2's: `None` is the dense
/// `4·C` GELU MLP everywhere, `Some((experts, active))` a mixture of
/// `4·C` GELU experts in every layer, `active` of them (top-k plus a
/// shared one) run per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FeedForwards {
    /// The dense block (`None`: GPT-2's `4·C` GELU MLP).
    pub dense: Option<FfnShape>,
    /// The mixture of experts, if any (a `hidden` of 0: `4·C`).
    pub moe: Option<FfnShape>,
    /// Leading layers that keep the dense block under a mixture of
    /// experts (DeepSeek's `first_k_dense_replace`).
    pub first_dense: usize,
}

impl From<Option<(usize, usize)>> for FeedForwards {
    fn from(moe: Option<(usize, usize)>) -> Self {
        FeedForwards {
            dense: None,
            moe: moe.map(|(e, a)| FfnShape::mlp(0).experts(e, a)),
            first_dense: 0,
        }
    }
}

impl From<FfnShape> for FeedForwards {
    /// `ffn` in every layer (dense or a mixture).
    fn from(ffn: FfnShape) -> Self {
        if ffn.experts > 0 {
            FeedForwards {
                dense: None,
                moe: Some(ffn),
                first_dense: 0,
            }
        } else {
            FeedForwards {
                dense: Some(ffn),
                moe: None,
                first_dense: 0,
            }
        }
    }
}

impl FeedForwards {
    /// The block of layer `layer` of a decoder `hidden` channels wide.
    #[must_use]
    pub fn layer(&self, layer: usize, hidden: usize) -> FfnShape {
        let dense = self.dense.unwrap_or(FfnShape::mlp(4 * hidden));
        match self.moe {
            Some(m) if layer >= self.first_dense => FfnShape {
                hidden: if m.hidden == 0 { 4 * hidden } else { m.hidden },
                ..m
            },
            _ => dense,
        }
    }
}

/// One transformer block, as [`transformer_profiles`] costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Query width `Cq = NH·HS` (`C` unless the head size is set apart).
    pub q_dim: usize,
    /// Key (and value) width `Ckv = NKV·HS` (`Cq` without grouped-query
    /// attention).
    pub kv_dim: usize,
    /// `Some(W)`: a sliding-window layer whose queries see `W` keys at
    /// most; `None`: the whole causal context.
    pub window: Option<usize>,
    /// The feed-forward block.
    pub ffn: FfnShape,
}

/// Keys a query attends to on average in a causal sequence of `seq`
/// tokens: `T/2` over the whole context (the causal half of the `T×T`
/// scores), `W − W²/(2T)` through a window of `W < T` keys (the first `W`
/// queries see fewer).
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn attended_keys(seq: usize, window: Option<usize>) -> f64 {
    let t = seq as f64;
    match window {
        Some(w) if w < seq => {
            let w = w as f64;
            w - w * w / (2.0 * t)
        }
        _ => t / 2.0,
    }
}

impl BlockShape {
    /// Forward FLOPs per token of the block in a sequence of `seq` tokens
    /// and `hidden` channels: the attention's projections
    /// `2·C·(Cq + 2·Ckv) + 2·Cq·C`, its two products with the scores
    /// `4·Cq` per attended key ([`attended_keys`]), and the feed-forward
    /// block ([`FfnShape::flops`]).
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn flops(&self, hidden: usize, seq: usize) -> f64 {
        let (c, q, kv) = (hidden as f64, self.q_dim as f64, self.kv_dim as f64);
        2.0 * c * (q + 2.0 * kv)
            + 2.0 * q * c
            + 4.0 * q * attended_keys(seq, self.window)
            + self.ffn.flops(hidden)
    }
}

/// The shape of a decoder, layer by layer, as [`transformer_profiles`]
/// costs it: blocks that may differ (local and global attention, dense and
/// mixture-of-experts feed-forward blocks), the embedding before them and
/// the head after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransformerShape {
    /// Model width `C`.
    pub hidden: usize,
    /// Sequence length `T`.
    pub seq: usize,
    /// Vocabulary `V` (the head's product, on the last layer).
    pub vocab: usize,
    /// The blocks, first to last (`L` of them).
    pub blocks: Vec<BlockShape>,
}

impl TransformerShape {
    /// A GPT-2-style decoder of `layers` equal blocks: multi-head
    /// attention over the whole context, and the dense `4·C` GELU MLP
    /// (`experts: None`) or a mixture of `4·C` experts (`Some((experts,
    /// active))`, `active` run per token: top-k plus any shared expert).
    #[must_use]
    pub fn gpt(
        layers: usize,
        hidden: usize,
        seq: usize,
        vocab: usize,
        experts: Option<(usize, usize)>,
    ) -> Self {
        Self::decoder(
            hidden,
            seq,
            vocab,
            (hidden, hidden),
            &vec![None; layers],
            &experts.into(),
        )
    }

    /// A decoder whose layer `l` attends through `windows[l]` with query
    /// and key/value widths `(Cq, Ckv)`, and runs `ffn.layer(l, hidden)`.
    #[must_use]
    pub fn decoder(
        hidden: usize,
        seq: usize,
        vocab: usize,
        (q_dim, kv_dim): (usize, usize),
        windows: &[Option<usize>],
        ffn: &FeedForwards,
    ) -> Self {
        TransformerShape {
            hidden,
            seq,
            vocab,
            blocks: windows
                .iter()
                .enumerate()
                .map(|(l, &window)| BlockShape {
                    q_dim,
                    kv_dim,
                    window,
                    ffn: ffn.layer(l, hidden),
                })
                .collect(),
        }
    }

    /// Blocks, `L`.
    #[must_use]
    pub fn layers(&self) -> usize {
        self.blocks.len()
    }
}

/// Per-layer profiles of a decoder for [`partition`], in FLOPs per token:
/// each block's forward ([`BlockShape::flops`]: for GPT-2's dense block
/// `24·C² + 2·T·C`), the last block also carrying the head's `2·C·V`; the
/// embedding's lookup is free. The backward halves are as large as the
/// forward (B and W each as many FLOPs); activation and weight-gradient
/// memory count one unit per layer.
///
/// ```
/// use weft_pipeline::{TransformerShape, transformer_profiles};
/// let shape = TransformerShape::gpt(4, 64, 32, 100, None);
/// let p = transformer_profiles(&shape);
/// assert_eq!(p.len(), 4);
/// assert_eq!(p[0].forward, 24.0 * 64.0 * 64.0 + 2.0 * 32.0 * 64.0);
/// assert!(p[3].forward > p[0].forward); // the head
/// ```
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn transformer_profiles(shape: &TransformerShape) -> Vec<LayerProfile> {
    let (c, v) = (shape.hidden as f64, shape.vocab as f64);
    let l = shape.layers();
    shape
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let block = b.flops(shape.hidden, shape.seq);
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

/// The split [`partition`] chooses beside the equal-layer split, each
/// simulated: what balancing unequal layers removes.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitComparison {
    /// Layers of each virtual stage as [`equal_split`] cuts them.
    pub equal: Partition,
    /// The split [`partition`] chooses (no memory limit).
    pub chosen: Partition,
}

/// [`partition`] (no memory limit) and [`equal_split`] of `layers` over
/// `schedule`, both simulated with `p2p_latency`.
///
/// # Errors
/// As [`partition`].
pub fn compare_splits(
    schedule: &Schedule,
    layers: &[LayerProfile],
    p2p_latency: f64,
) -> Result<SplitComparison> {
    let chosen = partition(
        schedule,
        layers,
        &PartitionOptions {
            p2p_latency,
            memory_limit: None,
        },
    )?;
    let n = schedule.placement().virtual_stages();
    let equal = evaluate(schedule, layers, &equal_split(layers.len(), n), p2p_latency)?;
    Ok(SplitComparison { equal, chosen })
}

impl SplitComparison {
    /// `chosen.makespan / equal.makespan − 1` (negative: time saved).
    #[must_use]
    pub fn makespan_change(&self) -> f64 {
        if self.equal.makespan > 0.0 {
            self.chosen.makespan / self.equal.makespan - 1.0
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for SplitComparison {
    /// Per split: layers per virtual stage, busy time per pipeline stage
    /// (and its spread, max/min), makespan and bubble.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, p: &Partition| {
            let num = |x: f64| {
                if x.abs() >= 1e5 {
                    format!("{x:.3e}")
                } else {
                    format!("{x:.3}")
                }
            };
            let busy = p
                .stage_busy
                .iter()
                .map(|&b| num(b))
                .collect::<Vec<_>>()
                .join(" ");
            let (lo, hi) = p
                .stage_busy
                .iter()
                .fold((f64::INFINITY, 0.0f64), |(lo, hi), &b| {
                    (lo.min(b), hi.max(b))
                });
            let spread = if lo > 0.0 { hi / lo } else { f64::INFINITY };
            writeln!(
                f,
                "{name:<7} layers {:?}  stage busy [{busy}] (max/min {spread:.3})  makespan {}  bubble {:.2}%",
                p.layers_per_chunk(),
                num(p.makespan),
                100.0 * p.bubble_fraction
            )
        };
        row(f, "equal", &self.equal)?;
        row(f, "chosen", &self.chosen)?;
        write!(
            f,
            "the chosen split changes the makespan by {:+.2}% against the equal split",
            100.0 * self.makespan_change()
        )
    }
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

    /// One micro-batch runs the stages one after another: every split has
    /// the same makespan, and the most even one is taken.
    #[test]
    fn ties_go_to_the_most_even_split() {
        let s = ScheduleKind::OneFOneB.generate(3, 1, 1).unwrap();
        let layers = vec![layer(1.0, 1.0, 0.0); 12];
        let p = partition(
            &s,
            &layers,
            &PartitionOptions {
                p2p_latency: 0.0,
                memory_limit: None,
            },
        )
        .unwrap();
        assert_eq!(p.layers_per_chunk(), vec![4, 4, 4]);
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
        let shape = |vocab| TransformerShape::gpt(8, 64, 64, vocab, None);
        let s = crate::generate::one_f_one_b(2, 4).unwrap();
        // a tiny head: an even split; a head of 8 blocks' FLOPs: the last
        // stage gives up layers (block 24·64² + 2·64·64 = 106 496 FLOPs;
        // 2·64·V = 8 blocks at V = 6656)
        assert_eq!(partition_transformer(&s, &shape(2)).unwrap(), vec![4, 4]);
        let split = partition_transformer(&s, &shape(6656)).unwrap();
        assert_eq!(split.iter().sum::<usize>(), 8);
        assert!(split[1] < 4, "{split:?}");
        let p = transformer_profiles(&TransformerShape::gpt(8, 64, 64, 2, Some((8, 2))));
        let dense = transformer_profiles(&shape(2));
        let c = 64.0;
        assert_eq!(
            p[0].forward - dense[0].forward,
            16.0 * c * c + 2.0 * c * 8.0
        );
        assert!(
            partition_transformer(
                &crate::generate::one_f_one_b(4, 4).unwrap(),
                &TransformerShape::gpt(3, 64, 64, 2, None)
            )
            .is_err()
        );
    }

    /// A Llama-shaped block: grouped-query attention's narrower K and V,
    /// SwiGLU's three matrices, the window's attended keys.
    #[test]
    fn block_flops_follow_the_layer_s_shape() {
        let (c, t) = (256usize, 1024usize);
        let ffn = FfnShape::swiglu(688);
        let gqa = BlockShape {
            q_dim: 256,
            kv_dim: 64,
            window: None,
            ffn,
        };
        let (cf, tf) = (c as f64, t as f64);
        let proj = 2.0 * cf * (256.0 + 128.0) + 2.0 * 256.0 * cf;
        let swiglu = 2.0 * 3.0 * cf * 688.0;
        assert_eq!(gqa.flops(c, t), proj + 4.0 * 256.0 * tf / 2.0 + swiglu);
        // a window of T/4: (W − W²/2T) / (T/2) = 2·(1/4) − (1/4)² = 7/16
        // of the global layer's score products
        let local = BlockShape {
            window: Some(t / 4),
            ..gqa
        };
        let scores = |b: &BlockShape| b.flops(c, t) - proj - swiglu;
        assert!((scores(&local) / scores(&gqa) - 7.0 / 16.0).abs() < 1e-12);
        // a window as long as the sequence is the global layer
        let whole = BlockShape {
            window: Some(t),
            ..gqa
        };
        assert_eq!(whole.flops(c, t), gqa.flops(c, t));
        // experts: k active blocks and the router
        let moe = ffn.experts(16, 3);
        assert_eq!(moe.flops(c), 3.0 * swiglu + 2.0 * cf * 16.0);
        // GPT-2's dense MLP through the old constructor
        let ff: FeedForwards = None.into();
        assert_eq!(ff.layer(5, c), FfnShape::mlp(4 * c));
        let first = FeedForwards {
            dense: Some(ffn),
            moe: Some(ffn.experts(16, 3)),
            first_dense: 2,
        };
        assert_eq!(first.layer(1, c), ffn);
        assert_eq!(first.layer(2, c), moe);
    }

    /// Blocks of unequal cost — 5 local : 1 global attention, dense : MoE
    /// — split by cost beat the equal-layer split; equal blocks split
    /// equally either way.
    #[test]
    fn unequal_layers_split_by_cost_beat_the_equal_split() {
        let (c, t, v) = (128, 4096, 256);
        let s = ScheduleKind::OneFOneB.generate(4, 8, 1).unwrap();
        let windows: Vec<Option<usize>> =
            (0..12).map(|l| ((l + 1) % 6 != 0).then_some(128)).collect();
        let ff = FeedForwards::from(FfnShape::swiglu(344));
        let local = TransformerShape::decoder(c, t, v, (c, c / 4), &windows, &ff);
        let moe = TransformerShape::decoder(
            c,
            256,
            v,
            (c, c),
            &[None; 12],
            &FeedForwards {
                dense: Some(FfnShape::swiglu(344)),
                moe: Some(FfnShape::swiglu(344).experts(64, 8)),
                first_dense: 3,
            },
        );
        for shape in [local, moe] {
            let cmp = compare_splits(&s, &transformer_profiles(&shape), 0.0).unwrap();
            assert!(cmp.chosen.makespan < 0.95 * cmp.equal.makespan, "{cmp}");
            assert_eq!(
                partition_transformer(&s, &shape).unwrap(),
                cmp.chosen.layers_per_chunk()
            );
            let text = cmp.to_string();
            assert!(text.contains("equal") && text.contains("chosen"), "{text}");
        }
        // equal blocks and a negligible head: the equal split is optimal
        let same = TransformerShape::gpt(12, c, 256, 2, None);
        let cmp = compare_splits(&s, &transformer_profiles(&same), 0.0).unwrap();
        assert_eq!(cmp.chosen.layers_per_chunk(), vec![3, 3, 3, 3]);
        assert!((cmp.chosen.makespan - cmp.equal.makespan).abs() < 1e-9 * cmp.equal.makespan);
        assert_eq!(cmp.makespan_change(), 0.0);
    }
}
