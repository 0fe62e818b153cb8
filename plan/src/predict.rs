//! One layout's prediction: memory per GPU by category, step time by part,
//! tokens/s, TFLOP/s per GPU, MFU, and whether it fits.

use serde::{Deserialize, Serialize};
use weft_pipeline::{ChunkCost, Costs, ScheduleKind};

use crate::cluster::{Cluster, Device};
use crate::error::{Error, Result};
use weft_parallel::Strategy;

use crate::layout::Layout;
use crate::memory::{Accounting, Chunk, Memory, Recipe, stage_memory};
use crate::model::ModelSpec;
use crate::time::{
    ChunkTime, FsdpTime, Machine, StepTime, block_activation_bytes, chunk_time, dp_step,
    fsdp_per_microbatch, muon_time, optimizer_time,
};

/// What to plan: a model, a global batch, a cluster and a recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// The model.
    pub model: ModelSpec,
    /// The global batch, in sequences of `model.seq` tokens.
    pub batch: usize,
    /// The cluster (its `gpus` is the world every layout fills).
    pub cluster: Cluster,
    /// What the ranks hold and compute.
    pub recipe: Recipe,
}

impl Request {
    /// Checks the model, the cluster and the batch.
    ///
    /// # Errors
    /// The model's or cluster's error; [`Error::InvalidRequest`] for a
    /// batch of zero.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.cluster.validate()?;
        if self.batch == 0 {
            return Err(Error::InvalidRequest {
                field: "global_batch",
                reason: "must be at least 1 sequence".into(),
            });
        }
        Ok(())
    }

    /// Bytes of memory one rank has.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        let per = if self.cluster.device.shares_machine() {
            self.cluster.memory / self.cluster.gpus.max(1) as f64
        } else {
            self.cluster.memory
        };
        per as u64
    }

    /// Peak FLOP/s of one rank in the recipe's precision.
    #[must_use]
    pub fn peak_per_gpu(&self) -> f64 {
        let p = self.cluster.peak.of(self.recipe.precision);
        if self.cluster.device.shares_machine() {
            p / self.cluster.gpus.max(1) as f64
        } else {
            p
        }
    }
}

/// The prediction for one layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The layout.
    pub layout: Layout,
    /// Micro-batches per data-parallel rank per step.
    pub micro_batches: usize,
    /// Layers of each virtual stage, in forward order.
    pub layers: Vec<usize>,
    /// Memory of the fullest GPU (the pipeline stage that holds most).
    pub memory: Memory,
    /// Memory of rank 0 (pipeline stage 0: what `weft train`'s start-up
    /// report shows).
    pub memory_rank0: Memory,
    /// Memory of each pipeline stage.
    pub memory_per_stage: Vec<Memory>,
    /// Bytes of memory per GPU.
    pub capacity: u64,
    /// Whether the fullest GPU's memory is within its capacity.
    pub fits: bool,
    /// Step time by part.
    pub time: StepTime,
    /// Seconds per step.
    pub step_s: f64,
    /// Tokens per second, the whole cluster.
    pub tokens_per_s: f64,
    /// Model TFLOP/s per GPU (`ModelSpec::flops_per_token` × tokens/s / GPUs).
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation: model FLOP/s over the GPUs' peak.
    pub mfu: f64,
}

/// The schedule a layout runs and each virtual stage's chunk.
pub(crate) struct Geometry {
    pub schedule: weft_pipeline::Schedule,
    pub layers: Vec<usize>,
    /// Per pipeline stage, its chunks in chunk order.
    pub stages: Vec<Vec<Chunk>>,
    /// Per pipeline stage, the virtual stage of each chunk.
    pub virtual_stages: Vec<Vec<usize>>,
}

/// weft's split of the layers over a schedule's virtual stages:
/// `weft_pipeline::partition_transformer`, the function `weft train`'s
/// stages are cut with (`weft_model::partition_layers`).
fn weft_partition(model: &ModelSpec, schedule: &weft_pipeline::Schedule) -> Result<Vec<usize>> {
    Ok(weft_pipeline::partition_transformer(
        schedule,
        &model.transformer_shape(),
    )?)
}

