//! The executor: runs a [`Schedule`] over real GPT stages, one rank per
//! pipeline stage, activations and gradients flowing by send/recv.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_model::{Gpt, GptStage, StageInput, StageSpec};
use weft_trace::{Trace, TraceEvent};

use crate::schedule::{Action, ActionKind, Schedule};
use crate::simulate::{ChunkCost, Costs, Slot, Timeline, simulate};
use crate::validate::validate;

/// What went wrong running a schedule.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The schedule is invalid (see [`validate`]) or the costs are.
    #[error(transparent)]
    Schedule(#[from] crate::Error),
    /// A model call failed.
    #[error("model: {0}")]
    Model(#[from] weft_model::Error),
    /// A send or receive failed.
    #[error("communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// The stages or the data do not fit the schedule.
    #[error("pipeline rank {rank}: {reason}")]
    Setup {
        /// The rank (pipeline stage).
        rank: usize,
        /// What does not fit, with the numbers.
        reason: String,
    },
    /// An action failed; the cause is inside.
    #[error("pipeline rank {rank}, step {step} ({action}): {source}")]
    Action {
        /// The rank (pipeline stage).
        rank: usize,
        /// Position in the rank's action list.
        step: usize,
        /// The action.
        action: Action,
        /// Why it failed.
        source: Box<ExecError>,
    },
}

/// `Result` with [`ExecError`].
pub type ExecResult<T> = Result<T, ExecError>;

/// The data of one micro-batch: token ids and next-token targets, `B·T`
/// each. Every rank passes all micro-batches of the step; the first
/// virtual stage reads the tokens, the last the targets.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    /// Input token ids `(B,T)`.
    pub tokens: &'a [u32],
    /// Target ids `(B,T)`.
    pub targets: &'a [u32],
}

/// One micro-batch's finished gradients of part of a stage, handed to the
/// step's hook (see [`Executor::step`]).
#[derive(Debug)]
pub struct GradEvent<'a> {
    /// The micro-batch.
    pub microbatch: usize,
    /// The rank's chunk (index into [`Executor::stages`]).
    pub chunk: usize,
    /// The virtual stage (position in the model).
    pub virtual_stage: usize,
    /// The range of the stage's [`GptStage::grads`] (and
    /// [`GptStage::params`]) these gradients cover.
    pub range: Range<usize>,
    /// The gradients, `grads[range]`; zeroed after the hook returns.
    pub grads: &'a [f32],
}

/// What one rank measured during a step: every action's start and end
/// (seconds from the step's start, taken after a barrier), and the time
/// each action waited in receives before it could start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankTimeline {
    /// The rank (pipeline stage).
    pub rank: usize,
    /// The actions in execution order (compute only, receives excluded).
    pub slots: Vec<Slot>,
    /// `(start, end)` of the receive wait before each slot (same order).
    pub waits: Vec<(f64, f64)>,
}

/// The outcome of one [`Executor::step`] on one rank.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Mean loss of each micro-batch, on the rank holding the head (`None`
    /// elsewhere).
    pub losses: Vec<Option<f64>>,
    /// The measured timeline of this rank.
    pub timeline: RankTimeline,
}

const ACT: u64 = 0;
const GRAD: u64 = 1;
const TIED: u64 = 2;
const SYNC: u64 = 3;
const GATHER: u64 = 4;

