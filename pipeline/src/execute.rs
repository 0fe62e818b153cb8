//! The executor: runs a [`Schedule`] over the [`Stage`]s of one rank, one
//! rank per pipeline stage, activations and gradients flowing by
//! send/recv.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_trace::{Trace, TraceEvent};

use crate::schedule::{Action, ActionKind, Schedule};
use crate::simulate::{ChunkCost, Costs, Slot, Timeline, simulate};
use crate::stage::{Shared, Stage};
use crate::validate::validate;

/// What went wrong running a schedule.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The schedule is invalid (see [`validate`]) or the costs are.
    #[error(transparent)]
    Schedule(#[from] crate::Error),
    /// A stage failed (its own error inside).
    #[error("stage: {0}")]
    Stage(Box<dyn std::error::Error + Send + Sync>),
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

impl ExecError {
    /// The innermost error, below the [`Action`](Self::Action) that
    /// failed.
    pub fn root(&self) -> &ExecError {
        match self {
            ExecError::Action { source, .. } => source.root(),
            e => e,
        }
    }
}

/// `Result` with [`ExecError`].
pub type ExecResult<T> = Result<T, ExecError>;

fn stage_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> ExecError {
    ExecError::Stage(Box::new(e))
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
    /// The range of the stage's [`grads`](Stage::grads) these gradients
    /// cover.
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
    /// Loss of each micro-batch, on the rank holding the last virtual
    /// stage (`None` elsewhere).
    pub losses: Vec<Option<f64>>,
    /// The measured timeline of this rank.
    pub timeline: RankTimeline,
}

const ACT: u64 = 0;
const GRAD: u64 = 1;
const GATHER: u64 = 4;

/// Message kinds of shared parameter `id`: its gradient contributions, and
/// its value after the optimizer step.
fn shared_grad_kind(id: u32) -> u64 {
    16 + 2 * u64::from(id)
}
fn shared_sync_kind(id: u32) -> u64 {
    17 + 2 * u64::from(id)
}

/// Runs a pipeline schedule over the [`Stage`]s of one rank.
///
/// Each rank (a thread of a `LocalCluster`, or a process) builds one
/// `Executor` for its stage of the schedule, owning one stage per chunk
/// (one for GPipe, 1F1B and ZB-H1; `v` non-contiguous ones for interleaved
/// 1F1B), and calls [`step`](Self::step) once per optimizer step with the
/// step's micro-batches, on every rank at once. The stages are any
/// model's: the executor knows message lengths, slots and gradient ranges,
/// never what a stage computes.
///
/// * Forward activations go from virtual stage `s` to `s+1` and input
///   gradients back from `s+1` to `s` by `send`/`recv` on the pipeline
///   communicator (group rank = pipeline stage; to the same rank they
///   stay in memory). Sends are buffered, so the order of each rank's list
///   is all that matters; any schedule that [`validate`] accepts runs
///   without deadlock.
/// * `F`, `BW` (whole backward), `B` and `W` map to [`Stage::forward`],
///   [`Stage::backward`], [`Stage::backward_input`] and
///   [`Stage::backward_weight`]; a [forward-only](Schedule::forward_only)
///   schedule's `F` is followed by [`Stage::discard`].
/// * Shared parameters ([`Shared`], tied embeddings): after the user
///   stage's `BW`/`B` of a micro-batch its gradient contribution goes to
///   the owner, which takes it before its own `BW`/`W` of that
///   micro-batch; [`sync_shared`](Self::sync_shared) copies the owner's
///   value back after the optimizer step.
/// * Gradient accumulation: without a hook, every micro-batch's gradients
///   accumulate in place (`+=`) into each stage's buffer. With a hook, each
///   micro-batch's gradients are handed over as soon as they are final
///   (the ranges each backward call returns) and then zeroed, so the
///   caller can accumulate them exactly (with the collectives' exact
///   partial sums, as `weft_parallel::GradReducer` does).
///
/// # Example
///
/// A chain of scalings `y = w·x` over two stages on threads, 1F1B over 4
/// micro-batches of 3 values, each stage with its own weight; the loss is
/// the mean of `y`.
///
/// ```
/// use std::ops::Range;
/// use weft_collectives::{Communicator, LocalCluster};
/// use weft_pipeline::{Executor, ScheduleKind, Stage};
///
/// #[derive(Debug)]
/// struct Scale { w: f32, first: bool, last: bool, x: Vec<Vec<f32>>, g: Vec<f32> }
/// #[derive(Debug, thiserror::Error)]
/// #[error("scale stage")]
/// struct E;
///
/// impl Stage for Scale {
///     type Batch<'a> = Vec<f32>;
///     type Error = E;
///     fn input_len(&self) -> usize { 3 }
///     fn output_len(&self) -> usize { 3 }
///     fn slots(&self) -> usize { 4 }
///     fn splits_backward(&self) -> bool { false }
///     fn forward(&mut self, mb: usize, batch: &Vec<f32>, input: Option<&[f32]>,
///                output: Option<&mut [f32]>) -> Result<Option<f64>, E> {
///         let x = input.unwrap_or(batch).to_vec();
///         let y: Vec<f32> = x.iter().map(|v| self.w * v).collect();
///         self.x[mb] = x;
///         match output {
///             Some(out) => { out.copy_from_slice(&y); Ok(None) }
///             None => Ok(Some(y.iter().map(|&v| f64::from(v)).sum::<f64>() / 3.0)),
///         }
///     }
///     fn backward(&mut self, mb: usize, dout: Option<&[f32]>, dinput: Option<&mut [f32]>)
///                 -> Result<Vec<Range<usize>>, E> {
///         let dy = dout.map_or(vec![1.0 / 3.0; 3], <[f32]>::to_vec);
///         self.g[0] += dy.iter().zip(&self.x[mb]).map(|(d, x)| d * x).sum::<f32>();
///         if let Some(dx) = dinput {
///             dx.iter_mut().zip(&dy).for_each(|(o, d)| *o = self.w * d);
///         }
///         Ok(vec![0..1])
///     }
///     fn backward_input(&mut self, _: usize, _: Option<&[f32]>, _: Option<&mut [f32]>)
///                       -> Result<Vec<Range<usize>>, E> { Err(E) }
///     fn backward_weight(&mut self, _: usize) -> Result<Vec<Range<usize>>, E> { Err(E) }
///     fn discard(&mut self, _: usize) -> Result<(), E> { Ok(()) }
///     fn grads(&self) -> &[f32] { &self.g }
///     fn grads_mut(&mut self) -> &mut [f32] { &mut self.g }
/// }
///
/// let data: Vec<Vec<f32>> = (0..4).map(|k| vec![k as f32, 1.0, 2.0]).collect();
/// let schedule = ScheduleKind::OneFOneB.generate(2, 4, 1)?;
/// let out = LocalCluster::run(2, |comm| {
///     let r = comm.rank();
///     let stage = Scale { w: 2.0 + r as f32, first: r == 0, last: r == 1,
///                         x: vec![Vec::new(); 4], g: vec![0.0] };
///     let mut ex = Executor::new(schedule.clone(), r, vec![stage])?;
///     let report = ex.step(&comm, &data, None)?;
///     Ok::<_, weft_pipeline::ExecError>((report.losses, ex.stages()[0].g[0]))
/// })?;
/// let (losses, _) = out[1].as_ref().unwrap();
/// // micro-batch 1: mean of 6 · (1, 1, 2)
/// assert_eq!(losses[1], Some(8.0));
/// // d loss / d w₂ = Σ over micro-batches of mean(2·x)
/// let (_, g1) = out[1].as_ref().unwrap();
/// assert_eq!(*g1, (2.0 * (0.0 + 1.0 + 2.0 + 3.0) + 4.0 * 6.0) / 3.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Executor<S> {
    schedule: Schedule,
    rank: usize,
    chunks: Vec<S>,
    shared: Vec<Vec<Shared>>,
    mailbox: HashMap<u64, Vec<f32>>,
}

