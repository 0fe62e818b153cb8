//! Step time: compute by a roofline per operation, collectives by the α–β
//! model over the cluster's hierarchy, what overlaps and what does not,
//! and the pipeline's bubble from `weft-pipeline`'s simulator.
//!
//! * **Compute.** Each operation of a block, the embedding and the head
//!   costs `max(FLOPs / (peak · η_gemm), bytes / (bandwidth · η_mem))`
//!   plus one launch overhead. A matrix product's bytes are its operands
//!   and result; the element-wise work of a block (layernorms, softmax,
//!   GELU, residual additions, dropout) moves twice the activation bytes
//!   the block keeps for its backward (each written once and read once)
//!   in the forward, and twice that in the backward. The backward's
//!   products are two per forward product: the input gradient (the `B` of
//!   split schedules) and the weight gradient (`W`). With recomputation the
//!   forward runs again inside the backward.
//! * **Collectives** (Hockney's α–β model; ring algorithms as in NCCL and
//!   weft's collectives; Thakur, Rabenseifner & Gropp 2005): an
//!   all-reduce of `S` bytes over `n` ranks costs `2(n−1)·α + 2(n−1)/n ·
//!   S/β`, a reduce-scatter or all-gather half of that; CPU ranks of one
//!   machine, 3 to 16 of them, pay α once per phase (weft's direct
//!   exchange: the ring's bytes in one step). A group spread
//!   over `k` nodes with `g` ranks in each runs hierarchically: a
//!   reduce-scatter inside the node, the all-reduce of the `S/g` shard
//!   between nodes (each GPU on its own network port), an all-gather
//!   inside the node. The mesh is `pp × dp × cp × tp` with `tp` innermost
//!   (Megatron-LM's and weft's order), so a tensor-parallel group is
//!   consecutive ranks, a context-parallel group strides over them, and
//!   the gradients sum over the data- and context-parallel ranks together.
//! * **Context parallelism's ring**: each rank computes on
//!   `T/cp` rows of each sequence (the attention's keys still reach over
//!   the whole sequence); per block, `cp − 1` steps pass key/value chunks
//!   on, in the forward and again in the backward with the key/value
//!   gradient parts, each step hidden behind its share of the attention
//!   where the exchange runs beside the compute.
//! * **Overlap.** Tensor- and expert-parallel collectives sit on the
//!   critical path (the layer waits for them). Pipeline transfers delay
//!   the next stage (the simulator's latency). On GPUs the data-parallel
//!   reduction overlaps the backward of the last micro-batch when the
//!   recipe says so, and FSDP's gathers are prefetched under the previous
//!   unit's compute (only what exceeds the compute is exposed); ZeRO-1/2's
//!   all-gather of updated parameters and the optimizer step are exposed.
//!   On CPU ranks nothing overlaps: a collective runs on the cores that
//!   compute. CPU ranks on nodes of one machine's network
//!   ([`Device::CpuNodes`]) overlap FSDP's collectives that span nodes as
//!   GPUs do (they wait on the link, not on the cores), and run them as
//!   one ring whose steps cross each node's link. Their bytes between
//!   nodes also take the machine's cores (the network is software on
//!   them, [`Cluster::network_cpu`]): that part delays the compute of
//!   every rank and hides behind nothing.
//! * **Bubble.** The per-micro-batch costs of every virtual stage go to
//!   [`weft_pipeline::simulate`] for the layout's schedule; its makespan is
//!   the pipeline's part of the step.

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, Device, Link};
use weft_parallel::Strategy;

use crate::layout::Layout;
use crate::memory::{Accounting, Chunk, Recipe};
use crate::model::ModelSpec;

/// Seconds of one training step, by part, on the busiest pipeline stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Arithmetic and memory traffic of the forward and backward passes
    /// (and recomputation) of every micro-batch.
    pub compute: f64,
    /// Tensor-parallel collectives (on the critical path).
    pub tp_comm: f64,
    /// Expert-parallel all-to-alls (on the critical path).
    pub ep_comm: f64,
    /// Context parallelism's ring (keys and values, and their gradients
    /// back to their owners), hidden or not.
    #[serde(default)]
    pub cp_comm: f64,
    /// The part of `cp_comm` not hidden behind the attention it feeds.
    #[serde(default)]
    pub cp_exposed: f64,
    /// Pipeline idle time: the bubble and the transfers between stages.
    pub bubble: f64,
    /// Data-parallel collectives in total (gradient reduction, FSDP's
    /// gathers), hidden or not.
    pub dp_comm: f64,
    /// The part of `dp_comm` not hidden behind compute.
    pub dp_exposed: f64,
    /// Of `dp_exposed`, what FSDP's bytes between CPU nodes take from the
    /// machine's cores ([`Cluster::network_cpu`]): it slows the compute
    /// rather than waiting on a link (a trace shows it as compute).
    #[serde(default)]
    pub dp_cores: f64,
    /// The optimizer step (and the gradient norm and zeroing; with Muon,
    /// its Newton–Schulz and exchange, `muon`).
    pub optimizer: f64,
    /// Of `optimizer`, Muon's Newton–Schulz and exchange
    /// ([`Recipe::muon`](crate::Recipe)).
    #[serde(default)]
    pub muon: f64,
    /// Bytes a rank sends per step in Muon's exchange (on average over
    /// the ranks of the busiest stage).
    #[serde(default)]
    pub muon_bytes: f64,
    /// The step: pipeline makespan + exposed data-parallel time + optimizer.
    pub total: f64,
    /// Idle fraction of the pipeline: `bubble / makespan`.
    pub bubble_fraction: f64,
    /// Seconds of one transfer between pipeline stages.
    pub p2p: f64,
}

