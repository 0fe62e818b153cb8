//! One rank's model: the whole GPT (whose mixture-of-experts blocks may
//! hold a share of the experts), its tensor-parallel shard, or its fully
//! sharded data-parallel state (`weft-fsdp`).
//!
//! The training loop talks to a `Net` only: a training step over this
//! rank's micro-batches (forward, backward, gradient reduction, global-norm
//! clipping, AdamW — or a skip on a non-finite gradient), evaluation, and
//! assembling / sharding the whole model for checkpoints.

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::AdamW;
use weft_model::tp::{TpActivations, TpGpt, TpLayout};
use weft_model::{Activations, AdamWState, Gpt, ParamLayout};

use weft_collectives::repro;
use weft_model::GptStage;

use crate::data::{Batch, Data};
use crate::parallel::{Dp, GradAccum};
use crate::train::TrainError;

/// One rank's model.
pub(crate) enum Net {
    /// The whole model (experts possibly sharded over an expert group).
    Whole(Gpt),
    /// This rank's tensor-parallel shard.
    Tp(TpGpt),
    /// This rank's sharded data-parallel state; the runner does the whole
    /// step (its own reductions, clipping and sharded AdamW).
    Fsdp(Box<weft_fsdp::Fsdp>),
    /// This rank's pipeline stages (one per model chunk it holds) and
    /// their optimizer state.
    Pp(Box<Pipe>),
}

/// One rank's share of a pipeline: the executor, AdamW moments per chunk,
/// exact per-micro-batch gradient sums, and the last step's measured
/// timeline (for the run's trace and its bubble).
pub(crate) struct Pipe {
    pub(crate) ex: weft_pipeline::Executor<GptStage>,
    opt: Vec<AdamWState>,
    /// Exact sums keyed by (chunk, gradient range), reproducible mode.
    partials: Option<std::collections::BTreeMap<(usize, usize, usize), repro::ExactPartial>>,
    pub(crate) timeline: Option<weft_pipeline::RankTimeline>,
}

impl Pipe {
    /// Rank `rank`'s stages of `schedule` over the whole model `whole`,
    /// `layers` per virtual stage, micro-batches of `b`×`t` tokens.
    pub(crate) fn new(
        whole: &Gpt,
        schedule: weft_pipeline::Schedule,
        rank: usize,
        layers: &[usize],
        b: usize,
        t: usize,
        exact: bool,
    ) -> Result<Self, TrainError> {
        let stages = weft_model::pipeline_stages(whole, &schedule, rank, layers, b, t)?;
        let ex = weft_pipeline::Executor::new(schedule, rank, stages)?;
        let opt = ex
            .stages()
            .iter()
            .map(|s| AdamWState {
                m: vec![0.0; s.params.len()],
                v: vec![0.0; s.params.len()],
                step: 0,
            })
            .collect();
        Ok(Self {
            ex,
            opt,
            partials: exact.then(std::collections::BTreeMap::new),
            timeline: None,
        })
    }
}

/// Activation buffers for a [`Net`].
pub(crate) enum NetActs {
    /// For [`Net::Whole`].
    Whole(Activations),
    /// For [`Net::Tp`], with the batch size they were planned for.
    Tp(TpActivations, usize),
    /// For [`Net::Fsdp`] and [`Net::Pp`] (which own their buffers): the
    /// batch size and the bytes planned.
    Fsdp(usize, usize),
}

impl NetActs {
    /// Bytes of activations planned.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            NetActs::Whole(a) => a.bytes(),
            NetActs::Tp(a, _) => a.bytes(),
            NetActs::Fsdp(_, bytes) => *bytes,
        }
    }

    /// Sequences the buffers were planned for.
    pub(crate) fn batch(&self) -> usize {
        match self {
            NetActs::Whole(a) => a.batch(),
            NetActs::Tp(_, b) | NetActs::Fsdp(b, _) => *b,
        }
    }
}

/// What a training step did.
pub(crate) struct StepOutcome {
    /// Mean loss over the global batch.
    pub(crate) loss: f64,
    /// Global gradient norm (before clipping).
    pub(crate) grad_norm: f64,
    /// Whether the update was applied (false: skipped as non-finite).
    pub(crate) applied: bool,
}

