//! The chain of problems and fixes, computed for one model and cluster:
//! compute is 6·N·D; plain data parallelism runs out of memory; FSDP
//! shards the state and overlaps its gathers; as the GPU count grows the
//! compute per GPU shrinks but the communication does not — the
//! communication crossover — so pipeline (and tensor) parallelism, or
//! hierarchical sharding, must be mixed in; a larger batch moves the crossover right, a sparser model
//! (a mixture of experts) moves it left; tensor parallelism belongs on the
//! fastest links; and a micro-batch holds at least one sequence, so once
//! one sequence's activations outgrow a GPU only splitting the sequence
//! (context parallelism) trains it.

use std::fmt::{self, Write as _};

use serde::Serialize;

use crate::error::Result;
use weft_parallel::Strategy;

use crate::layout::Layout;
use crate::memory::{Accounting, bytes};
use crate::model::ModelSpec;
use crate::predict::{Prediction, Request, predict};
use crate::search::{Constraints, search};

/// Compute against communication per step of pure FSDP (ZeRO-3, no tensor
/// or pipeline parallelism) at one GPU count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ScalingPoint {
    /// GPUs (= the data-parallel degree).
    pub gpus: usize,
    /// Seconds of compute per step on one GPU.
    pub compute: f64,
    /// Seconds of data-parallel communication per step on one GPU (hidden
    /// or not).
    pub comm: f64,
    /// Step time.
    pub step: f64,
}

/// Where communication overtakes compute.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Crossover {
    /// The global batch it was computed for.
    pub batch: usize,
    /// The model it was computed for.
    pub model: ModelSpec,
    /// Compute and communication at each GPU count (powers of two, up to
    /// the batch: one sequence per GPU).
    pub points: Vec<ScalingPoint>,
    /// The first GPU count whose communication exceeds its compute, if
    /// any before one sequence per GPU.
    pub gpus: Option<usize>,
}

/// The chain for one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explanation {
    /// Parameters, N.
    pub params: f64,
    /// Training FLOPs per token.
    pub flops_per_token: f64,
    /// FLOPs of one step (6·N·D with attention) for the global batch.
    pub step_flops: f64,
    /// Bytes of model state per parameter with replicas (16 with mixed
    /// precision: bf16 weights and gradients, f32 master weights and
    /// two moments; weft's f32 run: 16 plus its 4-byte reducer bucket).
    pub state_bytes_per_param: f64,
    /// Plain data parallelism over every GPU with the smallest
    /// micro-batch (replicas, no tensor or pipeline parallelism).
    pub plain_dp: Option<Prediction>,
    /// The largest parameter count whose replicas fit a GPU beside one
    /// sequence's activations (the model's shape scaled in depth).
    pub plain_dp_max_params: f64,
    /// The best replica layout (no tensor or pipeline parallelism).
    pub best_dp: Option<Prediction>,
    /// The best fully sharded layout (no tensor or pipeline parallelism).
    pub best_fsdp: Option<Prediction>,
    /// The crossover for the request's model and batch.
    pub crossover: Crossover,
    /// The crossover for other batches (½, 2× and 4× the request's).
    pub crossover_by_batch: Vec<Crossover>,
    /// The crossover for the sparse (or, for a mixture of experts, the
    /// dense) counterpart of the model at the request's batch.
    pub crossover_sparse: Option<Crossover>,
    /// The best layout overall on the cluster.
    pub best: Option<Prediction>,
    /// Past the crossover (twice its GPU count, at most one sequence per
    /// GPU): the GPU count, the best layout of any kind there, and the
    /// best pure FSDP layout there.
    pub beyond: Option<(usize, Prediction, Option<Prediction>)>,
    /// The best layout with tensor parallelism inside a node, and the same
    /// with tensor parallelism across two nodes (when the heads allow).
    pub tp_placement: Option<(Prediction, Prediction)>,
    /// The batch floor: the longest sequence each context-parallel degree
    /// trains.
    pub sequence_floor: Vec<SequenceFloor>,
    /// At twice the longest sequence FSDP alone trains (its tokens): the sequence split
    /// over two ranks by context parallelism, and the same two ranks
    /// splitting the layers by tensor parallelism (with sequence
    /// parallelism), both fully sharded with full recomputation.
    pub cp_against_tp: Option<(usize, Prediction, Prediction)>,
}