/// The split of `model`'s layers over `layout`'s virtual stages weft
/// chooses ([`weft_pipeline::partition_transformer`] on
/// [`ModelSpec::transformer_shape`], as `weft train` cuts its stages)
/// beside the equal-layer split, both simulated on the per-layer FLOPs —
/// what balancing unequal layers (windows, experts, the head) removes.
/// `None` without pipeline parallelism.
///
/// # Errors
/// The schedule's errors (micro-batches the schedule refuses); fewer
/// layers than virtual stages.
pub fn split_comparison(
    model: &ModelSpec,
    layout: &Layout,
    batch: usize,
) -> Result<Option<weft_pipeline::SplitComparison>> {
    if layout.parallel.pp == 1 {
        return Ok(None);
    }
    let schedule = layout.schedule().generate(
        layout.parallel.pp,
        layout.micro_batches(batch),
        layout.chunks(),
    )?;
    let profiles = weft_pipeline::transformer_profiles(&model.transformer_shape());
    Ok(Some(weft_pipeline::compare_splits(
        &schedule, &profiles, 0.0,
    )?))
}

pub(crate) fn geometry(
    model: &ModelSpec,
    layout: &Layout,
    batch: usize,
    recipe: &Recipe,
) -> Result<Geometry> {
    let m = layout.micro_batches(batch);
    let schedule = if layout.parallel.pp > 1 {
        layout
            .schedule()
            .generate(layout.parallel.pp, m, layout.chunks())?
    } else {
        ScheduleKind::OneFOneB.generate(1, m, 1)?
    };
    let pl = schedule.placement();
    let nvs = pl.virtual_stages();
    let layers = if layout.parallel.pp == 1 {
        vec![model.layers]
    } else {
        match recipe.accounting {
            Accounting::Weft => weft_partition(model, &schedule)?,
            Accounting::Mixed => weft_pipeline::equal_split(model.layers, nvs)
                .windows(2)
                .map(|w| w[1] - w[0])
                .collect(),
        }
    };
    if layers.len() != nvs || layers.contains(&0) {
        return Err(Error::InvalidLayout {
            layout: layout.to_string(),
            field: "pp",
            reason: format!(
                "the layers split as {layers:?}: a stage without layers; use fewer stages"
            ),
        });
    }
    let mut stages = Vec::with_capacity(layout.parallel.pp);
    let mut virtual_stages = Vec::with_capacity(layout.parallel.pp);
    for r in 0..layout.parallel.pp {
        let peak = weft_pipeline::peak_in_flight_per_chunk(&schedule, r);
        let mut chunks = Vec::with_capacity(pl.chunks());
        let mut vss = Vec::with_capacity(pl.chunks());
        for (c, &slots) in peak.iter().enumerate() {
            let vs = pl.virtual_stage(r, c);
            chunks.push(Chunk {
                first: layers[..vs].iter().sum(),
                layers: layers[vs],
                embed: vs == 0,
                head: vs + 1 == nvs,
                slots: slots.max(1),
            });
            vss.push(vs);
        }
        stages.push(chunks);
        virtual_stages.push(vss);
    }
    Ok(Geometry {
        schedule,
        layers,
        stages,
        virtual_stages,
    })
}

/// Memory of every pipeline stage of `layout` (rank 0 of each).
///
/// # Errors
/// As [`predict`].
pub fn memory_per_stage(req: &Request, layout: &Layout) -> Result<Vec<Memory>> {
    req.validate()?;
    layout.validate(&req.model, req.batch, req.cluster.gpus)?;
    let g = geometry(&req.model, layout, req.batch, &req.recipe)?;
    Ok(g.stages
        .iter()
        .map(|chunks| stage_memory(&req.model, layout, &req.recipe, chunks))
        .collect())
}

/// Predicts memory and time of `layout` for `req`.
///
/// # Errors
/// The request's errors; [`Error::InvalidLayout`] when weft cannot run
/// the layout for this model, batch and cluster; a pipeline error when the
/// schedule cannot be generated.
pub fn predict(req: &Request, layout: &Layout) -> Result<Prediction> {
    req.validate()?;
    layout.validate(&req.model, req.batch, req.cluster.gpus)?;
    predict_valid(req, layout)
}