/// Collective costs over a group of `n` ranks spread over nodes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    /// Ranks.
    pub n: usize,
    /// Ranks of the group on one node (`n` when it fits one node).
    pub per_node: usize,
}

impl Group {
    /// A group of `n` ranks whose members are `stride` ranks apart on a
    /// cluster with `per_node` ranks per node.
    pub(crate) fn strided(n: usize, stride: usize, per_node: usize) -> Group {
        let in_node = (per_node / stride.max(1)).max(1);
        Group {
            n,
            per_node: in_node.min(n).max(1),
        }
    }

    pub(crate) fn nodes(self) -> usize {
        self.n.div_ceil(self.per_node)
    }
}

/// `factor` ring phases over `n` ranks: `n − 1` steps of `bytes / n`
/// each, or — `direct` — the same bytes in one step (weft's direct
/// exchange inside one machine, see `weft_collectives::Algorithm::Ring`).
fn ring(n: usize, bytes: f64, link: Link, eff: f64, factor: f64, direct: bool) -> f64 {
    if n <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let nf = n as f64;
    let steps = if direct { 1.0 } else { nf - 1.0 };
    factor * (steps * link.latency + (nf - 1.0) / nf * bytes / (link.bandwidth * eff))
}

/// Whether `n` ranks inside one node exchange directly instead of in a
/// ring: CPU ranks of one machine, 3 to 16 of them (weft's collectives).
fn direct(c: &Cluster, n: usize) -> bool {
    c.device == Device::Cpu && (3..=16).contains(&n)
}

/// `factor` phases of one ring over a group `g` that spans nodes of
/// [`Device::CpuNodes`]: its `n − 1` steps each cross a node's link once
/// per direction, at the link's rate the group's ranks of a node have
/// between them (`inter` per rank).
fn ring_across(c: &Cluster, g: Group, bytes: f64, factor: f64) -> f64 {
    let link = Link {
        bandwidth: c.inter.bandwidth * g.per_node as f64,
        latency: c.inter.latency,
    };
    ring(g.n, bytes, link, c.efficiency.link, factor, false) + network_cpu(c, g, bytes, factor)
}

/// Seconds by which `factor` ring phases over `g` delay every rank of
/// [`Device::CpuNodes`] through the cores their bytes between nodes take
/// ([`Cluster::network_cpu`]): of the ring's `n` edges, one per node
/// crosses a link, each carrying `(n − 1)/n` of the bytes a phase, so a
/// rank sends on average `(n − 1)/n · nodes/n` of them across; every
/// rank of the job sends alike and shares the machine, which is busy for
/// all of their bytes. 0 inside a node or where a NIC moves the bytes.
pub(crate) fn network_cpu(c: &Cluster, g: Group, bytes: f64, factor: f64) -> f64 {
    if c.device != Device::CpuNodes || g.nodes() <= 1 || g.n <= 1 {
        return 0.0;
    }
    let n = g.n as f64;
    let per_rank = factor * (n - 1.0) / n * bytes * g.nodes() as f64 / n;
    per_rank * c.gpus as f64 * c.network_cpu
}

/// Seconds of an all-reduce of `bytes` over `g`.
pub(crate) fn all_reduce(c: &Cluster, g: Group, bytes: f64) -> f64 {
    let eff = c.efficiency.link;
    if g.nodes() <= 1 {
        return ring(g.n, bytes, c.intra, eff, 2.0, direct(c, g.n));
    }
    if c.device == Device::CpuNodes {
        return ring_across(c, g, bytes, 2.0);
    }
    let k = g.nodes();
    let p = g.per_node;
    ring(p, bytes, c.intra, eff, 1.0, direct(c, p))
        + ring(k, bytes / p as f64, c.inter, eff, 2.0, false)
        + ring(p, bytes, c.intra, eff, 1.0, direct(c, p))
}

/// Seconds of a reduce-scatter (or an all-gather) of `bytes` (the whole
/// buffer) over `g`.
pub(crate) fn reduce_scatter(c: &Cluster, g: Group, bytes: f64) -> f64 {
    let eff = c.efficiency.link;
    if g.nodes() <= 1 {
        return ring(g.n, bytes, c.intra, eff, 1.0, direct(c, g.n));
    }
    if c.device == Device::CpuNodes {
        return ring_across(c, g, bytes, 1.0);
    }
    let k = g.nodes();
    let p = g.per_node;
    ring(p, bytes, c.intra, eff, 1.0, direct(c, p))
        + ring(k, bytes / p as f64, c.inter, eff, 1.0, false)
}

