//! [`Fsdp`]: a model's parameters sharded over a data-parallel group, with
//! the hooks the model's own forward and backward call.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use weft_collectives::repro::ExactPartial;
use weft_collectives::{
    Communicator, CommunicatorExt, Dtype, Mesh, Pending, Traffic, bf16, shard_range,
};
use weft_kernels::AdamW;
use weft_parallel::{GradNorm, ParamLayout};

use crate::config::{FsdpConfig, Strategy};
use crate::error::{Error, Result, comm};
use crate::lowp::LowVec;
use crate::memory::{Category, MemoryReport, bytes_of};
use crate::reducer::{self, Done, GradIn, GradOut, Groups, Reducer};
use crate::spans::{SpanLog, Track};
use crate::units::{UnitPlan, UnitSpec};
use crate::wire::Bf16Wire;

/// Muon's part of an optimizer step ([`Fsdp::apply_with`]).
#[derive(Clone, Copy, Debug)]
pub struct MuonStep<'a> {
    /// The plan over this rank's shards of the units (buffer `u`: unit
    /// `u`'s shard, as [`Fsdp::muon_shards`] lists them).
    pub plan: &'a weft_parallel::MuonPlan,
    /// Muon's hyper-parameters.
    pub hp: &'a weft_kernels::Muon,
    /// Newton–Schulz's precision.
    pub precision: weft_kernels::Precision,
}

/// Per-unit state of this rank.
#[derive(Debug)]
struct UnitState {
    /// f32 master weights of the range this rank updates: its shard.
    master: Vec<f32>,
    /// AdamW first moments, same range.
    m: Vec<f32>,
    /// AdamW second moments, same range.
    v: Vec<f32>,
    /// With bf16 parameters, how the unit travels (bf16 words, and the
    /// f32 bits of what it keeps in f32).
    wire: Option<Arc<Bf16Wire>>,
    /// The replicated compute parameters (strategies that do not shard
    /// parameters): f32 values, or with bf16 parameters the gathered
    /// words of `wire`.
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
    /// Reduced values (shard); `true` if already the mean over the global
    /// batch.
    Reduced(LowVec, bool),
    /// The exact accumulator of this rank's shard, of this many bytes,
    /// which the reducer keeps until the last micro-batch (reproducible
    /// mode).
    Remote(usize),
}

/// A gathered unit: in flight, or ready as f32.
#[derive(Debug, Default)]
enum Slot {
    #[default]
    Empty,
    Flight {
        /// The gather, widened to f32 where it runs.
        handle: Pending<Vec<f32>>,
        start: Instant,
        /// Bytes of the gather buffer (bf16 words, or f32).
        bytes: usize,
    },
    Ready(Vec<f32>),
}

/// Where the hooks are in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Between steps.
    Idle,
    /// Training: `local` micro-batches on this rank.
    Train { local: usize },
    /// A forward without backward (evaluation).
    Eval,
}

/// Which way the units are walked (the prefetch order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Forward,
    Backward,
}