/// `Σ g²` over `grads`: exact in f64 per term, summed exactly, rounded once.
fn exact_sum_of_squares(grads: &[f32]) -> f64 {
    let mut sum = weft_numerics::ExactSum::new();
    add_squares(&mut sum, grads);
    sum.to_f64()
}

/// Adds every `g²` of `grads` (exact in f64) to `sum`.
fn add_squares(sum: &mut weft_numerics::ExactSum, grads: &[f32]) {
    let mut buf = Vec::with_capacity(4096);
    for c in grads.chunks(4096) {
        buf.clear();
        buf.extend(c.iter().map(|&x| f64::from(x) * f64::from(x)));
        sum.add_slice(&buf);
    }
}

/// Gathers the sharded runner's `(master, m, v)[which]` of every unit into
/// the whole-model buffer `out` (on ranks that pass one). Collective over
/// the data-parallel group when the optimizer state is sharded: the shards
/// of the first shard group, in rank order, tile each padded unit.
fn gather_fsdp(
    dp: &Dp,
    f: &weft_fsdp::Fsdp,
    which: usize,
    mut out: Option<&mut [f32]>,
) -> Result<(), TrainError> {
    for (u, unit) in f.plan().units().iter().enumerate() {
        let state = f.shard_state(u);
        let mine = [state.0, state.1, state.2][which];
        let whole_unit =
            f.optimizer_range(u).len() >= unit.len() && f.optimizer_range(u).start == 0;
        if whole_unit {
            if let Some(o) = out.as_deref_mut() {
                o[unit.range.clone()].copy_from_slice(&mine[..unit.len()]);
            }
            continue;
        }
        let mut all = vec![0.0f32; mine.len() * dp.size()];
        dp.comm().all_gather(mine, &mut all)?;
        if let Some(o) = out.as_deref_mut() {
            o[unit.range.clone()].copy_from_slice(&all[..unit.len()]);
        }
    }
    Ok(())
}

fn tp_err(e: weft_model::tp::Error) -> TrainError {
    TrainError::TensorParallel(e)
}

/// The tensor-parallel group, which a [`Net::Tp`] needs.
fn tp_comm(dp: Option<&Dp>) -> Result<&dyn Communicator, TrainError> {
    dp.and_then(Dp::tp)
        .ok_or_else(|| TrainError::Unsupported("a tensor-parallel model needs its tp group".into()))
}

impl Net {
    /// Activation buffers for micro-batches of `b` sequences of `t` tokens.
    pub(crate) fn activations(&mut self, b: usize, t: usize) -> Result<NetActs, TrainError> {
        Ok(match self {
            Net::Whole(m) => NetActs::Whole(m.activations(b, t)?),
            Net::Tp(m) => NetActs::Tp(m.activations(b, t).map_err(tp_err)?, b),
            Net::Fsdp(f) => {
                f.prepare(b, t)?;
                let bytes = f.memory().current(weft_fsdp::Category::Activations);
                NetActs::Fsdp(b, bytes)
            }
            Net::Pp(p) => {
                let bytes = p.ex.stages().iter().map(|s| s.activation_bytes()).sum();
                NetActs::Fsdp(b, bytes)
            }
        })
    }

    /// Mean loss of one batch, without gradients (evaluation). Collective
    /// for sharded models.
    pub(crate) fn eval_batch(
        &mut self,
        dp: Option<&Dp>,
        acts: &mut NetActs,
        b: &Batch,
    ) -> Result<f64, TrainError> {
        if let Net::Fsdp(f) = self {
            let mb = weft_fsdp::MicroBatch {
                tokens: &b.inputs,
                targets: &b.targets,
            };
            return Ok(f.eval_loss(b.batch, b.seq, mb)?);
        }
        Ok(self
            .forward(dp, acts, &b.inputs, Some(&b.targets))?
            .unwrap_or(f64::NAN))
    }

