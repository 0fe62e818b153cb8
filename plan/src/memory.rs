//! Memory per GPU, by category, for a layout under a [`Recipe`].
//!
//! Two accountings:
//!
//! * [`Accounting::Weft`] — what weft allocates today, counted the way its
//!   start-up report counts it (`weft_model::ParallelGpt::predict_memory`,
//!   equal to what the built model holds): f32 parameters, gradients and
//!   AdamW moments (16 bytes per parameter) plus the gradient reducer's
//!   f32 buckets (4 more) for replicas; FSDP's padded unit shards (an f32
//!   shard is its own master copy, so 12 bytes per sharded parameter under
//!   ZeRO-3); every activation buffer the blocks plan, in f32 (the
//!   attention keeps each row's log-sum-exp, not its `T` probabilities),
//!   for as many micro-batches as
//!   the pipeline schedule keeps in flight on the stage (a
//!   context-parallel rank's `T/cp` rows of each sequence, and the whole
//!   sequences' tokens); the shared working
//!   buffers; the tied embedding's copy and exchange between the first and
//!   last stages. The transient buffers of a step (FSDP's gathered units,
//!   pipeline messages, collective scratch) are not counted, as weft's
//!   report does not count them.
//! * [`Accounting::Mixed`] — mixed precision on GPUs as Megatron-LM and
//!   PyTorch FSDP run it: bf16 parameters and gradients, an f32 master
//!   copy and two f32 AdamW moments (2 + 2 + 12 = 16 bytes per parameter;
//!   ZeRO shards the 12, then the 2 of the gradients, then the 2 of the
//!   parameters); activations in 16 bits as Korthikanti et al. (2022,
//!   "Reducing Activation Recomputation in Large Transformer Models",
//!   Table 2) count them per layer and micro-batch: `s·b·h·(34 + 5·a·s/h)`
//!   bytes without parallelism, `s·b·h·(10 + 24/t + 5·a·s/(h·t))` with
//!   tensor parallelism `t`, `s·b·h/t·(34 + 5·a·s/h)` with sequence
//!   parallelism too, `2·s·b·h` (÷`t` with sequence parallelism) with full
//!   recomputation; without the `5·a·s/h` of the attention scores under
//!   fused (flash) attention; plus the logits (bf16 and f32) on the last stage; the
//!   buffers: FSDP's two gathered units (the one computing and the one
//!   prefetched) and the pipeline's send and receive buffers.

use std::fmt;
use std::ops::AddAssign;

use serde::{Deserialize, Serialize};

use crate::cluster::Precision;
use weft_parallel::Strategy;

use crate::layout::Layout;
use crate::model::ModelSpec;

/// Bytes one GPU holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Parameters (the compute copy, or the shard; a last stage's copy of a
    /// tied embedding).
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state: AdamW's moments and any master copy.
    pub optimizer: u64,
    /// Activations kept for the backward, for the micro-batches in flight,
    /// and the working buffers.
    pub activations: u64,
    /// Buffers for communication (gradient buckets, gathered FSDP units,
    /// pipeline messages, the tied embedding's exchange).
    pub buffers: u64,
}

impl Memory {
    /// All categories together.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.buffers
    }

    /// The categories with their names, in report order.
    #[must_use]
    pub fn categories(&self) -> [(&'static str, u64); 5] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("buffers", self.buffers),
        ]
    }

    /// The largest category's name.
    #[must_use]
    pub fn largest(&self) -> &'static str {
        self.categories()
            .into_iter()
            .max_by_key(|&(_, b)| b)
            .map_or("params", |(n, _)| n)
    }
}

impl AddAssign for Memory {
    fn add_assign(&mut self, o: Memory) {
        self.params += o.params;
        self.grads += o.grads;
        self.optimizer += o.optimizer;
        self.activations += o.activations;
        self.buffers += o.buffers;
    }
}

impl fmt::Display for Memory {
    /// `params 1.2 GiB, grads ..., total ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, b) in self.categories() {
            write!(f, "{name} {}, ", bytes(b))?;
        }
        write!(f, "total {}", bytes(self.total()))
    }
}

/// `b` bytes in GiB, MiB or KiB.
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn bytes(b: u64) -> String {
    let x = b as f64;
    const K: f64 = 1024.0;
    if x >= K * K * K {
        format!("{:.2} GiB", x / (K * K * K))
    } else if x >= K * K {
        format!("{:.1} MiB", x / (K * K))
    } else {
        format!("{:.1} KiB", x / K)
    }
}

