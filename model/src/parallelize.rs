//! One GPT, parallelized by transforms over a device mesh: the pipeline
//! split, then the sharding styles of the tensor- and expert-parallel
//! axes, then FSDP over what remains — and one training step for every
//! layout.
//!
//! [`ParallelGpt`] is what `weft train` runs on each rank. Its pieces are
//! the libraries' own:
//!
//! 1. **Pipeline split** — the model is cut into stages
//!    ([`partition_layers`] balances them by cost with `weft-pipeline`'s
//!    partitioner); each rank holds one [`GptStage`] per chunk of the
//!    schedule. Without pipeline parallelism the whole model is one stage.
//!    Either way the step runs through `weft-pipeline`'s executor (with
//!    one stage, 1F1B is forward, backward, forward, backward…).
//! 2. **Tensor, expert and context parallelism** are properties of the
//!    blocks the stages run ([`GptBlocks`] sharded by the layout's
//!    placements, the feed-forward block's expert group, the sequences'
//!    rows over the cp group: [`crate::cp`]): the model code is the same.
//! 3. **Data parallelism** — each stage's gradients are reduced over each
//!    tensor's data-parallel group by `weft-parallel`'s [`GradReducer`]
//!    (exact or plain), or the stage is fully sharded over the group
//!    (`weft-fsdp`, [`GptStage::shard`]).
//!
//! The step is then the same for every layout: micro-batches through the
//! executor, the reduction, the exact global norm over every stage by
//! placement ([`GradNorm`]), clipping, AdamW on each stage (resident or
//! sharded), and the tied embedding's refresh across stages.

use std::sync::Arc;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::{OptimStep, Precision};
use weft_parallel::{
    DimSet, GradNorm, GradReducer, MeshTraffic, ParallelDims, ParallelMesh, ParamLayout,
    TrafficAxis,
};
use weft_pipeline::{Executor, RankTimeline, Schedule};

use crate::config::GptConfig;
use crate::cp::ContextParallel;
use crate::error::{Error, Result};
use crate::ffn::FeedForward;
use crate::gpt::{GptBlocks, MicroBatch};
use crate::memory::RankMemory;
use crate::params::{Sharding, param_layout};
use crate::stage::{GptStage, OwnedPart, ReadTensor, StageSpec};
use crate::tp::{TensorParallel, TpOptions};
use weft_parallel::Recompute;

/// How a job is laid out beyond the mesh's degrees: sharding of the
/// data-parallel group, the pipeline schedule, the micro-batch shape and
/// the reduction mode.
#[derive(Clone, Debug)]
pub struct ParallelPlan {
    /// Fully shard each stage over the data-parallel group (`None`:
    /// replicas, reduced by the [`GradReducer`]).
    pub fsdp: Option<weft_fsdp::FsdpConfig>,
    /// The pipeline schedule and the layers of each of its virtual stages
    /// (`None`: the whole model on one stage).
    pub pipeline: Option<(Schedule, Vec<usize>)>,
    /// Sequences per micro-batch, B.
    pub batch: usize,
    /// Tokens per sequence, T.
    pub seq: usize,
    /// Micro-batches each data-parallel rank runs per step.
    pub micro_batches: usize,
    /// Exact, order-independent gradient sums (bitwise the one-rank run).
    pub reproducible: bool,
    /// How the tensor-parallel axis splits and sums (used when the mesh
    /// has `tp > 1`).
    pub tp: TpOptions,
    /// The arithmetic of every linear layer's products
    /// ([`GptBlocks::set_precision`]): `Precision::Bf16` is mixed
    /// precision — bf16 operands, f32 accumulation, f32 master weights,
    /// gradients and moments.
    pub precision: Precision,
    /// The dtype of gradients between data-parallel replicas (the
    /// reducer's, [`GradReducer::with_wire`]): `F32`, or `BF16` for half
    /// the bytes. A sharded (FSDP) stage uses its own
    /// `FsdpConfig::precision.reduce` instead.
    pub grad_wire: weft_collectives::Dtype,
    /// Document masking: the token that ends a document, or `None` to
    /// attend across documents ([`GptBlocks::set_doc_boundary`]).
    pub doc_boundary: Option<u32>,
    /// Which blocks recompute their forward in the backward instead of
    /// keeping its activations ([`GptBlocks::set_recompute`]); the losses,
    /// gradients and weights are bitwise those without.
    pub recompute: Recompute,
    /// Tokens per chunk of the head's loss, 0 for the whole micro-batch
    /// ([`GptBlocks::set_loss_chunk`]); bitwise the unchunked loss.
    pub loss_chunk: usize,
}