/// Runs a pipeline schedule over the [`GptStage`]s of one rank.
///
/// Each rank (a thread of a `LocalCluster`, or a process) builds one
/// `Executor` for its stage of the schedule, owning one [`GptStage`] per
/// chunk (one for GPipe, 1F1B and ZB-H1; `v` non-contiguous ones for
/// interleaved 1F1B), and calls [`step`](Self::step) once per optimizer
/// step with the step's micro-batches, on every rank at once.
///
/// * Forward activations go from virtual stage `s` to `s+1` and input
///   gradients back from `s+1` to `s` by `send`/`recv` on the pipeline
///   communicator (group rank = pipeline stage; to the same rank they
///   stay in memory). Sends are buffered, so the order of each rank's list
///   is all that matters; any schedule that [`validate`] accepts runs
///   without deadlock.
/// * `F`, `BW` (whole backward), `B` and `W` map to [`GptStage::forward`],
///   [`GptStage::backward`], [`GptStage::backward_input`] and
///   [`GptStage::backward_weight`].
/// * Tied embeddings (first and last virtual stage on different
///   [`GptStage`]s): after the last stage's `BW`/`B` of a micro-batch its
///   part of `wte`'s gradient goes to the first stage, which adds it
///   before its own embedding backward (see [`GptStage`]);
///   [`sync_tied_embeddings`](Self::sync_tied_embeddings) copies the
///   updated `wte` back after the optimizer step.
/// * Gradient accumulation: without a hook, every micro-batch's gradients
///   accumulate in place (`+=`) into each stage's
///   [`grads`](GptStage::grads) — bitwise what one [`Gpt`] accumulating the
///   same micro-batches in order holds (for every tensor; for a tied `wte`
///   too whenever a micro-batch's `B·T` fits one GEMM depth block). With
///   a hook, each micro-batch's gradients are handed over as soon as they
///   are final (after `BW`, after `W`, and for the head's `ln_f`/`lm_head`
///   after `B`) and then zeroed, so the caller can accumulate them exactly
///   (e.g. with the collectives' exact partial sums): each piece is
///   bitwise the single model's gradient of that micro-batch.
///
/// # Example
///
/// Two pipeline stages on threads, ZB-H1 over 4 micro-batches, checked
/// against the whole model:
///
/// ```
/// use weft_collectives::{Communicator, LocalCluster};
/// use weft_model::{Gpt, GptConfig};
/// use weft_pipeline::{Executor, MicroBatch, ScheduleKind};
///
/// let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 40, block_size: 8,
///                       tied_embeddings: true, layer_norm_epsilon: 1e-5 };
/// let mut model = Gpt::new(cfg)?;
/// model.init_gpt2(1);
/// let (b, t, m) = (2, 8, 4);
/// let data: Vec<(Vec<u32>, Vec<u32>)> = (0..m as u32)
///     .map(|k| ((0..16).map(|i| (i * 7 + k) % 40).collect(), (0..16).map(|i| (i * 3 + k) % 40).collect()))
///     .collect();
/// let mbs: Vec<MicroBatch> = data.iter().map(|(x, y)| MicroBatch { tokens: x, targets: y }).collect();
/// let schedule = ScheduleKind::ZbH1.generate(2, m, 1)?;
/// let losses = LocalCluster::run(2, |comm| {
///     let mut ex = Executor::from_gpt(&model, schedule.clone(), comm.rank(), &[1, 1], b, t)?;
///     let report = ex.step(&comm, &mbs, None)?;
///     Ok::<_, weft_pipeline::ExecError>(report.losses)
/// })?;
/// let last: Vec<f64> = losses[1].as_ref().unwrap().iter().map(|l| l.unwrap()).collect();
/// let mut acts = model.activations(b, t)?;
/// for (k, (x, y)) in data.iter().enumerate() {
///     assert_eq!(model.forward(&mut acts, x, Some(y))?.unwrap().to_bits(), last[k].to_bits());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Executor {
    schedule: Schedule,
    rank: usize,
    chunks: Vec<GptStage>,
    mailbox: HashMap<u64, Vec<f32>>,
}

/// Micro-batches in flight on each chunk of `rank` at the schedule's
/// peak (activations held from `F` until `BW`, or `W` after `B`).
#[must_use]
pub fn peak_in_flight_per_chunk(schedule: &Schedule, rank: usize) -> Vec<usize> {
    let v = schedule.chunks();
    let mut now = vec![0usize; v];
    let mut peak = vec![0usize; v];
    for a in schedule.stages().get(rank).map_or(&[][..], Vec::as_slice) {
        if a.chunk >= v {
            continue;
        }
        match a.kind {
            ActionKind::Forward => {
                now[a.chunk] += 1;
                peak[a.chunk] = peak[a.chunk].max(now[a.chunk]);
            }
            ActionKind::Backward | ActionKind::BackwardWeight => {
                now[a.chunk] = now[a.chunk].saturating_sub(1);
            }
            ActionKind::BackwardInput => {}
        }
    }
    peak
}

