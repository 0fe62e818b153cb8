//! [`Fsdp`]: the sharded training step.

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use weft_collectives::repro::ExactPartial;
use weft_collectives::{Communicator, CommunicatorExt, Dtype, Mesh, Pending, Traffic};
use weft_kernels::{AdamW, adamw_update};
use weft_model::{BlockActs, BlockScratch, FeedForward, GptBlocks, GptConfig, HeadActs};
use weft_numerics::ExactSum;

use crate::config::{FsdpConfig, Strategy};
use crate::error::{Error, Result, comm};
use crate::exact::{self, ExactBuf};
use crate::lowp::LowVec;
use crate::memory::{Category, MemoryReport, bytes_of};
use crate::reducer::{self, Done, GradIn, GradOut, Groups, Kind, Reducer};
use crate::spans::{SpanLog, Track};
use crate::units::{UnitKind, UnitPlan};

/// One micro-batch: `B·T` input tokens and their `B·T` targets.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    /// Input token ids `(B,T)`.
    pub tokens: &'a [u32],
    /// Target token ids `(B,T)`.
    pub targets: &'a [u32],
}

/// What one [`Fsdp::step`] did.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Mean loss over the global batch (every rank's micro-batches): the
    /// micro-batch losses summed in global order in f64, divided by their
    /// number.
    pub loss: f64,
    /// Every micro-batch's mean loss, in global order (rank-major).
    pub micro_losses: Vec<f64>,
    /// Global L2 norm of the gradient before clipping.
    pub grad_norm: f64,
    /// The factor the gradient was multiplied by (1 when not clipped).
    pub clip_coef: f32,
    /// Whether the update was applied: a non-finite gradient norm (or
    /// loss) skips the AdamW step — parameters, moments and the optimizer
    /// step stay as they were — as a training loop's health check expects.
    pub applied: bool,
    /// The optimizer step just taken (counts from 1).
    pub optimizer_step: u32,
    /// Bytes this rank sent and received during the step, by operation.
    pub traffic: Traffic,
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// Seconds the training thread was blocked on communication (the
    /// exposed, un-hidden part).
    pub exposed_comm_seconds: f64,
    /// Seconds collectives were in flight (issue to completion), summed.
    pub comm_seconds: f64,
    /// Memory when every gradient was reduced, just before the optimizer
    /// (the gradient shards are complete then; peaks are since the last
    /// [`Fsdp::reset_memory_peaks`]).
    pub memory_at_update: MemoryReport,
}

/// Per-unit state of this rank.
#[derive(Debug)]
struct UnitState {
    /// f32 master weights of the range this rank updates: its shard, or
    /// the whole padded unit when the optimizer is not sharded.
    master: Vec<f32>,
    /// AdamW first moments, same range.
    m: Vec<f32>,
    /// AdamW second moments, same range.
    v: Vec<f32>,
    /// The compute-dtype copy of the shard (sharded parameters in bf16).
    shard_lp: Option<LowVec>,
    /// The replicated compute parameters (strategies that do not shard
    /// parameters), unless `master` itself serves (no sharding, f32).
    resident: Option<LowVec>,
}

/// Gradient being accumulated for one unit during a step.
#[derive(Debug, Default)]
enum GradAcc {
    #[default]
    None,
    /// Whole-unit f32 gradients accumulated in place (plain mode, no
    /// gradient sharding).
    Full(Vec<f32>),
    /// Whole-unit exact partial (reproducible mode, no gradient sharding).
    FullExact(ExactPartial),
    /// Reduced values (shard, or the whole unit after an all-reduce);
    /// `true` if already the mean over the global batch.
    Reduced(LowVec, bool),
    /// Exact partial of this rank's shard (reproducible mode).
    ShardExact(ExactBuf),
}

/// A gathered unit: in flight, or ready as f32.
#[derive(Debug, Default)]
enum Slot {
    #[default]
    Empty,
    Flight {
        handle: JoinHandle<(weft_collectives::Result<LowVec>, Instant)>,
        start: Instant,
        bytes: usize,
    },
    Ready(Vec<f32>),
}

/// The activations of one micro-batch shape.
#[derive(Debug)]
struct Acts {
    b: usize,
    t: usize,
    tokens: Vec<u32>,       // (B,T)
    encoded: Vec<f32>,      // (B,T,C)
    layers: Vec<BlockActs>, // L
    head: HeadActs,
    scratch: BlockScratch,
    dres: Vec<f32>, // (B,T,C)
}

impl Acts {
    fn bytes(&self) -> usize {
        bytes_of(&self.tokens)
            + bytes_of(&self.encoded)
            + bytes_of(&self.dres)
            + self.layers.iter().map(BlockActs::bytes).sum::<usize>()
            + self.head.bytes()
            + self.scratch.bytes()
    }
}