impl ParallelPlan {
    /// The plan of a job laid out as `layout` (a job file's `[parallel]`
    /// table) for the model `cfg`: FSDP over the data-parallel group with
    /// the layout's strategy — in bf16 products (`precision`) the sharding
    /// strategies gather the products' weights in bf16 and the rest in
    /// f32, while replicating ones keep an f32 replica — the pipeline
    /// schedule with its layers partitioned by cost ([`partition_layers`];
    /// `ffn`: the feed-forward blocks, `None` for GPT-2's MLP, `Some((experts,
    /// active))` for its mixture of experts), the
    /// micro-batches of `split`, `seq` tokens per sequence, and the
    /// reductions the layout asks for.
    ///
    /// # Errors
    /// [`Error::Schedule`] when the schedule cannot be generated;
    /// [`Error::Config`] when the layers cannot be partitioned.
    pub fn new(
        cfg: &GptConfig,
        layout: &weft_parallel::ParallelLayout,
        ffn: impl Into<weft_pipeline::FeedForwards>,
        split: weft_parallel::BatchSplit,
        precision: Precision,
        doc_boundary: Option<u32>,
    ) -> Result<Self> {
        let pipeline = if layout.pp > 1 {
            let schedule =
                layout
                    .pp_schedule
                    .generate(layout.pp, split.per_rank, layout.chunks())?;
            let layers = partition_layers(cfg, ffn, &schedule)?;
            Some((schedule, layers))
        } else {
            None
        };
        let fsdp = layout.fsdp.map(|strategy| weft_fsdp::FsdpConfig {
            strategy,
            reproducible: layout.reproducible,
            hybrid_shard: layout.hybrid_shard,
            precision: weft_fsdp::Precision {
                // bf16 mixed precision gathers the products' weights in
                // bf16 (half the bytes; the products round them to the
                // same bits) and the layernorms, biases and embeddings in
                // f32. Strategies that replicate the parameters keep them
                // in f32: they gather once per step, and compute from the
                // replica
                param: if precision == Precision::Bf16 && strategy.shards_params() {
                    weft_collectives::Dtype::BF16
                } else {
                    weft_collectives::Dtype::F32
                },
                reduce: layout.grad_wire,
            },
            ..weft_fsdp::FsdpConfig::default()
        });
        Ok(ParallelPlan {
            fsdp,
            pipeline,
            batch: split.micro,
            seq: cfg.block_size,
            micro_batches: split.per_rank,
            reproducible: layout.reproducible,
            tp: TpOptions {
                sequence_parallel: layout.sequence_parallel,
                reproducible: layout.reproducible,
                ..TpOptions::default()
            },
            precision,
            grad_wire: layout.grad_wire,
            doc_boundary,
            recompute: Recompute::None,
            loss_chunk: 0,
        })
    }
}

/// Where a parallel model's initial parameters come from.
#[derive(Clone, Copy, Debug)]
pub enum Init<'a> {
    /// GPT-2's initialisation from a seed ([`crate::init_gpt2`]): each rank
    /// computes only its part, the values the whole model has there.
    Gpt2 {
        /// The seed.
        seed: u64,
    },
    /// A whole model's parameters, in the unsharded layout (the same on
    /// every rank).
    Whole(&'a [f32]),
}

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// Mean loss over the global batch (every micro-batch's, summed in
    /// global order).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied (false: skipped as non-finite).
    pub applied: bool,
}

/// What one rank sent in a training step, per parallel axis, as the
/// collectives' counters of each group counted it
/// ([`ParallelGpt::last_traffic`]; `tests/measured.rs` checks the volumes
/// against the textbook formulas, layout by layout).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTraffic {
    /// The step's data: activations and their gradients (tp, pp, ep),
    /// gradients and parameters (dp: the gradient reducer, FSDP's
    /// gathers and reduce-scatters), the tied embedding (pp).
    pub payload: MeshTraffic,
    /// The step's scalars: every micro-batch's loss to every rank, and the
    /// gradient norm's exact partial sums (whose encoded size depends on
    /// the values).
    pub scalars: MeshTraffic,
}

/// A GPT on one rank of a parallel layout (see the [module docs](self)).
pub struct ParallelGpt {
    mesh: ParallelMesh,
    whole: ParamLayout,
    ex: Executor<GptStage>,
    train: Schedule,
    timeline: Option<RankTimeline>,
    traffic: Option<StepTraffic>,
}

impl std::fmt::Debug for ParallelGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelGpt")
            .field("mesh", &self.mesh)
            .field("schedule", &self.train.name())
            .finish_non_exhaustive()
    }
}