/// The longest sequence one context-parallel degree trains on the
/// cluster: FSDP over the rest of the GPUs, one sequence per micro-batch,
/// full recomputation (the least memory a sequence can take without
/// splitting it further).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SequenceFloor {
    /// The context-parallel degree.
    pub cp: usize,
    /// The longest sequence that fits (the model's length doubled while
    /// it fits), if any; with its prediction.
    pub longest: Option<(usize, Prediction)>,
}

/// Doublings of the sequence tried by [`sequence_floor`]: up to 2^12
/// times the model's.
const MAX_DOUBLINGS: u32 = 12;

/// The layout of the batch floor at `cp`: FSDP over `gpus / cp` ranks
/// (replicas on one), one sequence per micro-batch, full recomputation;
/// with `tp`, the sequence's layers split over `tp` ranks instead.
fn floor_layout(gpus: usize, cp: usize, tp: usize) -> Layout {
    let mut l = Layout::degrees(gpus / (cp * tp), tp, 1);
    l.parallel.cp = cp;
    l.parallel.sequence_parallel = tp > 1;
    if gpus / tp > 1 {
        l.parallel.fsdp = Some(Strategy::Full);
    }
    l.micro_batch_size = 1;
    l.recompute = weft_parallel::Recompute::Full;
    l
}

/// `req` with its model's sequence `seq` tokens long.
fn with_seq(req: &Request, seq: usize) -> Request {
    Request {
        model: ModelSpec {
            seq,
            ..req.model.clone()
        },
        ..req.clone()
    }
}

/// The batch floor for `cp` ranks a sequence ([`SequenceFloor`]).
fn sequence_floor(req: &Request, cp: usize) -> SequenceFloor {
    let g = req.cluster.gpus;
    let mut longest = None;
    for k in 0..=MAX_DOUBLINGS {
        let seq = req.model.seq << k;
        match predict(&with_seq(req, seq), &floor_layout(g, cp, 1)) {
            Ok(p) if p.fits => longest = Some((seq, p)),
            // a sequence cp cannot cut: try the next
            Err(_) => {}
            Ok(_) => break,
        }
    }
    SequenceFloor { cp, longest }
}

fn pure_dp(fsdp: Option<Strategy>) -> Constraints {
    Constraints {
        tp: Some(1),
        pp: Some(1),
        ep: Some(1),
        cp: Some(1),
        fsdp: Some(fsdp),
        ..Constraints::default()
    }
}

/// Pure FSDP at `gpus` GPUs: the largest micro-batch that fits (one
/// micro-batch per rank when it fits; fewer sequences per micro-batch
/// mean more gathers).
fn fsdp_point(base: &Request, gpus: usize) -> Option<ScalingPoint> {
    let req = Request {
        cluster: base.cluster.clone().with_gpus(gpus),
        ..base.clone()
    };
    let sharding = if gpus > 1 { Some(Strategy::Full) } else { None };
    let preds = search(&req, &pure_dp(sharding)).ok()?;
    let p = preds.iter().find(|p| p.fits).or(preds.first())?;
    Some(ScalingPoint {
        gpus,
        compute: p.time.compute + p.time.optimizer,
        comm: p.time.dp_comm,
        step: p.step_s,
    })
}

/// The crossover of pure FSDP for `model` and `batch` on the request's
/// cluster (nodes of its size, as many as needed).
#[must_use]
pub fn crossover(base: &Request, model: &ModelSpec, batch: usize) -> Crossover {
    let req = Request {
        model: model.clone(),
        batch,
        ..base.clone()
    };
    let mut points = Vec::new();
    let mut g = 1usize;
    while g <= batch {
        if let Some(p) = fsdp_point(&req, g) {
            points.push(p);
        }
        g *= 2;
    }
    let gpus = points.iter().find(|p| p.comm > p.compute).map(|p| p.gpus);
    Crossover {
        batch,
        model: model.clone(),
        points,
        gpus,
    }
}

