//! Multi-rank runs: ranks are threads of this process, talking through
//! `weft-collectives`' local backend.
//!
//! Every rank runs the same training loop (SPMD, as torchtitan does); the
//! ranks differ only in which micro-batches they compute and in how their
//! gradients are combined. Rank 0 alone writes the run folder and reports
//! to the [`Observer`]: its reports cross to the calling thread over a
//! channel, so the terminal observer never leaves the main thread.
//!
//! # Data parallelism and bitwise reproducibility
//! A step's global batch is `train.grad_accum` micro-batches whatever the
//! split; with `parallel.dp = N` rank r computes micro-batches
//! `r·M/N .. (r+1)·M/N`. With `parallel.reproducible` on (the default) a
//! rank does not add its micro-batch gradients in f32: it folds each into
//! an exact, mergeable partial sum ([`weft_collectives::repro::ExactPartial`]),
//! the ranks reduce their partials exactly
//! ([`CommunicatorExt::all_reduce_exact`]), and the mean is rounded once. The
//! gradient — and so every later parameter — has the same bits for any
//! `dp` that divides `grad_accum`, including the single-rank run. Losses are
//! gathered per micro-batch and summed in micro-batch order, as the single
//! rank sums them. With `reproducible` off gradients are summed in f32
//! where they land and all-reduced with the ring: faster, and equal only to
//! rounding.

use std::ops::Range;
use std::sync::{Arc, mpsc};

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp, repro};

use crate::train::{EvalReport, HealthEvent, Observer, RunInfo, StepReport, Summary, TrainError};

/// An observer report crossing from rank 0 to the calling thread.
pub(crate) enum Report {
    Start(RunInfo),
    Step(StepReport),
    Eval(EvalReport),
    Event(HealthEvent),
    Resumed(u64, Vec<String>),
    Finish(Summary),
}

impl Report {
    /// Hands the report to `observer`.
    pub(crate) fn deliver(self, observer: &mut dyn Observer) {
        match self {
            Report::Start(i) => observer.start(&i),
            Report::Step(s) => observer.step(&s),
            Report::Eval(e) => observer.eval(&e),
            Report::Event(e) => observer.event(&e),
            Report::Resumed(step, skipped) => observer.resumed(step, &skipped),
            Report::Finish(s) => observer.finish(&s),
        }
    }
}

/// Rank 0's observer: forwards every report over a channel. A closed
/// channel (the receiver gave up) drops reports silently.
pub(crate) struct Forward(pub(crate) mpsc::Sender<Report>);

impl Observer for Forward {
    fn start(&mut self, info: &RunInfo) {
        let _ = self.0.send(Report::Start(info.clone()));
    }
    fn step(&mut self, report: &StepReport) {
        let _ = self.0.send(Report::Step(*report));
    }
    fn eval(&mut self, report: &EvalReport) {
        let _ = self.0.send(Report::Eval(*report));
    }
    fn event(&mut self, event: &HealthEvent) {
        let _ = self.0.send(Report::Event(event.clone()));
    }
    fn resumed(&mut self, step: u64, skipped: &[String]) {
        let _ = self.0.send(Report::Resumed(step, skipped.to_vec()));
    }
    fn finish(&mut self, summary: &Summary) {
        let _ = self.0.send(Report::Finish(summary.clone()));
    }
}

/// The expert-parallel groups of one rank (`parallel.ep > 1`): ranks
/// `g·ep .. (g+1)·ep` of the data-parallel world form expert group `g`
/// and share out the experts; the ranks holding the same experts (one per
/// group) form a replica group.
pub(crate) struct Ep {
    /// The expert group, handed to the model's mixture-of-experts blocks.
    pub(crate) group: Arc<dyn Communicator>,
    /// The ranks that hold this rank's experts.
    replica: Box<dyn Communicator>,
}

/// The groups of one rank: its data-parallel group, and where asked its
/// expert-parallel and tensor-parallel groups.
///
/// World ranks are laid out as a `dp × tp` mesh with tp varying fastest
/// (`rank = dp_index · tp + tp_index`), so a tensor-parallel group is `tp`
/// consecutive ranks — the ranks that must share the fastest links. The
/// data-parallel group of a rank is the ranks with its tp index.
pub(crate) struct Dp {
    comm: Box<dyn Communicator>,
    world_rank: usize,
    ep: Option<Ep>,
    tp: Option<Box<dyn Communicator>>,
    pp: Option<Box<dyn Communicator>>,
}