/// How memory is counted and what the arithmetic is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accounting {
    /// What weft allocates today (see the [module docs](self)).
    Weft,
    /// Mixed precision on GPUs (see the [module docs](self)).
    #[default]
    Mixed,
}

/// What the ranks hold and compute, and how the framework behaves: weft's
/// own run, or mixed precision on GPUs as Megatron-LM and PyTorch FSDP run
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Recipe {
    /// How memory is counted.
    pub accounting: Accounting,
    /// The arithmetic of the matrix products (the peak they run at).
    pub precision: Precision,
    /// Data-parallel gradients travel in bf16 (weft's
    /// `parallel.grad_wire = "bf16"`; always so under [`Accounting::Mixed`]).
    pub bf16_grad_wire: bool,
    /// The data-parallel gradient reduction overlaps the backward of the
    /// last micro-batch (PyTorch DDP, FSDP, Megatron-LM's
    /// `--overlap-grad-reduce`); off: it runs after the backward
    /// (Megatron-LM 2021's `--DDP-impl local`). Never on CPU ranks.
    pub overlap_grad_reduce: bool,
    /// Fused attention that never writes the `T×T` scores (FlashAttention,
    /// Dao et al. 2022): their `5·a·s²·b` bytes of activations and their
    /// memory traffic go, the masked half of the causal products is
    /// skipped, and the backward recomputes the scores (2.5× the forward's
    /// products instead of 2×), as weft's CPU kernel does. Off: the scores
    /// are materialized (Megatron-LM 2021).
    pub flash_attention: bool,
    /// Muon for the hidden matrices (`optim.name = "muon"`): the optimizer
    /// step adds Newton–Schulz on whole matrices, shared by the ranks of a
    /// stage, and the exchange that gathers each matrix to the rank that
    /// orthogonalises it and scatters the update back.
    #[serde(default)]
    pub muon: bool,
}

impl Recipe {
    /// weft's run in `precision` (`train.precision`), f32 gradients on the
    /// wire.
    #[must_use]
    pub fn weft(precision: Precision) -> Self {
        Recipe {
            accounting: Accounting::Weft,
            precision,
            bf16_grad_wire: false,
            overlap_grad_reduce: false,
            flash_attention: true,
            muon: false,
        }
    }

    /// bf16 mixed precision on GPUs, the gradient reduction overlapped,
    /// fused (flash) attention.
    #[must_use]
    pub fn mixed() -> Self {
        Recipe {
            accounting: Accounting::Mixed,
            precision: Precision::Bf16,
            bf16_grad_wire: true,
            overlap_grad_reduce: true,
            flash_attention: true,
            muon: false,
        }
    }

    /// Bytes of an activation element.
    #[must_use]
    pub fn activation_bytes(&self) -> u64 {
        match self.accounting {
            Accounting::Weft => 4,
            Accounting::Mixed => 2,
        }
    }

    /// Bytes of a gradient element on the data-parallel wire.
    #[must_use]
    pub fn grad_wire_bytes(&self) -> u64 {
        if self.bf16_grad_wire || self.accounting == Accounting::Mixed {
            2
        } else {
            4
        }
    }

    /// Bytes of a parameter element when gathered for compute.
    #[must_use]
    pub fn param_bytes(&self) -> u64 {
        match self.accounting {
            Accounting::Weft => 4,
            Accounting::Mixed => 2,
        }
    }
}

/// One model chunk a pipeline stage holds (a virtual stage).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its first transformer block (blocks may differ: windows, experts).
    pub first: usize,
    /// Transformer blocks in the chunk.
    pub layers: usize,
    /// Whether it holds the embedding (the first virtual stage).
    pub embed: bool,
    /// Whether it holds the head (the last virtual stage).
    pub head: bool,
    /// Micro-batches whose activations it holds at the schedule's peak.
    pub slots: usize,
}

impl Chunk {
    /// Its blocks' indices.
    pub(crate) fn blocks(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.layers
    }
}