    /// One training step over micro-batches `share` of step `step` (each
    /// `micro` sequences): forward and backward, the gradient of the global
    /// batch's mean loss (through `accum` over `dp`), the global norm, and
    /// — unless the loss or the norm is not finite — clipping to
    /// `clip` (`clip / (norm + 1e-6)`, as PyTorch's `clip_grad_norm_`) and
    /// AdamW with `hp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_step(
        &mut self,
        dp: Option<&Dp>,
        data: &Data,
        step: u64,
        share: std::ops::Range<usize>,
        micro: usize,
        acts: &mut NetActs,
        accum: &mut GradAccum,
        opt: &mut AdamWState,
        hp: &AdamW,
        clip: f64,
        micro_batches: usize,
    ) -> Result<StepOutcome, TrainError> {
        if let Net::Fsdp(f) = self {
            let batches: Vec<Batch> = share.map(|m| data.train_batch(step, m, micro)).collect();
            let mbs: Vec<weft_fsdp::MicroBatch<'_>> = batches
                .iter()
                .map(|b| weft_fsdp::MicroBatch {
                    tokens: &b.inputs,
                    targets: &b.targets,
                })
                .collect();
            let seq = batches.first().map_or(0, |b| b.seq);
            let r = f.step(micro, seq, &mbs, hp.lr)?;
            return Ok(StepOutcome {
                loss: r.loss,
                grad_norm: r.grad_norm,
                applied: r.applied,
            });
        }
        if let Net::Pp(p) = self {
            let batches: Vec<Batch> = share.map(|m| data.train_batch(step, m, micro)).collect();
            return pipe_step(p, dp, &batches, hp, clip, micro_batches);
        }
        self.zero_grad();
        let mut micro_losses = Vec::with_capacity(share.len());
        for m in share {
            let b = data.train_batch(step, m, micro);
            let l = self.forward(dp, acts, &b.inputs, Some(&b.targets))?;
            micro_losses.push(l.unwrap_or(f64::NAN));
            self.backward(dp, acts)?;
            accum.add(self.grads_mut())?;
        }
        accum.finish(self.grads_mut(), dp, micro_batches)?;
        if let Some(dp) = dp {
            micro_losses = dp.gather(&micro_losses)?;
        }
        // Summed in micro-batch order on every rank, as one rank sums them.
        let mut loss = 0.0;
        for l in micro_losses {
            loss += l;
        }
        loss /= micro_batches as f64;
        let grad_norm = self.grad_norm_sq(dp)?.sqrt();
        let applied = loss.is_finite() && grad_norm.is_finite();
        if applied {
            if clip > 0.0 && grad_norm > clip {
                #[allow(clippy::cast_possible_truncation)]
                let s = (clip / (grad_norm + 1e-6)) as f32;
                self.grads_mut().iter_mut().for_each(|g| *g *= s);
            }
            self.adamw_step(opt, hp)?;
        }
        Ok(StepOutcome {
            loss,
            grad_norm,
            applied,
        })
    }

    /// The communication and computation spans recorded since the last
    /// call (sharded runner only), as Chrome trace events of process `pid`
    /// — with the track names when `names` is set.
    pub(crate) fn take_trace_events(
        &mut self,
        pid: u64,
        names: bool,
    ) -> Vec<weft_trace::TraceEvent> {
        let Net::Fsdp(f) = self else {
            return Vec::new();
        };
        let mut events = f.spans().trace_events(pid, 0.0);
        if !names {
            events.retain(|e| e.ph == weft_trace::Phase::Complete);
        }
        f.spans_mut().clear();
        events
    }

    /// Bytes this rank holds, by category.
    pub(crate) fn memory(&self, opt: &AdamWState, acts: &NetActs) -> crate::train::RankMemory {
        use weft_fsdp::Category as C;
        match self {
            Net::Pp(p) => {
                let n: usize = p.ex.stages().iter().map(|s| s.params.len()).sum();
                crate::train::RankMemory {
                    params: 4 * n,
                    grads: 4 * n,
                    optimizer: 8 * n,
                    activations: acts.bytes(),
                }
            }
            Net::Fsdp(f) => {
                let m = f.memory();
                crate::train::RankMemory {
                    params: m.current(C::ParamShards) + m.current(C::GatheredParams),
                    grads: m.current(C::Gradients),
                    optimizer: m.current(C::OptimizerState),
                    activations: m.current(C::Activations),
                }
            }
            _ => crate::train::RankMemory {
                params: 4 * self.params_len(),
                grads: 4 * self.grads().len(),
                optimizer: 4 * (opt.m.len() + opt.v.len()),
                activations: acts.bytes(),
            },
        }
    }

    /// Forward over one batch; the mean loss with `targets`.
    pub(crate) fn forward(
        &self,
        dp: Option<&Dp>,
        acts: &mut NetActs,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>, TrainError> {
        match (self, acts) {
            (Net::Whole(m), NetActs::Whole(a)) => Ok(m.forward(a, tokens, targets)?),
            (Net::Tp(m), NetActs::Tp(a, _)) => {
                m.forward(tp_comm(dp)?, a, tokens, targets).map_err(tp_err)
            }
            _ => Err(TrainError::Unsupported(
                "forward of a model that runs whole steps only".into(),
            )),
        }
    }

    /// Backward of the last forward, accumulating into the gradients.
    pub(crate) fn backward(
        &mut self,
        dp: Option<&Dp>,
        acts: &mut NetActs,
    ) -> Result<(), TrainError> {
        match (self, acts) {
            (Net::Whole(m), NetActs::Whole(a)) => Ok(m.backward(a)?),
            (Net::Tp(m), NetActs::Tp(a, _)) => m.backward(tp_comm(dp)?, a).map_err(tp_err),
            _ => Err(TrainError::Unsupported(
                "backward of a model that runs whole steps only".into(),
            )),
        }
    }

    /// Sets every gradient to zero.
    pub(crate) fn zero_grad(&mut self) {
        match self {
            Net::Whole(m) => m.zero_grad(),
            Net::Tp(m) => m.zero_grad(),
            Net::Fsdp(_) => {}
            Net::Pp(p) => p.ex.stages_mut().iter_mut().for_each(GptStage::zero_grad),
        }
    }

    /// This rank's copy of the parameter tensor `name` (Hugging Face name),
    /// if it holds it whole: the whole model's, or the pipeline stage's
    /// that owns it; `None` for a tensor held elsewhere or sharded.
    pub(crate) fn param_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        match self {
            Net::Whole(m) => {
                let r = m.layout().get(name)?.range();
                Some(&mut m.params[r])
            }
            Net::Tp(_) | Net::Fsdp(_) => None,
            Net::Pp(p) => p.ex.stages_mut().iter_mut().find_map(|s| {
                let r = s.specs().iter().find(|spec| spec.name == name)?.range();
                Some(&mut s.params[r])
            }),
        }
    }

    /// Parameters on this rank.
    pub(crate) fn params_len(&self) -> usize {
        match self {
            Net::Whole(m) => m.params.len(),
            Net::Tp(m) => m.params.len(),
            Net::Fsdp(f) => f.plan().shard_params(),
            Net::Pp(p) => p.ex.stages().iter().map(|s| s.params.len()).sum(),
        }
    }

    /// This rank's gradient buffer.
    pub(crate) fn grads(&self) -> &[f32] {
        match self {
            Net::Whole(m) => &m.grads,
            Net::Tp(m) => &m.grads,
            Net::Fsdp(_) | Net::Pp(_) => &[],
        }
    }

    /// This rank's gradient buffer, mutably.
    pub(crate) fn grads_mut(&mut self) -> &mut [f32] {
        match self {
            Net::Whole(m) => &mut m.grads,
            Net::Tp(m) => &mut m.grads,
            Net::Fsdp(_) | Net::Pp(_) => &mut [],
        }
    }

    /// Zero AdamW moments for this rank's parameters.
    pub(crate) fn adamw_state(&self) -> AdamWState {
        match self {
            Net::Whole(m) => m.adamw_state(),
            Net::Tp(m) => m.adamw_state(),
            // The runner (or each stage) keeps its own moments.
            Net::Fsdp(_) | Net::Pp(_) => AdamWState {
                m: Vec::new(),
                v: Vec::new(),
                step: 0,
            },
        }
    }

    /// One AdamW step on this rank's parameters.
    pub(crate) fn adamw_step(
        &mut self,
        opt: &mut AdamWState,
        hp: &AdamW,
    ) -> Result<(), TrainError> {
        match self {
            Net::Whole(m) => Ok(m.adamw_step(opt, hp)?),
            Net::Tp(m) => m.adamw_step(opt, hp).map_err(tp_err),
            Net::Fsdp(_) | Net::Pp(_) => Err(TrainError::Unsupported(
                "sharded and pipelined models step their own optimizer".into(),
            )),
        }
    }

    /// The squared L2 norm of the whole model's gradient, the same on every
    /// rank: tensor-parallel shards summed over the tp group and expert
    /// shards over the expert group, replicated tensors counted once.
    pub(crate) fn grad_norm_sq(&self, dp: Option<&Dp>) -> Result<f64, TrainError> {
        match self {
            Net::Tp(m) => m.grad_norm_sq(tp_comm(dp)?).map_err(tp_err),
            Net::Fsdp(_) | Net::Pp(_) => Err(TrainError::Unsupported(
                "sharded and pipelined models compute their own norm".into(),
            )),
            Net::Whole(m) => match dp {
                Some(d) if d.ep().is_some() => {
                    let (mut dense, mut experts) = (0.0, 0.0);
                    for spec in m.layout().specs() {
                        let sq: f64 = m.grads[spec.range()]
                            .iter()
                            .map(|&g| f64::from(g) * f64::from(g))
                            .sum();
                        if weft_model::MoeFfn::is_expert_param(&spec.name) {
                            experts += sq;
                        } else {
                            dense += sq;
                        }
                    }
                    Ok(dense + d.sum_over_experts(experts)?)
                }
                // Squares of f32 are exact in f64; their exact sum, rounded
                // once, is what the sharded runner computes over shards.
                _ => Ok(exact_sum_of_squares(&m.grads)),
            },
        }
    }

    /// Copies the whole model's state, `whole` and `whole_opt` (laid out by
    /// their [`ParamLayout`]), into this rank's share: its experts, or its
    /// tensor-parallel shard.
    pub(crate) fn take_share(
        &mut self,
        dp: Option<&Dp>,
        whole: &Gpt,
        whole_opt: &AdamWState,
        opt: &mut AdamWState,
    ) -> Result<(), TrainError> {
        opt.step = whole_opt.step;
        match self {
            Net::Whole(m) => {
                let ep_rank = dp.and_then(Dp::ep_rank).unwrap_or(0);
                let (fl, ll) = (whole.layout().clone(), m.layout().clone());
                crate::parallel::take_experts(&fl, &whole.params, &ll, &mut m.params, ep_rank);
                crate::parallel::take_experts(&fl, &whole_opt.m, &ll, &mut opt.m, ep_rank);
                crate::parallel::take_experts(&fl, &whole_opt.v, &ll, &mut opt.v, ep_rank);
                Ok(())
            }
            Net::Tp(m) => {
                let lay = m.layout().clone();
                let fl = whole.layout();
                m.load_full(&whole.params).map_err(tp_err)?;
                opt.m = lay.shard(fl, &whole_opt.m).map_err(tp_err)?;
                opt.v = lay.shard(fl, &whole_opt.v).map_err(tp_err)?;
                Ok(())
            }
            Net::Pp(p) => {
                for (st, o) in p.ex.stages_mut().iter_mut().zip(&mut p.opt) {
                    st.load_from_full(&whole.params)?;
                    for (l, g) in st.segments().to_vec() {
                        o.m[l.clone()].copy_from_slice(&whole_opt.m[g.clone()]);
                        o.v[l].copy_from_slice(&whole_opt.v[g]);
                    }
                    o.step = whole_opt.step;
                }
                if let Some(d) = dp.and_then(Dp::pp) {
                    p.ex.sync_shared(d)?;
                }
                Ok(())
            }
            Net::Fsdp(f) => {
                let units = f.plan().units().to_vec();
                for (u, unit) in units.iter().enumerate() {
                    let r = f.optimizer_range(u);
                    let pad = |buf: &[f32]| -> Vec<f32> {
                        let mut padded = vec![0.0f32; r.end.max(unit.len())];
                        padded[..unit.len()].copy_from_slice(&buf[unit.range.clone()]);
                        padded[r.clone()].to_vec()
                    };
                    let (p, m, v) = (pad(&whole.params), pad(&whole_opt.m), pad(&whole_opt.v));
                    f.load_shard_state(u, &p, &m, &v, whole_opt.step)?;
                }
                Ok(())
            }
        }
    }

    /// Assembles the whole model's parameters and moments into `whole` and
    /// `whole_opt` (on ranks that keep them; `None` elsewhere). Collective
    /// over the expert or tp group: every rank of the group calls it.
    pub(crate) fn assemble(
        &self,
        dp: Option<&Dp>,
        opt: &AdamWState,
        full_layout: &ParamLayout,
        whole: Option<(&mut Gpt, &mut AdamWState)>,
    ) -> Result<(), TrainError> {
        let (mut p, mut mo, mut vo) = (None, None, None);
        if let Some((g, o)) = whole {
            o.step = match self {
                Net::Fsdp(f) => f.optimizer_step(),
                Net::Pp(p) => p.opt.first().map_or(0, |o| o.step),
                _ => opt.step,
            };
            p = Some(&mut g.params[..]);
            mo = Some(&mut o.m[..]);
            vo = Some(&mut o.v[..]);
        }
        match self {
            Net::Whole(m) => {
                let d = dp.ok_or_else(|| TrainError::Unsupported("no groups".into()))?;
                let ll = m.layout();
                d.gather_experts(ll, full_layout, &m.params, p)?;
                d.gather_experts(ll, full_layout, &opt.m, mo)?;
                d.gather_experts(ll, full_layout, &opt.v, vo)
            }
            Net::Tp(m) => {
                let comm = tp_comm(dp)?;
                for (local, out) in [(&m.params[..], p), (&opt.m[..], mo), (&opt.v[..], vo)] {
                    gather_tp(comm, m, local, full_layout, out)?;
                }
                Ok(())
            }
            Net::Pp(pipe) => {
                let comm = dp
                    .and_then(Dp::pp)
                    .ok_or_else(|| TrainError::Unsupported("no pipeline group".into()))?;
                gather_stages(comm, pipe, [p, mo, vo])
            }
            Net::Fsdp(f) => {
                let d = dp.ok_or_else(|| TrainError::Unsupported("no groups".into()))?;
                for (which, out) in [(0, p), (1, mo), (2, vo)] {
                    gather_fsdp(d, f, which, out)?;
                }
                Ok(())
            }
        }
    }
}