impl Dp {
    /// The groups of world rank `world.rank()`: with `tp > 1`, tp groups of
    /// `tp` consecutive ranks and data-parallel groups across them; with
    /// `ep > 1`, expert groups of `ep` consecutive data-parallel ranks.
    /// With `pp > 1` (the other degrees 1) the whole world is the
    /// pipeline group, rank `i` holding stage `i`, and each rank is its own
    /// data-parallel group.
    pub(crate) fn new(
        world: Box<dyn Communicator>,
        ep: usize,
        tp: usize,
        pp: usize,
    ) -> Result<Self, TrainError> {
        let world_rank = world.rank();
        if pp > 1 {
            let comm = world.split(world_rank as u32, 0)?;
            return Ok(Self {
                comm,
                world_rank,
                ep: None,
                tp: None,
                pp: Some(world),
            });
        }
        let (comm, tp) = if tp > 1 {
            let (d, t) = ((world_rank / tp) as u32, (world_rank % tp) as u32);
            let dp = world.split(t, d)?;
            let tp = world.split(d, t)?;
            (dp, Some(tp))
        } else {
            (world, None)
        };
        let ep = if ep > 1 {
            let r = comm.rank();
            let (g, i) = ((r / ep) as u32, (r % ep) as u32);
            let group: Arc<dyn Communicator> = Arc::from(comm.split(g, i)?);
            let replica = comm.split(i, g)?;
            Some(Ep { group, replica })
        } else {
            None
        };
        Ok(Self {
            comm,
            world_rank,
            ep,
            tp,
            pp: None,
        })
    }

    /// The data-parallel group.
    pub(crate) fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// The expert-parallel groups, if any.
    pub(crate) fn ep(&self) -> Option<&Ep> {
        self.ep.as_ref()
    }

    /// This rank's index in its expert group, if any.
    pub(crate) fn ep_rank(&self) -> Option<usize> {
        self.ep.as_ref().map(|e| e.group.rank())
    }

    /// The pipeline group, if any.
    pub(crate) fn pp(&self) -> Option<&dyn Communicator> {
        self.pp.as_deref()
    }

    /// The tensor-parallel group, if any.
    pub(crate) fn tp(&self) -> Option<&dyn Communicator> {
        self.tp.as_deref()
    }

    /// This rank's index in the world.
    pub(crate) fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// This rank's index in its data-parallel group.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the data-parallel group.
    pub(crate) fn size(&self) -> usize {
        self.comm.size()
    }

    /// The micro-batches (of `total`) this rank computes.
    pub(crate) fn share(&self, total: usize) -> Range<usize> {
        let per = total / self.size();
        self.rank() * per..(self.rank() + 1) * per
    }

    /// Every rank's `local` values, concatenated in rank order (all ranks
    /// pass the same length).
    pub(crate) fn gather(&self, local: &[f64]) -> Result<Vec<f64>, TrainError> {
        let mut all = vec![0.0; local.len() * self.size()];
        self.comm.all_gather(local, &mut all)?;
        Ok(all)
    }