/// Element counts of one tensor-parallel rank's share of the model
/// (rank 0 of every axis: it holds the largest share of an uneven split).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shares {
    /// `wte` rows on this rank (`ceil(V/tp)`), times C.
    pub wte: u64,
    /// `wpe`: T·C (learned positions only).
    pub wpe: u64,
    /// One block's norms and attention on this rank.
    pub attention: u64,
    /// The dense feed-forward block on this rank.
    pub dense: u64,
    /// The mixture-of-experts block on this rank (its local experts).
    pub moe: u64,
    /// Routed experts per layer (0: dense).
    experts: usize,
    /// Leading dense blocks under a mixture of experts.
    first_dense: usize,
    /// The final norm (and an untied head's rows).
    pub head: u64,
}

fn u(x: usize) -> u64 {
    x as u64
}

impl Shares {
    pub(crate) fn of(model: &ModelSpec, layout: &Layout) -> Shares {
        let (c, t) = (u(model.hidden), u(layout.parallel.tp));
        let mlp = |f: u64| {
            if model.swiglu {
                3 * c * f
            } else {
                2 * c * f + f + c
            }
        };
        // replicated over tp; experts shared out over ep
        let e = u(model.experts);
        let expert = mlp(u(model.expert_width()));
        let moe = c * e + e + e / u(layout.parallel.ep) * expert + u(model.shared_experts) * expert;
        // the dense block: c_fc (or gate and up) by columns, c_proj (down)
        // by rows, c_proj's bias replicated
        let f = u(model.ffn_hidden);
        let dense = if model.swiglu {
            3 * c * f / t
        } else {
            2 * c * f / t + f / t + c
        };
        // norms; c_attn (C, Cq/tp + 2·Ckv_rank) and its bias (Ckv_rank:
        // Ckv/tp, or one copied head's HS when tp exceeds the key/value
        // heads); QK-norm's gains; c_proj (Cq/tp, C) and (GPT-2) its bias
        let (q, kv) = (
            u(model.q_dim()),
            u(model.kv_dim_per_rank(layout.parallel.tp)),
        );
        let gpt2 = model.block == crate::model::Block::Gpt2;
        let norm = if gpt2 { 2 * c } else { c };
        let attention = 2 * norm
            + c * (q / t + 2 * kv)
            + if model.qkv_bias { q / t + 2 * kv } else { 0 }
            + if model.qk_norm {
                2 * u(model.head_dim())
            } else {
                0
            }
            + q * c / t
            + if gpt2 { c } else { 0 };
        let v_loc = u(model.vocab.div_ceil(layout.parallel.tp));
        let head = norm + if model.tied_embeddings { 0 } else { v_loc * c };
        Shares {
            wte: v_loc * c,
            wpe: model.position_params() as u64,
            attention,
            dense,
            moe,
            experts: model.experts,
            first_dense: model.first_dense,
            head,
        }
    }

    /// Parameters of block `layer` on this rank.
    pub(crate) fn block(&self, layer: usize) -> u64 {
        self.attention
            + if self.experts > 0 && layer >= self.first_dense {
                self.moe
            } else {
                self.dense
            }
    }

    /// Parameters of `chunk` on this rank (FSDP units: embedding, each
    /// block, head).
    pub(crate) fn units(&self, chunk: &Chunk) -> Vec<u64> {
        let mut v = Vec::with_capacity(chunk.layers + 2);
        if chunk.embed {
            v.push(self.wte + self.wpe);
        }
        v.extend(chunk.blocks().map(|l| self.block(l)));
        if chunk.head {
            v.push(self.head);
        }
        v
    }
}

/// Memory of one pipeline stage holding `chunks`, on its rank 0.
pub(crate) fn stage_memory(
    model: &ModelSpec,
    layout: &Layout,
    recipe: &Recipe,
    chunks: &[Chunk],
) -> Memory {
    let mut m = Memory::default();
    for c in chunks {
        m += match recipe.accounting {
            Accounting::Weft => weft_chunk(model, layout, recipe, c),
            Accounting::Mixed => mixed_chunk(model, layout, recipe, c),
        };
    }
    if recipe.accounting == Accounting::Mixed && layout.parallel.pp > 1 {
        // one send and one receive buffer of a micro-batch's activations
        let rows = tokens(model, layout)
            / if layout.parallel.sequence_parallel {
                u(layout.parallel.tp)
            } else {
                1
            };
        m.buffers += 2 * 2 * rows * u(model.hidden);
    }
    m
}