impl ParallelGpt {
    /// This rank's share of a GPT of configuration `config` with
    /// feed-forward block `ffn` (whose experts may be sharded over the
    /// mesh's `ep` axis: [`FeedForward::expert_parallel`]), initialised
    /// by `init`. The transforms are applied in turn: the blocks are split over
    /// the mesh's `tp` axis (the sharding styles of [`crate::tp`]), the
    /// layers cut into the plan's pipeline stages, and each stage either
    /// reduced over or fully sharded across its data-parallel group.
    /// Collective over `mesh`.
    ///
    /// # Errors
    /// [`Error::Config`] for a plan that does not fit the mesh or the
    /// model, or a combination of axes not composed yet; the stages',
    /// FSDP's and the executor's errors.
    pub fn new(
        config: GptConfig,
        ffn: Arc<dyn FeedForward>,
        init: Init<'_>,
        plan: &ParallelPlan,
        mesh: ParallelMesh,
    ) -> Result<Self> {
        let whole = param_layout(&config, ffn.as_ref(), &Sharding::SINGLE)?;
        let dims = mesh.dims();
        let ep = ffn.expert_parallel().1;
        if ep != dims.ep {
            return Err(Error::Config {
                field: "ep",
                reason: format!(
                    "the feed-forward block is split over {ep} expert-parallel ranks but the mesh has ep = {}",
                    dims.ep
                ),
            });
        }
        let blocks = Self::blocks(config, ffn, plan, &mesh)?;
        Self::from_blocks(blocks, whole, init, plan, mesh)
    }

    /// This rank's blocks: tensor-parallel over the mesh's tp group when
    /// it has several ranks.
    fn blocks(
        config: GptConfig,
        ffn: Arc<dyn FeedForward>,
        plan: &ParallelPlan,
        mesh: &ParallelMesh,
    ) -> Result<GptBlocks> {
        let tp = mesh.dims().tp;
        let mut blocks = if tp > 1 {
            let copies = crate::kv_copies(config.n_head, config.n_kv_head(), tp)?;
            let group = TensorParallel::new(mesh.group_arc(DimSet::TP), plan.tp)
                .with_kv_copies(mesh.copies_group_arc(DimSet::NONE, copies)?);
            GptBlocks::with_tp(config, ffn, group)?
        } else {
            GptBlocks::new(config, ffn)?
        };
        Self::split_sequences(&mut blocks, plan, mesh)?;
        Ok(blocks)
    }

    /// Splits the sequences of `blocks` over the mesh's context-parallel
    /// group (when it has several ranks and the blocks are not split yet),
    /// and returns the rows of each sequence a rank holds.
    ///
    /// # Errors
    /// [`Error::Config`] when the sequence does not cut into `2·cp`
    /// chunks of `64·2^k` positions.
    fn split_sequences(
        blocks: &mut GptBlocks,
        plan: &ParallelPlan,
        mesh: &ParallelMesh,
    ) -> Result<usize> {
        let cp = mesh.dims().cp;
        if cp <= 1 {
            return Ok(plan.seq);
        }
        mesh.dims().context_chunk(plan.seq)?;
        if blocks.ffn().moe().is_some_and(|m| !m.per_token()) {
            return Err(Error::Config {
                field: "cp",
                reason: "context parallelism composes with a mixture of experts whose routing is \
                         per token (dropless top-k, balanced by the selection bias): a capacity \
                         and the auxiliary loss are functions of whole sequences' tokens, which \
                         no cp rank holds"
                    .into(),
            });
        }
        if blocks.context_parallel().is_none() {
            blocks.set_context_parallel(Some(ContextParallel::new(mesh.group_arc(DimSet::CP))));
        }
        Ok(plan.seq / cp)
    }

    /// The training schedule and the layers of each virtual stage.
    fn schedule_of(
        plan: &ParallelPlan,
        dims: ParallelDims,
        n_layer: usize,
    ) -> Result<(Schedule, Vec<usize>)> {
        let (schedule, layers) = match &plan.pipeline {
            Some((s, l)) => (s.clone(), l.clone()),
            None => (
                weft_pipeline::ScheduleKind::OneFOneB.generate(1, plan.micro_batches, 1)?,
                vec![n_layer],
            ),
        };
        if schedule.num_stages() != dims.pp || schedule.microbatches() != plan.micro_batches {
            return Err(Error::Config {
                field: "pipeline",
                reason: format!(
                    "schedule {} has {} stages and {} micro-batches for pp = {} and {} micro-batches per rank",
                    schedule.name(),
                    schedule.num_stages(),
                    schedule.microbatches(),
                    dims.pp,
                    plan.micro_batches
                ),
            });
        }
        Ok((schedule, layers))
    }