/// Fully sharded data-parallel training of a GPT over a communicator; see
/// the [crate documentation](crate) for what a step does.
///
/// # Driving it from a training loop
/// Every call below is collective over the data-parallel group (every rank
/// calls it, in the same order, with the same shapes).
///
/// 1. **Construction**: [`Fsdp::new`] with the data-parallel communicator,
///    the model configuration and feed-forward block, an [`FsdpConfig`]
///    (strategy from `parallel.fsdp` via [`Strategy`]'s `FromStr`), and the
///    whole initial parameter buffer (the same on every rank).
///    [`memory`](Self::memory) then reports the resident state.
/// 2. **Each step**: build this rank's `M` micro-batches — global
///    micro-batches `dp_rank·M .. (dp_rank+1)·M` of the step's global
///    batch of `M·dp_size` — and call [`step`](Self::step) with the
///    learning rate of the schedule. Every rank gets the same
///    [`StepReport`] loss and norm. Write [`spans`](Self::spans) as trace
///    events ([`SpanLog::trace_events`]) and [`clear`](SpanLog::clear) them.
/// 3. **Evaluation**: [`eval_loss`](Self::eval_loss) on every rank of the
///    shard group (it gathers units); or [`full_params`](Self::full_params)
///    into a [`weft_model::Gpt`].
/// 4. **Checkpoint**: for each unit `u`, [`shard_state`](Self::shard_state)
///    gives the f32 master weights and AdamW moments over
///    [`optimizer_range`](Self::optimizer_range)`(u)` of the padded unit;
///    [`UnitPlan::shard_pieces`]`(u, shard_rank())` names the Hugging Face
///    tensors that range holds, with element ranges and row/column boxes
///    (`shard_offset` is relative to the shard's start). Under
///    [`Strategy::Hybrid`] the replicas hold identical shards (write them
///    from the ranks with `dp_rank < shard_size`); under [`Strategy::None`]
///    every rank holds every shard (write the pieces of all shard ranks
///    from rank 0). The optimizer step is [`optimizer_step`](Self::optimizer_step).
///    To restore, build the runner (any initial buffer) and call
///    [`load_shard_state`](Self::load_shard_state) for every unit.
///
/// After an error the group is broken (a peer is lost, or ranks disagree);
/// drop the runner.
pub struct Fsdp {
    cfg: FsdpConfig,
    blocks: GptBlocks,
    plan: UnitPlan,
    /// Shard-group rank and size.
    rank: usize,
    n: usize,
    /// Whole data-parallel group rank and size.
    dp_rank: usize,
    dp_size: usize,
    /// The shard group, for parameter all-gathers (training thread).
    params_comm: Box<dyn Communicator>,
    /// The whole data-parallel group, for losses.
    world: Box<dyn Communicator>,
    reducer: Reducer,
    units: Vec<UnitState>,
    step: u32,
    mem: MemoryReport,
    spans: SpanLog,
    acts: Option<Acts>,
    /// Bytes handed to the reducer per job, in submission order.
    in_flight: std::collections::VecDeque<usize>,
    /// Whether the current step has one micro-batch per rank.
    single_micro: bool,
}

impl std::fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("strategy", &self.cfg.strategy)
            .field("rank", &self.rank)
            .field("n", &self.n)
            .field("dp_rank", &self.dp_rank)
            .field("dp_size", &self.dp_size)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

fn split_of(c: &dyn Communicator, what: &str) -> Result<Box<dyn Communicator>> {
    c.split(0, c.rank() as u32)
        .map_err(comm(format!("splitting the {what} communicator")))
}

impl Fsdp {
    /// Builds the runner on every rank of `comm` (collective: every rank
    /// calls it with the same arguments). `params` is the whole initial
    /// parameter buffer in [`ParamLayout`](weft_model::ParamLayout) order (the same on every rank,
    /// e.g. from the same seed or checkpoint); each rank keeps only what
    /// its strategy needs.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid precision, a hybrid shard size that
    /// does not divide the group, or a parameter buffer of the wrong
    /// length; [`Error::Model`] for an invalid model configuration;
    /// [`Error::Collective`] if splitting the communicator fails.
    pub fn new(
        comm: &dyn Communicator,
        model: GptConfig,
        ffn: Arc<dyn FeedForward>,
        cfg: FsdpConfig,
        params: &[f32],
    ) -> Result<Self> {
        cfg.precision.check()?;
        let n_layer = model.n_layer;
        let blocks = GptBlocks::new(model, ffn)?;
        let layout = blocks.layout().clone();
        if params.len() != layout.len() {
            return Err(Error::StateShape {
                what: "initial parameters".into(),
                expected: layout.len(),
                got: params.len(),
            });
        }
        let world_n = comm.size();
        let (params_comm, reduce_shard, replicas, world) = if cfg.strategy == Strategy::Hybrid {
            let s = if cfg.hybrid_shard == 0 {
                comm.topology().ranks_per_domain().min(world_n)
            } else {
                cfg.hybrid_shard
            };
            if s == 0 || !world_n.is_multiple_of(s) {
                return Err(Error::Config {
                    field: "hybrid_shard",
                    reason: format!("= {s} must divide the data-parallel group size {world_n}"),
                });
            }
            let mesh = Mesh::new(comm, &[("replicate", world_n / s), ("shard", s)])
                .map_err(crate::error::comm("building the hybrid mesh"))?;
            let g = |names: &[&str]| {
                mesh.group(names)
                    .map_err(crate::error::comm("splitting the hybrid mesh"))
            };
            let p = g(&["shard"])?;
            let rs = g(&["shard"])?;
            let rep = g(&["replicate"])?;
            let w = split_of(comm, "data-parallel")?;
            (p, rs, Some(rep), w)
        } else {
            let p = split_of(comm, "parameter")?;
            let rs = split_of(comm, "gradient")?;
            let w = split_of(comm, "data-parallel")?;
            (p, rs, None, w)
        };
        let (rank, n) = (params_comm.rank(), params_comm.size());
        let plan = UnitPlan::per_block(&layout, n_layer, n)?;
        // The units must be the model's own slices.
        for u in plan.units() {
            let want = match u.kind {
                UnitKind::Embedding => blocks.embed_range(),
                UnitKind::Block(l) => blocks.block_range(l),
                UnitKind::Head => blocks.lnf_range().start..layout.len(),
            };
            if u.range != want {
                return Err(Error::Config {
                    field: "units",
                    reason: format!(
                        "unit {} covers {:?} but the model's slice is {want:?}",
                        u.name, u.range
                    ),
                });
            }
        }
        let reducer = Reducer::start(Groups {
            shard: reduce_shard,
            replicas,
            opts: reducer::options(cfg.algorithm, cfg.precision.reduce),
        })?;
        let mut mem = MemoryReport::default();
        let strategy = cfg.strategy;
        let pdt = cfg.precision.param;
        let mut units = Vec::with_capacity(plan.units().len());
        for u in plan.units() {
            let padded = u.padded_len(n);
            let mut full = vec![0.0f32; padded];
            full[..u.len()].copy_from_slice(&params[u.range.clone()]);
            let opt = if strategy.shards_optimizer() {
                u.shard(rank)
            } else {
                0..padded
            };
            let master = full[opt.clone()].to_vec();
            let shard_lp = (strategy.shards_params() && pdt == Dtype::BF16)
                .then(|| LowVec::from_f32(&master, pdt));
            let resident = (!strategy.shards_params()
                && (strategy != Strategy::None || pdt == Dtype::BF16))
                .then(|| LowVec::from_f32(&full, pdt));
            let st = UnitState {
                m: vec![0.0; master.len()],
                v: vec![0.0; master.len()],
                master,
                shard_lp,
                resident,
            };
            mem.alloc(Category::OptimizerState, 3 * bytes_of(&st.master));
            if let Some(x) = &st.shard_lp {
                mem.alloc(Category::ParamShards, x.bytes());
            }
            if let Some(x) = &st.resident {
                mem.alloc(Category::ParamShards, x.bytes());
            }
            units.push(st);
        }
        Ok(Fsdp {
            rank,
            n,
            dp_rank: world.rank(),
            dp_size: world.size(),
            cfg,
            blocks,
            plan,
            params_comm,
            world,
            reducer,
            units,
            step: 0,
            mem,
            spans: SpanLog::new(),
            acts: None,
            in_flight: std::collections::VecDeque::new(),
            single_micro: true,
        })
    }

