//! The search: every layout weft can run for the request (or those the
//! caller pins down), each predicted, best first, with the reason each
//! wins or loses.

use std::collections::HashMap;
use std::rc::Rc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use weft_parallel::{ParallelLayout, Recompute, Strategy};
use weft_pipeline::ScheduleKind;

use crate::layout::Layout;
use crate::memory::Accounting;
use crate::predict::{Geometry, Prediction, Request, geometry, predict_with};

/// Which layouts to consider: each `Some` pins that setting.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraints {
    /// Data-parallel degree.
    pub dp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: Option<usize>,
    /// Pipeline stages.
    pub pp: Option<usize>,
    /// Expert-parallel degree.
    pub ep: Option<usize>,
    /// Context-parallel degree (sequences split over `cp` ranks).
    pub cp: Option<usize>,
    /// Sharding of the data-parallel group (`Some(None)`: replicas).
    pub fsdp: Option<Option<Strategy>>,
    /// Ranks per sharding group with [`Strategy::Hybrid`] (default: the
    /// ranks of a node).
    pub hybrid_shard: Option<usize>,
    /// Pipeline schedule.
    pub schedule: Option<ScheduleKind>,
    /// Chunks per stage of the interleaved schedule (default 2).
    pub pp_chunks: Option<usize>,
    /// Micro-batch size.
    pub micro_batch_size: Option<usize>,
    /// Sequence parallelism.
    pub sequence_parallel: Option<bool>,
    /// Recomputation: `None` tries none, selective and full, `Some` pins
    /// it.
    pub recompute: Option<Recompute>,
    /// Tokens per chunk of the head's loss: `None` tries the whole
    /// micro-batch and, with weft's accounting ([`Accounting::Weft`])
    /// where a rank's micro-batch has more tokens than it, chunks of
    /// [`LOSS_CHUNK`]; `Some(n)` pins it (0: the whole micro-batch).
    pub loss_chunk: Option<usize>,
    /// Largest micro-batch size tried (default 64).
    pub max_micro_batch: Option<usize>,
}

impl Constraints {
    /// Whether every degree is pinned (one layout to evaluate).
    #[must_use]
    pub fn is_single(&self) -> bool {
        self.dp.is_some() && self.tp.is_some() && self.pp.is_some()
    }
}