/// Seconds of an all-to-all where each rank sends `bytes` in all (a
/// share `1/n` stays home).
pub(crate) fn all_to_all(c: &Cluster, g: Group, bytes: f64) -> f64 {
    if g.n <= 1 {
        return 0.0;
    }
    let nf = g.n as f64;
    let link = if g.nodes() > 1 { c.inter } else { c.intra };
    (nf - 1.0) * link.latency + (nf - 1.0) / nf * bytes / (link.bandwidth * c.efficiency.link)
}

/// Costs of one micro-batch on one virtual stage, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ChunkTime {
    /// Forward compute.
    pub f_compute: f64,
    /// Input-gradient half of the backward (and recomputation), compute.
    pub b_compute: f64,
    /// Weight-gradient half, compute.
    pub w_compute: f64,
    /// Tensor-parallel collectives of forward and backward.
    pub f_tp: f64,
    /// Of the backward.
    pub b_tp: f64,
    /// Expert all-to-alls, forward.
    pub f_ep: f64,
    /// Backward.
    pub b_ep: f64,
    /// The context-parallel ring's exposed time, forward.
    pub f_cp: f64,
    /// Backward.
    pub b_cp: f64,
    /// The ring's time in total (exposed or hidden).
    pub cp_total: f64,
    /// FSDP's exposed per-micro-batch communication, forward.
    pub f_dp: f64,
    /// Backward.
    pub b_dp: f64,
    /// FSDP's per-micro-batch communication in total (exposed or hidden).
    pub dp_total: f64,
    /// Of `f_dp + b_dp`, the cores' part ([`network_cpu`]).
    pub dp_cores: f64,
}

impl ChunkTime {
    pub(crate) fn forward(&self) -> f64 {
        self.f_compute + self.f_tp + self.f_ep + self.f_cp + self.f_dp
    }
    pub(crate) fn backward_input(&self) -> f64 {
        self.b_compute + self.b_tp + self.b_ep + self.b_cp + self.b_dp
    }
    pub(crate) fn backward_weight(&self) -> f64 {
        self.w_compute
    }
    pub(crate) fn compute(&self) -> f64 {
        self.f_compute + self.b_compute + self.w_compute
    }
}

/// The cost model's view of one rank: its peak and bandwidth (CPU ranks
/// share the machine's), and the recipe.
pub(crate) struct Machine<'a> {
    pub cluster: &'a Cluster,
    pub recipe: &'a Recipe,
    /// FLOP/s one rank reaches in large products.
    pub flops: f64,
    /// Bytes/s of one rank's memory traffic.
    pub bandwidth: f64,
}

impl<'a> Machine<'a> {
    pub(crate) fn new(cluster: &'a Cluster, recipe: &'a Recipe) -> Self {
        // CPU ranks split the machine's cores and memory bandwidth
        let share = if cluster.device.shares_machine() {
            cluster.gpus.max(1) as f64
        } else {
            1.0
        };
        Machine {
            cluster,
            recipe,
            flops: cluster.peak.of(recipe.precision) * cluster.efficiency.gemm / share,
            bandwidth: cluster.memory_bandwidth * cluster.efficiency.memory / share,
        }
    }

    /// A product `(m, k) × (k, n)`.
    fn gemm(&self, m: f64, k: f64, n: f64) -> f64 {
        let dt = self.recipe.activation_bytes() as f64;
        let flops = 2.0 * m * k * n;
        let bytes = dt * (m * k + k * n + m * n);
        (flops / self.flops).max(bytes / self.bandwidth) + self.cluster.launch_overhead
    }

    /// Element-wise work moving `bytes`, in `ops` kernels.
    fn memory(&self, bytes: f64, ops: f64) -> f64 {
        bytes / self.bandwidth + ops * self.cluster.launch_overhead
    }

    /// Products of `flops` that run at the machine's rate (attention).
    fn flops_time(&self, flops: f64) -> f64 {
        flops / self.flops + self.cluster.launch_overhead
    }
}

/// Keys per query whose scores layer `layer` computes: the causal blocks
/// of 128 rows under flash attention (and of 64 for weft's CPU kernel) of
/// a global layer, all `T` when the scores are materialized on GPUs
/// (Megatron-LM 2021's softmax path, masked windows included); through a
/// sliding window of W, the `W − W²/(2T)` keys a query sees on average
/// ([`weft_pipeline::attended_keys`]).
fn attended_keys(model: &ModelSpec, recipe: &Recipe, layer: usize) -> f64 {
    let t = model.seq as f64;
    let causal = |block: usize| {
        let nb = model.seq.div_ceil(block) as f64;
        t * (nb * (nb + 1.0) / 2.0) / (nb * nb)
    };
    let materialized = recipe.accounting == Accounting::Mixed && !recipe.flash_attention;
    match model.window_of(layer) {
        _ if materialized => t,
        Some(w) if w < model.seq => weft_pipeline::attended_keys(model.seq, Some(w)),
        _ if recipe.accounting == Accounting::Mixed => causal(128),
        _ => causal(64),
    }
}