/// [`predict`] for a request and layout already validated.
pub(crate) fn predict_valid(req: &Request, layout: &Layout) -> Result<Prediction> {
    let g = geometry(&req.model, layout, req.batch, &req.recipe)?;
    predict_with(req, layout, &g, true)
}

/// The prediction on a computed geometry; `exact`: the bubble from the
/// simulator (else from the schedule's closed form where it has one, for
/// ranking many layouts quickly).
pub(crate) fn predict_with(
    req: &Request,
    layout: &Layout,
    g: &Geometry,
    exact: bool,
) -> Result<Prediction> {
    let model = &req.model;
    let mut seen: Vec<(&[Chunk], Memory)> = Vec::new();
    let memory_per_stage: Vec<Memory> = g
        .stages
        .iter()
        .map(|chunks| {
            if let Some((_, m)) = seen.iter().find(|(c, _)| *c == chunks.as_slice()) {
                return *m;
            }
            let m = stage_memory(model, layout, &req.recipe, chunks);
            seen.push((chunks, m));
            m
        })
        .collect();
    let memory = memory_per_stage
        .iter()
        .copied()
        .max_by_key(Memory::total)
        .unwrap_or_default();
    let capacity = req.capacity();
    let time = step_time(req, layout, g, exact)?;
    let tokens_per_s = (req.batch * model.seq) as f64 / time.total;
    let gpus = req.cluster.gpus as f64;
    let model_flops = model.flops_per_token() * tokens_per_s / gpus;
    Ok(Prediction {
        layout: *layout,
        micro_batches: layout.micro_batches(req.batch),
        layers: g.layers.clone(),
        memory,
        memory_rank0: memory_per_stage[0],
        memory_per_stage,
        capacity,
        fits: memory.total() <= capacity,
        time,
        step_s: time.total,
        tokens_per_s,
        tflops_per_gpu: model_flops / 1e12,
        mfu: model_flops / req.peak_per_gpu(),
    })
}

/// FSDP's communication of one micro-batch on a chunk: all of it, and
/// what stays exposed. `hidden`: prefetched under the compute of the
/// previous unit, where the first unit's transfer and what exceeds the
/// compute stay exposed; the part that takes the cores
/// ([`crate::time::network_cpu`]) hides only behind the first unit's
/// transfer (the cores wait for it) and lengthens the compute the rest
/// hides behind. Otherwise all of it is exposed.
fn fsdp_exposed(ct: &mut ChunkTime, t: &FsdpTime, chunk: &Chunk, hidden: bool) {
    ct.dp_total = t.forward + t.backward;
    if !hidden {
        ct.f_dp = t.forward;
        ct.b_dp = t.backward;
        return;
    }
    let units = (chunk.layers + usize::from(chunk.embed) + usize::from(chunk.head)).max(1) as f64;
    let exposed = |all: f64, cpu: f64, compute: f64| {
        let (link, cores) = (all - cpu, cpu * (1.0 - 1.0 / units));
        (
            cores,
            ((link - compute - cores).max(0.0) + link / units).min(link),
        )
    };
    let (f_cores, f_link) = exposed(t.forward, t.forward_cpu, ct.f_compute);
    let (b_cores, b_link) = exposed(t.backward, t.backward_cpu, ct.b_compute + ct.w_compute);
    ct.f_dp = f_cores + f_link;
    ct.b_dp = b_cores + b_link;
    ct.dp_cores = f_cores + b_cores;
}