/// The sparse counterpart of a dense model (8 experts, 2 per token), or
/// the dense counterpart of a mixture of experts.
#[must_use]
pub fn counterpart(model: &ModelSpec) -> ModelSpec {
    if model.is_moe() {
        ModelSpec {
            experts: 0,
            top_k: 0,
            shared_experts: 0,
            expert_hidden: 0,
            first_dense: 0,
            ..model.clone()
        }
    } else {
        model.clone().with_moe(8, 2)
    }
}

/// Walks the chain for `req`.
///
/// # Errors
/// The request's errors.
pub fn explain(req: &Request) -> Result<Explanation> {
    req.validate()?;
    let m = &req.model;
    let g = req.cluster.gpus;
    let state = match req.recipe.accounting {
        Accounting::Weft => 20.0,
        Accounting::Mixed => 16.0,
    };
    let plain = Layout::degrees(g, 1, 1);
    let plain_dp = predict(req, &plain).ok();
    // the activations of one sequence, per layer, from the plain layout's
    // prediction: params scale with depth, activations too
    let plain_dp_max_params = plain_dp.as_ref().map_or(0.0, |p| {
        let per_layer_act = p.memory.activations as f64 / m.layers as f64;
        let per_layer_state = state * m.block_params();
        let fixed = state * (m.params() - m.layers as f64 * m.block_params());
        let layers = ((p.capacity as f64 - fixed) / (per_layer_state + per_layer_act)).floor();
        (layers.max(0.0) * m.block_params()) + (m.params() - m.layers as f64 * m.block_params())
    });
    let best_of = |c: &Constraints| {
        search(req, c)
            .ok()
            .and_then(|v| v.into_iter().find(|p| p.fits))
    };
    let best_dp = best_of(&pure_dp(None));
    let best_fsdp = if g > 1 {
        best_of(&pure_dp(Some(Strategy::Full)))
    } else {
        None
    };
    let best = best_of(&Constraints::default());
    let crossover_here = crossover(req, m, req.batch);
    let beyond = crossover_here.gpus.and_then(|g| {
        let g2 = (2 * g).min(req.batch);
        let r = Request {
            cluster: req.cluster.clone().with_gpus(g2),
            ..req.clone()
        };
        let first_fit = |c: &Constraints| {
            search(&r, c)
                .ok()
                .and_then(|v| v.into_iter().find(|p| p.fits))
        };
        first_fit(&Constraints::default())
            .map(|b| (g2, b, first_fit(&pure_dp(Some(Strategy::Full)))))
    });
    let crossover_by_batch = [req.batch / 2, req.batch * 2, req.batch * 4]
        .into_iter()
        .filter(|&b| b > 0)
        .map(|b| crossover(req, m, b))
        .collect();
    let sparse = counterpart(m);
    let crossover_sparse = sparse
        .validate()
        .ok()
        .map(|()| crossover(req, &sparse, req.batch));
    // tensor parallelism inside a node against across two nodes
    let node = req.cluster.gpus_per_node;
    let tp_placement = if g >= 2 * node && m.heads.is_multiple_of(2 * node) && node > 1 {
        let inside = best_of(&Constraints {
            tp: Some(node),
            ..Constraints::default()
        });
        let across = best_of(&Constraints {
            tp: Some(2 * node),
            ..Constraints::default()
        });
        inside.zip(across)
    } else {
        None
    };
    // the batch floor: the longest sequence of each cp (dense models)
    let sequence_floor: Vec<SequenceFloor> = if m.is_moe() {
        Vec::new()
    } else {
        [1usize, 2, 4, 8]
            .into_iter()
            .filter(|&cp| cp <= g && g.is_multiple_of(cp) && req.batch.is_multiple_of(g / cp))
            .map(|cp| sequence_floor(req, cp))
            .collect()
    };
    let cp_against_tp = sequence_floor
        .first()
        .and_then(|f| f.longest.as_ref())
        .filter(|_| g >= 2 && m.heads.is_multiple_of(2) && req.batch.is_multiple_of(g / 2))
        .and_then(|(seq, _)| {
            let r = with_seq(req, 2 * seq);
            let cp = predict(&r, &floor_layout(g, 2, 1)).ok()?;
            let tp = predict(&r, &floor_layout(g, 1, 2)).ok()?;
            Some((2 * seq, cp, tp))
        });
    Ok(Explanation {
        params: m.params(),
        flops_per_token: m.flops_per_token(),
        step_flops: m.flops_per_token() * (req.batch * m.seq) as f64,
        state_bytes_per_param: state,
        plain_dp,
        plain_dp_max_params,
        best_dp,
        best_fsdp,
        crossover: crossover_here,
        crossover_by_batch,
        crossover_sparse,
        best,
        beyond,
        tp_placement,
        sequence_floor,
        cp_against_tp,
    })
}