/// Bytes a block keeps for its backward per micro-batch on one rank (the
/// basis of its element-wise traffic), for block `layer`.
pub(crate) fn block_activation_bytes(
    model: &ModelSpec,
    layout: &Layout,
    recipe: &Recipe,
    layer: usize,
) -> f64 {
    let probe = Chunk {
        first: layer,
        layers: 1,
        embed: false,
        head: false,
        slots: 1,
    };
    let empty = Chunk { layers: 0, ..probe };
    let mut no_recompute = Layout {
        recompute: weft_parallel::Recompute::None,
        ..*layout
    };
    no_recompute.parallel.fsdp = None;
    no_recompute.parallel.pp = 1;
    let one = crate::memory::stage_memory(model, &no_recompute, recipe, &[probe]);
    let zero = crate::memory::stage_memory(model, &no_recompute, recipe, &[empty]);
    (one.activations - zero.activations) as f64
}

/// Per-micro-batch costs of a chunk of `chunk.layers` blocks from
/// `chunk.first` (with the embedding and the head when it holds them);
/// `act(l)`: [`block_activation_bytes`] of block `l`.
pub(crate) fn chunk_time(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    chunk: &Chunk,
    act: &dyn Fn(usize) -> f64,
) -> ChunkTime {
    let c = mach.cluster;
    let recipe = mach.recipe;
    let dt = recipe.activation_bytes() as f64;
    // a rank's rows of each sequence under context parallelism
    let (b, s) = (
        layout.micro_batch_size as f64,
        crate::memory::rank_seq(model, layout) as f64,
    );
    let n = b * s;
    let h = model.hidden as f64;
    let t = layout.parallel.tp as f64;
    let (q, kv) = (model.q_dim() as f64, model.kv_dim() as f64);
    let tp_group = Group::strided(layout.parallel.tp, 1, c.gpus_per_node);
    // gate and up (SwiGLU) or c_fc, then down (c_proj)
    let ffn = |rows: f64, f: f64| {
        (model.ffn_matrices() - 1) as f64 * mach.gemm(rows, h, f) + mach.gemm(rows, f, h)
    };

    // the block's collectives: two all-reduces (or reduce-scatter and
    // all-gather pairs, the same volume) per pass over tp
    let tp_bytes = n * h * dt;
    let tp_f = if layout.parallel.tp > 1 {
        2.0 * all_reduce(c, tp_group, tp_bytes)
    } else {
        0.0
    };
    let ep_group = Group::strided(layout.parallel.ep, layout.parallel.tp, c.gpus_per_node);
    let ep_f = if layout.parallel.ep > 1 {
        // dispatch and combine of each token's k copies
        2.0 * all_to_all(c, ep_group, n * model.top_k as f64 * h * dt)
    } else {
        0.0
    };
    // weft recomputes the experts' hidden activations (one more dispatch)
    // in the backward under expert parallelism
    let ep_b = ep_f
        * if recipe.accounting == Accounting::Weft {
            1.5
        } else {
            1.0
        };
    let attention_backward = if recipe.flash_attention { 2.5 } else { 2.0 };
    let split = layout.schedule().splits_backward() && layout.parallel.pp > 1;

    let mut ct = ChunkTime::default();
    // the ring's (and the attention's) cost depends on a block only
    // through its window: computed once for each window of the chunk
    let mut rings: Vec<(Option<usize>, f64, RingTime)> = Vec::new();
    for l in chunk.blocks() {
        // one block, forward: products (Q, K and V at their widths; the
        // output projection)
        let mut gemm_f = mach.gemm(n, h, (q + 2.0 * kv) / t) + mach.gemm(n, q / t, h);
        let moe = model.is_moe_layer(l);
        if moe {
            let (e, k) = (model.experts as f64, model.top_k as f64);
            let ep = layout.parallel.ep as f64;
            let fe = model.expert_width() as f64;
            // the router, then each local expert's products over the
            // tokens routed to it from every rank of its group (n·k·ep/E,
            // balanced), and the shared experts' over every token
            gemm_f += mach.gemm(n, h, e);
            let routed = n * k * ep / e;
            gemm_f += (e / ep) * ffn(routed, fe);
            gemm_f += model.shared_experts as f64 * ffn(n, fe);
        } else {
            gemm_f += ffn(n, model.ffn_hidden as f64 / t);
        }
        let window = model.window_of(l);
        let (attention, ring) = match rings.iter().find(|r| r.0 == window) {
            Some(&(_, attention, ring)) => (attention, ring),
            None => {
                let attention = mach.flops_time(4.0 * n * attended_keys(model, recipe, l) * q / t);
                let ring = ring_time(
                    mach,
                    model,
                    layout,
                    l,
                    (attention, attention_backward * attention),
                );
                rings.push((window, attention, ring));
                (attention, ring)
            }
        };
        let elem_f = mach.memory(2.0 * act(l), 10.0);
        let (ep_f, ep_b) = if moe { (ep_f, ep_b) } else { (0.0, 0.0) };
        let block_fwd = gemm_f + attention + elem_f;
        ct.f_compute += block_fwd;
        // input gradients of the products, the attention's backward (with
        // the scores recomputed under flash attention), the element-wise
        // backward
        ct.b_compute += gemm_f + attention_backward * attention + 2.0 * elem_f;
        ct.f_cp += ring.forward_exposed;
        ct.b_cp += ring.backward_exposed;
        ct.cp_total += ring.total;
        // weight gradients
        ct.w_compute += gemm_f;
        ct.f_tp += tp_f;
        ct.b_tp += tp_f;
        ct.f_ep += ep_f;
        ct.b_ep += ep_b;
        if layout.recompute.selective() && !moe {
            // a dense block's activation function again (reading its
            // input, writing its output)
            let hid = model.ffn_hidden as f64 / t;
            let act_fn = n * hid * if model.swiglu { 3.0 } else { 2.0 } * dt;
            ct.b_compute += mach.memory(act_fn, 1.0);
        }
        if layout.recompute.recomputes(l) {
            // the forward again before the backward; weft's split
            // backward (zero-bubble schedules) runs it before each half
            // (its communication counted with the input half's)
            ct.b_compute += block_fwd;
            ct.b_tp += tp_f;
            ct.b_ep += ep_f;
            if split {
                ct.w_compute += block_fwd;
                ct.b_tp += tp_f;
                ct.b_ep += ep_f;
            }
        }
    }
    let v_loc = model.vocab.div_ceil(layout.parallel.tp) as f64;
    if chunk.embed {
        // gather rows of wte and wpe, write the sum; the backward scatters
        ct.f_compute += mach.memory(3.0 * n * h * dt, 1.0);
        ct.w_compute += mach.memory(3.0 * n * h * 4.0, 1.0);
        if layout.parallel.tp > 1 {
            // the vocabulary-parallel lookup is summed over tp
            ct.f_tp += all_reduce(c, tp_group, tp_bytes);
        }
    }
    if chunk.head {
        let logits = mach.gemm(n, h, v_loc);
        // layernorm, softmax and cross-entropy over the logits
        let elem = mach.memory(2.0 * n * h * dt + 3.0 * n * v_loc * 4.0, 3.0);
        ct.f_compute += logits + elem;
        ct.b_compute += logits + elem;
        ct.w_compute += logits;
        if layout.loss_chunk > 0 && (layout.loss_chunk as f64) < n {
            // chunks keep no logits: the backward computes them again
            ct.b_compute += logits;
        }
        if layout.parallel.tp > 1 {
            // the vocabulary-parallel loss: maxima, sums and the targets'
            // logits of every token
            ct.f_tp += 3.0 * all_reduce(c, tp_group, 4.0 * n);
            ct.b_tp += all_reduce(c, tp_group, tp_bytes);
        }
    }
    ct
}