/// Gathers a tensor-parallel shard buffer (parameters or a moment) of
/// every rank of the tp group into the whole-model buffer `out` (on ranks
/// that pass one): each rank broadcasts its shard in turn.
fn gather_tp(
    comm: &dyn Communicator,
    m: &TpGpt,
    local: &[f32],
    full_layout: &ParamLayout,
    mut out: Option<&mut [f32]>,
) -> Result<(), TrainError> {
    for r in 0..m.tp() {
        let lay = TpLayout::new(m.config(), m.tp(), r).map_err(tp_err)?;
        let mut buf = if r == m.rank() {
            local.to_vec()
        } else {
            vec![0.0f32; lay.len()]
        };
        comm.broadcast(&mut buf, r)?;
        if let Some(o) = out.as_deref_mut() {
            lay.place(&buf, full_layout, o, r == 0).map_err(tp_err)?;
        }
    }
    Ok(())
}

/// One pipelined training step over all `batches` of the global batch: the
/// schedule (micro-batch gradients summed exactly when reproducible, in
/// place otherwise), the mean loss broadcast from the head's rank, the
/// exact global norm over every stage, clipping and AdamW per stage, and
/// the tied embedding's refresh.
fn pipe_step(
    p: &mut Pipe,
    dp: Option<&Dp>,
    batches: &[Batch],
    hp: &AdamW,
    clip: f64,
    micro_batches: usize,
) -> Result<StepOutcome, TrainError> {
    let comm = dp
        .and_then(Dp::pp)
        .ok_or_else(|| TrainError::Unsupported("no pipeline group".into()))?;
    let mbs: Vec<weft_model::MicroBatch<'_>> = batches
        .iter()
        .map(|b| weft_model::MicroBatch {
            tokens: &b.inputs,
            targets: &b.targets,
        })
        .collect();
    p.ex.stages_mut().iter_mut().for_each(GptStage::zero_grad);
    let report = match &mut p.partials {
        Some(parts) => {
            let mut failed = None;
            let mut hook = |ev: weft_pipeline::GradEvent<'_>| {
                let key = (ev.chunk, ev.range.start, ev.range.end);
                let part = parts
                    .entry(key)
                    .or_insert_with(|| repro::ExactPartial::new(ev.range.len()));
                if let Err(e) = part.add(ev.grads) {
                    failed.get_or_insert(e);
                }
            };
            let r = p.ex.step(comm, &mbs, Some(&mut hook))?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            for ((chunk, a, b), part) in parts.iter_mut() {
                part.mean_to(&mut p.ex.stages_mut()[*chunk].grads[*a..*b])?;
                part.clear();
            }
            r
        }
        None => {
            let r = p.ex.step(comm, &mbs, None)?;
            let inv = 1.0 / micro_batches as f32;
            for st in p.ex.stages_mut() {
                st.grads.iter_mut().for_each(|g| *g *= inv);
            }
            r
        }
    };
    // The losses live on the head's rank; every rank gets them.
    let pl = p.ex.schedule().placement();
    let (head, _) = pl.location(pl.virtual_stages() - 1);
    let mut losses: Vec<f64> = report
        .losses
        .iter()
        .map(|l| l.unwrap_or(f64::NAN))
        .collect();
    comm.broadcast(&mut losses, head)?;
    p.timeline = Some(report.timeline);
    let mut loss = 0.0;
    for l in &losses {
        loss += l;
    }
    loss /= micro_batches as f64;
    // The exact sum of squares over every stage of every rank.
    let mut sq = weft_numerics::ExactSum::new();
    for st in p.ex.stages() {
        add_squares(&mut sq, &st.grads);
    }
    let sq = crate::parallel::merge_exact_sums(comm, &sq)?;
    let grad_norm = sq.to_f64().sqrt();
    let applied = loss.is_finite() && grad_norm.is_finite();
    if applied {
        #[allow(clippy::cast_possible_truncation)]
        let coef = if clip > 0.0 && grad_norm > clip {
            (clip / (grad_norm + 1e-6)) as f32
        } else {
            1.0
        };
        for (st, o) in p.ex.stages_mut().iter_mut().zip(&mut p.opt) {
            if coef != 1.0 {
                st.grads.iter_mut().for_each(|g| *g *= coef);
            }
            let runs: Vec<_> = st.layout().decay_runs().collect();
            o.step(runs, &mut st.params, &st.grads, hp)
                .map_err(weft_model::Error::from)?;
        }
        p.ex.sync_shared(comm)?;
    }
    Ok(StepOutcome {
        loss,
        grad_norm,
        applied,
    })
}