/// Micro-batches in flight on each chunk of `rank` at the schedule's
/// peak (activations held from `F` until `BW`, or `W` after `B`; one for a
/// forward-only schedule, whose stages discard each micro-batch after its
/// forward).
#[must_use]
pub fn peak_in_flight_per_chunk(schedule: &Schedule, rank: usize) -> Vec<usize> {
    let v = schedule.chunks();
    if schedule.is_forward_only() {
        return vec![1; v];
    }
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

impl<S: Stage> Executor<S> {
    /// An executor for `rank` of `schedule` over its `chunks` (chunk `c`
    /// is virtual stage `schedule.placement().virtual_stage(rank, c)`).
    ///
    /// # Errors
    /// [`ExecError::Schedule`] if the schedule does not validate;
    /// [`ExecError::Setup`] if `rank` is out of range, the number of
    /// chunks differs, a split schedule meets a stage that cannot split its
    /// backward, a chunk has fewer slots than the schedule keeps in flight,
    /// or a shared parameter names virtual stages outside the schedule.
    pub fn new(schedule: Schedule, rank: usize, chunks: Vec<S>) -> ExecResult<Self> {
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
        let mut shared = Vec::with_capacity(chunks.len());
        for (c, st) in chunks.iter().enumerate() {
            if schedule.splits_backward() && !st.splits_backward() {
                return setup(format!(
                    "schedule {} splits the backward but chunk {c}'s stage cannot",
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
            let vs = pl.virtual_stage(rank, c);
            let mine = st.shared();
            for sh in &mine {
                if sh.owner >= nvs
                    || sh.user >= nvs
                    || sh.owner == sh.user
                    || (sh.owner != vs && sh.user != vs)
                {
                    return setup(format!(
                        "chunk {c} (virtual stage {vs} of {nvs}) declares shared parameter {} between virtual stages {} and {}",
                        sh.id, sh.owner, sh.user
                    ));
                }
            }
            shared.push(mine);
        }
        Ok(Executor {
            schedule,
            rank,
            chunks,
            shared,
            mailbox: HashMap::new(),
        })
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
    pub fn stages(&self) -> &[S] {
        &self.chunks
    }

    /// This rank's stages, by chunk (to read gradients, update parameters).
    pub fn stages_mut(&mut self) -> &mut [S] {
        &mut self.chunks
    }

    /// Replaces the schedule (the same placement and chunks: a
    /// [forward-only](Schedule::forward_only) one for evaluation, or
    /// another number of micro-batches), returning the old one.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`ExecError::Setup`] if the placement
    /// differs; the executor keeps its schedule then.
    pub fn set_schedule(&mut self, schedule: Schedule) -> ExecResult<Schedule> {
        validate(&schedule)?;
        if schedule.placement() != self.schedule.placement() {
            return Err(ExecError::Setup {
                rank: self.rank,
                reason: format!(
                    "schedule {} places chunks as {:?}, the stages are placed as {:?}",
                    schedule.name(),
                    schedule.placement(),
                    self.schedule.placement()
                ),
            });
        }
        let peak = peak_in_flight_per_chunk(&schedule, self.rank);
        for (c, st) in self.chunks.iter().enumerate() {
            if st.slots() < peak[c] || (schedule.splits_backward() && !st.splits_backward()) {
                return Err(ExecError::Setup {
                    rank: self.rank,
                    reason: format!(
                        "chunk {c} cannot run schedule {} ({} slots for {} in flight)",
                        schedule.name(),
                        st.slots(),
                        peak[c]
                    ),
                });
            }
        }
        Ok(std::mem::replace(&mut self.schedule, schedule))
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
            if got.len() != out.len() {
                return Err(ExecError::Setup {
                    rank: self.rank,
                    reason: format!(
                        "a local message of {} floats where {} were expected",
                        got.len(),
                        out.len()
                    ),
                });
            }
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
    /// With `hook`, each micro-batch's final gradients are passed to it
    /// piece by piece and zeroed in the stage (see the type docs).
    ///
    /// # Errors
    /// [`ExecError::Setup`] if `data` does not hold `m` micro-batches;
    /// [`ExecError::Action`] naming the rank, step and action that failed
    /// (a stage error, or a lost peer).
    pub fn step(
        &mut self,
        comm: &dyn Communicator,
        data: &[S::Batch<'_>],
        mut hook: Option<&mut dyn FnMut(GradEvent<'_>)>,
    ) -> ExecResult<StepReport> {
        let m = self.schedule.microbatches();
        if data.len() != m {
            return Err(ExecError::Setup {
                rank: self.rank,
                reason: format!("{} micro-batches given for a schedule of {m}", data.len()),
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
        for (step, a) in actions.iter().enumerate() {
            self.run_action(comm, *a, data, &mut hook, t0, &mut losses, &mut timeline)
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
        data: &[S::Batch<'_>],
        hook: &mut Option<&mut dyn FnMut(GradEvent<'_>)>,
        t0: Instant,
        losses: &mut [Option<f64>],
        timeline: &mut RankTimeline,
    ) -> ExecResult<()> {
        let pl = self.schedule.placement();
        let nvs = pl.virtual_stages();
        let vs = pl.virtual_stage(self.rank, a.chunk);
        let (mb, c) = (a.microbatch, a.chunk);
        let (is_first, is_last) = (vs == 0, vs + 1 == nvs);
        let secs = |t: Instant| t.duration_since(t0).as_secs_f64();
        let (mm, nv) = (self.schedule.microbatches() as u64, nvs as u64);
        let tag = move |kind: u64, mb: usize, vs: usize| (kind * mm + mb as u64) * nv + vs as u64;
        let forward_only = self.schedule.is_forward_only();
        let rank = self.rank;
        let wait_start = Instant::now();
        // Receives this action needs.
        let mut buf = Vec::new();
        match a.kind {
            ActionKind::Forward if !is_first => {
                buf = vec![0.0; self.chunks[c].input_len()];
                let from = pl.location(vs - 1).0;
                let tag = self.tag(ACT, mb, vs - 1);
                self.recv(comm, from, tag, &mut buf)?;
            }
            ActionKind::Backward | ActionKind::BackwardInput if !is_last => {
                buf = vec![0.0; self.chunks[c].output_len()];
                let from = pl.location(vs + 1).0;
                let tag = self.tag(GRAD, mb, vs + 1);
                self.recv(comm, from, tag, &mut buf)?;
            }
            _ => {}
        }
        // Shared-parameter gradients this owner takes before accumulating.
        if matches!(a.kind, ActionKind::Backward | ActionKind::BackwardWeight) {
            for sh in self.shared[c].clone() {
                if sh.owner != vs {
                    continue;
                }
                let mut g = vec![0.0; sh.len];
                let tag = self.tag(shared_grad_kind(sh.id), mb, sh.owner);
                self.recv(comm, pl.location(sh.user).0, tag, &mut g)?;
                self.chunks[c]
                    .add_shared_grad(sh.id, mb, &g)
                    .map_err(stage_err)?;
            }
        }
        let start = Instant::now();
        timeline.waits.push((secs(wait_start), secs(start)));
        let mut sends: Vec<(usize, u64, Vec<f32>)> = Vec::new();
        let stage = &mut self.chunks[c];
        let done = match a.kind {
            ActionKind::Forward => {
                let mut out = (!is_last).then(|| vec![0.0; stage.output_len()]);
                let input = (!is_first).then_some(buf.as_slice());
                let loss = stage
                    .forward(mb, &data[mb], input, out.as_deref_mut())
                    .map_err(stage_err)?;
                if is_last {
                    losses[mb] = loss;
                }
                if let Some(out) = out {
                    sends.push((pl.location(vs + 1).0, tag(ACT, mb, vs), out));
                }
                if forward_only {
                    stage.discard(mb).map_err(stage_err)?;
                }
                Vec::new()
            }
            ActionKind::Backward | ActionKind::BackwardInput => {
                let dout = (!is_last).then_some(buf.as_slice());
                let mut dinp = (!is_first).then(|| vec![0.0; stage.input_len()]);
                let done = if a.kind == ActionKind::Backward {
                    stage.backward(mb, dout, dinp.as_deref_mut())
                } else {
                    stage.backward_input(mb, dout, dinp.as_deref_mut())
                }
                .map_err(stage_err)?;
                if let Some(g) = dinp {
                    sends.push((pl.location(vs - 1).0, tag(GRAD, mb, vs), g));
                }
                for sh in &self.shared[c] {
                    if sh.user == vs {
                        let g = stage.shared_grad(sh.id, mb).ok_or_else(|| ExecError::Setup {
                            rank,
                            reason: format!(
                                "virtual stage {vs} gave no gradient of shared parameter {} for micro-batch {mb}",
                                sh.id
                            ),
                        })?;
                        let tag = tag(shared_grad_kind(sh.id), mb, sh.owner);
                        sends.push((pl.location(sh.owner).0, tag, g.to_vec()));
                    }
                }
                done
            }
            ActionKind::BackwardWeight => stage.backward_weight(mb).map_err(stage_err)?,
        };
        if let Some(h) = hook.as_deref_mut() {
            for r in done {
                let grads = stage.grads();
                if r.end > grads.len() {
                    return Err(ExecError::Setup {
                        rank,
                        reason: format!(
                            "stage reported gradients {r:?} of a buffer of {}",
                            grads.len()
                        ),
                    });
                }
                h(GradEvent {
                    microbatch: mb,
                    chunk: c,
                    virtual_stage: vs,
                    range: r.clone(),
                    grads: &grads[r.clone()],
                });
                stage.grads_mut()[r].fill(0.0);
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

    /// After the optimizer step: every shared parameter's owner sends its
    /// updated value to the user, which replaces its copy. Call it on every
    /// rank of the pipeline group (ranks without shared parameters return
    /// at once).
    ///
    /// # Errors
    /// A communication error; [`ExecError::Stage`] if a stage does not
    /// hold what it declared.
    pub fn sync_shared(&mut self, comm: &dyn Communicator) -> ExecResult<()> {
        let pl = self.schedule.placement();
        // owners first (sends are buffered), then users
        for c in 0..self.chunks.len() {
            let vs = pl.virtual_stage(self.rank, c);
            for sh in self.shared[c].clone() {
                if sh.owner != vs {
                    continue;
                }
                let w = self.chunks[c]
                    .shared_param(sh.id)
                    .ok_or_else(|| ExecError::Setup {
                        rank: self.rank,
                        reason: format!("owner of shared parameter {} holds no value", sh.id),
                    })?
                    .to_vec();
                let tag = self.tag(shared_sync_kind(sh.id), 0, sh.user);
                self.send(comm, pl.location(sh.user).0, tag, &w)?;
            }
        }
        for c in 0..self.chunks.len() {
            let vs = pl.virtual_stage(self.rank, c);
            for sh in self.shared[c].clone() {
                if sh.user != vs {
                    continue;
                }
                let mut w = vec![0.0; sh.len];
                let tag = self.tag(shared_sync_kind(sh.id), 0, sh.user);
                self.recv(comm, pl.location(sh.owner).0, tag, &mut w)?;
                self.chunks[c]
                    .set_shared_param(sh.id, &w)
                    .map_err(stage_err)?;
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

impl<S> Executor<S> {
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
        gather_timelines(comm, local, &self.schedule)
    }
}

/// Sends `local` (a rank's timeline of a step of `schedule`) to rank 0 of
/// `comm` and returns every rank's timeline there (`None` on the other
/// ranks), for [`Measured::new`] and one trace of all stages. Call it on
/// every rank.
///
/// # Errors
/// A communication error.
pub fn gather_timelines(
    comm: &dyn Communicator,
    local: &RankTimeline,
    schedule: &Schedule,
) -> ExecResult<Option<Vec<RankTimeline>>> {
    let m = schedule.microbatches() as u64;
    let nvs = schedule.placement().virtual_stages() as u64;
    gather(comm, local, GATHER * m * nvs)
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