impl Executor {
    /// An executor for `rank` of `schedule` over its `chunks` (chunk `c`
    /// is virtual stage `schedule.placement().virtual_stage(rank, c)`).
    ///
    /// # Errors
    /// [`ExecError::Schedule`] if the schedule does not validate;
    /// [`ExecError::Setup`] if `rank` is out of range, the number of
    /// chunks differs, a chunk's embedding/head flags do not match its
    /// position, a split schedule meets a stage planned without the split
    /// backward, or a chunk has fewer slots than the schedule keeps in
    /// flight.
    pub fn new(schedule: Schedule, rank: usize, chunks: Vec<GptStage>) -> ExecResult<Self> {
        validate(&schedule)?;
        let setup = |reason: String| Err(ExecError::Setup { rank, reason });
        let p = schedule.num_stages();
        if rank >= p {
            return setup(format!("rank {rank} outside the schedule's {p} stages"));
        }
        let pl = schedule.placement();
        if chunks.len() != pl.chunks() {
            return setup(format!(
                "{} stages given for {} chunks per rank",
                chunks.len(),
                pl.chunks()
            ));
        }
        let peak = peak_in_flight_per_chunk(&schedule, rank);
        let nvs = pl.virtual_stages();
        for (c, st) in chunks.iter().enumerate() {
            let vs = pl.virtual_stage(rank, c);
            let spec = st.spec();
            if spec.embed != (vs == 0) || spec.head != (vs + 1 == nvs) {
                return setup(format!(
                    "chunk {c} is virtual stage {vs} of {nvs} but its stage has embed={}, head={}",
                    spec.embed, spec.head
                ));
            }
            if schedule.splits_backward() && !st.splits() {
                return setup(format!(
                    "schedule {} splits the backward but chunk {c}'s stage was planned without it",
                    schedule.name()
                ));
            }
            if st.slots() < peak[c] {
                return setup(format!(
                    "chunk {c} has {} micro-batch slots, the schedule keeps {} in flight",
                    st.slots(),
                    peak[c]
                ));
            }
        }
        Ok(Executor {
            schedule,
            rank,
            chunks,
            mailbox: HashMap::new(),
        })
    }