    /// What this rank of `mesh` will hold, by category, once
    /// [`new`](Self::new) has built it with the same arguments — computed
    /// from the configuration, the plan and the mesh alone, before
    /// anything is allocated (see [`crate::memory`]): for refusing a run
    /// too large for its machine, and for the start-up report.
    /// [`memory`](Self::memory) counts the same after construction.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`Error::Config`] if a size overflows.
    pub fn predict_memory(
        config: &GptConfig,
        ffn: Arc<dyn FeedForward>,
        plan: &ParallelPlan,
        mesh: &ParallelMesh,
    ) -> Result<RankMemory> {
        let dims = mesh.dims();
        let mut blocks = Self::blocks(config.clone(), ffn, plan, mesh)?;
        // the precision decides what the activations are kept in, the
        // recomputation which
        blocks.set_precision(plan.precision);
        blocks.set_recompute(plan.recompute);
        blocks.set_loss_chunk(plan.loss_chunk)?;
        blocks.set_doc_boundary(plan.doc_boundary);
        let (schedule, layers) = Self::schedule_of(plan, dims, config.n_layer)?;
        let pl = schedule.placement();
        let rank = mesh.coords().pp;
        let peak = weft_pipeline::peak_in_flight_per_chunk(&schedule, rank);
        let split = schedule.splits_backward();
        let experts = dims.ep > 1;
        let seq = plan.seq / dims.cp.max(1);
        let shard = match &plan.fsdp {
            None => None,
            Some(cfg) => {
                let group = if experts { dims.dp / dims.ep } else { dims.dp } * dims.cp;
                let n = if cfg.strategy == weft_fsdp::Strategy::Hybrid {
                    if cfg.hybrid_shard == 0 {
                        mesh.world().topology().ranks_per_domain().min(group)
                    } else {
                        cfg.hybrid_shard
                    }
                } else {
                    group
                };
                Some((cfg, n))
            }
        };
        let mut total = RankMemory::default();
        for (c, &slots) in peak.iter().enumerate() {
            let spec = StageSpec::nth(&layers, pl.virtual_stage(rank, c))?;
            total += GptStage::predict_memory(
                &blocks,
                &spec,
                plan.batch,
                seq,
                slots.max(1),
                split,
                shard,
                experts,
                // the reducer's bf16 buckets beside the f32 ones
                if plan.grad_wire == weft_collectives::Dtype::BF16 {
                    2
                } else {
                    0
                },
            )?;
        }
        Ok(total)
    }