    /// The settings.
    pub fn config(&self) -> &FsdpConfig {
        &self.cfg
    }

    /// The units and their sharding over the shard group.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// This rank's position in the shard group (the shard it holds).
    pub fn shard_rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the shard group (the whole group, or the hybrid shard size).
    pub fn shard_size(&self) -> usize {
        self.n
    }

    /// This rank's position in the whole data-parallel group (the position
    /// of its micro-batches in the global batch).
    pub fn dp_rank(&self) -> usize {
        self.dp_rank
    }

    /// Ranks of the whole data-parallel group.
    pub fn dp_size(&self) -> usize {
        self.dp_size
    }

    /// Optimizer steps taken.
    pub fn optimizer_step(&self) -> u32 {
        self.step
    }

    /// Memory by category (current and peak), from the buffers allocated.
    pub fn memory(&self) -> &MemoryReport {
        &self.mem
    }

    /// Resets the memory peaks to the current values.
    pub fn reset_memory_peaks(&mut self) {
        self.mem.reset_peaks();
    }

    /// The span log (compute, communication and wait tracks).
    pub fn spans(&self) -> &SpanLog {
        &self.spans
    }

    /// The span log, to clear it or turn recording off.
    pub fn spans_mut(&mut self) -> &mut SpanLog {
        &mut self.spans
    }

    /// This rank's traffic counters (every group of the rank).
    pub fn traffic(&self) -> Traffic {
        self.world.traffic()
    }

    /// The range of unit `u`'s padded buffer that this rank's master
    /// weights and moments cover (its shard, or the whole padded unit
    /// under [`Strategy::None`]).
    ///
    /// # Panics
    /// If `u` is out of range.
    pub fn optimizer_range(&self, u: usize) -> Range<usize> {
        let unit = &self.plan.units()[u];
        if self.cfg.strategy.shards_optimizer() {
            unit.shard(self.rank)
        } else {
            0..unit.padded_len(self.n)
        }
    }

    /// Unit `u`'s f32 master weights and AdamW moments `(master, m, v)` on
    /// this rank, over [`optimizer_range`](Self::optimizer_range) (padding
    /// included, always zero).
    ///
    /// # Panics
    /// If `u` is out of range.
    pub fn shard_state(&self, u: usize) -> (&[f32], &[f32], &[f32]) {
        let s = &self.units[u];
        (&s.master, &s.m, &s.v)
    }

    /// Restores unit `u`'s state on this rank (from a checkpoint) and the
    /// optimizer step; the compute copies are rebuilt from `master`. Under
    /// strategies that replicate parameters this is collective (the full
    /// parameters are all-gathered).
    ///
    /// # Errors
    /// [`Error::StateShape`] if a slice has the wrong length; a collective
    /// error.
    pub fn load_shard_state(
        &mut self,
        u: usize,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        step: u32,
    ) -> Result<()> {
        let want = self.units[u].master.len();
        for (what, x) in [("master", master), ("m", m), ("v", v)] {
            if x.len() != want {
                return Err(Error::StateShape {
                    what: format!("unit {} {what}", self.plan.units()[u].name),
                    expected: want,
                    got: x.len(),
                });
            }
        }
        let s = &mut self.units[u];
        s.master.copy_from_slice(master);
        s.m.copy_from_slice(m);
        s.v.copy_from_slice(v);
        self.step = step;
        self.refresh_compute_params(u)
    }