    /// Builds `rank`'s stages from a whole model: virtual stage `s` holds
    /// `layers_per_virtual_stage[s]` layers (in model order, summing to
    /// `n_layer`; a [`Partition`](crate::Partition)'s
    /// [`layers_per_chunk`](crate::Partition::layers_per_chunk)), with
    /// parameters copied from `model`, planned for micro-batches of `b`
    /// sequences of `t` tokens and the schedule's peak in-flight count.
    ///
    /// # Errors
    /// [`ExecError::Setup`] if the layer counts do not match the schedule's
    /// virtual stages or the model; as [`new`](Self::new) otherwise.
    pub fn from_gpt(
        model: &Gpt,
        schedule: Schedule,
        rank: usize,
        layers_per_virtual_stage: &[usize],
        b: usize,
        t: usize,
    ) -> ExecResult<Self> {
        let pl = schedule.placement();
        let nvs = pl.virtual_stages();
        let total: usize = layers_per_virtual_stage.iter().sum();
        if layers_per_virtual_stage.len() != nvs || total != model.config().n_layer {
            return Err(ExecError::Setup {
                rank,
                reason: format!(
                    "layers per virtual stage {layers_per_virtual_stage:?}: need {nvs} counts summing to n_layer = {}",
                    model.config().n_layer
                ),
            });
        }
        if rank >= pl.stages() {
            return Err(ExecError::Setup {
                rank,
                reason: format!("rank {rank} outside the schedule's {} stages", pl.stages()),
            });
        }
        let peak = peak_in_flight_per_chunk(&schedule, rank);
        let split = schedule.splits_backward();
        let chunks = (0..pl.chunks())
            .map(|c| {
                let vs = pl.virtual_stage(rank, c);
                let spec = StageSpec::nth(layers_per_virtual_stage, vs)?;
                GptStage::from_gpt(model, spec, b, t, peak[c].max(1), split)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(schedule, rank, chunks)
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// This rank's pipeline stage.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's stages, by chunk.
    pub fn stages(&self) -> &[GptStage] {
        &self.chunks
    }

    /// This rank's stages, by chunk (to read gradients, update parameters).
    pub fn stages_mut(&mut self) -> &mut [GptStage] {
        &mut self.chunks
    }

    fn tag(&self, kind: u64, mb: usize, vs: usize) -> u64 {
        let m = self.schedule.microbatches() as u64;
        let nvs = self.schedule.placement().virtual_stages() as u64;
        (kind * m + mb as u64) * nvs + vs as u64
    }

    fn send(
        &mut self,
        comm: &dyn Communicator,
        to: usize,
        tag: u64,
        data: &[f32],
    ) -> ExecResult<()> {
        if to == self.rank {
            self.mailbox.insert(tag, data.to_vec());
        } else {
            comm.send(to, tag, data)?;
        }
        Ok(())
    }

    fn recv(
        &mut self,
        comm: &dyn Communicator,
        from: usize,
        tag: u64,
        out: &mut [f32],
    ) -> ExecResult<()> {
        if from == self.rank {
            let got = self.mailbox.remove(&tag).ok_or_else(|| ExecError::Setup {
                rank: self.rank,
                reason: format!("message {tag} to itself was never produced"),
            })?;
            out.copy_from_slice(&got);
        } else {
            comm.recv(from, tag, out)?;
        }
        Ok(())
    }

    /// Runs this rank's part of one step: every action of the schedule on
    /// this rank, in order, over `data` (all `m` micro-batches). Starts
    /// with a barrier on `comm` (so ranks share a time origin), which must
    /// be the pipeline group (rank `i` = pipeline stage `i`).
    ///
    /// `hook`: `None` accumulates gradients in place; `Some(f)` calls `f`
    /// with each micro-batch's final gradients of each part of a stage and
    /// zeroes them afterwards (see the type docs). The stages' gradients are
    /// not zeroed at the start: call [`GptStage::zero_grad`] between steps
    /// when accumulating in place.
    ///
    /// # Errors
    /// [`ExecError::Setup`] if `data` does not hold `m` micro-batches;
    /// [`ExecError::Action`] naming the step and action for a model or
    /// communication failure (a peer that fails makes the others' receives
    /// fail with the communicator's error, or time out; nothing hangs).
    pub fn step(
        &mut self,
        comm: &dyn Communicator,
        data: &[MicroBatch<'_>],
        mut hook: Option<&mut dyn FnMut(GradEvent<'_>)>,
    ) -> ExecResult<StepReport> {
        let m = self.schedule.microbatches();
        if data.len() != m {
            return Err(ExecError::Setup {
                rank: self.rank,
                reason: format!("{} micro-batches given, the schedule runs {m}", data.len()),
            });
        }
        comm.barrier()?;
        let t0 = Instant::now();
        let mut losses = vec![None; m];
        let mut timeline = RankTimeline {
            rank: self.rank,
            ..RankTimeline::default()
        };
        let actions = self.schedule.stage(self.rank).to_vec();
        let mut pending_tied_w: Vec<Option<usize>> = vec![None; self.chunks.len()];
        for (step, a) in actions.iter().enumerate() {
            self.run_action(
                comm,
                *a,
                data,
                &mut hook,
                t0,
                &mut losses,
                &mut timeline,
                &mut pending_tied_w,
            )
            .map_err(|e| ExecError::Action {
                rank: self.rank,
                step,
                action: *a,
                source: Box::new(e),
            })?;
        }
        Ok(StepReport { losses, timeline })
    }

    #[allow(clippy::too_many_arguments, clippy::too_many_lines)]
    fn run_action(
        &mut self,
        comm: &dyn Communicator,
        a: Action,
        data: &[MicroBatch<'_>],
        hook: &mut Option<&mut dyn FnMut(GradEvent<'_>)>,
        t0: Instant,
        losses: &mut [Option<f64>],
        timeline: &mut RankTimeline,
        pending_tied_w: &mut [Option<usize>],
    ) -> ExecResult<()> {
        let pl = self.schedule.placement();
        let nvs = pl.virtual_stages();
        let vs = pl.virtual_stage(self.rank, a.chunk);
        let (mb, c) = (a.microbatch, a.chunk);
        let msg = self.chunks[c].message_len();
        let exchange = self.chunks[c].tied_exchange();
        let (is_embed, is_head) = (vs == 0, vs + 1 == nvs);
        let secs = |t: Instant| t.duration_since(t0).as_secs_f64();
        let (mm, nv) = (self.schedule.microbatches() as u64, nvs as u64);
        let tag = move |kind: u64, mb: usize, vs: usize| (kind * mm + mb as u64) * nv + vs as u64;
        let wait_start = Instant::now();
        // Receives this action needs.
        let mut buf = Vec::new();
        match a.kind {
            ActionKind::Forward if !is_embed => {
                buf = vec![0.0; msg];
                let from = pl.location(vs - 1).0;
                self.recv(comm, from, self.tag(ACT, mb, vs - 1), &mut buf)?;
            }
            ActionKind::Backward | ActionKind::BackwardInput if !is_head => {
                buf = vec![0.0; msg];
                let from = pl.location(vs + 1).0;
                self.recv(comm, from, self.tag(GRAD, mb, vs + 1), &mut buf)?;
            }
            _ => {}
        }
        if exchange
            && is_embed
            && matches!(a.kind, ActionKind::Backward | ActionKind::BackwardWeight)
        {
            let from = pl.location(nvs - 1).0;
            let tag = self.tag(TIED, mb, 0);
            let mut g = vec![0.0; self.chunks[c].blocks().wte_len()];
            self.recv(comm, from, tag, &mut g)?;
            let dst = self.chunks[c]
                .tied_wte_grad_mut(mb)
                .ok_or_else(|| ExecError::Setup {
                    rank: self.rank,
                    reason: format!("micro-batch {mb} not in flight for the tied wte gradient"),
                })?;
            dst.copy_from_slice(&g);
        }
        let start = Instant::now();
        timeline.waits.push((secs(wait_start), secs(start)));
        let mut sends: Vec<(usize, u64, Vec<f32>)> = Vec::new();
        let mut events: Vec<Range<usize>> = Vec::new();
        let stage = &mut self.chunks[c];
        let tied_single = stage.blocks().config().tied_embeddings && is_embed && is_head;
        match a.kind {
            ActionKind::Forward => {
                let input = if is_embed {
                    StageInput::Tokens(data[mb].tokens)
                } else {
                    StageInput::Hidden(&buf)
                };
                losses[mb] = stage.forward(mb, input, is_head.then_some(data[mb].targets))?;
                if !is_head {
                    let out = stage.output(mb).map(<[f32]>::to_vec).unwrap_or_default();
                    sends.push((pl.location(vs + 1).0, tag(ACT, mb, vs), out));
                }
            }
            ActionKind::Backward => {
                let dout = (!is_head).then_some(buf.as_slice());
                let mut dinp = None;
                stage.backward(mb, dout, &mut |g| {
                    dinp = Some(g.to_vec());
                    Ok(())
                })?;
                if let Some(g) = dinp {
                    sends.push((pl.location(vs - 1).0, tag(GRAD, mb, vs), g));
                }
                events.push(0..stage.grads.len());
            }
            ActionKind::BackwardInput => {
                if tied_single && hook.is_some() {
                    if let Some(prev) = pending_tied_w[c] {
                        return Err(ExecError::Setup {
                            rank: self.rank,
                            reason: format!(
                                "with tied embeddings on one stage, the per-micro-batch hook needs W of micro-batch {prev} before the next B"
                            ),
                        });
                    }
                    pending_tied_w[c] = Some(mb);
                }
                let dout = (!is_head).then_some(buf.as_slice());
                stage.backward_input(mb, dout)?;
                if !is_embed {
                    let g = stage
                        .input_grad(mb)
                        .map(<[f32]>::to_vec)
                        .unwrap_or_default();
                    sends.push((pl.location(vs - 1).0, tag(GRAD, mb, vs), g));
                }
                if let Some(r) = stage.head_grad_range() {
                    events.push(r);
                }
            }
            ActionKind::BackwardWeight => {
                stage.backward_weight(mb)?;
                pending_tied_w[c] = None;
                let end = stage
                    .head_grad_range()
                    .map_or(stage.grads.len(), |r| r.start);
                events.push(0..end);
            }
        }
        if exchange && is_head && matches!(a.kind, ActionKind::Backward | ActionKind::BackwardInput)
        {
            let g = stage
                .tied_wte_grad(mb)
                .map(<[f32]>::to_vec)
                .unwrap_or_default();
            sends.push((pl.location(0).0, tag(TIED, mb, 0), g));
        }
        if let Some(h) = hook.as_deref_mut() {
            for r in events {
                h(GradEvent {
                    microbatch: mb,
                    chunk: c,
                    virtual_stage: vs,
                    range: r.clone(),
                    grads: &stage.grads[r.clone()],
                });
                stage.grads[r].fill(0.0);
            }
        }
        let end = Instant::now();
        timeline.slots.push(Slot {
            action: a,
            virtual_stage: vs,
            start: secs(start),
            end: secs(end),
        });
        for (to, tag, d) in sends {
            self.send(comm, to, tag, &d)?;
        }
        Ok(())
    }

    /// After the optimizer step, with tied embeddings split across ranks:
    /// the rank holding the first virtual stage sends its updated `wte` to
    /// the rank holding the last, which refreshes its copy. Call it on
    /// every rank (the others return at once).
    ///
    /// # Errors
    /// A communication error.
    pub fn sync_tied_embeddings(&mut self, comm: &dyn Communicator) -> ExecResult<()> {
        let pl = self.schedule.placement();
        let nvs = pl.virtual_stages();
        let (first, c0) = pl.location(0);
        let (last, cl) = pl.location(nvs - 1);
        let tag = self.tag(SYNC, 0, 0);
        if self.rank == first
            && let Some(w) = self.chunks[c0].wte().map(<[f32]>::to_vec)
            && self.chunks[c0].tied_exchange()
        {
            if first == last {
                if let Some(dst) = self.chunks[cl].tied_wte_mut() {
                    dst.copy_from_slice(&w);
                }
            } else {
                comm.send(last, tag, &w)?;
            }
        }
        if self.rank == last && first != last && self.chunks[cl].tied_exchange() {
            let dst = self.chunks[cl].tied_wte_mut();
            if let Some(dst) = dst {
                comm.recv(first, tag, dst)?;
            }
        }
        Ok(())
    }
}

impl Timeline {
    /// A timeline of measured slots (per stage, in execution order, times
    /// in seconds from a shared origin), for its bubble, makespan and
    /// [`to_trace`](Self::to_trace). Activation memory counts micro-batches
    /// in flight, `1/v` per chunk (`M_W` taken equal to `M_B`).
    ///
    /// # Errors
    /// [`crate::Error::InvalidParameter`] if `stages` does not hold one
    /// list per stage of `schedule`.
    pub fn from_measured(schedule: &Schedule, stages: Vec<Vec<Slot>>) -> crate::Result<Self> {
        if stages.len() != schedule.num_stages() {
            return Err(crate::Error::InvalidParameter {
                name: "measured stages",
                value: stages.len().to_string(),
                expected: format!("{} (one per stage)", schedule.num_stages()),
            });
        }
        #[allow(clippy::cast_precision_loss)]
        let per = 1.0 / schedule.chunks() as f64;
        let memory = stages
            .iter()
            .map(|slots| {
                let mut now = 0.0f64;
                slots
                    .iter()
                    .map(|s| {
                        match s.action.kind {
                            ActionKind::Forward => now += per,
                            ActionKind::Backward | ActionKind::BackwardWeight => now -= per,
                            ActionKind::BackwardInput => {}
                        }
                        now
                    })
                    .collect()
            })
            .collect();
        Ok(Timeline::from_parts(
            format!("{} (measured)", schedule.name()),
            schedule.microbatches(),
            schedule.chunks(),
            stages,
            memory,
        ))
    }
}

/// All ranks' measurements of one step.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The measured timeline (bubble, makespan, trace).
    pub timeline: Timeline,
    /// Receive waits per stage, `(start, end)` in seconds.
    pub waits: Vec<Vec<(f64, f64)>>,
    /// Mean measured cost of each virtual stage's actions, seconds: `F`,
    /// `B` and `W` (a whole backward `BW` counts as `B`, with `W` = 0), and
    /// mean receive wait as the p2p latency.
    pub costs: Costs,
}

impl Measured {
    /// Assembles every rank's [`RankTimeline`] (one per stage, any order).
    ///
    /// # Errors
    /// [`crate::Error::InvalidParameter`] if a stage is missing or twice.
    pub fn new(schedule: &Schedule, ranks: Vec<RankTimeline>) -> crate::Result<Self> {
        let p = schedule.num_stages();
        let mut stages = vec![None; p];
        for r in ranks {
            let rank = r.rank;
            if rank >= p || stages[rank].is_some() {
                return Err(crate::Error::InvalidParameter {
                    name: "rank timelines",
                    value: format!("rank {rank}"),
                    expected: format!("each of the {p} stages exactly once"),
                });
            }
            stages[rank] = Some(r);
        }
        let stages: Vec<RankTimeline> = stages
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                s.ok_or(crate::Error::InvalidParameter {
                    name: "rank timelines",
                    value: format!("stage {i} missing"),
                    expected: format!("each of the {p} stages exactly once"),
                })
            })
            .collect::<crate::Result<_>>()?;
        let nvs = schedule.placement().virtual_stages();
        let mut sum = vec![[0.0f64; 3]; nvs];
        let mut cnt = vec![[0usize; 3]; nvs];
        for s in stages.iter().flat_map(|r| &r.slots) {
            let k = match s.action.kind {
                ActionKind::Forward => 0,
                ActionKind::Backward | ActionKind::BackwardInput => 1,
                ActionKind::BackwardWeight => 2,
            };
            sum[s.virtual_stage][k] += s.end - s.start;
            cnt[s.virtual_stage][k] += 1;
        }
        #[allow(clippy::cast_precision_loss)]
        let mean = |vs: usize, k: usize| {
            if cnt[vs][k] == 0 {
                0.0
            } else {
                sum[vs][k] / cnt[vs][k] as f64
            }
        };
        #[allow(clippy::cast_precision_loss)]
        let per = 1.0 / schedule.chunks() as f64;
        let chunks = (0..nvs)
            .map(|vs| ChunkCost {
                forward: mean(vs, 0),
                backward_input: mean(vs, 1),
                backward_weight: mean(vs, 2),
                activation: per,
                weight_grad_memory: per,
            })
            .collect();
        let waits: Vec<Vec<(f64, f64)>> = stages.iter().map(|r| r.waits.clone()).collect();
        let timeline =
            Timeline::from_measured(schedule, stages.into_iter().map(|r| r.slots).collect())?;
        Ok(Measured {
            timeline,
            waits,
            costs: Costs {
                chunks,
                p2p_latency: 0.0,
            },
        })
    }

    /// The simulator's timeline for the same schedule with the measured
    /// mean costs (p2p latency 0: the local backend's send is a copy
    /// inside the sender's slot) — the prediction to set beside
    /// [`timeline`](Self::timeline)'s measured bubble.
    ///
    /// # Errors
    /// As [`simulate`].
    pub fn predicted(&self, schedule: &Schedule) -> crate::Result<Timeline> {
        simulate(schedule, &self.costs)
    }

    /// The measured timeline as Chrome trace events: the simulator's export
    /// ([`Timeline::to_trace`]: one process per stage, `F`/`B`/`W`/`BW`
    /// slices with micro-batch and chunk, explicit idle) plus a `p2p`
    /// thread per stage with a `recv wait` slice for every wait.
    #[must_use]
    pub fn to_trace(&self) -> Trace {
        let us = 1e6;
        let mut t = self.timeline.to_trace(us);
        for (stage, waits) in self.waits.iter().enumerate() {
            let pid = stage as u64;
            t.push(TraceEvent::thread_name(pid, 1, "p2p"));
            for &(a, b) in waits {
                if b > a {
                    t.push(
                        TraceEvent::complete("recv wait", a * us, (b - a) * us, pid, 1)
                            .with_cat("p2p"),
                    );
                }
            }
        }
        t
    }
}

impl Executor {
    /// Sends `local` (this rank's [`StepReport::timeline`]) to group rank 0
    /// of `comm` and returns every rank's timeline there (`None` on the
    /// other ranks), for [`Measured::new`] and one trace of all stages.
    /// Call it on every rank.
    ///
    /// # Errors
    /// A communication error.
    pub fn gather_timelines(
        &self,
        comm: &dyn Communicator,
        local: &RankTimeline,
    ) -> ExecResult<Option<Vec<RankTimeline>>> {
        let tag = self.tag(GATHER, 0, 0);
        gather(comm, local, tag)
    }
}

fn gather(
    comm: &dyn Communicator,
    local: &RankTimeline,
    tag: u64,
) -> ExecResult<Option<Vec<RankTimeline>>> {
    let encode = |r: &RankTimeline| -> Vec<f64> {
        let mut v = vec![r.rank as f64, r.slots.len() as f64];
        for (s, w) in r.slots.iter().zip(&r.waits) {
            let kind = match s.action.kind {
                ActionKind::Forward => 0.0,
                ActionKind::Backward => 1.0,
                ActionKind::BackwardInput => 2.0,
                ActionKind::BackwardWeight => 3.0,
            };
            v.extend([
                kind,
                s.action.microbatch as f64,
                s.action.chunk as f64,
                s.virtual_stage as f64,
                s.start,
                s.end,
                w.0,
                w.1,
            ]);
        }
        v
    };
    let me = comm.rank();
    if me != 0 {
        let v = encode(local);
        #[allow(clippy::cast_precision_loss)]
        comm.send(0, tag, &[v.len() as f64])?;
        comm.send(0, tag + 1, &v)?;
        return Ok(None);
    }
    let mut out = vec![local.clone()];
    for peer in 1..comm.size() {
        let mut n = [0.0f64];
        comm.recv(peer, tag, &mut n)?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let mut v = vec![0.0f64; n[0] as usize];
        comm.recv(peer, tag + 1, &mut v)?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let u = |x: f64| x as usize;
        let mut r = RankTimeline {
            rank: u(v.first().copied().unwrap_or(0.0)),
            ..RankTimeline::default()
        };
        for rec in v.get(2..).unwrap_or(&[]).chunks_exact(8) {
            let kind = match u(rec[0]) {
                0 => ActionKind::Forward,
                1 => ActionKind::Backward,
                2 => ActionKind::BackwardInput,
                _ => ActionKind::BackwardWeight,
            };
            r.slots.push(Slot {
                action: Action {
                    kind,
                    microbatch: u(rec[1]),
                    chunk: u(rec[2]),
                },
                virtual_stage: u(rec[3]),
                start: rec[4],
                end: rec[5],
            });
            r.waits.push((rec[6], rec[7]));
        }
        out.push(r);
    }
    Ok(Some(out))
}