/// Context parallelism's ring for one block and micro-batch
/// ([`ring_time`]), in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RingTime {
    /// Every exchange of the forward and the backward.
    pub total: f64,
    /// What the forward's attention waits for.
    pub forward_exposed: f64,
    /// What the backward's waits for.
    pub backward_exposed: f64,
}

/// The ring of block `layer` on the busiest rank of a context-parallel
/// group: at each of `cp − 1` steps the key/value chunks a later rank
/// still reads ([`weft_parallel::ContextChunks::sent`]: `2·Ckv` of a rank's
/// kv heads a row, in the activations' dtype) go to the next rank, one
/// message of the link between the group's ranks; the backward sends them
/// again with the key/value gradient parts of the step before (f32, to
/// their owners), and the last step's parts while the rank computes the
/// diagonal of its later chunk, kept for last (a quarter of a chunk pair
/// of the `2·cp` pairs' work a rank has: `1/(4·cp)` of its attention). A
/// step's exchange hides behind that step's attention (`attention.0`
/// forward, `attention.1` backward, spread evenly over the `cp` steps)
/// where the exchange runs beside the compute — on GPUs and across CPU
/// nodes; CPU ranks of one machine copy on the cores that compute, so
/// nothing hides.
pub(crate) fn ring_time(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    layer: usize,
    attention: (f64, f64),
) -> RingTime {
    let cp = layout.parallel.cp;
    if cp <= 1 {
        return RingTime::default();
    }
    let c = mach.cluster;
    let len = model.seq / (2 * cp);
    let chunks = weft_parallel::ContextChunks {
        cp,
        len,
        window: model.window_of(layer).filter(|&w| w < model.seq),
    };
    let rows = (layout.micro_batch_size * len) as f64;
    let kv = rows * 2.0 * model.kv_dim_per_rank(layout.parallel.tp) as f64;
    let (kv_bytes, grad_bytes) = (kv * mach.recipe.activation_bytes() as f64, kv * 4.0);
    let group = Group::strided(cp, layout.parallel.tp, c.gpus_per_node);
    let link = if group.nodes() > 1 { c.inter } else { c.intra };
    let send = |bytes: f64| {
        if bytes > 0.0 {
            link.latency + bytes / (link.bandwidth * c.efficiency.link)
        } else {
            0.0
        }
    };
    let overlaps = c.device != Device::Cpu;
    let cpf = cp as f64;
    let diagonal = attention.1 / (4.0 * cpf);
    let (f_step, b_step) = (attention.0 / cpf, (attention.1 - diagonal) / cpf);
    let hide = |x: f64, behind: f64| if overlaps { (x - behind).max(0.0) } else { x };
    let mut worst = RingTime::default();
    for me in 0..cp {
        let mut r = RingTime::default();
        for step in 0..cp {
            let n = chunks.sent(me, step).iter().filter(|&&s| s).count() as f64;
            let f = send(n * kv_bytes);
            // the kv again, with the gradient parts of the step before
            let b = send(
                n * kv_bytes + chunks.grad_parts(me, step.saturating_sub(1)) as f64 * grad_bytes,
            );
            r.total += f + b;
            r.forward_exposed += hide(f, f_step);
            r.backward_exposed += hide(b, b_step);
        }
        // the last step's gradient parts, behind the deferred diagonal
        let last = send(chunks.grad_parts(me, cp - 1) as f64 * grad_bytes);
        r.total += last;
        r.backward_exposed += hide(last, diagonal);
        if r.forward_exposed + r.backward_exposed > worst.forward_exposed + worst.backward_exposed
            || me == 0
        {
            worst = r;
        }
    }
    worst
}