    /// Elementwise sum over the data-parallel ranks, then over the pipeline
    /// stages, of small integer-valued counts (exact below 2^53 whatever
    /// the order).
    pub(crate) fn sum_counts(&self, values: &mut [f64]) -> Result<(), TrainError> {
        self.comm.all_reduce(values, ReduceOp::Sum)?;
        if let Some(pp) = &self.pp {
            pp.all_reduce(values, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Sum over the expert group (distinct expert shards' figures).
    pub(crate) fn sum_over_experts(&self, value: f64) -> Result<f64, TrainError> {
        let mut v = [value];
        if let Some(ep) = &self.ep {
            ep.group.all_reduce(&mut v, ReduceOp::Sum)?;
        }
        Ok(v[0])
    }

    /// Assembles the unsharded buffer `full` (laid out by `full_layout`;
    /// `None` on ranks that do not keep one) from `src` (laid out by
    /// `local`): expert tensors are gathered over the expert group — a
    /// collective every rank of the group joins — and other tensors copied.
    pub(crate) fn gather_experts(
        &self,
        local: &weft_model::ParamLayout,
        full_layout: &weft_model::ParamLayout,
        src: &[f32],
        mut full: Option<&mut [f32]>,
    ) -> Result<(), TrainError> {
        let mut scratch = Vec::new();
        for spec in local.specs() {
            let Some(dst) = full_layout.get(&spec.name) else {
                continue;
            };
            let part = &src[spec.range()];
            match (&self.ep, full.as_deref_mut()) {
                (Some(ep), out) if weft_model::MoeFfn::is_expert_param(&spec.name) => {
                    let out = match out {
                        Some(f) => &mut f[dst.range()],
                        None => {
                            scratch.resize(dst.numel(), 0.0);
                            &mut scratch[..]
                        }
                    };
                    ep.group.all_gather(part, out)?;
                }
                (_, Some(f)) => f[dst.range()].copy_from_slice(part),
                (_, None) => {}
            }
        }
        Ok(())
    }
}

/// Where a gradient part is reduced.
#[derive(Clone, Copy, PartialEq)]
enum Over {
    /// Replicated tensors: the mean over every micro-batch of the world.
    World,
    /// Expert shards, which already hold their expert group's sum: summed
    /// over the replica group, then divided by the micro-batches.
    Replicas,
}

/// A set of gradient elements reduced the same way.
struct Part {
    /// Element ranges in the gradient buffer (empty: the whole buffer).
    ranges: Vec<Range<usize>>,
    over: Over,
    exact: Option<repro::ExactPartial>,
    /// The part's elements, gathered (unless it is the whole buffer).
    buf: Vec<f32>,
}

/// Copies the elements of `ranges` of `grads` into `buf`, in order.
fn gather_ranges(ranges: &[Range<usize>], grads: &[f32], buf: &mut Vec<f32>) {
    buf.clear();
    for r in ranges {
        buf.extend_from_slice(&grads[r.clone()]);
    }
}

/// The inverse of [`gather_ranges`].
fn scatter_ranges(ranges: &[Range<usize>], buf: &[f32], grads: &mut [f32]) {
    let mut at = 0;
    for r in ranges {
        grads[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
        at += r.len();
    }
}

/// Sums micro-batch gradients: exactly (order- and split-independent) or
/// in place in f32.
pub(crate) struct GradAccum {
    parts: Vec<Part>,
    exact: bool,
}

impl GradAccum {
    /// An empty accumulator for `len` gradients; `exact` selects the
    /// reproducible sum; with `experts` (expert parallelism: the rank's
    /// whole-model layout) the expert tensors are reduced over their
    /// replica group.
    pub(crate) fn new(len: usize, exact: bool, experts: Option<&weft_model::ParamLayout>) -> Self {
        let new_part = |ranges: Vec<Range<usize>>, over: Over| {
            let n = if ranges.is_empty() {
                len
            } else {
                ranges.iter().map(Range::len).sum()
            };
            Part {
                ranges,
                over,
                exact: exact.then(|| repro::ExactPartial::new(n)),
                buf: Vec::new(),
            }
        };
        let parts = match experts {
            Some(layout) => {
                let (experts, dense): (Vec<_>, Vec<_>) = layout
                    .specs()
                    .iter()
                    .partition(|s| weft_model::MoeFfn::is_expert_param(&s.name));
                let ranges = |v: Vec<&weft_model::ParamSpec>| v.iter().map(|s| s.range()).collect();
                vec![
                    new_part(ranges(dense), Over::World),
                    new_part(ranges(experts), Over::Replicas),
                ]
            }
            None => vec![new_part(Vec::new(), Over::World)],
        };
        Self { parts, exact }
    }

    /// Call after each micro-batch's backward. Exact: folds `grads` into
    /// the partials and zeroes them for the next micro-batch. Plain: leaves
    /// them to accumulate in place.
    pub(crate) fn add(&mut self, grads: &mut [f32]) -> Result<(), TrainError> {
        if !self.exact {
            return Ok(());
        }
        for part in &mut self.parts {
            let Some(partial) = &mut part.exact else {
                continue;
            };
            if part.ranges.is_empty() {
                partial.add(grads)?;
            } else {
                gather_ranges(&part.ranges, grads, &mut part.buf);
                partial.add(&part.buf)?;
            }
        }
        weft_kernels::zero(grads);
        Ok(())
    }

    /// Writes the gradient of the global batch's mean loss over its
    /// `micro_batches` into `grads` and resets the accumulator. Replicated
    /// tensors: exact — the exact sum over every rank's micro-batches
    /// divided by their count, rounded once; plain — the f32 sum
    /// all-reduced over `dp`, times `1/micro_batches`. Expert shards (with
    /// expert parallelism): the sum over the replica group (exact, rounded
    /// once, or plain) times `1/micro_batches`.
    pub(crate) fn finish(
        &mut self,
        grads: &mut [f32],
        dp: Option<&Dp>,
        micro_batches: usize,
    ) -> Result<(), TrainError> {
        let inv = 1.0 / micro_batches as f32;
        for part in &mut self.parts {
            let whole = part.ranges.is_empty();
            if !whole {
                gather_ranges(&part.ranges, grads, &mut part.buf);
            }
            let out: &mut [f32] = if whole { grads } else { &mut part.buf };
            let comm: Option<&dyn Communicator> = match (dp, part.over) {
                (None, _) => None,
                (Some(d), Over::World) => Some(&*d.comm),
                (Some(d), Over::Replicas) => d.ep.as_ref().map(|e| &*e.replica),
            };
            let scale = match (&mut part.exact, part.over) {
                (Some(partial), Over::World) => {
                    match comm {
                        Some(c) => c.all_reduce_exact(partial, out, ReduceOp::Avg)?,
                        None => partial.mean_to(out)?,
                    }
                    partial.clear();
                    false
                }
                (Some(partial), Over::Replicas) => {
                    match comm {
                        Some(c) => c.all_reduce_exact(partial, out, ReduceOp::Sum)?,
                        None => partial.round_to(out)?,
                    }
                    partial.clear();
                    true
                }
                (None, _) => {
                    if let Some(c) = comm {
                        c.all_reduce(out, ReduceOp::Sum)?;
                    }
                    true
                }
            };
            if scale && micro_batches > 1 {
                out.iter_mut().for_each(|g| *g *= inv);
            }
            if !whole {
                scatter_ranges(&part.ranges, &part.buf, grads);
            }
        }
        Ok(())
    }
}

/// Copies the unsharded buffer `full` (laid out by `full_layout`) into
/// `local` (laid out by `local_layout`, whose expert tensors hold `1/ep` of
/// the experts): expert tensors take block `ep_rank` of their first
/// dimension — contiguous in memory — and other tensors are copied whole.
/// Tensors missing from `full` are left alone.
pub(crate) fn take_experts(
    full_layout: &weft_model::ParamLayout,
    full: &[f32],
    local_layout: &weft_model::ParamLayout,
    local: &mut [f32],
    ep_rank: usize,
) {
    for spec in local_layout.specs() {
        let Some(src) = full_layout.get(&spec.name) else {
            continue;
        };
        let n = spec.numel();
        let start = if weft_model::MoeFfn::is_expert_param(&spec.name) {
            src.range().start + ep_rank * n
        } else {
            src.range().start
        };
        local[spec.range()].copy_from_slice(&full[start..start + n]);
    }
}

/// The exact sum of every rank's `local` exact sum over `comm`, the same
/// on every rank: each rank sends its state to every other and merges all
/// of them (merging is exact, so the order does not matter).
pub(crate) fn merge_exact_sums(
    comm: &dyn Communicator,
    local: &weft_numerics::ExactSum,
) -> Result<weft_numerics::ExactSum, TrainError> {
    const TAG: u64 = 0x5746_4e53; // "WFNS"
    let mine = local.to_bytes();
    let me = comm.rank();
    for peer in (0..comm.size()).filter(|&p| p != me) {
        comm.send_bytes(peer, TAG, &(mine.len() as u64).to_le_bytes())?;
        comm.send_bytes(peer, TAG + 1, &mine)?;
    }
    let mut total = local.clone();
    for peer in (0..comm.size()).filter(|&p| p != me) {
        let mut n = [0u8; 8];
        comm.recv_bytes(peer, TAG, &mut n)?;
        let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(0);
        let mut buf = vec![0u8; len];
        comm.recv_bytes(peer, TAG + 1, &mut buf)?;
        let other = weft_numerics::ExactSum::from_bytes(&buf).map_err(|e| {
            TrainError::Unsupported(format!("a peer's gradient-norm state is corrupt: {e}"))
        })?;
        total.merge(&other);
    }
    Ok(total)
}