fn divisors(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (1..=n.isqrt())
        .filter(|d| n.is_multiple_of(*d))
        .flat_map(|d| [d, n / d])
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Every layout of `req.cluster.gpus` GPUs that weft can run for the
/// model and batch and that `c` allows: degrees multiplying to the GPU
/// count, tp dividing the heads, pp at most the layers, ep dividing the
/// experts and dp, every sharding strategy (hybrid over the ranks of a
/// node), every schedule (interleaved with two chunks), micro-batch sizes
/// dividing the per-rank batch (powers of two, and the whole per-rank
/// batch), sequence parallelism with tp > 1, each recomputation policy,
/// and (weft's accounting, more than [`LOSS_CHUNK`] tokens a micro-batch
/// on a rank) the loss whole and in chunks.
#[must_use]
pub fn enumerate(req: &Request, c: &Constraints) -> Vec<Layout> {
    let g = req.cluster.gpus;
    let m = &req.model;
    let max_mbs = c.max_micro_batch.unwrap_or(64);
    let mut out = Vec::new();
    let pin = |v: Option<usize>, x: usize| v.is_none_or(|p| p == x);
    for tp in divisors(g) {
        if !pin(c.tp, tp) || !m.heads.is_multiple_of(tp) || m.vocab < tp {
            continue;
        }
        // each tensor-parallel rank holds whole key/value heads, or a copy
        // of the one its query heads read
        let kv_split = m.kv_heads().is_multiple_of(tp) || tp.is_multiple_of(m.kv_heads());
        if !kv_split {
            continue;
        }
        // sequences split over cp ranks where they cut into 2·cp chunks
        // of 64·2^k tokens
        let cps: Vec<usize> = divisors(g / tp)
            .into_iter()
            .filter(|&cp| {
                pin(c.cp, cp)
                    && (cp == 1
                        || weft_parallel::ParallelDims {
                            cp,
                            ..weft_parallel::ParallelDims::SINGLE
                        }
                        .context_chunk(m.seq)
                        .is_ok())
            })
            .collect();
        for (cp, pp) in cps
            .iter()
            .flat_map(|&cp| divisors(g / (tp * cp)).into_iter().map(move |pp| (cp, pp)))
        {
            if !pin(c.pp, pp) || pp > m.layers {
                continue;
            }
            let dp = g / (tp * cp * pp);
            if !pin(c.dp, dp) || !req.batch.is_multiple_of(dp) {
                continue;
            }
            let eps: Vec<usize> = if m.is_moe() {
                divisors(dp)
                    .into_iter()
                    .filter(|e| m.experts.is_multiple_of(*e))
                    .collect()
            } else {
                vec![1]
            };
            let per_rank = req.batch / dp;
            // powers of two dividing it, and itself, up to max_mbs (not
            // from its divisors: a batch of 2^63 has 2^31.5 to try)
            let mut mbss: Vec<usize> = (0..usize::BITS)
                .map(|k| 1usize << k)
                .chain([per_rank])
                .filter(|&d| d <= max_mbs.min(per_rank) && per_rank.is_multiple_of(d))
                .collect();
            mbss.dedup();
            if let Some(b) = c.micro_batch_size {
                mbss = vec![b];
            }
            for &ep in &eps {
                if !pin(c.ep, ep) {
                    continue;
                }
                let group = dp / ep * cp;
                let node = (req.cluster.gpus_per_node / tp).max(1);
                let mut shardings = vec![(None, 1)];
                if group > 1 {
                    for s in [Strategy::Optimizer, Strategy::GradOp, Strategy::Full] {
                        shardings.push((Some(s), 1));
                    }
                    if node > 1 && node < group && group.is_multiple_of(node) {
                        shardings.push((Some(Strategy::Hybrid), node));
                    }
                }
                if let Some(s) = c.fsdp {
                    shardings = vec![(s, c.hybrid_shard.unwrap_or(node))];
                }
                let schedules: Vec<ScheduleKind> = if pp == 1 {
                    vec![ScheduleKind::OneFOneB]
                } else {
                    ScheduleKind::ALL
                        .into_iter()
                        .filter(|&s| c.schedule.is_none_or(|p| p == s))
                        .collect()
                };
                for &(fsdp, hybrid_shard) in &shardings {
                    for &pp_schedule in &schedules {
                        for &mbs in &mbss {
                            let sps: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
                            for &sp in sps {
                                if c.sequence_parallel.is_some_and(|x| x != sp) {
                                    continue;
                                }
                                let rcs: &[Recompute] = match &c.recompute {
                                    Some(r) => std::slice::from_ref(r),
                                    None => {
                                        &[Recompute::None, Recompute::Selective, Recompute::Full]
                                    }
                                };
                                // chunks of the loss change nothing where a
                                // micro-batch has no more tokens than one
                                // (and the GPU recipe's memory, Megatron's,
                                // holds the whole micro-batch's logits)
                                let rows = mbs * m.seq / cp;
                                let weft = req.recipe.accounting == Accounting::Weft;
                                let chunks: &[usize] = match &c.loss_chunk {
                                    Some(k) => std::slice::from_ref(k),
                                    None if weft && rows > LOSS_CHUNK => &[0, LOSS_CHUNK],
                                    None => &[0],
                                };
                                for (&recompute, &loss_chunk) in
                                    rcs.iter().flat_map(|r| chunks.iter().map(move |k| (r, k)))
                                {
                                    let l = Layout {
                                        parallel: ParallelLayout {
                                            dp,
                                            tp,
                                            pp,
                                            ep,
                                            cp,
                                            fsdp,
                                            hybrid_shard,
                                            pp_schedule,
                                            pp_chunks: c.pp_chunks.unwrap_or(2),
                                            sequence_parallel: sp,
                                            ..ParallelLayout::default()
                                        },
                                        micro_batch_size: mbs,
                                        recompute,
                                        loss_chunk,
                                    };
                                    if l.validate(m, req.batch, g).is_ok() {
                                        out.push(l);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The loss chunk a search tries beside the whole micro-batch
/// ([`Constraints::loss_chunk`]): the smallest `train.loss_chunk`, the
/// rows the head's weight gradient sums at a time
/// (`weft_kernels::WT_SUM_ROWS`).
pub const LOSS_CHUNK: usize = weft_kernels::WT_SUM_ROWS;

/// The most forward passes (stages × chunks × micro-batches, summed over
/// the distinct schedules) one search generates: 2^25.
pub const MAX_SEARCH_PASSES: u128 = 1 << 25;

/// Best first: the layouts that fit by step time, then those that do not
/// by how much they need.
fn order(a: &Prediction, b: &Prediction) -> std::cmp::Ordering {
    match (a.fits, b.fits) {
        (true, false) => std::cmp::Ordering::Less,
        (false, true) => std::cmp::Ordering::Greater,
        (true, true) => a.step_s.total_cmp(&b.step_s),
        (false, false) => a.memory.total().cmp(&b.memory.total()),
    }
}

/// Predicts every layout of [`enumerate`] and returns them best first
/// (fitting layouts by step time, then the rest by memory). The first
/// [`EXACT`] (with pipelines) have their bubble from `weft-pipeline`'s
/// simulator; the rest from the schedule's closed form
/// (`ScheduleKind::expected_bubble`), which only ranks them.
///
/// # Errors
/// The request's errors; [`Error::InvalidRequest`] when no layout
/// satisfies the constraints (with the first reason a pinned layout
/// fails, when every degree is pinned).
pub fn search(req: &Request, c: &Constraints) -> Result<Vec<Prediction>> {
    req.validate()?;
    let layouts = enumerate(req, c);
    // every distinct schedule is generated (and kept) once: bound their
    // passes in all before generating any
    let mut keys = std::collections::HashSet::new();
    let passes: u128 = layouts
        .iter()
        .filter(|l| {
            keys.insert((
                l.schedule(),
                l.parallel.pp,
                l.chunks(),
                l.micro_batches(req.batch),
            ))
        })
        .map(|l| (l.parallel.pp * l.chunks()) as u128 * l.micro_batches(req.batch) as u128)
        .sum();
    if passes > MAX_SEARCH_PASSES {
        return Err(Error::InvalidRequest {
            field: "gpus",
            reason: format!(
                "the {} layouts of {} GPUs with a global batch of {} have schedules of {passes} passes in all, more than the search's bound of {MAX_SEARCH_PASSES}: pin --pp, --dp or --micro-batch, or plan fewer GPUs",
                layouts.len(),
                req.cluster.gpus,
                req.batch
            ),
        });
    }
    if layouts.is_empty() {
        let largest = c
            .micro_batch_size
            .unwrap_or(c.max_micro_batch.unwrap_or(64))
            .max(1);
        if req.batch / largest > weft_parallel::MAX_MICRO_BATCHES {
            return Err(Error::InvalidRequest {
                field: "global_batch",
                reason: format!(
                    "{} sequences in micro-batches of at most {largest} make more than {} micro-batches per step",
                    req.batch,
                    weft_parallel::MAX_MICRO_BATCHES
                ),
            });
        }
        if c.is_single() {
            // say why the pinned layout is refused
            let l = Layout {
                parallel: ParallelLayout {
                    dp: c.dp.unwrap_or(1),
                    tp: c.tp.unwrap_or(1),
                    pp: c.pp.unwrap_or(1),
                    ep: c.ep.unwrap_or(1),
                    fsdp: c.fsdp.unwrap_or_default(),
                    hybrid_shard: c.hybrid_shard.unwrap_or(1),
                    pp_schedule: c.schedule.unwrap_or_default(),
                    pp_chunks: c.pp_chunks.unwrap_or(2),
                    sequence_parallel: c.sequence_parallel.unwrap_or(false),
                    ..ParallelLayout::default()
                },
                micro_batch_size: c.micro_batch_size.unwrap_or(1),
                recompute: c.recompute.unwrap_or_default(),
                loss_chunk: c.loss_chunk.unwrap_or(0),
            };
            l.validate(&req.model, req.batch, req.cluster.gpus)?;
        }
        return Err(Error::InvalidRequest {
            field: "layout",
            reason: format!(
                "no layout of {} GPUs runs this model with a global batch of {} under the given constraints",
                req.cluster.gpus, req.batch
            ),
        });
    }
    // phase 1: every layout, each schedule generated once, the bubble in
    // closed form where the schedule has one; phase 2: the simulator's
    // bubble for the best
    let mut geoms: HashMap<(ScheduleKind, usize, usize, usize), Option<Rc<Geometry>>> =
        HashMap::new();
    let mut preds = Vec::with_capacity(layouts.len());
    let mut failed: Option<Error> = None;
    for l in &layouts {
        let key = (
            l.schedule(),
            l.parallel.pp,
            l.chunks(),
            l.micro_batches(req.batch),
        );
        let g = geoms
            .entry(key)
            .or_insert_with(|| match geometry(&req.model, l, req.batch, &req.recipe) {
                Ok(g) => Some(Rc::new(g)),
                Err(e) => {
                    failed.get_or_insert(e);
                    None
                }
            })
            .clone();
        let Some(g) = g else { continue };
        match predict_with(req, l, &g, false) {
            Ok(p) => preds.push((p, g)),
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    if preds.is_empty()
        && let Some(e) = failed
    {
        return Err(e);
    }
    preds.sort_by(|a, b| order(&a.0, &b.0));
    let mut out: Vec<Prediction> = Vec::with_capacity(preds.len());
    for (i, (p, g)) in preds.into_iter().enumerate() {
        if i < EXACT && p.layout.parallel.pp > 1 {
            out.push(predict_with(req, &p.layout, &g, true)?);
        } else {
            out.push(p);
        }
    }
    out.sort_by(order);
    Ok(out)
}

/// Layouts whose bubble the simulator computes in a search (the best by
/// the closed forms); the rest keep the closed form's estimate.
pub const EXACT: usize = 64;

/// Why `p` wins or loses against `best` (the first of a [`search`]):
/// memory, communication (tensor, expert, data parallel), the bubble, or
/// compute.
#[must_use]
pub fn reason(p: &Prediction, best: &Prediction) -> String {
    let ms = |s: f64| format!("{:.1} ms", 1e3 * s);
    let share = |x: f64| format!("{:.0}%", 100.0 * x / p.step_s);
    if !p.fits {
        return format!(
            "does not fit: {} per GPU against {} ({} the largest part: {})",
            crate::memory::bytes(p.memory.total()),
            crate::memory::bytes(p.capacity),
            p.memory.largest(),
            crate::memory::bytes(
                p.memory
                    .categories()
                    .iter()
                    .map(|&(_, b)| b)
                    .max()
                    .unwrap_or(0)
            ),
        );
    }
    let t = &p.time;
    let parts = [
        ("compute", t.compute),
        ("tensor-parallel communication", t.tp_comm),
        ("expert all-to-all", t.ep_comm),
        ("exposed context-parallel ring", t.cp_exposed),
        ("pipeline bubble", t.bubble),
        ("exposed data-parallel communication", t.dp_exposed),
        ("optimizer step", t.optimizer),
    ];
    if std::ptr::eq(p, best) || p.layout == best.layout {
        let mut v: Vec<(&str, f64)> = parts.iter().copied().filter(|&(_, x)| x > 0.0).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        let list: Vec<String> = v
            .iter()
            .take(3)
            .map(|&(n, x)| format!("{n} {}", share(x)))
            .collect();
        return format!(
            "best: fits ({} of {}), step {} = {}",
            crate::memory::bytes(p.memory.total()),
            crate::memory::bytes(p.capacity),
            ms(p.step_s),
            list.join(", ")
        );
    }
    let b = &best.time;
    let deltas = [
        ("compute", t.compute - b.compute),
        ("tensor-parallel communication", t.tp_comm - b.tp_comm),
        ("expert all-to-all", t.ep_comm - b.ep_comm),
        ("exposed context-parallel ring", t.cp_exposed - b.cp_exposed),
        ("pipeline bubble", t.bubble - b.bubble),
        (
            "exposed data-parallel communication",
            t.dp_exposed - b.dp_exposed,
        ),
        ("optimizer step", t.optimizer - b.optimizer),
    ];
    let (name, worst) = deltas
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or(("compute", 0.0));
    format!(
        "{:+.1}% step time, mostly {name}: {}{} against the best ({} of its step)",
        100.0 * (p.step_s / best.step_s - 1.0),
        if worst >= 0.0 { "+" } else { "" },
        ms(worst),
        share(match name {
            "compute" => t.compute,
            "tensor-parallel communication" => t.tp_comm,
            "expert all-to-all" => t.ep_comm,
            "exposed context-parallel ring" => t.cp_exposed,
            "pipeline bubble" => t.bubble,
            "optimizer step" => t.optimizer,
            _ => t.dp_exposed,
        })
    )
}