/// Fully sharded data parallelism of any model whose parameters live in
/// one flat buffer cut into units ([`UnitPlan`]): each rank keeps `1/N` of
/// every unit's parameters (ZeRO-3), gradients (ZeRO-2) and AdamW state
/// (ZeRO-1); the model's own forward and backward call the hooks around
/// each unit, FSDP2-style, and read the gathered parameters in between.
///
/// # A step, as the model drives it
/// Every call is collective over the data-parallel group (every rank calls
/// it, in the same order, with the same units).
///
/// 1. [`begin_step`](Self::begin_step) with this rank's number of
///    micro-batches.
/// 2. Per micro-batch, for each unit in forward order
///    [`pre_forward`](Self::pre_forward)
///    (gathers it, and issues the next units' gathers: they travel while
///    this one computes), compute with [`params`](Self::params),
///    [`post_forward`](Self::post_forward) (frees it, unless it is the
///    last unit or [`keep_gathered`](UnitSpec::keep_gathered)); then for
///    each unit in reverse [`pre_backward`](Self::pre_backward), compute,
///    accumulating into [`grads_mut`](Self::grads_mut) (or
///    [`view`](Self::view) / [`views2`](Self::views2) for parameters and
///    gradients at once), [`post_backward`](Self::post_backward) (hands its
///    gradients to the reducer thread, which reduce-scatters them while the
///    next unit computes). Each unit counts its own forwards and
///    backwards, so the micro-batches may interleave — a pipeline stage
///    runs several forwards before their backwards (1F1B, interleaved);
///    each unit's backwards come in the order of its forwards.
/// 3. [`finish_backward`](Self::finish_backward) waits for the last
///    reductions; [`grad_norm`](Self::grad_norm) gives this shard's part of
///    the exact squared norm (merged over the shard group), and
///    [`apply`](Self::apply) runs AdamW on the shards with a clipping
///    coefficient — or [`skip`](Self::skip) drops the step.
///
/// Evaluation is [`begin_eval`](Self::begin_eval), the forward hooks,
/// [`end_eval`](Self::end_eval).
///
/// After an error the group is broken (a peer is lost, or ranks disagree);
/// drop the value.
pub struct Fsdp {
    cfg: FsdpConfig,
    plan: UnitPlan,
    /// Shard-group rank and size.
    rank: usize,
    n: usize,
    /// Whole data-parallel group rank and size.
    dp_rank: usize,
    dp_size: usize,
    /// The shard group, for parameter all-gathers (training thread).
    params_comm: Box<dyn Communicator>,
    /// The reducer's groups (shard, replicas), for their traffic.
    grad_groups: [Option<Arc<dyn Communicator>>; 2],
    reducer: Reducer,
    units: Vec<UnitState>,
    step: u32,
    mem: MemoryReport,
    spans: SpanLog,
    phase: Phase,
    slots: Vec<Slot>,
    /// Per unit, the gradient buffers of the micro-batches whose backward
    /// is under way (id, buffer): one, or several when a pipeline splits
    /// backwards into input and weight halves run at different times.
    gbufs: Vec<Vec<(usize, Vec<f32>)>>,
    grads: Vec<GradAcc>,
    /// When each unit's forward or backward compute began (for spans).
    compute_from: Vec<Option<Instant>>,
    /// Forwards and backwards each unit has run in this step: a unit's
    /// micro-batches are counted on their own, so a pipeline stage may run
    /// several forwards before their backwards (1F1B, interleaved).
    forwards: Vec<usize>,
    backwards: Vec<usize>,
    /// The micro-batch each unit's current forward or backward belongs to.
    current: Vec<Option<usize>>,
    /// Bytes handed to the reducer per job, in submission order.
    in_flight: VecDeque<usize>,
    /// Micro-batches of the whole data-parallel group in this step.
    global_m: usize,
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

/// The gradient buffer of micro-batch `mb` among a unit's.
fn grad_of(bufs: &mut [(usize, Vec<f32>)], mb: usize) -> Option<&mut Vec<f32>> {
    bufs.iter_mut().find(|(id, _)| *id == mb).map(|(_, g)| g)
}

fn phase_err(what: &str, phase: Phase) -> Error {
    Error::Order {
        reason: format!("{what} during {phase:?}"),
    }
}

impl Fsdp {
    /// Shards `params` (the whole initial buffer of a model laid out by
    /// `layout`, the same on every rank) over the data-parallel group
    /// `comm`, cut into `units`; each rank keeps only its shards.
    /// Collective: every rank calls it with the same arguments.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid precision, a hybrid shard size that
    /// does not divide the group, or units that do not tile the layout;
    /// [`Error::StateShape`] for a parameter buffer of the wrong length;
    /// [`Error::Collective`] if splitting the communicator fails.
    pub fn new(
        comm: &dyn Communicator,
        layout: &ParamLayout,
        units: Vec<UnitSpec>,
        cfg: FsdpConfig,
        params: &[f32],
    ) -> Result<Self> {
        cfg.precision.check()?;
        if params.len() != layout.len() {
            return Err(Error::StateShape {
                what: "initial parameters".into(),
                expected: layout.len(),
                got: params.len(),
            });
        }
        let world_n = comm.size();
        type Groups3 = (
            Box<dyn Communicator>,
            Arc<dyn Communicator>,
            Option<Arc<dyn Communicator>>,
        );
        let (params_comm, reduce_shard, replicas): Groups3 = if cfg.strategy == Strategy::Hybrid {
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
            (
                g(&["shard"])?,
                Arc::from(g(&["shard"])?),
                Some(Arc::from(g(&["replicate"])?)),
            )
        } else {
            (
                split_of(comm, "parameter")?,
                Arc::from(split_of(comm, "gradient")?),
                None,
            )
        };
        let grad_groups = [Some(reduce_shard.clone()), replicas.clone()];
        let (rank, n) = (params_comm.rank(), params_comm.size());
        let plan = UnitPlan::new(layout, units, n)?;
        let reducer = Reducer::start(Groups {
            shard: reduce_shard,
            replicas,
            opts: reducer::options(cfg.algorithm, cfg.precision.reduce),
        })?;
        let mut mem = MemoryReport::default();
        let strategy = cfg.strategy;
        let pdt = cfg.precision.param;
        let mut states = Vec::with_capacity(plan.units().len());
        for u in plan.units() {
            let padded = u.padded_len(n);
            let mut full = vec![0.0f32; padded];
            full[..u.len()].copy_from_slice(&params[u.range.clone()]);
            let master = full[u.shard(rank)].to_vec();
            // a unit kept whole in f32 (an embedding that is looked up)
            // travels as f32: as many bytes, and nothing to unpack
            let all_kept = u.keep_f32.iter().map(Range::len).sum::<usize>() == u.len();
            let wire = (pdt == Dtype::BF16 && !all_kept).then(|| Arc::new(Bf16Wire::new(u, n)));
            let resident = (!strategy.shards_params()).then(|| match &wire {
                Some(w) => {
                    let mut words = vec![bf16::ZERO; w.len()];
                    w.write_unit(0, &full, &mut words);
                    LowVec::Bf16(words)
                }
                None => LowVec::F32(full),
            });
            let st = UnitState {
                m: vec![0.0; master.len()],
                v: vec![0.0; master.len()],
                master,
                wire,
                resident,
            };
            mem.alloc(Category::OptimizerState, 3 * bytes_of(&st.master));
            if let Some(x) = &st.resident {
                mem.alloc(Category::ParamShards, x.bytes());
            }
            states.push(st);
        }
        let nu = plan.units().len();
        Ok(Fsdp {
            rank,
            n,
            dp_rank: comm.rank(),
            dp_size: world_n,
            cfg,
            plan,
            params_comm,
            grad_groups,
            reducer,
            units: states,
            step: 0,
            mem,
            spans: SpanLog::new(),
            phase: Phase::Idle,
            slots: (0..nu).map(|_| Slot::Empty).collect(),
            gbufs: (0..nu).map(|_| Vec::new()).collect(),
            grads: (0..nu).map(|_| GradAcc::None).collect(),
            compute_from: vec![None; nu],
            forwards: vec![0; nu],
            backwards: vec![0; nu],
            current: vec![None; nu],
            in_flight: VecDeque::new(),
            global_m: 0,
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

    /// Records the model's activation buffers (`bytes` now allocated, the
    /// previous figure replaced), so that the report's peak total covers
    /// them too.
    pub fn record_activations(&mut self, bytes: usize) {
        let now = self.mem.current(Category::Activations);
        self.mem.free(Category::Activations, now);
        self.mem.alloc(Category::Activations, bytes);
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
        self.params_comm.traffic()
    }

    /// This rank's traffic through FSDP's own groups alone: the parameter
    /// all-gathers and the gradient reduce-scatters (and, hybrid, the
    /// all-reduces over the replicas).
    pub fn group_traffic(&self) -> Traffic {
        let mut t = self.params_comm.group_traffic();
        for g in self.grad_groups.iter().flatten() {
            t += &g.group_traffic();
        }
        t
    }

    /// The range of unit `u`'s padded buffer that this rank's master
    /// weights and moments cover: its shard.
    ///
    /// # Panics
    /// If `u` is out of range.
    pub fn optimizer_range(&self, u: usize) -> Range<usize> {
        self.plan.units()[u].shard(self.rank)
    }

    /// This rank's shards as a [`MuonPlan`](weft_parallel::MuonPlan)'s
    /// buffers: per unit, the range of the model's layout its shard
    /// holds (padding left out) and the layout element at its position 0.
    #[must_use]
    pub fn muon_shards(&self) -> Vec<(Range<usize>, usize)> {
        self.plan
            .units()
            .iter()
            .map(|u| {
                (
                    u.shard_in_model(self.rank),
                    u.range.start + u.shard(self.rank).start,
                )
            })
            .collect()
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

    /// The whole buffers `(master, m, v)` of this rank's model (f32, the
    /// layout's order), on every rank: every unit's shards all-gathered.
    /// Collective over the shard group.
    ///
    /// # Errors
    /// A collective error.
    pub fn unshard_state(&self) -> Result<[Vec<f32>; 3]> {
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0.0f32; self.plan.num_params()]);
        for (u, unit) in self.plan.units().iter().enumerate() {
            let s = &self.units[u];
            for (buf, mine) in out.iter_mut().zip([&s.master, &s.m, &s.v]) {
                let mut full = vec![0.0f32; unit.padded_len(self.n)];
                self.params_comm
                    .all_gather(mine, &mut full)
                    .map_err(comm(format!("all_gather of unit {}", unit.name)))?;
                buf[unit.range.clone()].copy_from_slice(&full[..unit.len()]);
            }
        }
        Ok(out)
    }

    /// Unit `u`'s parameters (f32 master weights, without padding) on
    /// every rank, outside a step — e.g. a tied embedding another pipeline
    /// stage keeps a copy of. Collective over the shard group.
    ///
    /// # Errors
    /// [`Error::Order`] for a unit the plan does not have; a collective
    /// error.
    pub fn unit_params(&self, u: usize) -> Result<Vec<f32>> {
        self.check_unit(u)?;
        let unit = &self.plan.units()[u];
        let mut full = vec![0.0f32; unit.padded_len(self.n)];
        self.params_comm
            .all_gather(&self.units[u].master, &mut full)
            .map_err(comm(format!("all_gather of unit {}", unit.name)))?;
        full.truncate(unit.len());
        Ok(full)
    }

    /// The unit holding all of `range` (of the model's buffer).
    fn unit_of(&self, range: &Range<usize>) -> Result<usize> {
        self.plan
            .units()
            .iter()
            .position(|u| range.start >= u.range.start && range.end <= u.range.end)
            .ok_or_else(|| Error::Config {
                field: "range",
                reason: format!("{range:?} is not inside one unit"),
            })
    }

    /// Where `range` (inside unit `u`) meets this rank's shard: (range of
    /// the model's buffer, offset of its start in the shard).
    fn held_part(&self, u: usize, range: &Range<usize>) -> Option<(Range<usize>, usize)> {
        let unit = &self.plan.units()[u];
        let held = unit.shard_in_model(self.rank);
        let (a, b) = (range.start.max(held.start), range.end.min(held.end));
        let shard_start = unit.range.start + unit.shard(self.rank).start;
        (a < b).then(|| (a..b, a - shard_start))
    }

    /// Elements `range` of the model's buffer (inside one unit; the f32
    /// master weights) on every rank, outside a step — e.g. a router's
    /// selection bias that a balancer adjusts. Collective over the shard
    /// group (every rank passes the same range).
    ///
    /// # Errors
    /// [`Error::Config`] for a range that is not inside one unit; a
    /// collective error.
    pub fn read_params(&self, range: Range<usize>) -> Result<Vec<f32>> {
        let u = self.unit_of(&range)?;
        let len = range.len();
        let mut mine = vec![0.0f32; len];
        if let Some((part, at)) = self.held_part(u, &range) {
            mine[part.start - range.start..part.end - range.start]
                .copy_from_slice(&self.units[u].master[at..at + part.len()]);
        }
        if self.n == 1 {
            return Ok(mine);
        }
        // every element is held by one rank: take it from that rank's copy
        let mut all = vec![0.0f32; len * self.n];
        self.params_comm
            .all_gather(&mine, &mut all)
            .map_err(comm(format!("all_gather of {range:?}")))?;
        let unit = &self.plan.units()[u];
        let mut out = vec![0.0f32; len];
        for r in 0..self.n {
            let held = unit.shard_in_model(r);
            let (a, b) = (range.start.max(held.start), range.end.min(held.end));
            for i in a..b {
                out[i - range.start] = all[r * len + i - range.start];
            }
        }
        Ok(out)
    }

    /// Overwrites elements `range` of the model's buffer (inside one unit)
    /// with `values` — the same on every rank of the shard group — outside
    /// a step: this rank's master weights and compute copies of them. No
    /// communication.
    ///
    /// # Errors
    /// [`Error::Config`] for a range that is not inside one unit;
    /// [`Error::StateShape`] for values of another length; [`Error::Order`]
    /// during a step.
    pub fn write_params(&mut self, range: Range<usize>, values: &[f32]) -> Result<()> {
        if self.phase != Phase::Idle {
            return Err(phase_err("write_params", self.phase));
        }
        if values.len() != range.len() {
            return Err(Error::StateShape {
                what: format!("values of {range:?}"),
                expected: range.len(),
                got: values.len(),
            });
        }
        let u = self.unit_of(&range)?;
        let unit_start = self.plan.units()[u].range.start;
        let part = self.held_part(u, &range);
        let st = &mut self.units[u];
        if let Some((part, at)) = part {
            let src = &values[part.start - range.start..part.end - range.start];
            st.master[at..at + part.len()].copy_from_slice(src);
        }
        match (&mut st.resident, &st.wire) {
            (Some(LowVec::Bf16(words)), Some(w)) => {
                w.write_unit(range.start - unit_start, values, words);
            }
            (Some(res), _) => res.assign_f32_at(range.start - unit_start, values),
            (None, _) => {}
        }
        Ok(())
    }

    /// The whole parameter buffer (f32 master weights, the layout's order)
    /// on every rank. Collective over the shard group.
    ///
    /// # Errors
    /// A collective error.
    pub fn full_params(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.plan.num_params()];
        for (u, unit) in self.plan.units().iter().enumerate() {
            let mut full = vec![0.0f32; unit.padded_len(self.n)];
            self.params_comm
                .all_gather(&self.units[u].master, &mut full)
                .map_err(comm(format!("all_gather of unit {}", unit.name)))?;
            out[unit.range.clone()].copy_from_slice(&full[..unit.len()]);
        }
        Ok(out)
    }

    /// Loads this rank's shards of a whole parameter buffer and its AdamW
    /// moments (the layout's order; the same on every rank), e.g. a
    /// restored checkpoint, and the optimizer step. Collective under
    /// strategies that replicate parameters.
    ///
    /// # Errors
    /// [`Error::StateShape`] for buffers of the wrong length; a collective
    /// error.
    pub fn load_whole(&mut self, params: &[f32], m: &[f32], v: &[f32], step: u32) -> Result<()> {
        for (what, x) in [("parameters", params), ("m", m), ("v", v)] {
            if x.len() != self.plan.num_params() {
                return Err(Error::StateShape {
                    what: format!("whole {what}"),
                    expected: self.plan.num_params(),
                    got: x.len(),
                });
            }
        }
        for u in 0..self.plan.units().len() {
            let unit = &self.plan.units()[u];
            let r = self.optimizer_range(u);
            let pad = |buf: &[f32]| -> Vec<f32> {
                let mut padded = vec![0.0f32; unit.padded_len(self.n)];
                padded[..unit.len()].copy_from_slice(&buf[unit.range.clone()]);
                padded[r.clone()].to_vec()
            };
            let (p, m, v) = (pad(params), pad(m), pad(v));
            self.load_shard_state(u, &p, &m, &v, step)?;
        }
        Ok(())
    }

    /// Rebuilds the compute-dtype copies of unit `u` from its master weights.
    fn refresh_compute_params(&mut self, u: usize) -> Result<()> {
        let st = &mut self.units[u];
        let shard_start = self.plan.units()[u].shard(self.rank).start;
        if let Some(res) = &mut st.resident {
            // the updated shard straight into its place in the replicated
            // buffer, then the peers' shards around it (in place: no
            // shard copy, no allocation)
            match (&mut *res, &st.wire) {
                (LowVec::Bf16(words), Some(w)) => w.write(self.rank, 0, &st.master, words),
                (res, _) => res.assign_f32_at(shard_start, &st.master),
            }
            let t0 = Instant::now();
            res.all_gather_in_place(&*self.params_comm)
                .map_err(comm(format!(
                    "all_gather of updated unit {}",
                    self.plan.units()[u].name
                )))?;
            self.spans
                .push(Track::Comm, "all_gather", Some(u), None, t0, Instant::now());
        }
        Ok(())
    }

    fn check_unit(&self, u: usize) -> Result<()> {
        if u >= self.plan.units().len() {
            return Err(Error::Order {
                reason: format!("unit {u} of {}", self.plan.units().len()),
            });
        }
        Ok(())
    }

    /// The micro-batch unit `u` is computing, for its spans.
    fn micro(&self, u: usize) -> Option<usize> {
        self.current.get(u).copied().flatten()
    }

    // ---------------------------------------------------------- the hooks

    /// Makes the gradients the mean over `micro_batches · ranks`
    /// micro-batches per step instead of `micro_batches ·` the group's
    /// size: for a group that is part of a larger data-parallel group whose
    /// other ranks' contributions reach its gradients another way (a
    /// mixture of experts' tokens through the all-to-all, tensors summed
    /// over a replica group before the hooks hand them over).
    ///
    /// # Errors
    /// [`Error::Config`] for fewer ranks than the group has (or was set to).
    pub fn set_data_parallel_size(&mut self, ranks: usize) -> Result<()> {
        if ranks < self.dp_size {
            return Err(Error::Config {
                field: "data_parallel_size",
                reason: format!("= {ranks} is less than the group's {} ranks", self.dp_size),
            });
        }
        self.dp_size = ranks;
        Ok(())
    }

    /// Starts a step of `micro_batches` micro-batches on this rank (every
    /// rank of the group runs the same number; the global batch has
    /// `micro_batches · dp_size`).
    ///
    /// # Errors
    /// [`Error::Order`] if a step or an evaluation is under way, or for 0
    /// micro-batches.
    pub fn begin_step(&mut self, micro_batches: usize) -> Result<()> {
        if self.phase != Phase::Idle {
            return Err(phase_err("begin_step", self.phase));
        }
        if micro_batches == 0 {
            return Err(Error::Order {
                reason: "a step needs at least one micro-batch".into(),
            });
        }
        self.global_m = micro_batches * self.dp_size;
        self.phase = Phase::Train {
            local: micro_batches,
        };
        self.forwards.iter_mut().for_each(|x| *x = 0);
        self.backwards.iter_mut().for_each(|x| *x = 0);
        Ok(())
    }

    /// Starts a forward without backward (evaluation): only the forward
    /// hooks follow, then [`end_eval`](Self::end_eval).
    ///
    /// # Errors
    /// [`Error::Order`] if a step is under way.
    pub fn begin_eval(&mut self) -> Result<()> {
        if self.phase != Phase::Idle {
            return Err(phase_err("begin_eval", self.phase));
        }
        self.phase = Phase::Eval;
        Ok(())
    }

    /// Ends an evaluation forward: frees every gathered unit.
    ///
    /// # Errors
    /// [`Error::Order`] outside an evaluation.
    pub fn end_eval(&mut self) -> Result<()> {
        if self.phase != Phase::Eval {
            return Err(phase_err("end_eval", self.phase));
        }
        for u in 0..self.slots.len() {
            self.free_slot(u);
        }
        self.phase = Phase::Idle;
        Ok(())
    }

    /// Before unit `u`'s forward: its parameters are gathered (waiting for
    /// a prefetched gather, or issuing one), and the gathers of the next
    /// `prefetch` units are issued so they travel while `u` computes.
    ///
    /// # Errors
    /// [`Error::Order`] outside a step or an evaluation, or past the step's
    /// micro-batches; a collective error.
    pub fn pre_forward(&mut self, u: usize) -> Result<()> {
        self.check_unit(u)?;
        match self.phase {
            Phase::Eval => self.current[u] = None,
            Phase::Train { local } if self.forwards[u] < local => {
                self.current[u] = Some(self.forwards[u]);
            }
            Phase::Train { local } => {
                return Err(Error::Order {
                    reason: format!(
                        "forward {} of unit {} in a step of {local} micro-batches",
                        self.forwards[u] + 1,
                        self.plan.units()[u].name
                    ),
                });
            }
            Phase::Idle => return Err(phase_err("pre_forward", self.phase)),
        }
        self.prefetch(Dir::Forward, u)?;
        self.materialize(u)?;
        self.compute_from[u] = Some(Instant::now());
        Ok(())
    }

    /// After unit `u`'s forward: frees its gathered parameters unless it is
    /// the last unit (its backward comes next), is kept gathered, or the
    /// run keeps every unit (`reshard_after_forward = false`).
    ///
    /// # Errors
    /// [`Error::Order`] without a matching [`pre_forward`](Self::pre_forward).
    pub fn post_forward(&mut self, u: usize) -> Result<()> {
        self.check_unit(u)?;
        let from = self.compute_from[u].take().ok_or_else(|| Error::Order {
            reason: format!("post_forward of unit {u} without pre_forward"),
        })?;
        let op = if self.phase == Phase::Eval {
            "eval"
        } else {
            "forward"
        };
        self.spans.push(
            Track::Compute,
            op,
            Some(u),
            self.micro(u),
            from,
            Instant::now(),
        );
        if self.phase != Phase::Eval {
            self.forwards[u] += 1;
        }
        let nu = self.plan.units().len();
        let keep = self.phase != Phase::Eval && (!self.cfg.reshard_after_forward || u + 1 == nu)
            || self.plan.units()[u].keep_gathered;
        if !keep {
            self.free_slot(u);
        }
        self.drain_reductions(false)
    }

    /// Before unit `u`'s backward of micro-batch `mb` (the caller's id of
    /// the micro-batch, distinct among those in flight): its parameters are
    /// gathered (and the previous units' gathers issued), and a gradient
    /// buffer for `mb` (zeroed, or the running accumulator) is ready in
    /// [`grads_mut`](Self::grads_mut). Calling it again for a unit and
    /// micro-batch already prepared (a kept unit another unit's backward
    /// reads) does nothing more. Several micro-batches' backwards of a unit
    /// may be under way at once (a zero-bubble pipeline's input and weight
    /// halves); they end in any order.
    ///
    /// # Errors
    /// [`Error::Order`] outside a step, or without a forward whose
    /// backward is pending; a collective error.
    pub fn pre_backward(&mut self, u: usize, mb: usize) -> Result<()> {
        self.check_unit(u)?;
        if !matches!(self.phase, Phase::Train { .. }) {
            return Err(phase_err("pre_backward", self.phase));
        }
        if self.gbufs[u].iter().any(|(id, _)| *id == mb) {
            return Ok(());
        }
        if self.backwards[u] + self.gbufs[u].len() >= self.forwards[u] {
            return Err(Error::Order {
                reason: format!(
                    "backward {} of unit {} after {} forwards",
                    self.backwards[u] + self.gbufs[u].len() + 1,
                    self.plan.units()[u].name,
                    self.forwards[u]
                ),
            });
        }
        self.current[u] = Some(mb);
        self.prefetch(Dir::Backward, u)?;
        self.materialize(u)?;
        let g = self.grad_buffer(u);
        self.gbufs[u].push((mb, g));
        self.compute_from[u].get_or_insert_with(Instant::now);
        Ok(())
    }

    /// After unit `u`'s backward of micro-batch `mb`: its gradients are
    /// complete; they go to the reducer (or accumulate until the step's
    /// last micro-batch, for strategies that keep whole gradients), and its
    /// parameters are freed once no backward of the unit is under way.
    ///
    /// # Errors
    /// [`Error::Order`] without a matching [`pre_backward`](Self::pre_backward);
    /// a reducer error.
    pub fn post_backward(&mut self, u: usize, mb: usize) -> Result<()> {
        self.check_unit(u)?;
        let Phase::Train { local } = self.phase else {
            return Err(phase_err("post_backward", self.phase));
        };
        let at = self.gbufs[u]
            .iter()
            .position(|(id, _)| *id == mb)
            .ok_or_else(|| Error::Order {
                reason: format!(
                    "post_backward of unit {} for micro-batch {mb} without pre_backward",
                    self.plan.units()[u].name
                ),
            })?;
        let (_, g) = self.gbufs[u].remove(at);
        let from = self.compute_from[u].take().unwrap_or_else(Instant::now);
        self.spans.push(
            Track::Compute,
            "backward",
            Some(u),
            Some(mb),
            from,
            Instant::now(),
        );
        if self.gbufs[u].is_empty() {
            self.free_slot(u);
        }
        let done = self.backwards[u];
        self.backwards[u] += 1;
        self.finish_unit_grads(u, done, done + 1 == local, g)?;
        self.drain_reductions(false)
    }

    /// Unit `u`'s f32 parameters (without padding), between its
    /// `pre_*` and `post_*` hooks (any time for strategies that do not
    /// shard parameters).
    ///
    /// # Errors
    /// [`Error::Order`] if the unit is not gathered.
    pub fn params(&self, u: usize) -> Result<&[f32]> {
        self.check_unit(u)?;
        unit_params(&self.units, &self.slots, &self.plan, u).ok_or_else(|| Error::Order {
            reason: format!(
                "unit {} is not gathered (call pre_forward or pre_backward first)",
                self.plan.units()[u].name
            ),
        })
    }

    /// Unit `u`'s gradient buffer (without padding), between
    /// [`pre_backward`](Self::pre_backward) and
    /// [`post_backward`](Self::post_backward); the backward adds into it.
    ///
    /// # Errors
    /// [`Error::Order`] outside those hooks.
    pub fn grads_mut(&mut self, u: usize, mb: usize) -> Result<&mut [f32]> {
        Ok(self.view(u, mb)?.1)
    }

    /// Unit `u`'s parameters and its gradient buffer for micro-batch `mb`
    /// together.
    ///
    /// # Errors
    /// As [`params`](Self::params) and [`grads_mut`](Self::grads_mut).
    pub fn view(&mut self, u: usize, mb: usize) -> Result<(&[f32], &mut [f32])> {
        self.check_unit(u)?;
        let len = self.plan.units()[u].len();
        let name = &self.plan.units()[u].name;
        let p =
            unit_params(&self.units, &self.slots, &self.plan, u).ok_or_else(|| Error::Order {
                reason: format!("unit {name} is not gathered"),
            })?;
        let g = grad_of(&mut self.gbufs[u], mb).ok_or_else(|| Error::Order {
            reason: format!(
                "unit {name} has no gradient buffer for micro-batch {mb} (call pre_backward first)"
            ),
        })?;
        Ok((p, &mut g[..len]))
    }

    /// The views of two different units at once, for micro-batch `mb` (a
    /// unit whose backward also writes another's gradients: a tied output
    /// head).
    ///
    /// # Errors
    /// As [`view`](Self::view); [`Error::Order`] if `a == b`.
    #[allow(clippy::type_complexity)]
    pub fn views2(
        &mut self,
        a: usize,
        b: usize,
        mb: usize,
    ) -> Result<((&[f32], &mut [f32]), (&[f32], &mut [f32]))> {
        self.check_unit(a)?;
        self.check_unit(b)?;
        if a == b {
            return Err(Error::Order {
                reason: format!("views2 of unit {a} twice"),
            });
        }
        let missing = |u: usize| Error::Order {
            reason: format!(
                "unit {} is not gathered or has no gradient buffer for micro-batch {mb}",
                self.plan.units()[u].name
            ),
        };
        let (la, lb) = (self.plan.units()[a].len(), self.plan.units()[b].len());
        let pa = unit_params(&self.units, &self.slots, &self.plan, a).ok_or_else(|| missing(a))?;
        let pb = unit_params(&self.units, &self.slots, &self.plan, b).ok_or_else(|| missing(b))?;
        let (lo, hi) = self.gbufs.split_at_mut(a.max(b));
        let (first, second) = (&mut lo[a.min(b)], &mut hi[0]);
        let (ga, gb) = if a < b {
            (first, second)
        } else {
            (second, first)
        };
        let ga = grad_of(ga, mb).ok_or_else(|| missing(a))?;
        let gb = grad_of(gb, mb).ok_or_else(|| missing(b))?;
        Ok(((pa, &mut ga[..la]), (pb, &mut gb[..lb])))
    }

    /// After every unit's backward of the step's last micro-batch: waits
    /// for every reduction.
    ///
    /// # Errors
    /// [`Error::Order`] outside a step, or before every unit's backwards
    /// ran; a reducer error.
    pub fn finish_backward(&mut self) -> Result<()> {
        let Phase::Train { local } = self.phase else {
            return Err(phase_err("finish_backward", self.phase));
        };
        if let Some(u) = self.backwards.iter().position(|&b| b != local) {
            return Err(Error::Order {
                reason: format!(
                    "the step ended after {} of {local} backwards of unit {}",
                    self.backwards[u],
                    self.plan.units()[u].name
                ),
            });
        }
        // nothing stays gathered between steps
        for u in 0..self.slots.len() {
            self.free_slot(u);
        }
        self.drain_reductions(true)
    }

    /// This rank's shards' part of the squared gradient norm, classed by
    /// placement and merged over the shard group (exactly), after
    /// [`finish_backward`](Self::finish_backward). The caller adds the
    /// other parts of the model and finishes the norm over its mesh.
    ///
    /// # Errors
    /// A collective error; [`Error::Config`] if a unit got no gradient.
    pub fn grad_norm(&mut self) -> Result<GradNorm> {
        let t0 = Instant::now();
        let mut norm = GradNorm::new();
        for u in 0..self.grads.len() {
            let g = self.final_grad(&self.grads[u], u)?;
            let unit = &self.plan.units()[u];
            let held = unit.shard_in_model(self.rank);
            let shard_start = unit.range.start + unit.shard(self.rank).start;
            let coords = self.plan.coords();
            for s in self.plan.specs() {
                let r = s.range();
                let (a, b) = (r.start.max(held.start), r.end.min(held.end));
                if a < b {
                    norm.add_spec(s, &coords, a..b, &g[a - shard_start..b - shard_start]);
                }
            }
        }
        self.spans
            .push(Track::Compute, "grad_norm", None, None, t0, Instant::now());
        if self.n > 1 {
            let t1 = Instant::now();
            norm.merge_over(&*self.params_comm)?;
            self.spans
                .push(Track::Comm, "norm_exchange", None, None, t1, Instant::now());
        }
        Ok(norm)
    }

    /// The AdamW update of this rank's shards with the gradients times
    /// `clip_coef` (1: no clipping), then the compute copies refreshed
    /// (ZeRO-1/2: the updated shards all-gathered). Ends the step.
    ///
    /// # Errors
    /// A kernel or collective error; [`Error::Order`] outside a step.
    pub fn apply(&mut self, clip_coef: f32, hp: &AdamW) -> Result<()> {
        self.apply_with(clip_coef, hp, None)
    }

    /// [`apply`](Self::apply) with Muon taking the matrices of `muon`'s
    /// plan (its buffers: this rank's shards of the units, in order) and
    /// AdamW the rest: per unit, AdamW and Muon's momentum (its Nesterov
    /// input left in the second-moment buffer, which Muon's elements do
    /// not use); then the plan's collective orthogonalisation, and
    /// Muon's weight step.
    ///
    /// # Errors
    /// As [`apply`](Self::apply); the plan's.
    pub fn apply_with(
        &mut self,
        clip_coef: f32,
        hp: &AdamW,
        muon: Option<MuonStep<'_>>,
    ) -> Result<()> {
        if !matches!(self.phase, Phase::Train { .. }) {
            return Err(phase_err("apply", self.phase));
        }
        self.step += 1;
        let t2 = Instant::now();
        for u in 0..self.grads.len() {
            let acc = std::mem::take(&mut self.grads[u]);
            let mut g = self.final_grad(&acc, u)?;
            let gb = bytes_of(&g);
            self.mem.alloc(Category::Gradients, gb);
            self.release(&acc);
            drop(acc);
            if clip_coef != 1.0 {
                g.iter_mut().for_each(|x| *x *= clip_coef);
            }
            let opt = self.optimizer_range(u);
            let runs: Vec<(Range<usize>, bool)> = self
                .plan
                .decay_runs(u)
                .into_iter()
                .filter_map(|(run, decay)| {
                    let (a, e) = (run.start.max(opt.start), run.end.min(opt.end));
                    (a < e).then(|| (a - opt.start..e - opt.start, decay))
                })
                .collect();
            let base = self.plan.units()[u].range.start + opt.start;
            let runs = match &muon {
                Some(m) => m.plan.adamw_runs(runs, base),
                None => runs,
            };
            let st = &mut self.units[u];
            weft_parallel::adamw_runs(
                runs,
                &mut st.master,
                &g,
                &mut st.m,
                &mut st.v,
                hp,
                self.step,
            )?;
            if let Some(m) = &muon {
                m.plan.momentum(u, &g, &mut st.m, &mut st.v, m.hp)?;
            }
            self.mem.free(Category::Gradients, gb);
        }
        self.spans
            .push(Track::Compute, "optimizer", None, None, t2, Instant::now());
        if let Some(m) = &muon {
            let t3 = Instant::now();
            let mut updates: Vec<&mut [f32]> =
                self.units.iter_mut().map(|s| &mut s.v[..]).collect();
            m.plan.orthogonalize(&mut updates, m.hp, m.precision)?;
            for (u, st) in self.units.iter_mut().enumerate() {
                m.plan.apply(u, &mut st.master, &st.v, m.hp)?;
            }
            self.spans
                .push(Track::Compute, "muon", None, None, t3, Instant::now());
        }
        for u in 0..self.plan.units().len() {
            self.refresh_compute_params(u)?;
        }
        self.phase = Phase::Idle;
        Ok(())
    }

    /// Drops the step's gradients without an update (a non-finite loss or
    /// norm). Ends the step.
    pub fn skip(&mut self) {
        for u in 0..self.grads.len() {
            let acc = std::mem::take(&mut self.grads[u]);
            self.release(&acc);
        }
        self.phase = Phase::Idle;
    }

    /// Unregisters an accumulator's memory.
    fn release(&mut self, acc: &GradAcc) {
        let bytes = match acc {
            GradAcc::Reduced(v, _) => v.bytes(),
            GradAcc::Remote(b) => *b,
            GradAcc::Full(v) => bytes_of(v),
            GradAcc::FullExact(x) => x.encoded_bytes(),
            GradAcc::None => 0,
        };
        self.mem.free(Category::Gradients, bytes);
    }

    // ------------------------------------------------------- the machinery

    fn prefetch(&mut self, dir: Dir, u: usize) -> Result<()> {
        if !self.cfg.strategy.shards_params() {
            return Ok(());
        }
        let nu = self.plan.units().len();
        for k in 1..=self.cfg.prefetch {
            let next = match dir {
                Dir::Forward => u + k,
                Dir::Backward => match u.checked_sub(k) {
                    Some(v) => v,
                    None => break,
                },
            };
            if next >= nu {
                break;
            }
            self.issue_gather(next)?;
        }
        Ok(())
    }

    /// Starts gathering unit `u` (sharded parameters only; a no-op if it is
    /// in flight or ready).
    fn issue_gather(&mut self, u: usize) -> Result<()> {
        if !matches!(self.slots[u], Slot::Empty) {
            return Ok(());
        }
        let unit = &self.plan.units()[u];
        let padded = unit.padded_len(self.n);
        let st = &self.units[u];
        let what = format!("all_gather of unit {}", unit.name);
        let start = Instant::now();
        // in place: the shard is copied once, into its place in the
        // gathered buffer, and the gather moves only the peers' shards
        let (handle, bytes) = match &st.wire {
            Some(w) => {
                // rounded from the master as it is written: no bf16 copy
                // of the shard is kept between steps (FSDP2's cast into
                // the all-gather input)
                let mut full = vec![bf16::ZERO; w.len()];
                w.write(self.params_comm.rank(), 0, &st.master, &mut full);
                // widened where the gather runs, behind the computation
                let wire = Arc::clone(w);
                // reserved here, filled there: allocated by this thread,
                // as the f32 gathers are, and written once
                let mut out = Vec::with_capacity(padded);
                let p = self
                    .params_comm
                    .all_gather_in_place_async_then(full, move |words| {
                        wire.read(&words, &mut out);
                        out
                    })
                    .map_err(comm(&what))?;
                (p, w.len() * 2)
            }
            None => {
                let mut full = vec![0f32; padded];
                full[shard_range(padded, self.n, self.params_comm.rank())]
                    .copy_from_slice(&st.master);
                let p = self
                    .params_comm
                    .all_gather_in_place_async(full)
                    .map_err(comm(&what))?;
                (p, padded * 4)
            }
        };
        self.mem.alloc(Category::GatheredParams, bytes);
        self.slots[u] = Slot::Flight {
            handle,
            start,
            bytes,
        };
        Ok(())
    }

    /// Makes unit `u`'s f32 parameters available in `slots[u]` (sharded
    /// parameters: waits for its gather; bf16 replicated: widens).
    fn materialize(&mut self, u: usize) -> Result<()> {
        let len = self.plan.units()[u].padded_len(self.n);
        if self.cfg.strategy.shards_params() {
            self.issue_gather(u)?;
            match std::mem::take(&mut self.slots[u]) {
                Slot::Flight {
                    handle,
                    start,
                    bytes,
                } => {
                    let data = self.land(handle, start, bytes, u)?;
                    self.slots[u] = Slot::Ready(data);
                }
                other => self.slots[u] = other,
            }
        } else if matches!(self.slots[u], Slot::Empty)
            && let (Some(LowVec::Bf16(res)), Some(wire)) =
                (&self.units[u].resident, &self.units[u].wire)
        {
            let mut w = Vec::with_capacity(len);
            wire.read(res, &mut w);
            self.mem.alloc(Category::GatheredParams, bytes_of(&w));
            self.slots[u] = Slot::Ready(w);
        }
        Ok(())
    }

    /// Waits for a gather (widened to f32 where it ran).
    fn land(
        &mut self,
        handle: Pending<Vec<f32>>,
        start: Instant,
        bytes: usize,
        u: usize,
    ) -> Result<Vec<f32>> {
        let w0 = Instant::now();
        let (r, end) = handle.wait_timed();
        let w1 = Instant::now();
        let micro = self.micro(u);
        self.spans
            .push(Track::Comm, "all_gather", Some(u), micro, start, end);
        if end > w0 {
            self.spans
                .push(Track::Wait, "wait all_gather", Some(u), micro, w0, w1);
        }
        let got = r.map_err(comm(format!(
            "all_gather of unit {}",
            self.plan.units()[u].name
        )))?;
        // a bf16 gather's words were widened into f32 values
        if bytes_of(&got) != bytes {
            self.mem.alloc(Category::GatheredParams, bytes_of(&got));
            self.mem.free(Category::GatheredParams, bytes);
        }
        Ok(got)
    }

    fn free_slot(&mut self, u: usize) {
        match std::mem::take(&mut self.slots[u]) {
            Slot::Ready(v) => self.mem.free(Category::GatheredParams, bytes_of(&v)),
            Slot::Flight { handle, bytes, .. } => {
                // a prefetch never used (e.g. an evaluation's last units)
                let _ = handle.wait();
                self.mem.free(Category::GatheredParams, bytes);
            }
            Slot::Empty => {}
        }
    }

    fn drain_reductions(&mut self, block: bool) -> Result<()> {
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
            self.accept(done)?;
        }
    }