fn si(x: f64) -> String {
    let (v, u) = if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "B")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    format!("{v:.2}{u}")
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", 1e3 * s)
    }
}

fn crossover_line(c: &Crossover) -> String {
    match c.gpus {
        Some(g) => format!("at {g} GPUs"),
        None => format!(
            "not before {} GPUs (one sequence each)",
            c.points.last().map_or(0, |p| p.gpus)
        ),
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "1. Compute: {} parameters, {} FLOPs per token (6·N plus attention), {} FLOPs per step of this batch.",
            si(self.params),
            si(self.flops_per_token),
            si(self.step_flops)
        );
        let _ = match &self.plain_dp {
            Some(p) => writeln!(
                s,
                "2. Plain data parallelism (every GPU a replica, one sequence per micro-batch) needs {} per GPU ({} B of state per parameter: {} of it, activations {}) against {}: {}. Replicas fit up to about {} parameters of this shape.",
                bytes(p.memory.total()),
                self.state_bytes_per_param,
                bytes(p.memory.params + p.memory.grads + p.memory.optimizer + p.memory.buffers),
                bytes(p.memory.activations),
                bytes(p.capacity),
                if p.fits { "it fits" } else { "it does not fit" },
                si(self.plain_dp_max_params)
            ),
            None => writeln!(
                s,
                "2. Plain data parallelism cannot split this batch over every GPU."
            ),
        };
        let _ = match (&self.best_dp, &self.best_fsdp) {
            (Some(d), Some(z)) => writeln!(
                s,
                "3. FSDP (ZeRO-3) shards the model state: {} per GPU against {} for replicas (activations come on top). The best FSDP layout ({}) steps in {} against the best replica layout's ({}) {}: FSDP sends 3× the parameters per micro-batch against 2× per step for replicas, hidden behind compute where it can be.",
                bytes(z.memory.params + z.memory.grads + z.memory.optimizer),
                bytes(d.memory.params + d.memory.grads + d.memory.optimizer),
                z.layout,
                secs(z.step_s),
                d.layout,
                secs(d.step_s)
            ),
            (None, Some(z)) => writeln!(
                s,
                "3. Replicas do not fit at any micro-batch; FSDP (ZeRO-3) does: {} per GPU, step {} ({}).",
                bytes(z.memory.total()),
                secs(z.step_s),
                z.layout
            ),
            (Some(d), None) => writeln!(
                s,
                "3. Replicas fit ({}, step {}); FSDP does not help on one GPU or does not fit.",
                bytes(d.memory.total()),
                secs(d.step_s)
            ),
            (None, None) => writeln!(
                s,
                "3. Neither replicas nor FSDP fit without tensor or pipeline parallelism."
            ),
        };
        let _ = writeln!(
            s,
            "4. The communication crossover: with pure FSDP and this batch, the compute per GPU shrinks as GPUs are added but the gradient and parameter traffic per GPU does not; communication overtakes compute {}.",
            crossover_line(&self.crossover)
        );
        for p in &self.crossover.points {
            let _ = writeln!(
                s,
                "   {:>6} GPUs: compute {:>10}, communication {:>10}{}",
                p.gpus,
                secs(p.compute),
                secs(p.comm),
                if p.comm > p.compute {
                    "  <- communication-bound"
                } else {
                    ""
                }
            );
        }
        let by: Vec<String> = self
            .crossover_by_batch
            .iter()
            .map(|c| format!("batch {}: {}", c.batch, crossover_line(c)))
            .collect();
        let _ = writeln!(
            s,
            "5. A larger batch moves it right (more compute per step for the same traffic): {}.",
            by.join("; ")
        );
        if let Some(c) = &self.crossover_sparse {
            let _ = writeln!(
                s,
                "6. Sparsity moves it left: the {} counterpart ({} parameters, {} FLOPs per token) crosses over {} (this model: {}).",
                if c.model.is_moe() {
                    format!(
                        "mixture-of-experts ({} experts, top-{})",
                        c.model.experts, c.model.top_k
                    )
                } else {
                    "dense".to_owned()
                },
                si(c.model.params()),
                si(c.model.flops_per_token()),
                crossover_line(c),
                crossover_line(&self.crossover)
            );
        }
        if let Some((g, b, fsdp)) = &self.beyond {
            let _ = writeln!(
                s,
                "7. Past the crossover what cuts the traffic per GPU must be mixed in (hybrid sharding, pipeline or tensor parallelism): at {g} GPUs the best layout is {} — step {}, bubble {:.1}%, MFU {:.1}%{}.",
                b.layout,
                secs(b.step_s),
                100.0 * b.time.bubble_fraction,
                100.0 * b.mfu,
                fsdp.as_ref().map_or_else(String::new, |z| format!(
                    "; pure FSDP there: {} — step {}, communication {} of it exposed",
                    z.layout,
                    secs(z.step_s),
                    secs(z.time.dp_exposed)
                ))
            );
        }
        if let Some(b) = &self.best {
            let _ = writeln!(
                s,
                "   On this cluster the best layout is {} — step {}, bubble {:.1}%, MFU {:.1}%.",
                b.layout,
                secs(b.step_s),
                100.0 * b.time.bubble_fraction,
                100.0 * b.mfu
            );
        }
        if let Some((inside, across)) = &self.tp_placement {
            let _ = writeln!(
                s,
                "8. Tensor parallelism belongs on the fastest links: tp inside a node, best {} at {}; tp across two nodes, best {} at {} (tensor-parallel traffic {} against {}).",
                inside.layout,
                secs(inside.step_s),
                across.layout,
                secs(across.step_s),
                secs(inside.time.tp_comm),
                secs(across.time.tp_comm)
            );
        }
        if let Some(first) = self.sequence_floor.first() {
            let line = |f: &SequenceFloor| match &f.longest {
                Some((seq, p)) => format!(
                    "cp = {}: {seq} tokens ({} per GPU)",
                    f.cp,
                    bytes(p.memory.total())
                ),
                None => format!("cp = {}: none", f.cp),
            };
            let rest: Vec<String> = self.sequence_floor.iter().skip(1).map(line).collect();
            let _ = writeln!(
                s,
                "9. The batch floor: a micro-batch holds at least one sequence, so more data-parallel ranks stop helping once one sequence's activations outgrow a GPU. With FSDP and full recomputation the longest sequence is {}; context parallelism splits each sequence over cp ranks (activations per GPU ∝ T/cp, keys and values passed around a ring behind the attention): {}.",
                line(first),
                if rest.is_empty() {
                    "no split fits this cluster".to_owned()
                } else {
                    rest.join(", ")
                }
            );
        }
        if let Some((seq, cp, tp)) = &self.cp_against_tp {
            let _ = writeln!(
                s,
                "   Past it, at {} tokens: the sequence over 2 ranks ({}) steps in {} with {} of its ring exposed; the layers over 2 ranks instead ({}) in {} with {} of tensor-parallel traffic on the critical path{}",
                seq,
                cp.layout,
                secs(cp.step_s),
                secs(cp.time.cp_exposed),
                tp.layout,
                secs(tp.step_s),
                secs(tp.time.tp_comm),
                if cp.step_s <= tp.step_s {
                    ": cp first, tp on the fastest links."
                } else {
                    ": here tp wins (its group on fast links)."
                }
            );
        }
        f.write_str(s.trim_end())
    }
}