/// Assembles every rank's stage buffers (parameters, first and second
/// moments) into the whole-model buffers on rank 0 of `comm` (the others
/// pass `None`): each rank sends its pieces' full-layout ranges and data.
fn gather_stages(
    comm: &dyn Communicator,
    pipe: &Pipe,
    mut out: [Option<&mut [f32]>; 3],
) -> Result<(), TrainError> {
    const TAG: u64 = 0x5746_5047; // "WFPG"
    // (full range, data) of every piece this rank holds, per buffer.
    let mut pieces: Vec<(std::ops::Range<usize>, [Vec<f32>; 3])> = Vec::new();
    for (st, o) in pipe.ex.stages().iter().zip(&pipe.opt) {
        for (l, g) in st.segments() {
            pieces.push((
                g.clone(),
                [
                    st.params[l.clone()].to_vec(),
                    o.m[l.clone()].to_vec(),
                    o.v[l.clone()].to_vec(),
                ],
            ));
        }
    }
    let place =
        |out: &mut [Option<&mut [f32]>; 3], g: &std::ops::Range<usize>, data: [&[f32]; 3]| {
            for (o, d) in out.iter_mut().zip(data) {
                if let Some(o) = o.as_deref_mut() {
                    o[g.clone()].copy_from_slice(d);
                }
            }
        };
    if comm.rank() != 0 {
        #[allow(clippy::cast_precision_loss)]
        let header: Vec<f64> = pieces
            .iter()
            .flat_map(|(g, _)| [g.start as f64, g.end as f64])
            .collect();
        #[allow(clippy::cast_precision_loss)]
        comm.send(0, TAG, &[header.len() as f64])?;
        comm.send(0, TAG + 1, &header)?;
        for (_, data) in &pieces {
            for d in data {
                comm.send(0, TAG + 2, d)?;
            }
        }
        return Ok(());
    }
    for (g, data) in &pieces {
        place(&mut out, g, [&data[0], &data[1], &data[2]]);
    }
    for peer in 1..comm.size() {
        let mut n = [0.0f64];
        comm.recv(peer, TAG, &mut n)?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let mut header = vec![0.0f64; n[0] as usize];
        comm.recv(peer, TAG + 1, &mut header)?;
        for pair in header.chunks_exact(2) {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let g = pair[0] as usize..pair[1] as usize;
            let mut data = [
                vec![0.0f32; g.len()],
                vec![0.0f32; g.len()],
                vec![0.0f32; g.len()],
            ];
            for d in &mut data {
                comm.recv(peer, TAG + 2, d)?;
            }
            place(&mut out, &g, [&data[0], &data[1], &data[2]]);
        }
    }
    Ok(())
}