    fn accept(&mut self, d: Done) -> Result<()> {
        self.spans.push(
            Track::Comm,
            "reduce_scatter",
            Some(d.unit),
            Some(d.micro),
            d.start,
            d.end,
        );
        // what was handed over is gone now (the reducer works in order)
        let held = self.in_flight.pop_front().unwrap_or(0);
        self.mem.free(Category::Gradients, held);
        let out = d.result?;
        let acc = &mut self.grads[d.unit];
        match (std::mem::take(acc), out) {
            (GradAcc::None, GradOut::Plain(v, mean)) => {
                self.mem.alloc(Category::Gradients, v.bytes());
                *acc = GradAcc::Reduced(v, mean);
            }
            (GradAcc::Reduced(mut a, false), GradOut::Plain(v, false)) => {
                a.add_assign(&v);
                *acc = GradAcc::Reduced(a, false);
            }
            (GradAcc::None, GradOut::Accumulated(b)) => {
                self.mem.alloc(Category::Gradients, b);
                *acc = GradAcc::Remote(b);
            }
            (GradAcc::Remote(before), GradOut::Accumulated(b)) => {
                self.mem.free(Category::Gradients, before);
                self.mem.alloc(Category::Gradients, b);
                *acc = GradAcc::Remote(b);
            }
            (GradAcc::Remote(before), GradOut::Plain(v, true)) => {
                self.mem.free(Category::Gradients, before);
                self.mem.alloc(Category::Gradients, v.bytes());
                *acc = GradAcc::Reduced(v, true);
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
        u: usize,
        micro: usize,
        last_micro: bool,
        g: Vec<f32>,
    ) -> Result<()> {
        let strategy = self.cfg.strategy;
        let repro = self.cfg.reproducible;
        let reduce = self.cfg.precision.reduce;
        let gbytes = bytes_of(&g);
        let single_micro = matches!(self.phase, Phase::Train { local: 1 });
        let divisor = self.global_m as u64;
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
        let data = if strategy.shards_grads() {
            if !repro {
                GradIn::Plain(to_wire(g))
            } else if single_micro && strategy != Strategy::Hybrid {
                // one contribution per rank: the collectives' exact
                // reduce-scatter rounds the final sum at once
                GradIn::Partial(partial(&g)?, divisor)
            } else {
                // accumulated over micro-batches (or merged across
                // replicas): the values travel, their owners keep the
                // exact sums
                GradIn::Values {
                    g,
                    first: micro == 0,
                    last: last_micro.then_some(divisor),
                }
            }
        } else {
            // ZeRO-1: accumulate the whole unit over the micro-batches,
            // reduce-scatter once after the last.
            let acc = match (std::mem::take(&mut self.grads[u]), repro) {
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
                // plain: `g` is the accumulator (see `grad_buffer`), or a
                // fresh buffer while the accumulator is lent to another
                // micro-batch's backward: the two are added
                (other, false) => match other {
                    GradAcc::Full(mut a) => {
                        a.iter_mut().zip(&g).for_each(|(x, y)| *x += y);
                        self.mem.free(Category::Gradients, gbytes);
                        GradAcc::Full(a)
                    }
                    _ => GradAcc::Full(g),
                },
            };
            if !last_micro {
                self.grads[u] = acc;
                return Ok(());
            }
            match acc {
                GradAcc::FullExact(x) => {
                    self.mem.free(Category::Gradients, x.encoded_bytes());
                    self.mem.alloc(Category::Gradients, gbytes);
                    GradIn::Partial(x, divisor)
                }
                GradAcc::Full(a) => GradIn::Plain(to_wire(a)),
                _ => unreachable!("accumulated above"),
            }
        };
        // What the reducer now owns, counted until it reports back.
        let held = match &data {
            GradIn::Values { g, .. } => bytes_of(g),
            GradIn::Plain(v) => v.bytes(),
            GradIn::Partial(p, _) => p.encoded_bytes(),
        };
        self.mem.free(Category::Gradients, gbytes);
        self.mem.alloc(Category::Gradients, held);
        self.in_flight.push_back(held);
        self.reducer.submit(u, micro, data)
    }

    /// A zeroed whole-unit gradient buffer for unit `u`, or (plain ZeRO-1)
    /// the running accumulator itself, so the model's `+=` accumulates
    /// micro-batches in place.
    fn grad_buffer(&mut self, u: usize) -> Vec<f32> {
        if !self.cfg.strategy.shards_grads()
            && !self.cfg.reproducible
            && let GradAcc::Full(a) = std::mem::take(&mut self.grads[u])
        {
            return a; // already counted
        }
        let g = vec![0.0f32; self.plan.units()[u].padded_len(self.n)];
        self.mem.alloc(Category::Gradients, bytes_of(&g));
        g
    }

    /// The f32 gradient of unit `u` on this rank's shard: the mean over the
    /// micro-batches of the global batch.
    fn final_grad(&self, acc: &GradAcc, u: usize) -> Result<Vec<f32>> {
        let want = self.units[u].master.len();
        let global_m = self.global_m;
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
}

/// Unit `u`'s f32 parameters without padding, if available.
fn unit_params<'a>(
    units: &'a [UnitState],
    slots: &'a [Slot],
    plan: &UnitPlan,
    u: usize,
) -> Option<&'a [f32]> {
    let len = plan.units()[u].len();
    match &slots[u] {
        Slot::Ready(v) => Some(&v[..len]),
        Slot::Flight { .. } => None,
        Slot::Empty => match &units[u].resident {
            Some(LowVec::F32(v)) => Some(&v[..len]),
            _ => None,
        },
    }
}