    /// The whole parameter buffer (f32 master weights, [`ParamLayout`](weft_model::ParamLayout)
    /// order) on every rank. Collective over the shard group.
    ///
    /// # Errors
    /// A collective error.
    pub fn full_params(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.plan.num_params()];
        for (u, unit) in self.plan.units().iter().enumerate() {
            let s = &self.units[u];
            if self.cfg.strategy.shards_optimizer() {
                let mut full = vec![0.0f32; unit.padded_len(self.n)];
                self.params_comm
                    .all_gather(&s.master, &mut full)
                    .map_err(comm(format!("all_gather of unit {}", unit.name)))?;
                out[unit.range.clone()].copy_from_slice(&full[..unit.len()]);
            } else {
                out[unit.range.clone()].copy_from_slice(&s.master[..unit.len()]);
            }
        }
        Ok(out)
    }

    /// Plans (allocates) the activations for micro-batches of `b`
    /// sequences of `t` tokens now, so [`memory`](Self::memory) can be
    /// reported at start-up with every resident category; [`step`](Self::step)
    /// does it on first use otherwise. Not collective.
    ///
    /// # Errors
    /// [`Error::Model`] if `t` exceeds the model's `block_size` or `b·t` is 0.
    pub fn prepare(&mut self, b: usize, t: usize) -> Result<()> {
        self.ensure_acts(b, t)
    }

    fn ensure_acts(&mut self, b: usize, t: usize) -> Result<()> {
        if self.acts.as_ref().is_some_and(|a| a.b == b && a.t == t) {
            return Ok(());
        }
        let bl = &self.blocks;
        let nc = b * t * bl.config().n_embd;
        let acts = Acts {
            b,
            t,
            tokens: vec![0; b * t],
            encoded: vec![0.0; nc],
            layers: (0..bl.config().n_layer)
                .map(|_| bl.block_acts(b, t))
                .collect::<weft_model::Result<_>>()?,
            head: bl.head_acts(b, t)?,
            scratch: bl.scratch(b, t)?,
            dres: vec![0.0; nc],
        };
        if let Some(a) = self.acts.take() {
            self.mem.free(Category::Activations, a.bytes());
        }
        self.mem.alloc(Category::Activations, acts.bytes());
        self.acts = Some(acts);
        Ok(())
    }

    /// Rebuilds the compute-dtype copies of unit `u` from its master weights.
    fn refresh_compute_params(&mut self, u: usize) -> Result<()> {
        let strategy = self.cfg.strategy;
        let st = &mut self.units[u];
        if let Some(lp) = &mut st.shard_lp {
            lp.assign_f32(&st.master);
        }
        if let Some(res) = &mut st.resident {
            if strategy.shards_optimizer() {
                let shard = LowVec::from_f32(&st.master, self.cfg.precision.param);
                let t0 = Instant::now();
                shard
                    .all_gather(&*self.params_comm, res)
                    .map_err(comm(format!(
                        "all_gather of updated unit {}",
                        self.plan.units()[u].name
                    )))?;
                self.spans
                    .push(Track::Comm, "all_gather", Some(u), None, t0, Instant::now());
            } else {
                res.assign_f32(&st.master);
            }
        }
        Ok(())
    }

    /// Starts gathering unit `u` (sharded parameters only; a no-op if it is
    /// in flight or ready).
    fn issue_gather(&mut self, slots: &mut [Slot], u: usize) -> Result<()> {
        if !matches!(slots[u], Slot::Empty) {
            return Ok(());
        }
        let unit = &self.plan.units()[u];
        let padded = unit.padded_len(self.n);
        let st = &self.units[u];
        let what = format!("all_gather of unit {}", unit.name);
        let start = Instant::now();
        let (handle, bytes) = match &st.shard_lp {
            Some(LowVec::Bf16(sh)) => {
                let p = self
                    .params_comm
                    .all_gather_async(sh.clone(), padded)
                    .map_err(comm(&what))?;
                (watch(p, LowVec::Bf16)?, padded * 2 + sh.len() * 2)
            }
            _ => {
                let p = self
                    .params_comm
                    .all_gather_async(st.master.clone(), padded)
                    .map_err(comm(&what))?;
                (watch(p, LowVec::F32)?, padded * 4 + st.master.len() * 4)
            }
        };
        self.mem.alloc(Category::GatheredParams, bytes);
        slots[u] = Slot::Flight {
            handle,
            start,
            bytes,
        };
        Ok(())
    }

    /// Makes unit `u`'s f32 parameters available in `slots[u]` (sharded
    /// parameters: waits for its gather; bf16 replicated: widens).
    fn materialize(&mut self, slots: &mut [Slot], u: usize, micro: usize) -> Result<()> {
        let len = self.plan.units()[u].padded_len(self.n);
        if self.cfg.strategy.shards_params() {
            self.issue_gather(slots, u)?;
            match std::mem::take(&mut slots[u]) {
                Slot::Flight {
                    handle,
                    start,
                    bytes,
                } => {
                    let data = self.land(handle, start, bytes, u, micro, len)?;
                    slots[u] = Slot::Ready(data);
                }
                other => slots[u] = other,
            }
        } else if matches!(slots[u], Slot::Empty)
            && let Some(LowVec::Bf16(res)) = &self.units[u].resident
        {
            let mut w = vec![0.0f32; len];
            w.iter_mut().zip(res).for_each(|(o, x)| *o = x.to_f32());
            self.mem.alloc(Category::GatheredParams, bytes_of(&w));
            slots[u] = Slot::Ready(w);
        }
        Ok(())
    }

    /// Waits for a gather and widens it to f32.
    #[allow(clippy::too_many_arguments)]
    fn land(
        &mut self,
        handle: JoinHandle<(weft_collectives::Result<LowVec>, Instant)>,
        start: Instant,
        bytes: usize,
        u: usize,
        micro: usize,
        len: usize,
    ) -> Result<Vec<f32>> {
        let w0 = Instant::now();
        let (r, end) = handle.join().unwrap_or_else(|_| {
            (
                Err(weft_collectives::Error::RankPanicked {
                    rank: self.dp_rank,
                    message: "all-gather watcher panicked".into(),
                }),
                Instant::now(),
            )
        });
        let w1 = Instant::now();
        self.spans
            .push(Track::Comm, "all_gather", Some(u), Some(micro), start, end);
        if end > w0 {
            self.spans
                .push(Track::Wait, "wait all_gather", Some(u), Some(micro), w0, w1);
        }
        let got = r.map_err(comm(format!(
            "all_gather of unit {}",
            self.plan.units()[u].name
        )))?;
        Ok(match got {
            LowVec::F32(v) => {
                // the input copy is gone; the gathered buffer stays
                self.mem
                    .free(Category::GatheredParams, bytes - bytes_of(&v));
                v
            }
            LowVec::Bf16(v) => {
                let mut w = vec![0.0f32; len];
                self.mem.alloc(Category::GatheredParams, bytes_of(&w));
                w.iter_mut().zip(&v).for_each(|(o, x)| *o = x.to_f32());
                self.mem.free(Category::GatheredParams, bytes);
                w
            }
        })
    }

    fn free_slot(&mut self, slots: &mut [Slot], u: usize) {
        if let Slot::Ready(v) = std::mem::take(&mut slots[u]) {
            self.mem.free(Category::GatheredParams, bytes_of(&v));
        }
    }

    /// Unit `u`'s f32 parameters (after [`materialize`](Self::materialize)),
    /// without padding.
    fn unit_params<'a>(
        units: &'a [UnitState],
        slots: &'a [Slot],
        plan: &UnitPlan,
        u: usize,
    ) -> &'a [f32] {
        let len = plan.units()[u].len();
        match &slots[u] {
            Slot::Ready(v) => &v[..len],
            _ => match &units[u].resident {
                Some(LowVec::F32(v)) => &v[..len],
                _ => &units[u].master[..len],
            },
        }
    }

    fn drain_reductions(&mut self, grads: &mut [GradAcc], block: bool) -> Result<()> {
        loop {
            let done = if block {
                if self.reducer.pending() == 0 {
                    return Ok(());
                }
                let w0 = Instant::now();
                let d = self.reducer.next()?;
                let w1 = Instant::now();
                if d.end > w0 {
                    self.spans.push(
                        Track::Wait,
                        "wait reduce",
                        Some(d.unit),
                        Some(d.micro),
                        w0,
                        w1,
                    );
                }
                d
            } else {
                match self.reducer.try_next() {
                    Some(d) => d,
                    None => return Ok(()),
                }
            };
            self.accept(grads, done)?;
        }
    }

    fn accept(&mut self, grads: &mut [GradAcc], d: Done) -> Result<()> {
        let op = match d.kind {
            Kind::Scatter => "reduce_scatter",
            Kind::AllReduce => "all_reduce",
        };
        self.spans
            .push(Track::Comm, op, Some(d.unit), Some(d.micro), d.start, d.end);
        // what was handed over is gone now (the reducer works in order)
        let held = self.in_flight.pop_front().unwrap_or(0);
        self.mem.free(Category::Gradients, held);
        let out = d.result?;
        let acc = &mut grads[d.unit];
        match (std::mem::take(acc), out) {
            (GradAcc::None, GradOut::Plain(v, mean)) => {
                self.mem.alloc(Category::Gradients, v.bytes());
                *acc = GradAcc::Reduced(v, mean);
            }
            (GradAcc::Reduced(mut a, false), GradOut::Plain(v, false)) => {
                a.add_assign(&v);
                *acc = GradAcc::Reduced(a, false);
            }
            (GradAcc::None, GradOut::Exact(x)) => {
                self.mem.alloc(Category::Gradients, x.bytes());
                *acc = GradAcc::ShardExact(x);
            }
            (GradAcc::ShardExact(mut a), GradOut::Exact(x)) => {
                let before = a.bytes();
                a.merge(&x)?;
                self.mem.free(Category::Gradients, before);
                self.mem.alloc(Category::Gradients, a.bytes());
                *acc = GradAcc::ShardExact(a);
            }
            (other, _) => {
                *acc = other;
                return Err(Error::Config {
                    field: "reducer",
                    reason: format!("unexpected reduction result for unit {}", d.unit),
                });
            }
        }
        Ok(())
    }

    /// Hands unit `u`'s gradients of micro-batch `micro` to the reducer, or
    /// accumulates them locally until the last micro-batch (strategies that
    /// do not shard gradients).
    fn finish_unit_grads(
        &mut self,
        grads: &mut [GradAcc],
        u: usize,
        micro: usize,
        last_micro: bool,
        g: Vec<f32>,
    ) -> Result<()> {
        let strategy = self.cfg.strategy;
        let repro = self.cfg.reproducible;
        let chunk = self.plan.units()[u].shard_len;
        let reduce = self.cfg.precision.reduce;
        let gbytes = bytes_of(&g);
        let to_wire = |g: Vec<f32>| {
            if reduce == Dtype::F32 {
                LowVec::F32(g)
            } else {
                LowVec::from_f32(&g, reduce)
            }
        };
        let partial = |g: &[f32]| -> Result<ExactPartial> {
            let mut p = ExactPartial::new(g.len());
            p.add(g).map_err(comm("accumulating an exact partial"))?;
            Ok(p)
        };
        let (kind, data) = if strategy.shards_grads() {
            let data = if !repro {
                GradIn::Plain(to_wire(g))
            } else if self.single_micro && strategy != Strategy::Hybrid {
                // one contribution per rank: the collectives' exact
                // reduce-scatter rounds the final sum at once
                GradIn::Partial(partial(&g)?)
            } else {
                // accumulated over micro-batches (or merged across
                // replicas): exchange exact partials of the shards
                GradIn::Exact(ExactBuf::encode(&g, chunk))
            };
            (Kind::Scatter, data)
        } else {
            // No gradient sharding: accumulate the whole unit over the
            // micro-batches, reduce once after the last.
            let acc = match (std::mem::take(&mut grads[u]), repro) {
                (GradAcc::FullExact(mut x), true) => {
                    let before = x.encoded_bytes();
                    x.add(&g).map_err(comm("accumulating an exact partial"))?;
                    self.mem.free(Category::Gradients, gbytes + before);
                    self.mem.alloc(Category::Gradients, x.encoded_bytes());
                    GradAcc::FullExact(x)
                }
                (_, true) => {
                    let x = partial(&g)?;
                    self.mem.free(Category::Gradients, gbytes);
                    self.mem.alloc(Category::Gradients, x.encoded_bytes());
                    GradAcc::FullExact(x)
                }
                // plain: `g` is the accumulator (see `grad_buffer`)
                (_, false) => GradAcc::Full(g),
            };
            if !last_micro {
                grads[u] = acc;
                return Ok(());
            }
            let kind = if strategy.shards_optimizer() {
                Kind::Scatter
            } else {
                Kind::AllReduce
            };
            let data = match acc {
                GradAcc::FullExact(x) => {
                    self.mem.free(Category::Gradients, x.encoded_bytes());
                    self.mem.alloc(Category::Gradients, gbytes);
                    GradIn::Partial(x)
                }
                GradAcc::Full(a) => GradIn::Plain(to_wire(a)),
                _ => unreachable!("accumulated above"),
            };
            (kind, data)
        };
        // What the reducer now owns, counted until it reports back.
        let held = match &data {
            GradIn::Exact(x) => x.bytes(),
            GradIn::Plain(v) => v.bytes(),
            GradIn::Partial(p) => p.encoded_bytes(),
        };
        self.mem.free(Category::Gradients, gbytes);
        self.mem.alloc(Category::Gradients, held);
        self.in_flight.push_back(held);
        self.reducer.submit(u, micro, kind, data)
    }

    /// A zeroed whole-unit gradient buffer for unit `u`, or (plain mode
    /// without gradient sharding) the running accumulator itself, so the
    /// model's `+=` accumulates micro-batches in place.
    fn grad_buffer(&mut self, grads: &mut [GradAcc], u: usize) -> Vec<f32> {
        if !self.cfg.strategy.shards_grads()
            && !self.cfg.reproducible
            && let GradAcc::Full(a) = std::mem::take(&mut grads[u])
        {
            return a; // already counted
        }
        let g = vec![0.0f32; self.plan.units()[u].padded_len(self.n)];
        self.mem.alloc(Category::Gradients, bytes_of(&g));
        g
    }

    /// One training step: forward and backward of this rank's
    /// micro-batches (each `B·T` tokens), gradient reduction, global-norm
    /// clipping and the sharded AdamW update with learning rate `lr`.
    /// Collective: every rank of the data-parallel group calls it with the
    /// same number of micro-batches of the same shape. Rank `dp_rank`'s
    /// micro-batches are positions `dp_rank·M .. (dp_rank+1)·M` of the
    /// global batch of `M·dp_size`.
    ///
    /// # Errors
    /// [`Error::Batch`] if no micro-batch is given or one has the wrong
    /// number of tokens; model, kernel and collective errors.
    pub fn step(
        &mut self,
        b: usize,
        t: usize,
        micro: &[MicroBatch<'_>],
        lr: f32,
    ) -> Result<StepReport> {
        if micro.is_empty() {
            return Err(Error::Batch {
                reason: "a step needs at least one micro-batch".into(),
            });
        }
        for (j, mb) in micro.iter().enumerate() {
            if mb.tokens.len() != b * t || mb.targets.len() != b * t {
                return Err(Error::Batch {
                    reason: format!(
                        "micro-batch {j}: {} tokens and {} targets, expected B*T = {b}*{t} = {}",
                        mb.tokens.len(),
                        mb.targets.len(),
                        b * t
                    ),
                });
            }
        }
        self.ensure_acts(b, t)?;
        self.single_micro = micro.len() == 1;
        let t_start = Instant::now();
        let traffic0 = self.world.traffic();
        let spans0 = self.spans.spans().len();
        let nu = self.plan.units().len();
        let mut grads: Vec<GradAcc> = (0..nu).map(|_| GradAcc::None).collect();
        let mut losses = Vec::with_capacity(micro.len());
        for (j, mb) in micro.iter().enumerate() {
            let loss = self.micro_step(&mut grads, j, j + 1 == micro.len(), *mb)?;
            losses.push(loss);
        }
        self.drain_reductions(&mut grads, true)?;
        // Every micro-batch's loss, in global order.
        let global_m = micro.len() * self.dp_size;
        let mut all = vec![0.0f64; global_m];
        self.world
            .all_gather(&losses, &mut all)
            .map_err(comm("all_gather of the losses"))?;
        #[allow(clippy::cast_precision_loss)]
        let loss = all.iter().sum::<f64>() / global_m as f64;
        let memory_at_update = self.mem.clone();
        let skip = !loss.is_finite();
        let (grad_norm, clip_coef, applied) = self.update(&mut grads, global_m, lr, skip)?;
        let traffic = self.world.traffic().since(&traffic0);
        let new = &self.spans.spans()[spans0..];
        let sum = |tr: Track| -> f64 {
            new.iter()
                .filter(|s| s.track == tr)
                .map(|s| s.end - s.start)
                .sum()
        };
        Ok(StepReport {
            loss,
            micro_losses: all,
            grad_norm,
            clip_coef,
            applied,
            optimizer_step: self.step,
            traffic,
            seconds: t_start.elapsed().as_secs_f64(),
            exposed_comm_seconds: sum(Track::Wait),
            comm_seconds: sum(Track::Comm),
            memory_at_update,
        })
    }

    /// Units still needed after the forward: the last one (its backward is
    /// next) and, with tied embeddings, the embedding (the head reads `wte`).
    fn keep_after_forward(&self, u: usize) -> bool {
        let nu = self.plan.units().len();
        !self.cfg.reshard_after_forward || u + 1 == nu || (u == 0 && self.plan.tied())
    }

    fn prefetch(&mut self, slots: &mut [Slot], order: &[usize], at: usize) -> Result<()> {
        if !self.cfg.strategy.shards_params() {
            return Ok(());
        }
        for &u in order.iter().skip(at + 1).take(self.cfg.prefetch) {
            self.issue_gather(slots, u)?;
        }
        Ok(())
    }

    fn time<R>(
        &mut self,
        op: &'static str,
        u: usize,
        micro: usize,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let t0 = Instant::now();
        let r = f(self);
        self.spans
            .push(Track::Compute, op, Some(u), Some(micro), t0, Instant::now());
        r
    }

    /// Forward and backward of one micro-batch.
    fn micro_step(
        &mut self,
        grads: &mut [GradAcc],
        j: usize,
        last_micro: bool,
        mb: MicroBatch<'_>,
    ) -> Result<f64> {
        let nu = self.plan.units().len();
        let mut slots: Vec<Slot> = (0..nu).map(|_| Slot::Empty).collect();
        let fwd: Vec<usize> = (0..nu).collect();
        let bwd: Vec<usize> = (0..nu).rev().collect();
        let mut loss = 0.0;
        // ---- forward ----
        for (i, &u) in fwd.iter().enumerate() {
            self.prefetch(&mut slots, &fwd, i)?;
            self.materialize(&mut slots, u, j)?;
            if u + 1 == nu && self.plan.tied() {
                self.materialize(&mut slots, 0, j)?;
            }
            loss = self.time("forward", u, j, |me| me.forward_unit(&slots, u, mb))?;
            if !self.keep_after_forward(u) {
                self.free_slot(&mut slots, u);
            }
            self.drain_reductions(grads, false)?;
        }
        // ---- backward ----
        let mut gbufs: Vec<Option<Vec<f32>>> = (0..nu).map(|_| None).collect();
        for (i, &u) in bwd.iter().enumerate() {
            self.prefetch(&mut slots, &bwd, i)?;
            self.materialize(&mut slots, u, j)?;
            if u + 1 == nu && self.plan.tied() {
                // the head reads the still-gathered `wte` of unit 0
                self.materialize(&mut slots, 0, j)?;
                if gbufs[0].is_none() {
                    gbufs[0] = Some(self.grad_buffer(grads, 0));
                }
            }
            if gbufs[u].is_none() {
                gbufs[u] = Some(self.grad_buffer(grads, u));
            }
            self.time("backward", u, j, |me| {
                me.backward_unit(&slots, &mut gbufs, u)
            })?;
            // Unit u's parameters are done; its gradients are complete
            // (with tied embeddings unit 0 also got the head's, earlier).
            self.free_slot(&mut slots, u);
            let g = gbufs[u].take().unwrap_or_default();
            self.finish_unit_grads(grads, u, j, last_micro, g)?;
            self.drain_reductions(grads, false)?;
        }
        for u in 0..nu {
            self.free_slot(&mut slots, u);
        }
        Ok(loss)
    }

    fn forward_unit(&mut self, slots: &[Slot], u: usize, mb: MicroBatch<'_>) -> Result<f64> {
        let nu = self.plan.units().len();
        let acts = self.acts.as_mut().ok_or_else(|| Error::Batch {
            reason: "activations not planned".into(),
        })?;
        let (b, t) = (acts.b, acts.t);
        let bl = &self.blocks;
        let p = Self::unit_params(&self.units, slots, &self.plan, u);
        match self.plan.units()[u].kind {
            UnitKind::Embedding => {
                acts.tokens.copy_from_slice(mb.tokens);
                bl.embed_forward(&mut acts.encoded, mb.tokens, p, b, t)?;
            }
            UnitKind::Block(l) => {
                let (prev, cur) = acts.layers.split_at_mut(l);
                let inp: &[f32] = if l == 0 {
                    &acts.encoded
                } else {
                    prev[l - 1].out()
                };
                bl.block_forward(l, &mut cur[0], inp, p, &mut acts.scratch)?;
            }
            UnitKind::Head => {
                let lnf_len = 2 * bl.config().n_embd;
                let (lnf, lm) = if self.plan.tied() {
                    let wte = &Self::unit_params(&self.units, slots, &self.plan, 0)[..bl.wte_len()];
                    (p, wte)
                } else {
                    p.split_at(lnf_len)
                };
                let last = acts.layers[nu - 3].out();
                let loss = bl.head_forward(&mut acts.head, last, lnf, lm, Some(mb.targets))?;
                return Ok(loss.unwrap_or(f64::NAN));
            }
        }
        Ok(0.0)
    }

    fn backward_unit(
        &mut self,
        slots: &[Slot],
        gbufs: &mut [Option<Vec<f32>>],
        u: usize,
    ) -> Result<()> {
        let nu = self.plan.units().len();
        let acts = self.acts.as_mut().ok_or_else(|| Error::Batch {
            reason: "activations not planned".into(),
        })?;
        let (b, t) = (acts.b, acts.t);
        let bl = &self.blocks;
        let p = Self::unit_params(&self.units, slots, &self.plan, u);
        let len = self.plan.units()[u].len();
        match self.plan.units()[u].kind {
            UnitKind::Embedding => {
                let g = gbufs[0].as_mut().map(|g| &mut g[..len]).unwrap_or_default();
                bl.embed_backward(g, &acts.dres, &acts.tokens, b, t)?;
            }
            UnitKind::Block(l) => {
                let g = gbufs[u].as_mut().map(|g| &mut g[..len]).unwrap_or_default();
                let inp: &[f32] = if l == 0 {
                    &acts.encoded
                } else {
                    acts.layers[l - 1].out()
                };
                bl.block_backward(
                    &mut acts.dres,
                    g,
                    &acts.layers[l],
                    inp,
                    p,
                    &mut acts.scratch,
                )?;
            }
            UnitKind::Head => {
                let lnf_len = 2 * bl.config().n_embd;
                let last = acts.layers[nu - 3].out();
                if self.plan.tied() {
                    let wte_len = bl.wte_len();
                    let wte = &Self::unit_params(&self.units, slots, &self.plan, 0)[..wte_len];
                    let (g0, rest) = gbufs.split_at_mut(u);
                    let dlnf = rest[0]
                        .as_mut()
                        .map(|g| &mut g[..lnf_len])
                        .unwrap_or_default();
                    let dwte = g0[0]
                        .as_mut()
                        .map(|g| &mut g[..wte_len])
                        .unwrap_or_default();
                    bl.head_backward(
                        &mut acts.dres,
                        dlnf,
                        dwte,
                        &mut acts.head,
                        last,
                        p,
                        wte,
                        &mut acts.scratch,
                    )?;
                } else {
                    let g = gbufs[u].as_mut().map(|g| &mut g[..len]).unwrap_or_default();
                    let (dlnf, dlm) = g.split_at_mut(lnf_len);
                    let (lnf, lm) = p.split_at(lnf_len);
                    bl.head_backward(
                        &mut acts.dres,
                        dlnf,
                        dlm,
                        &mut acts.head,
                        last,
                        lnf,
                        lm,
                        &mut acts.scratch,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The f32 gradient of unit `u` on this rank's optimizer range: the mean
    /// over the `global_m` micro-batches of the global batch.
    fn final_grad(&self, acc: &GradAcc, u: usize, global_m: usize) -> Result<Vec<f32>> {
        let want = self.units[u].master.len();
        let widen = |v: &LowVec| {
            let mut g = vec![0.0f32; v.len()];
            v.widen_into(&mut g);
            g
        };
        let g = match acc {
            GradAcc::Reduced(v, true) => widen(v),
            GradAcc::Reduced(v, false) => {
                // plain mode: the rounded sum, divided
                #[allow(clippy::cast_precision_loss)]
                let m = global_m as f32;
                let mut g = widen(v);
                if global_m != 1 {
                    g.iter_mut().for_each(|x| *x /= m);
                }
                g
            }
            GradAcc::ShardExact(x) => {
                if self.cfg.precision.reduce == Dtype::BF16 {
                    widen(&LowVec::Bf16(x.mean(global_m)?))
                } else {
                    x.mean(global_m)?
                }
            }
            _ => {
                return Err(Error::Config {
                    field: "reducer",
                    reason: format!("unit {u} received no reduced gradient"),
                });
            }
        };
        if g.len() != want {
            return Err(Error::StateShape {
                what: format!("reduced gradient of unit {u}"),
                expected: want,
                got: g.len(),
            });
        }
        Ok(g)
    }

    /// Global norm, clipping and the AdamW update of this rank's ranges;
    /// skipped (gradients dropped) when `skip` is set or the norm is not
    /// finite. Returns the norm, the clip coefficient and whether the
    /// update was applied.
    fn update(
        &mut self,
        grads: &mut [GradAcc],
        global_m: usize,
        lr: f32,
        skip: bool,
    ) -> Result<(f64, f32, bool)> {
        let t0 = Instant::now();
        let nu = self.plan.units().len();
        // Pass 1: the exact sum of squares over this rank's ranges.
        let mut sq = ExactSum::new();
        let mut buf = Vec::with_capacity(4096);
        for (u, acc) in grads.iter().enumerate() {
            let g = self.final_grad(acc, u, global_m)?;
            for c in g.chunks(4096) {
                buf.clear();
                buf.extend(c.iter().map(|&x| f64::from(x) * f64::from(x)));
                sq.add_slice(&buf);
            }
        }
        self.spans
            .push(Track::Compute, "grad_norm", None, None, t0, Instant::now());
        if self.cfg.strategy.shards_optimizer() && self.n > 1 {
            let t1 = Instant::now();
            let mine = sq.to_bytes();
            let msgs = vec![mine; self.n];
            let all = exact::exchange_bytes(&*self.params_comm, &msgs, "the gradient norm")?;
            let mut total = ExactSum::new();
            for b in &all {
                total.merge(&ExactSum::from_bytes(b)?);
            }
            sq = total;
            self.spans
                .push(Track::Comm, "norm_exchange", None, None, t1, Instant::now());
        }
        let norm = sq.to_f64().sqrt();
        let apply = !skip && norm.is_finite();
        let coef = match self.cfg.max_grad_norm {
            #[allow(clippy::cast_possible_truncation)]
            Some(max) if norm.is_finite() && norm > f64::from(max) => {
                (f64::from(max) / (norm + 1e-6)) as f32
            }
            _ => 1.0,
        };
        // Pass 2: AdamW on this rank's ranges, unit by unit.
        if apply {
            self.step += 1;
        }
        let hp = AdamW {
            lr,
            ..self.cfg.adamw
        };
        let t2 = Instant::now();
        for (u, slot) in grads.iter_mut().enumerate() {
            let acc = std::mem::take(slot);
            let mut g = self.final_grad(&acc, u, global_m)?;
            let gb = bytes_of(&g);
            self.mem.alloc(Category::Gradients, gb);
            match &acc {
                GradAcc::Reduced(v, _) => self.mem.free(Category::Gradients, v.bytes()),
                GradAcc::ShardExact(x) => self.mem.free(Category::Gradients, x.bytes()),
                _ => {}
            }
            drop(acc);
            if !apply {
                self.mem.free(Category::Gradients, gb);
                continue;
            }
            if coef != 1.0 {
                g.iter_mut().for_each(|x| *x *= coef);
            }
            let opt = self.optimizer_range(u);
            let st = &mut self.units[u];
            for (run, decay) in self.plan.decay_runs(u) {
                let a = run.start.max(opt.start);
                let e = run.end.min(opt.end);
                if a >= e {
                    continue;
                }
                let r = a - opt.start..e - opt.start;
                adamw_update(
                    &mut st.master[r.clone()],
                    &g[r.clone()],
                    &mut st.m[r.clone()],
                    &mut st.v[r.clone()],
                    &hp,
                    self.step,
                    decay,
                )?;
            }
            self.mem.free(Category::Gradients, gb);
            drop(g);
        }
        self.spans
            .push(Track::Compute, "optimizer", None, None, t2, Instant::now());
        for u in 0..nu {
            self.refresh_compute_params(u)?;
        }
        Ok((norm, coef, apply))
    }

    /// Mean loss of one batch `(B,T)` without gradients (evaluation).
    /// Collective over the shard group when parameters are sharded.
    ///
    /// # Errors
    /// [`Error::Batch`] for a wrong number of tokens; model, kernel and
    /// collective errors.
    pub fn eval_loss(&mut self, b: usize, t: usize, mb: MicroBatch<'_>) -> Result<f64> {
        if mb.tokens.len() != b * t || mb.targets.len() != b * t {
            return Err(Error::Batch {
                reason: format!(
                    "{} tokens and {} targets, expected B*T = {b}*{t} = {}",
                    mb.tokens.len(),
                    mb.targets.len(),
                    b * t
                ),
            });
        }
        self.ensure_acts(b, t)?;
        let nu = self.plan.units().len();
        let mut slots: Vec<Slot> = (0..nu).map(|_| Slot::Empty).collect();
        let fwd: Vec<usize> = (0..nu).collect();
        let mut loss = 0.0;
        for (i, &u) in fwd.iter().enumerate() {
            self.prefetch(&mut slots, &fwd, i)?;
            self.materialize(&mut slots, u, 0)?;
            if u + 1 == nu && self.plan.tied() {
                self.materialize(&mut slots, 0, 0)?;
            }
            loss = self.time("eval", u, 0, |me| me.forward_unit(&slots, u, mb))?;
            if !(u == 0 && self.plan.tied()) {
                self.free_slot(&mut slots, u);
            }
        }
        for u in 0..nu {
            self.free_slot(&mut slots, u);
        }
        Ok(loss)
    }
}

/// Waits for `p` on a watcher thread that stamps the completion time.
#[allow(clippy::type_complexity)]
fn watch<T: weft_collectives::Element>(
    p: Pending<Vec<T>>,
    f: fn(Vec<T>) -> LowVec,
) -> Result<JoinHandle<(weft_collectives::Result<LowVec>, Instant)>> {
    std::thread::Builder::new()
        .name("weft-fsdp-gather".into())
        .spawn(move || {
            let r = p.wait().map(f);
            (r, Instant::now())
        })
        .map_err(|e| Error::Config {
            field: "prefetch",
            reason: format!("cannot spawn an all-gather watcher thread: {e}"),
        })
}