/// Parameters of each kind on one rank of a stage holding `chunks`:
/// `(dense, experts)` (expert parameters reduce over `dp/ep`).
pub(crate) fn stage_params(model: &ModelSpec, layout: &Layout, chunks: &[Chunk]) -> (f64, f64) {
    let shares = crate::memory::Shares::of(model, layout);
    let mut total = 0.0;
    let mut moe_layers = 0.0;
    for ch in chunks {
        total += shares.units(ch).iter().sum::<u64>() as f64;
        moe_layers += ch.blocks().filter(|&l| model.is_moe_layer(l)).count() as f64;
    }
    let experts = moe_layers * (model.experts / layout.parallel.ep) as f64 * model.expert_params();
    (total - experts, experts)
}

/// FSDP's per-micro-batch communication of one chunk: the forward's and
/// backward's seconds in total (gathers, and the gradients'
/// reduce-scatter in the backward), and the part of each that takes the
/// cores.
pub(crate) fn fsdp_per_microbatch(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    chunk: &Chunk,
) -> FsdpTime {
    let c = mach.cluster;
    let recipe = mach.recipe;
    let shares = crate::memory::Shares::of(model, layout);
    let n = layout.shard_group();
    let group = Group::strided(n, layout.parallel.tp, c.gpus_per_node);
    let pb = recipe.param_bytes() as f64;
    let gb = recipe.grad_wire_bytes() as f64;
    let mut t = FsdpTime::default();
    // each unit is a collective of its own: its latency is paid per unit
    for &unit in &shares.units(chunk) {
        let unit = unit as f64;
        if layout.shards_params() {
            t.forward += reduce_scatter(c, group, unit * pb);
            t.backward += reduce_scatter(c, group, unit * pb);
            t.forward_cpu += network_cpu(c, group, unit * pb, 1.0);
            t.backward_cpu += network_cpu(c, group, unit * pb, 1.0);
        }
        if layout.shards_grads() {
            t.backward += reduce_scatter(c, group, unit * gb);
            t.backward_cpu += network_cpu(c, group, unit * gb, 1.0);
        }
    }
    t
}

/// FSDP's collectives of one micro-batch on one virtual stage, in
/// seconds ([`fsdp_per_microbatch`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FsdpTime {
    /// The forward's gathers, all of their time.
    pub forward: f64,
    /// The backward's gathers and reduce-scatters.
    pub backward: f64,
    /// Of `forward`, the cores' part ([`network_cpu`]): it overlaps
    /// nothing.
    pub forward_cpu: f64,
    /// Of `backward`.
    pub backward_cpu: f64,
}