/// Tokens of a micro-batch on one rank, B·T/cp.
fn tokens(model: &ModelSpec, layout: &Layout) -> u64 {
    u(layout.micro_batch_size * rank_seq(model, layout))
}

/// Rows of each sequence one rank holds: `T / cp` (context parallelism
/// gives each rank two of `2·cp` chunks).
pub(crate) fn rank_seq(model: &ModelSpec, layout: &Layout) -> usize {
    model.seq / layout.parallel.cp.max(1)
}

/// Floats of one block's activations on a rank, as weft's blocks plan them
/// (`GptBlocks::block_acts_len`), and of its saved weight-gradient inputs
/// for split backwards (`weight_inputs_len`). In bf16 the inputs that only
/// products read (ln_1's output, the attention output, and with the dense
/// MLP ln_2's output and the GELU output) are kept in bf16: two per float.
/// Every block plans the same buffers: a mixture of experts whose first
/// layers are dense saves the larger of the two blocks' activations in
/// each layer, the dense block's scratch and (layer 0's) split inputs,
/// and ln_2's output in f32 (the router reads it). Counted exactly for
/// GPT-2's blocks and the Llama family's: Q, K and V of their own widths;
/// RMSNorm's one statistic per row (LayerNorm's two); rotary positions'
/// `B·T` position ids; QK-norm's raw queries and keys and their per-head
/// statistics; SwiGLU's gate and up (`2·F`) and product in place of the
/// MLP's two.
fn weft_block_floats(model: &ModelSpec, layout: &Layout, precision: Precision) -> (u64, u64, u64) {
    let linear = |len: u64| {
        if precision == Precision::Bf16 {
            len.div_ceil(2)
        } else {
            len
        }
    };
    let (b, t, c) = (
        u(layout.micro_batch_size),
        u(rank_seq(model, layout)),
        u(model.hidden),
    );
    let tp = u(layout.parallel.tp);
    let sp = layout.parallel.sequence_parallel && layout.parallel.tp > 1;
    let n = b * t;
    let rows = if sp { n / tp } else { n };
    let nh = u(model.heads) / tp;
    // the query (and attention output) width and Q, K, V's on this rank
    let (ca, qkv) = (
        u(model.q_dim()) / tp,
        u(model.q_dim()) / tp + 2 * u(model.kv_dim_per_rank(layout.parallel.tp)),
    );
    let lse = b * nh * t;
    let hid = u(model.ffn_hidden) / tp;
    // SwiGLU keeps its gate and up outputs and their product
    let gated = if model.swiglu { n * hid } else { 0 };
    let llama = model.block == crate::model::Block::Llama;
    // a norm's statistics: LayerNorm's mean and 1/std, RMSNorm's 1/rms
    let stats = if llama { rows } else { 2 * rows };
    // QK-norm: the raw queries and keys, and a statistic per head
    let (qk_raw, qk_rstd) = if model.qk_norm {
        let kv = u(model.kv_dim()) / tp;
        (n * (ca + kv), n * (nh + u(model.kv_heads()) / tp))
    } else {
        (0, 0)
    };
    // rotary positions: one id per token
    let pos = if llama { n } else { 0 };
    // ln_2's output, in bf16 when the dense MLP alone reads it
    let ln2 = if model.is_moe() { n * c } else { linear(n * c) };
    let experts = {
        let (e, k, f) = (
            u(model.experts),
            u(model.top_k),
            u(model.expert_width()) * if model.swiglu { 3 } else { 2 } / 2,
        );
        let shared = u(model.shared_experts) * 2 * f;
        let per_token = if layout.parallel.ep > 1 {
            e + k * c + shared
        } else {
            e + k * (2 * f + c) + shared
        };
        (n * per_token, 0, 0)
    };
    let dense = {
        // the first product's output: the MLP's F, SwiGLU's gate and up
        let split = n * hid + gated + if sp { n * c } else { 0 };
        let input = n * hid
            + if layout.parallel.tp > 1 { n * c } else { 0 }
            + if sp { rows * c } else { 0 };
        // selective recomputation keeps no activation output
        let act = if layout.recompute.selective() {
            0
        } else {
            linear(n * hid)
        };
        (
            n * hid + gated + act,
            (input + split).max(n * c).max(n * hid),
            split,
        )
    };
    let (ffn_saved, ffn_scratch, ffn_split) = match (model.is_moe(), model.first_dense) {
        (false, _) => dense,
        (true, 0) => experts,
        (true, _) => (experts.0.max(dense.0), dense.1, dense.2),
    };
    let block = linear(n * c)
        + stats
        + n * qkv
        // the attention output, f32 in every precision
        + n * ca
        + lse
        + rows * c
        + ln2
        + stats
        + ffn_saved
        + rows * c
        + qk_raw
        + qk_rstd
        + pos
        // each block's row starts for the attention's backward where
        // windows mask it (weft keeps them under document masking too,
        // which the planner does not model)
        + if model.window > 0 { n } else { 0 };
    let scratch =
        2 * n * c + n * ca + n * qkv + ffn_scratch + if sp { rows * c + n * c } else { 0 };
    let weight_inputs = 3 * rows * c + n * c + n * qkv + ffn_split + qk_raw;
    (block, scratch, weight_inputs)
}