    /// [`new`](Self::new) from this rank's blocks as built by the caller
    /// (`whole`: the unsharded model's layout).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_blocks(
        mut blocks: GptBlocks,
        whole: ParamLayout,
        init: Init<'_>,
        plan: &ParallelPlan,
        mesh: ParallelMesh,
    ) -> Result<Self> {
        blocks.set_precision(plan.precision);
        blocks.set_doc_boundary(plan.doc_boundary);
        blocks.set_recompute(plan.recompute);
        blocks.set_loss_chunk(plan.loss_chunk)?;
        let seq = Self::split_sequences(&mut blocks, plan, &mesh)?;
        let dims = mesh.dims();
        let (schedule, layers) = Self::schedule_of(plan, dims, blocks.config().n_layer)?;
        let pl = schedule.placement();
        let rank = mesh.coords().pp;
        let peak = weft_pipeline::peak_in_flight_per_chunk(&schedule, rank);
        let split = schedule.splits_backward();
        let mut stages = Vec::with_capacity(pl.chunks());
        // zero moments for a whole model's state (only that form needs them)
        let zeros = match init {
            Init::Whole(_) => vec![0.0f32; whole.len()],
            Init::Gpt2 { .. } => Vec::new(),
        };
        for (c, &slots) in peak.iter().enumerate() {
            let spec = StageSpec::nth(&layers, pl.virtual_stage(rank, c))?;
            let mut st = GptStage::new(blocks.clone(), spec, plan.batch, seq, slots.max(1), split)?;
            match init {
                Init::Whole(p) => st.load_state(&whole, p, &zeros, &zeros, 0)?,
                Init::Gpt2 { seed } => st.init_gpt2(seed)?,
            }
            match &plan.fsdp {
                Some(cfg) => st.shard(&mesh, cfg.clone())?,
                None => st.set_reducer(
                    GradReducer::new(st.layout(), plan.reproducible).with_wire(plan.grad_wire)?,
                )?,
            }
            stages.push(st);
        }
        let ex = Executor::new(schedule.clone(), rank, stages)?;
        Ok(ParallelGpt {
            mesh,
            whole,
            ex,
            train: schedule,
            timeline: None,
            traffic: None,
        })
    }

    /// The mesh.
    pub fn mesh(&self) -> &ParallelMesh {
        &self.mesh
    }

    /// The unsharded model's layout (what checkpoints hold).
    pub fn whole_layout(&self) -> &ParamLayout {
        &self.whole
    }

    /// The training schedule (one stage, 1F1B, without pipeline
    /// parallelism).
    pub fn schedule(&self) -> &Schedule {
        &self.train
    }

    /// This rank's stages, by chunk.
    pub fn stages(&self) -> &[GptStage] {
        self.ex.stages()
    }

    /// This rank's stages, by chunk, mutably.
    pub fn stages_mut(&mut self) -> &mut [GptStage] {
        self.ex.stages_mut()
    }

    /// The executor (to gather the stages' timelines).
    pub fn executor(&self) -> &Executor<GptStage> {
        &self.ex
    }

    /// The measured timeline of the last step (then `None` until the next).
    pub fn take_timeline(&mut self) -> Option<RankTimeline> {
        self.timeline.take()
    }

    /// The values of parameter tensor `name` (this rank's part of it) on
    /// the stage holding it, outside a step; `None` if no stage of this
    /// rank holds it (another pipeline stage does). Collective over the
    /// data-parallel group of a sharded stage.
    ///
    /// # Errors
    /// FSDP's.
    pub fn read_param(&self, name: &str) -> Result<Option<Vec<f32>>> {
        for st in self.ex.stages() {
            if let Some(v) = st.read_param(name)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// Sets parameter tensor `name` (this rank's part; the same values on
    /// every rank of its data-parallel group) outside a step — e.g. a
    /// router's selection bias after a balancing update; `false` if no
    /// stage of this rank holds it.
    ///
    /// # Errors
    /// A length error; FSDP's.
    pub fn write_param(&mut self, name: &str, values: &[f32]) -> Result<bool> {
        for st in self.ex.stages_mut() {
            if st.write_param(name, values)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One optimizer step over this rank's micro-batches (its share of the
    /// global batch: data-parallel rank `d` runs global micro-batches
    /// `d·M .. (d+1)·M`), the gradient of the global batch's mean loss, the
    /// exact global norm, and — unless the loss or the norm is not finite —
    /// clipping to `clip` (`clip / (norm + 1e-6)`, as PyTorch's
    /// `clip_grad_norm_`; 0: off) and AdamW with `hp`. Collective over the
    /// mesh.
    ///
    /// # Errors
    /// The executor's, the stages' and collective errors.
    pub fn train_step(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &(impl Into<OptimStep> + Copy),
        clip: f64,
    ) -> Result<StepOutcome> {
        self.train_step_scaled(batches, hp, clip, 1.0)
    }

    /// [`train_step`](Self::train_step) with dynamic loss scaling: the
    /// backward is that of the loss times `loss_scale` (a power of two, as
    /// `weft_numerics::DynamicLossScaler` gives, keeps the unscaling
    /// exact), the norm is checked on the scaled gradients, and — unless
    /// the loss or a gradient is not finite, when the update is skipped
    /// (`applied: false`: the scaler should back off) — the gradients are
    /// divided by `loss_scale` as they are clipped. The reported norm is
    /// the unscaled one. `loss_scale = 1` is `train_step`, bit for bit.
    ///
    /// # Errors
    /// As [`train_step`](Self::train_step); a `loss_scale` that is not
    /// finite and positive.
    pub fn train_step_scaled(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &(impl Into<OptimStep> + Copy),
        clip: f64,
        loss_scale: f32,
    ) -> Result<StepOutcome> {
        let hp = &(*hp).into();
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(Error::Batch {
                reason: format!("loss scale {loss_scale} must be finite and positive"),
            });
        }
        for st in self.ex.stages_mut() {
            st.set_loss_scale(loss_scale);
        }
        let m = batches.len();
        // every context-parallel rank's loss is its rows' mean: one
        // contribution each, as a data-parallel rank's
        let dims = self.mesh.dims();
        let global = m * dims.dp * dims.cp;
        for st in self.ex.stages_mut() {
            st.begin_step(m)?;
        }
        let t0 = self.traffic_now();
        let report = self.ex.step(self.mesh.pp(), batches, None)?;
        for st in self.ex.stages_mut() {
            st.finish_backward(Some(&self.mesh), global)?;
        }
        let t1 = self.traffic_now();
        // The losses live on the head's rank of each pipeline; every rank
        // gets every micro-batch's, in global order.
        let pl = self.train.placement();
        let (head, _) = pl.location(pl.virtual_stages() - 1);
        let mut mine: Vec<f64> = report
            .losses
            .iter()
            .map(|l| l.unwrap_or(f64::NAN))
            .collect();
        self.mesh.pp().broadcast(&mut mine, head)?;
        let mut all = vec![0.0f64; global];
        self.mesh
            .group(DimSet::DP.with(DimSet::CP))
            .all_gather(&mine, &mut all)?;
        let mut loss = 0.0;
        for l in &all {
            loss += l;
        }
        #[allow(clippy::cast_precision_loss)]
        let loss = loss / global as f64;
        self.timeline = Some(report.timeline);
        let mut norm = GradNorm::new();
        for st in self.ex.stages_mut() {
            st.add_grad_norm(&mut norm)?;
        }
        let grad_norm = norm.finish(Some(&self.mesh))? / f64::from(loss_scale);
        let t2 = self.traffic_now();
        let applied = loss.is_finite() && grad_norm.is_finite();
        if applied {
            #[allow(clippy::cast_possible_truncation)]
            let clip_coef = if clip > 0.0 && grad_norm > clip {
                (clip / (grad_norm + 1e-6)) as f32
            } else {
                1.0
            };
            // unscaled as clipped (exact for a power-of-two scale)
            let coef = if loss_scale == 1.0 {
                clip_coef
            } else {
                clip_coef / loss_scale
            };
            for st in self.ex.stages_mut() {
                st.apply(coef, hp)?;
            }
            self.ex.sync_shared(self.mesh.pp())?;
        } else {
            for st in self.ex.stages_mut() {
                st.skip();
            }
        }
        let mut payload = t1.since(&t0);
        payload += &self.traffic_now().since(&t2);
        self.traffic = Some(StepTraffic {
            payload,
            scalars: t2.since(&t1),
        });
        Ok(StepOutcome {
            loss,
            grad_norm,
            applied,
        })
    }

    /// Mean loss per token over `batches` (every rank passes all of them),
    /// without gradients: each data-parallel rank evaluates a contiguous
    /// share, pipelined by a forward-only schedule when there are several
    /// stages, and the per-batch figures are gathered and summed in batch
    /// order — the same sum, bit for bit, as one rank's. Collective over
    /// the mesh.
    ///
    /// # Errors
    /// The executor's, the stages' and collective errors.
    pub fn eval_loss(&mut self, batches: &[MicroBatch<'_>]) -> Result<f64> {
        let dp = self.mesh.dp();
        let (rank, ranks) = (dp.rank(), dp.size());
        let per = batches.len().div_ceil(ranks);
        let mine = (rank * per).min(batches.len())..((rank + 1) * per).min(batches.len());
        // Every rank runs `per` forwards (collective forwards over an
        // expert group or an FSDP shard group need the same count): a
        // rank short of batches runs stand-ins and discards them.
        let mut run: Vec<MicroBatch<'_>> = batches[mine.clone()].to_vec();
        let real = run.len();
        if let Some(first) = batches.first() {
            run.resize(per, *first);
        }
        // a stage's rows of each sequence, and the whole sequence's tokens
        let seq = self.ex.stages()[0].batch_shape().1;
        let cp = self.mesh.dims().cp;
        let whole = seq * cp;
        let train_shape = self.ex.stages()[0].batch_shape();
        let mut local = vec![0.0f64; per];
        let mut at = 0;
        while at < run.len() {
            let b = run[at].tokens.len() / whole.max(1);
            let len = run[at..]
                .iter()
                .take_while(|x| x.tokens.len() == b * whole)
                .count();
            let losses = self.forward_only(&run[at..at + len], b, seq)?;
            for (i, l) in losses.into_iter().enumerate() {
                if at + i < real {
                    #[allow(clippy::cast_precision_loss)]
                    let tokens = run[at + i].tokens.len() as f64;
                    local[at + i] = l * tokens;
                }
            }
            at += len;
        }
        for st in self.ex.stages_mut() {
            st.set_batch_shape(train_shape.0, train_shape.1)?;
            st.set_eval(false);
        }
        if cp > 1 {
            // each context-parallel rank's figure is its rows' mean: the
            // sequences' is their mean
            self.mesh
                .cp()
                .all_reduce(&mut local, weft_collectives::ReduceOp::Sum)?;
            #[allow(clippy::cast_precision_loss)]
            let ranks = cp as f64;
            for x in &mut local {
                *x /= ranks;
            }
        }
        let mut all = vec![0.0f64; per * ranks];
        self.mesh.dp().all_gather(&local, &mut all)?;
        let (mut total, mut tokens) = (0.0, 0usize);
        for (x, b) in all.iter().zip(batches) {
            total += x;
            tokens += b.tokens.len();
        }
        #[allow(clippy::cast_precision_loss)]
        Ok(total / tokens.max(1) as f64)
    }

    /// The losses of `batches` (all of shape `b`×`t`) through a
    /// forward-only schedule, on every rank.
    fn forward_only(&mut self, batches: &[MicroBatch<'_>], b: usize, t: usize) -> Result<Vec<f64>> {
        let pl = self.train.placement();
        for st in self.ex.stages_mut() {
            st.set_batch_shape(b, t)?;
            st.set_eval(true);
        }
        let eval = Schedule::forward_only(pl, batches.len())?;
        let train = self.ex.set_schedule(eval)?;
        let report = self.ex.step(self.mesh.pp(), batches, None);
        self.ex.set_schedule(train)?;
        let report = report?;
        let (head, _) = pl.location(pl.virtual_stages() - 1);
        let mut losses: Vec<f64> = report
            .losses
            .iter()
            .map(|l| l.unwrap_or(f64::NAN))
            .collect();
        self.mesh.pp().broadcast(&mut losses, head)?;
        Ok(losses)
    }

    /// Assembles the whole model's parameters and AdamW moments, in the
    /// unsharded layout, on world rank 0 (`out`: `[params, m, v]`, `None`
    /// on the other ranks); returns the optimizer step. Collective over
    /// the mesh: every tensor part is sent once, by the rank that owns it
    /// (`weft_parallel::gather_whole`).
    ///
    /// # Errors
    /// Collective and layout errors.
    pub fn gather_whole(&self, mut out: Option<[&mut [f32]; 3]>) -> Result<u32> {
        let mut step = 0;
        for st in self.ex.stages() {
            let (state, s) = st.state()?;
            step = s;
            let locals = [&state[0][..], &state[1][..], &state[2][..]];
            let wholes = out.as_mut().map(|o| &mut o[..]);
            weft_parallel::gather_whole(
                self.mesh.world(),
                &self.mesh.coords(),
                st.layout(),
                &self.whole,
                &locals,
                wholes,
            )?;
        }
        Ok(step)
    }

    /// Loads this rank's share of a whole model's parameters and AdamW
    /// moments (unsharded layout; the same on every rank: a restored
    /// checkpoint) and the optimizer step. Collective when stages are
    /// sharded.
    ///
    /// # Errors
    /// Layout errors; FSDP's.
    pub fn load_whole(&mut self, params: &[f32], m: &[f32], v: &[f32], step: u32) -> Result<()> {
        let whole = self.whole.clone();
        for st in self.ex.stages_mut() {
            st.load_state(&whole, params, m, v, step)?;
        }
        Ok(())
    }

    /// The parts of the model's tensors this rank writes to a sharded
    /// checkpoint (parameters and AdamW moments), every element of the
    /// model written by exactly one rank of the mesh, and the optimizer
    /// step. No communication: each rank writes its own.
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_parts(&self) -> Result<(Vec<OwnedPart>, u32)> {
        let mut out = Vec::new();
        let step = self.owned_parts_into(&mut out)?;
        Ok((out, step))
    }

    /// [`owned_parts`](Self::owned_parts) into `out`, overwriting in place
    /// the parts a previous call left there (no allocation, no page
    /// fault: a training loop's saves copy at memory speed); returns the
    /// optimizer step.
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_parts_into(&self, out: &mut Vec<OwnedPart>) -> Result<u32> {
        let coords = self.mesh.coords();
        let (mut at, mut step) = (0, 0);
        for st in self.ex.stages() {
            st.owned_parts_into(&coords, out, &mut at)?;
            step = st.optimizer_step();
        }
        out.truncate(at);
        Ok(step)
    }

    /// Plans Muon for the hidden matrices of every stage this rank holds
    /// ([`GptStage::use_muon`]), over the ranks holding the same stage
    /// (the mesh less its pipeline axis), so that steps take
    /// [`OptimStep::muon`]; returns Muon's work and traffic per step over
    /// the job's ranks (each rank's summed over its stages), with
    /// `ns_steps` Newton–Schulz iterations. Collective over the mesh.
    ///
    /// # Errors
    /// The plans'; a collective error.
    pub fn use_muon(&mut self, ns_steps: usize) -> Result<weft_parallel::MuonCost> {
        let group = self.mesh.group_arc(DimSet::ALL.without(DimSet::PP));
        let mut sum = weft_parallel::MuonTraffic::default();
        for st in self.ex.stages_mut() {
            let t = st.use_muon(group.clone())?.traffic(ns_steps);
            sum.matrices += t.matrices;
            sum.owned += t.owned;
            sum.flops += t.flops;
            sum.sent += t.sent;
            sum.received += t.received;
        }
        Ok(weft_parallel::MuonCost::over(self.mesh.world(), sum)?)
    }

    /// Bytes of [`owned_parts`](Self::owned_parts) (parameters and
    /// optimizer state, f32), counted without copying: the host copy a
    /// checkpoint is saved from.
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_bytes(&self) -> Result<usize> {
        let coords = self.mesh.coords();
        let mut n = 0;
        for st in self.ex.stages() {
            n += st.owned_elements(&coords)?;
        }
        Ok(4 * n)
    }

    /// Loads this rank's part of a saved model — parameters and AdamW
    /// moments, from `read` (see [`GptStage::load_with`]), saved by any
    /// layout — and the optimizer step. Collective over the data-parallel
    /// groups of sharded stages.
    ///
    /// # Errors
    /// [`Error::Load`]; layout and FSDP errors.
    pub fn load_with(&mut self, step: u32, read: &mut ReadTensor<'_>) -> Result<()> {
        for st in self.ex.stages_mut() {
            st.load_with(step, read)?;
        }
        Ok(())
    }

    /// What this rank sent in the last training step, per axis (`None`
    /// before the first).
    pub fn last_traffic(&self) -> Option<&StepTraffic> {
        self.traffic.as_ref()
    }

    /// This rank's traffic so far: the mesh's groups, and FSDP's shard
    /// groups under the data-parallel axis.
    fn traffic_now(&self) -> MeshTraffic {
        let mut t = self.mesh.traffic();
        for st in self.ex.stages() {
            if let Some(f) = st.fsdp() {
                t.add(TrafficAxis::Dp, &f.group_traffic());
            }
        }
        t
    }

    /// Bytes this rank holds, by category, counted from the buffers it
    /// allocated (what [`predict_memory`](Self::predict_memory) predicts).
    pub fn memory(&self) -> RankMemory {
        let mut r = RankMemory::default();
        for st in self.ex.stages() {
            r += st.memory();
        }
        r
    }
}

/// The layers of each virtual stage of `schedule` for a model of
/// configuration `cfg` (vocabulary `vocab`) with feed-forward blocks
/// `ffn`, chosen by `weft-pipeline`'s partitioner to minimise the
/// simulated makespan ([`weft_pipeline::partition_transformer`], which
/// `weft plan` predicts with too). Per-layer costs are the model's FLOPs
/// per token ([`weft_pipeline::BlockShape::flops`]): attention's
/// projections at the query and key/value widths (`q_dim`, `kv_dim`: GQA's
/// K and V are narrower), its score products over the keys the layer sees
/// (a sliding-window layer, [`GptConfig::window`], fewer than a global
/// one), and the layer's feed-forward block — `ffn` is GPT-2's 4·C GELU
/// MLP for `None`, a mixture of 4·C experts for `Some((experts, active))`
/// (`active`: top-k plus a shared one), or any
/// [`weft_pipeline::FeedForwards`] (SwiGLU, expert widths, leading dense
/// layers); backward-for-input and backward-for-weights each as much as
/// the forward. The head's 2·C·V is charged to the last block and the
/// embedding's lookup is free, so the last stage takes fewer blocks when
/// the vocabulary is large.
///
/// # Errors
/// [`Error::Config`] if the model has fewer layers than the schedule has
/// virtual stages, or the partition leaves a stage without layers.
pub fn partition_layers(
    cfg: &GptConfig,
    ffn: impl Into<weft_pipeline::FeedForwards>,
    schedule: &Schedule,
) -> Result<Vec<usize>> {
    let nvs = schedule.placement().virtual_stages();
    let l = cfg.n_layer;
    if l < nvs {
        return Err(Error::Config {
            field: "n_layer",
            reason: format!(
                "pp = {} with {} chunks needs at least {nvs} layers (model.n_layer = {l})",
                schedule.num_stages(),
                schedule.chunks()
            ),
        });
    }
    let windows: Vec<Option<usize>> = (0..l).map(|i| cfg.window(i)).collect();
    let layers = weft_pipeline::partition_transformer(
        schedule,
        &weft_pipeline::TransformerShape::decoder(
            cfg.n_embd,
            cfg.block_size,
            cfg.vocab_size,
            (cfg.q_dim(), cfg.kv_dim()),
            &windows,
            &ffn.into(),
        ),
    )?;
    if layers.contains(&0) {
        return Err(Error::Config {
            field: "pipeline partition",
            reason: format!("left a stage without layers ({layers:?}); use fewer stages"),
        });
    }
    Ok(layers)
}

/// The data-parallel group's handle for a layer that keeps it (the
/// expert-parallel feed-forward block's `ep` group).
pub fn expert_group(mesh: &ParallelMesh) -> Arc<dyn Communicator> {
    mesh.group_arc(DimSet::EP)
}