/// Data-parallel communication once per step for a stage's parameters:
/// `(reduction that may overlap the last backward, exposed part)`.
pub(crate) fn dp_step(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    chunks: &[Chunk],
) -> (f64, f64) {
    let c = mach.cluster;
    let recipe = mach.recipe;
    let (dense, experts) = stage_params(model, layout, chunks);
    let gb = recipe.grad_wire_bytes() as f64;
    let pb = recipe.param_bytes() as f64;
    // gradients sum over the data-parallel ranks with the context-parallel
    // ones (cp innermost after tp)
    let cp = layout.parallel.cp.max(1);
    let dp = Group::strided(layout.parallel.dp * cp, layout.parallel.tp, c.gpus_per_node);
    let edp = Group::strided(
        layout.parallel.dp / layout.parallel.ep * cp,
        layout.parallel.tp,
        c.gpus_per_node,
    );
    let n = layout.shard_group();
    let shard = Group::strided(n, layout.parallel.tp, c.gpus_per_node);
    match layout.sharding() {
        None => (
            all_reduce(c, dp, dense * gb) + all_reduce(c, edp, experts * gb),
            0.0,
        ),
        Some(Strategy::Optimizer) => (
            reduce_scatter(c, shard, (dense + experts) * gb),
            reduce_scatter(c, shard, (dense + experts) * pb),
        ),
        Some(Strategy::GradOp) => (0.0, reduce_scatter(c, shard, (dense + experts) * pb)),
        Some(Strategy::Full) => (0.0, 0.0),
        Some(Strategy::Hybrid) => {
            let s = layout.parallel.hybrid_shard;
            let replicas = Group::strided(
                layout.parallel.dp / layout.parallel.ep * cp / s,
                layout.parallel.tp * s,
                c.gpus_per_node,
            );
            (
                all_reduce(c, replicas, (dense + experts) / s as f64 * gb),
                0.0,
            )
        }
    }
}

/// Muon's part of a stage's optimizer step (`Recipe::muon`):
/// `(seconds, bytes a rank sends)`. Newton–Schulz (five iterations of
/// `4·m²·k + 2·m³` FLOPs on each `m × k` matrix, `m ≤ k`) of the
/// stage's hidden matrices — Q, K, V, O and the feed-forward ones, each
/// expert's — shared by the `g` ranks of the stage; and two all-to-alls
/// over them: each matrix of `M` elements, cut into `s` pieces (tensor
/// parallelism, the optimizer shards), gathers `4·M·(s − 1)/s` bytes to
/// its owner and scatters `4·M·(h − 1)/s` back to its `h` holders —
/// exact where the pieces are tensor-parallel slices or replicas; under
/// FSDP an upper bound, the shards being contiguous runs of the layout
/// (a matrix inside one rank's shard is orthogonalised there and moves
/// nothing).
pub(crate) fn muon_time(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    chunks: &[Chunk],
) -> (f64, f64) {
    let p = &layout.parallel;
    let c = model.hidden as f64;
    let (q, kv) = (model.q_dim() as f64, model.kv_dim() as f64);
    let ns = |m: f64, k: f64| {
        let (m, k) = (m.min(k), m.max(k));
        5.0 * (4.0 * m * m * k + 2.0 * m * m * m)
    };
    let mlp = |f: f64| {
        let n = if model.swiglu { 3.0 } else { 2.0 };
        (n * ns(c, f), n * c * f)
    };
    // (flops, elements) of the stage's dense and expert matrices
    let (mut dense, mut experts) = ((0.0, 0.0), (0.0, 0.0));
    for ch in chunks {
        for l in ch.blocks() {
            dense.0 += ns(c, q) + 2.0 * ns(c, kv) + ns(q, c);
            dense.1 += 2.0 * c * q + 2.0 * c * kv;
            if model.is_moe_layer(l) {
                let (f, e) = mlp(model.expert_width() as f64);
                let n = (model.experts + model.shared_experts) as f64;
                experts.0 += n * f;
                experts.1 += n * e;
            } else {
                let (f, e) = mlp(model.ffn_hidden as f64);
                dense.0 += f;
                dense.1 += e;
            }
        }
    }
    let g = (p.dp * p.cp.max(1) * p.tp) as f64;
    let shards = if layout.sharding().is_some() {
        layout.shard_group() as f64
    } else {
        1.0
    };
    // dense matrices: cut over tp and the shards, held by every rank;
    // experts: whole over tp, each held by the ranks of its expert group
    let moved = |elems: f64, s: f64, h: f64| 4.0 * elems * ((s - 1.0) + (h - 1.0)) / s;
    let bytes = (moved(dense.1, p.tp as f64 * shards, g)
        + moved(experts.1, shards, g / p.ep.max(1) as f64))
        / g;
    let group = Group::strided(p.dp * p.cp.max(1) * p.tp, 1, mach.cluster.gpus_per_node);
    let flops = (dense.0 + experts.0) / g;
    let secs = flops / mach.flops + 2.0 * all_to_all(mach.cluster, group, bytes / 2.0);
    (secs, bytes)
}