fn weft_chunk(model: &ModelSpec, layout: &Layout, recipe: &Recipe, chunk: &Chunk) -> Memory {
    let shares = Shares::of(model, layout);
    let (b, t, c) = (
        u(layout.micro_batch_size),
        u(rank_seq(model, layout)),
        u(model.hidden),
    );
    let tp = u(layout.parallel.tp);
    let sp = layout.parallel.sequence_parallel && layout.parallel.tp > 1;
    let n = b * t;
    let rows = if sp { n / tp } else { n };
    let (block, scratch, split) = weft_block_floats(model, layout, recipe.precision);
    let layers = u(chunk.layers);
    let v_loc = u(model.vocab.div_ceil(layout.parallel.tp));
    // a recomputed block keeps its output; the working buffers gain one
    // block's activations for the recomputation
    let recomputed = u(chunk
        .blocks()
        .filter(|&l| layout.recompute.recomputes(l))
        .count());
    let scratch = scratch
        + if layout.recompute.any(0..model.layers) {
            block
        } else {
            0
        };
    let mut per_slot = 2 * rows * c + (layers - recomputed) * block + recomputed * rows * c;
    if chunk.embed {
        // the micro-batch's tokens, whole sequences on every cp rank
        per_slot += n * u(layout.parallel.cp);
    }
    if chunk.head {
        // targets, ln_f, its statistics, logits, losses, row statistics
        let stats = if model.block == crate::model::Block::Llama {
            rows
        } else {
            2 * rows
        };
        // (one loss chunk's logits, or the micro-batch's)
        let logit_rows = match u(layout.loss_chunk) {
            0 => n,
            k => k.min(n),
        };
        per_slot += n + n * c + stats + logit_rows * v_loc + n + 2 * n;
    }
    if layout.schedule().splits_backward() && layout.parallel.pp > 1 {
        per_slot += layers * split;
    }
    // and the shared working buffers
    let acts = u(chunk.slots.max(1)) * per_slot + scratch;
    let units = shares.units(chunk);
    let params: u64 = units.iter().sum();
    let tied = model.tied_embeddings;
    let tied_copy = if chunk.head && tied && !chunk.embed {
        shares.wte
    } else {
        0
    };
    let exchange = match (tied && chunk.embed != chunk.head, chunk.embed) {
        (false, _) => 0,
        (true, true) => u(chunk.slots.max(1)) * shares.wte,
        (true, false) => shares.wte,
    };
    let mut m = Memory {
        activations: 4 * acts,
        ..Memory::default()
    };
    match layout.sharding() {
        None => {
            m.params = 4 * (params + tied_copy);
            m.grads = 4 * params;
            m.optimizer = 4 * 2 * params;
            let wire = if recipe.bf16_grad_wire { 2 } else { 0 };
            m.buffers = 4 * (exchange + params) + wire * params;
        }
        Some(s) => {
            let n = u(layout.shard_group().max(1));
            let shard: u64 = units.iter().map(|&x| x.div_ceil(n)).sum();
            let (held, states) = if s.shards_params() {
                (shard, 2)
            } else {
                (shard * n, 3)
            };
            m.params = 4 * (held + tied_copy);
            m.optimizer = 4 * states * shard;
            let gathered = if tied && chunk.embed != chunk.head && chunk.embed {
                shares.wte
            } else {
                0
            };
            m.buffers = 4 * (exchange + gathered);
        }
    }
    m
}