fn step_time(req: &Request, layout: &Layout, g: &Geometry, exact: bool) -> Result<StepTime> {
    let model = &req.model;
    let c = &req.cluster;
    let mach = Machine::new(c, &req.recipe);
    // FSDP's collectives wait on the cores (CPU ranks of one machine, or
    // a shard group inside one node of CPU nodes), or on links the
    // compute does not need
    let fsdp_on_cores = match c.device {
        Device::Gpu => false,
        Device::Cpu => true,
        Device::CpuNodes => {
            let n = layout.shard_group();
            crate::time::Group::strided(n, layout.parallel.tp, c.gpus_per_node).nodes() <= 1
        }
    };
    let m = layout.micro_batches(req.batch) as f64;
    let nvs = g.layers.len();
    // per virtual stage: its chunk and costs
    let mut vs_time = vec![ChunkTime::default(); nvs];
    // blocks of one kind (window, experts) keep the same activations
    let kind = |l: usize| (model.window_of(l), model.is_moe_layer(l));
    let mut acts: Vec<((Option<usize>, bool), f64)> = Vec::new();
    for l in 0..model.layers {
        if !acts.iter().any(|(k, _)| *k == kind(l)) {
            acts.push((
                kind(l),
                block_activation_bytes(model, layout, &req.recipe, l),
            ));
        }
    }
    let act = |l: usize| {
        acts.iter()
            .find(|(k, _)| *k == kind(l))
            .map_or(0.0, |(_, a)| *a)
    };
    // chunks of equal shape cost the same: compute each shape once (with
    // blocks of one kind, wherever the chunk starts)
    let uniform = acts.len() == 1;
    let first = |c: &Chunk| if uniform { 0 } else { c.first };
    let mut shapes: Vec<((usize, usize, bool, bool), ChunkTime)> = Vec::new();
    for (r, chunks) in g.stages.iter().enumerate() {
        for (chunk, &vs) in chunks.iter().zip(&g.virtual_stages[r]) {
            let key = (first(chunk), chunk.layers, chunk.embed, chunk.head);
            if let Some((_, ct)) = shapes.iter().find(|(k, _)| *k == key) {
                vs_time[vs] = *ct;
                continue;
            }
            let mut ct = chunk_time(&mach, model, layout, chunk, &act);
            if layout.shards_params() || layout.shards_grads() {
                let fsdp = fsdp_per_microbatch(&mach, model, layout, chunk);
                let hidden =
                    !fsdp_on_cores && (req.recipe.overlap_grad_reduce || layout.shards_params());
                fsdp_exposed(&mut ct, &fsdp, chunk, hidden);
            }
            shapes.push((key, ct));
            vs_time[vs] = ct;
        }
    }
    // transfers between stages: a micro-batch's activations (its 1/tp
    // rows under sequence parallelism; across nodes Megatron-LM sends
    // 1/tp from each tensor-parallel rank and gathers over NVLink)
    let p2p = if layout.parallel.pp > 1 {
        let rows = (layout.micro_batch_size * crate::memory::rank_seq(model, layout)) as f64
            / if layout.parallel.sequence_parallel {
                layout.parallel.tp as f64
            } else {
                1.0
            };
        let mut bytes = rows * model.hidden as f64 * req.recipe.activation_bytes() as f64;
        let crosses = layout.parallel.dp * layout.parallel.tp >= c.gpus_per_node;
        let link = if crosses { c.inter } else { c.intra };
        if crosses
            && req.recipe.accounting == Accounting::Mixed
            && !layout.parallel.sequence_parallel
        {
            bytes /= layout.parallel.tp as f64;
        }
        // between CPU nodes the bytes also take the machine's cores
        let cores = if crosses { bytes * c.network_cpu } else { 0.0 };
        link.latency + bytes / (link.bandwidth * c.efficiency.link) + cores
    } else {
        0.0
    };
    let makespan;
    let mut busiest = 0usize;
    if layout.parallel.pp == 1 {
        let ct = &vs_time[0];
        makespan = m * (ct.forward() + ct.backward_input() + ct.backward_weight());
    } else if !exact
        && let Some(beta) = {
            // per-stage costs, averaged over the stages
            let p = layout.parallel.pp as f64;
            let (f, b, w) = vs_time.iter().fold((0.0, 0.0, 0.0), |acc, ct| {
                (
                    acc.0 + ct.forward() / p,
                    acc.1 + ct.backward_input() / p,
                    acc.2 + ct.backward_weight() / p,
                )
            });
            // ZB-V has no closed form: ZB-H2's bubble (both near zero
            // with W large enough) ranks it
            let kind = match layout.schedule() {
                ScheduleKind::ZbV => ScheduleKind::ZbH2,
                s => s,
            };
            kind.expected_bubble(layout.parallel.pp, m as usize, layout.chunks(), f, b, w)
        }
    {
        let busy: Vec<f64> = g
            .virtual_stages
            .iter()
            .map(|vss| {
                vss.iter()
                    .map(|&vs| {
                        let ct = &vs_time[vs];
                        m * (ct.forward() + ct.backward_input() + ct.backward_weight())
                    })
                    .sum()
            })
            .collect();
        let (r, most) = busy
            .iter()
            .copied()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        busiest = r;
        makespan = most / (1.0 - beta).max(1e-9) + 2.0 * (layout.parallel.pp - 1) as f64 * p2p;
    } else {
        let costs = Costs {
            chunks: vs_time
                .iter()
                .map(|ct| ChunkCost {
                    forward: ct.forward(),
                    backward_input: ct.backward_input(),
                    backward_weight: ct.backward_weight(),
                    activation: 1.0,
                    weight_grad_memory: 1.0,
                })
                .collect(),
            p2p_latency: p2p,
        };
        let timeline = weft_pipeline::simulate(&g.schedule, &costs)?;
        makespan = timeline.makespan();
        let mut most = 0.0;
        for r in 0..layout.parallel.pp {
            let b = timeline.busy(r);
            if b > most {
                most = b;
                busiest = r;
            }
        }
    }
    // the busiest stage's parts
    let mut t = StepTime::default();
    for &vs in &g.virtual_stages[busiest] {
        let ct = &vs_time[vs];
        t.compute += m * ct.compute();
        t.tp_comm += m * (ct.f_tp + ct.b_tp);
        t.ep_comm += m * (ct.f_ep + ct.b_ep);
        t.cp_comm += m * ct.cp_total;
        t.cp_exposed += m * (ct.f_cp + ct.b_cp);
        t.dp_comm += m * ct.dp_total;
        t.dp_exposed += m * (ct.f_dp + ct.b_dp);
        t.dp_cores += m * ct.dp_cores;
    }
    t.bubble =
        (makespan - t.compute - t.tp_comm - t.ep_comm - t.cp_exposed - t.dp_exposed).max(0.0);
    // once per step on every stage: the gradient reduction (overlapping
    // the last micro-batch's backward when the recipe does), the exposed
    // collectives, the optimizer; the step ends with the slowest stage
    let mut tail = 0.0f64;
    let mut tail_dp = (0.0, 0.0);
    let mut tail_opt = 0.0;
    // stages of the same chunks and backward window cost the same
    type Signature = (Vec<(usize, usize, bool, bool)>, f64);
    let mut done: Vec<Signature> = Vec::new();
    for (r, chunks) in g.stages.iter().enumerate() {
        let sig: Vec<(usize, usize, bool, bool)> = chunks
            .iter()
            .map(|c| (first(c), c.layers, c.embed, c.head))
            .collect();
        let window: f64 = g.virtual_stages[r]
            .iter()
            .map(|&vs| vs_time[vs].backward_input() + vs_time[vs].backward_weight())
            .sum();
        if done.iter().any(|(s, w)| *s == sig && *w == window) {
            continue;
        }
        done.push((sig, window));
        let (overlappable, exposed) = dp_step(&mach, model, layout, chunks);
        let hidden_part = if c.device == Device::Gpu
            && req.recipe.overlap_grad_reduce
            && layout.sharding() != Some(Strategy::Full)
        {
            overlappable.min(window)
        } else {
            0.0
        };
        let dp_exposed = overlappable - hidden_part + exposed;
        let muon = if req.recipe.muon {
            muon_time(&mach, model, layout, chunks)
        } else {
            (0.0, 0.0)
        };
        let opt = optimizer_time(&mach, model, layout, chunks) + muon.0;
        if dp_exposed + opt > tail {
            tail = dp_exposed + opt;
            tail_dp = (overlappable + exposed, dp_exposed);
            tail_opt = opt;
            (t.muon, t.muon_bytes) = muon;
        }
    }
    t.dp_comm += tail_dp.0;
    t.dp_exposed += tail_dp.1;
    t.optimizer = tail_opt;
    t.total = makespan + tail;
    t.bubble_fraction = if makespan > 0.0 {
        t.bubble / makespan
    } else {
        0.0
    };
    t.p2p = p2p;
    Ok(t)
}