/// The optimizer step of a stage: AdamW over the parameters the rank
/// updates (its shard under ZeRO), the gradient norm and zeroing.
pub(crate) fn optimizer_time(
    mach: &Machine<'_>,
    model: &ModelSpec,
    layout: &Layout,
    chunks: &[Chunk],
) -> f64 {
    let (dense, experts) = stage_params(model, layout, chunks);
    let p = dense + experts;
    let updated = match layout.sharding() {
        None => p,
        _ => p / layout.shard_group() as f64,
    };
    // AdamW reads parameter, gradient and two moments and writes three
    // (28 bytes in f32 state); the norm reads the gradients, zeroing
    // writes them
    let bytes = match mach.recipe.accounting {
        Accounting::Weft => 36.0,
        Accounting::Mixed => 32.0,
    };
    mach.memory(bytes * updated, 3.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-rank all-reduce inside one node: GPUs (NCCL's ring) pay the
    /// per-message latency 2(n − 1) times, CPU ranks (weft's direct
    /// exchange) twice; the bandwidth term is the ring's either way.
    #[test]
    fn cpu_ranks_pay_latency_once_per_phase() {
        let gpu = Cluster::preset("h100", 8).unwrap();
        let cpu = Cluster {
            device: Device::Cpu,
            ..gpu.clone()
        };
        let g = Group { n: 4, per_node: 4 };
        let s = 64e6;
        let (a, b, e) = (gpu.intra.latency, gpu.intra.bandwidth, gpu.efficiency.link);
        let bw = 2.0 * 3.0 / 4.0 * s / (b * e);
        assert!((all_reduce(&gpu, g, s) - (6.0 * a + bw)).abs() < 1e-12);
        assert!((all_reduce(&cpu, g, s) - (2.0 * a + bw)).abs() < 1e-12);
        assert!((reduce_scatter(&cpu, g, s) - (a + bw / 2.0)).abs() < 1e-12);
        // two ranks: one step either way
        let two = Group { n: 2, per_node: 2 };
        assert!((all_reduce(&cpu, two, s) - all_reduce(&gpu, two, s)).abs() < 1e-12);
    }

    /// CPU nodes: a group over 2 nodes of 2 ranks runs one ring whose 3
    /// steps each cross a node's link (2 ranks' shares of it) with `S/4`:
    /// an all-reduce moves `2 · 3/4 · S` over the link, half again the
    /// hierarchical form's `2 · 1/2 · S`; inside a node, as CPU ranks.
    #[test]
    fn cpu_nodes_run_one_ring_across_the_nodes_links() {
        let gpu = Cluster::preset("h100", 8).unwrap();
        let nodes = Cluster {
            device: Device::CpuNodes,
            gpus: 4,
            gpus_per_node: 2,
            inter: Link {
                bandwidth: 60e6,
                latency: 20e-6,
            },
            ..gpu.clone()
        };
        let g = Group { n: 4, per_node: 2 };
        let s = 64e6;
        let (a, e) = (nodes.inter.latency, nodes.efficiency.link);
        let link = 2.0 * nodes.inter.bandwidth * e;
        let ar = 2.0 * (3.0 * a + 3.0 / 4.0 * s / link);
        assert!((all_reduce(&nodes, g, s) - ar).abs() < 1e-12);
        assert!((reduce_scatter(&nodes, g, s) - ar / 2.0).abs() < 1e-12);
        let hier = Cluster {
            device: Device::Gpu,
            ..nodes.clone()
        };
        assert!(all_reduce(&nodes, g, s) > all_reduce(&hier, g, s));
        // one rank per node: the whole link
        let across = Group { n: 2, per_node: 1 };
        let one = 2.0 * (a + s / 2.0 / (nodes.inter.bandwidth * e));
        assert!((all_reduce(&nodes, across, s) - one).abs() < 1e-12);
        // inside a node: as CPU ranks of one machine
        let cpu = Cluster {
            device: Device::Cpu,
            ..nodes.clone()
        };
        let inside = Group { n: 2, per_node: 2 };
        assert_eq!(all_reduce(&nodes, inside, s), all_reduce(&cpu, inside, s));
    }

    /// CPU nodes whose network takes the machine's cores: a ring over 2
    /// nodes of 2 ranks has 2 of its 4 edges across, each carrying 3/4 of
    /// the bytes a phase; the job's 4 ranks send alike, so the machine is
    /// busy `4 · 3/4 · 2/4 · S · c` a phase and every rank waits that out
    /// on top of the link's time. Inside a node, and on GPUs, nothing.
    #[test]
    fn cpu_nodes_pay_the_network_s_cores() {
        let gpu = Cluster::preset("h100", 8).unwrap();
        let free = Cluster {
            device: Device::CpuNodes,
            gpus: 4,
            gpus_per_node: 2,
            ..gpu.clone()
        };
        let busy = Cluster {
            network_cpu: 4e-9,
            ..free.clone()
        };
        let g = Group { n: 4, per_node: 2 };
        let s = 64e6;
        let cores = 4.0 * 3.0 / 4.0 * 2.0 / 4.0 * s * 4e-9;
        assert!((network_cpu(&busy, g, s, 1.0) - cores).abs() < 1e-12);
        assert!((reduce_scatter(&busy, g, s) - reduce_scatter(&free, g, s) - cores).abs() < 1e-12);
        assert!((all_reduce(&busy, g, s) - all_reduce(&free, g, s) - 2.0 * cores).abs() < 1e-12);
        assert_eq!(network_cpu(&busy, Group { n: 2, per_node: 2 }, s, 1.0), 0.0);
        let gpus = Cluster {
            device: Device::Gpu,
            ..busy.clone()
        };
        assert_eq!(network_cpu(&gpus, g, s, 1.0), 0.0);
    }
}