fn mixed_chunk(model: &ModelSpec, layout: &Layout, recipe: &Recipe, chunk: &Chunk) -> Memory {
    let shares = Shares::of(model, layout);
    // a rank's rows of each sequence (its keys still reach back to the
    // whole sequence's)
    let (s, b, h, a) = (
        u(rank_seq(model, layout)),
        u(layout.micro_batch_size),
        u(model.hidden),
        u(model.heads),
    );
    let t = u(layout.parallel.tp);
    let sp = layout.parallel.sequence_parallel && layout.parallel.tp > 1;
    let sbh = s * b * h;
    // Korthikanti et al. 2022, Table 2, by part: 10·sbh replicated over
    // tp (the norms' inputs, the attention's and the MLP's inputs, two
    // dropout masks); sharded: Q, K, V and the projection's input,
    // 2·(2·Cq + 2·Ckv)·sb (8·sbh with multi-head attention), and the
    // feed-forward block's hidden activations, 4·F·sb for GELU (16·sbh at
    // F = 4·C) or 6·F·sb for SwiGLU's gate, up and product; a mixture of
    // experts runs k blocks of width Fe (top-k plus shared), each with its
    // own input and mask (3·sbh); the scores 5·a·s·b per key a query's
    // window holds
    let (q, kv) = (u(model.q_dim()), u(model.kv_dim()));
    let hidden_acts = |f: usize| if model.swiglu { 6 } else { 4 } * u(f) * s * b;
    let replicated = 10 * sbh;
    let attention = 4 * (q + kv) * s * b;
    let per_layer = |l: usize| {
        let ffn = if model.is_moe_layer(l) {
            let k = u(model.top_k + model.shared_experts);
            k * (3 * sbh + hidden_acts(model.expert_width())) - 3 * sbh
        } else {
            hidden_acts(model.ffn_hidden)
        };
        let keys = u(model.window_of(l).map_or(model.seq, |w| w.min(model.seq)));
        // selective recomputation keeps none (Korthikanti et al.'s
        // 34·sbh per layer)
        let scores = if recipe.flash_attention || layout.recompute.selective() {
            0
        } else {
            5 * a * s * keys * b
        };
        let sharded = attention + ffn + scores;
        if layout.recompute.recomputes(l) {
            if sp { 2 * sbh / t } else { 2 * sbh }
        } else if sp {
            (replicated + sharded) / t
        } else {
            replicated + sharded / t
        }
    };
    let mut per_slot: u64 = chunk.blocks().map(per_layer).sum();
    if chunk.embed {
        // the embedding's output and its dropout mask
        per_slot += 3 * sbh / if sp { t } else { 1 };
    }
    if chunk.head {
        // bf16 logits and their f32 softmax, vocabulary-parallel
        per_slot += 6 * s * b * u(model.vocab.div_ceil(layout.parallel.tp));
    }
    let units = shares.units(chunk);
    let params: u64 = units.iter().sum::<u64>()
        + if chunk.head && model.tied_embeddings && !chunk.embed {
            shares.wte
        } else {
            0
        };
    let n = u(layout.shard_group().max(1));
    let sharded = |x: u64| x.div_ceil(n);
    let mut m = Memory {
        activations: u(chunk.slots.max(1)) * per_slot,
        ..Memory::default()
    };
    match layout.sharding() {
        None => {
            m.params = 2 * params;
            m.grads = 2 * params;
            m.optimizer = 12 * params;
        }
        Some(Strategy::Optimizer) => {
            m.params = 2 * params;
            m.grads = 2 * params;
            m.optimizer = 12 * sharded(params);
        }
        Some(Strategy::GradOp) => {
            m.params = 2 * params;
            m.grads = 2 * sharded(params);
            m.optimizer = 12 * sharded(params);
        }
        Some(Strategy::Full) | Some(Strategy::Hybrid) => {
            m.params = 2 * sharded(params);
            m.grads = 2 * sharded(params);
            m.optimizer = 12 * sharded(params);
            // the unit computing and the one prefetched, gathered in bf16,
            // and the largest unit's full gradient before its reduce-scatter
            let largest = units.iter().copied().max().unwrap_or(0);
            m.buffers = 3 * 2 * largest;
        }
    }
    m
}
