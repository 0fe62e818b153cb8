//! [`GptBlocks`]: the computation of a decoder-only transformer — the
//! embedding, one transformer block, the head — as functions over explicit
//! parameter, gradient and activation slices, on one rank or a
//! tensor-parallel rank's shard (the [`tp`](crate::tp) module's sharding
//! styles in the same code). The block's architecture options
//! ([`BlockArch`](crate::BlockArch)) are branches of this one code path:
//! the norm (LayerNorm or RMSNorm), the optional biases, QK-norm and the
//! rotation between the QKV projection and attention, the grouped-query
//! heads and the sliding window inside the attention kernels.

use std::ops::Range;
use std::sync::Arc;

use weft_kernels::{
    Heads, LinearInput, Mode, Precision, RopeTable, attention_backward, attention_forward,
    encoder_backward, encoder_forward, fused_classifier_backward, fused_classifier_forward,
    layernorm_backward, layernorm_backward_input, layernorm_backward_weight, layernorm_forward,
    matmul_backward, matmul_backward_input, matmul_backward_weight, matmul_backward_wt,
    matmul_forward, matmul_forward_wt, residual_forward, rmsnorm_backward, rmsnorm_backward_input,
    rmsnorm_backward_weight, rmsnorm_forward, rope_backward, rope_forward,
    round_to_bf16_for_products,
};
use weft_numerics::bf16;
use weft_parallel::{Coords, ParamLayout};

use crate::chunk::{Lm, PieceRanges};
use crate::config::{GptConfig, Norm};
use crate::cp::{ContextParallel, RingIn};
use crate::error::{Error, Result};
use crate::ffn::{Dims, FeedForward};
use crate::params::{BlockLayout, Pieces, Sharding, param_layout};
use crate::tp::{TensorParallel, VocabShard, split_err};
use weft_parallel::Recompute;

/// The computation of a GPT-2, separated from its parameters: the
/// embedding, one transformer block and the head as functions over
/// explicit parameter, gradient and activation slices.
///
/// This is what [`Gpt`](crate::Gpt) runs, and what a pipeline stage
/// ([`GptStage`](crate::GptStage)) or an FSDP unit runs with its own (or a
/// just-gathered) parameter slice — the one block code path of every
/// layout. Calling these functions in the order
/// [`Gpt::forward`](crate::Gpt::forward) / [`Gpt::backward`](crate::Gpt::backward)
/// do gives bitwise their results.
///
/// # Parameter slices
///
/// The slices are cut from the flat buffer of [`layout`](Self::layout)
/// (or any buffer with the same order):
///
/// * embedding, [`embed_range`](Self::embed_range): `wte (V,C)` then
///   `wpe (maxT,C)`, [`embed_len`](Self::embed_len) floats;
/// * block `l`, [`block_range`](Self::block_range): `ln_1.weight (C)`,
///   `ln_1.bias (C)`, `attn.c_attn.weight (C,3C)`, `attn.c_attn.bias
///   (3C)`, `attn.c_proj.weight (C,C)`, `attn.c_proj.bias (C)`,
///   `ln_2.weight (C)`, `ln_2.bias (C)`, then the feed-forward block's
///   tensors in [`FeedForward::params`] order (for [`Mlp`](crate::Mlp):
///   `mlp.c_fc.weight (C,4C)`, `mlp.c_fc.bias (4C)`, `mlp.c_proj.weight
///   (4C,C)`, `mlp.c_proj.bias (C)`), [`block_len`](Self::block_len)
///   floats ([`block_layout`](Self::block_layout) has the offsets);
/// * final layernorm, [`lnf_range`](Self::lnf_range): `ln_f.weight (C)`,
///   `ln_f.bias (C)`;
/// * language-model head, [`lm_head_range`](Self::lm_head_range): `wte`
///   itself when embeddings are tied, else `lm_head.weight (V,C)` at the
///   end of the buffer.
///
/// Gradient slices have the same shapes; every backward function
/// *accumulates* (`+=`) into them, with the same kernel calls on the same
/// buffer as [`Gpt::backward`](crate::Gpt::backward), so accumulating
/// micro-batches in place gives bitwise the bits of a model doing the same.
///
/// # Tensor parallelism
///
/// Built [`with_tp`](Self::with_tp), the shapes above are this rank's
/// shard (the layout's placements: heads, MLP columns and rows, vocabulary
/// rows), and the functions do the group's communication of the sharding
/// styles (the [`tp`](crate::tp) module). Each function's activation rows
/// are the rank's rows of the residual stream — all `B·T`, or its `B·T/tp`
/// under sequence parallelism — and every rank of the group calls it with
/// the same tokens. Without a group (or with one of size 1) nothing is
/// split and the calls are exactly the unsplit ones.
///
/// # Backward split
///
/// [`block_backward`](Self::block_backward) is the whole backward of a
/// block. For zero-bubble schedules it splits into
/// [`block_backward_input`](Self::block_backward_input) (B: the gradient
/// of the block's input, saving in a [`WeightInputs`] what the weight
/// gradients need) and [`block_backward_weight`](Self::block_backward_weight)
/// (W: the parameter gradients). B then W gives bitwise the gradients of
/// the whole backward. The attention half and the layernorms run the
/// split kernels ([`weft_kernels::matmul_backward_input`]
/// in B, [`weft_kernels::matmul_backward_weight`] in
/// W, likewise for layernorm), which are the whole backward's kernels cut
/// in two, so nothing is computed twice there. The feed-forward block runs
/// [`FeedForward::backward_input`] in B and
/// [`FeedForward::backward_weight`] in W: the dense MLP splits like the
/// attention half; a block that cannot split (the mixture of experts) runs
/// its whole backward in each, the unwanted half going to a scratch sink.
#[derive(Clone, Debug)]
pub struct GptBlocks {
    config: GptConfig,
    ffn: Arc<dyn FeedForward>,
    layout: ParamLayout,
    pieces: Pieces,
    blk: BlockLayout,
    tp: Option<TensorParallel>,
    /// The context-parallel group: each sequence's rows are this rank's
    /// chunks of it (see [`crate::cp`]).
    cp: Option<ContextParallel>,
    vocab: VocabShard,
    mode: Mode,
    precision: Precision,
    loss_scale: f32,
    doc_boundary: Option<u32>,
    recompute: Recompute,
    /// Tokens per chunk of the head's loss (0: the whole micro-batch).
    loss_chunk: usize,
    /// Rotary positions' table for `block_size` positions, if rotary.
    rope: Option<Arc<RopeTable<f32>>>,
}

/// A rank's tokens of a micro-batch and their positions
/// ([`GptBlocks::embed_rows`]).
type EmbedRows<'a> = (std::borrow::Cow<'a, [u32]>, Option<Vec<u32>>);

/// What one block's forward keeps for its backward, for one micro-batch of
/// `B` sequences of `T` tokens; plan it with [`GptBlocks::block_acts`].
/// The block's output (the residual stream after the block) is
/// [`out`](Self::out); its input is not stored here (it is the previous
/// block's output, or the embedding, or what a pipeline stage received).
/// `rows` below is the rank's rows of the residual stream (`B·T`, or
/// `B·T/tp` under sequence parallelism), `Ca = C/tp` and `NHa = NH/tp` its
/// attention width and heads.
#[derive(Clone, Debug)]
pub struct BlockActs {
    b: usize,
    t: usize,
    layer: usize,       // set by the forward, read by the backward
    ln1: LinearAct,     // (B·T, C), gathered under SP
    ln1_mean: Vec<f32>, // (rows); empty under RMSNorm
    ln1_rstd: Vec<f32>, // (rows)
    qkv: Vec<f32>,      // (B·T, Ca+2·Ckva), after QK-norm and rotation
    qk_raw: Vec<f32>,   // QK-norm's input: (B·T·NHa, HS) then (B·T·NKVa, HS)
    qk_rstd: Vec<f32>,  // QK-norm's statistics: (B·T·(NHa+NKVa))
    pos: Vec<u32>,      // rotary positions (B·T), empty without

    atty: Vec<f32>,           // (B·T, Ca), f32 in every precision
    lse: Vec<f32>,            // (B, NHa, T) each row's log-sum-exp of its scores
    mask: Vec<u32>,           // the attention's row starts (B·T), if `masked`
    masked: bool,             // the forward's attention had a mask
    res2: Vec<f32>,           // (rows, C)
    ln2: LinearAct,           // (B·T, C), gathered under SP
    ln2_mean: Vec<f32>,       // (rows); empty under RMSNorm
    ln2_rstd: Vec<f32>,       // (rows)
    ffn_saved: Vec<f32>,      // the feed-forward block's saved_len
    pub(crate) out: Vec<f32>, // (rows, C)
}

impl BlockActs {
    /// The block's output `(rows, C)` after [`GptBlocks::block_forward`].
    pub fn out(&self) -> &[f32] {
        &self.out
    }
    /// Batch size these buffers were planned for.
    pub fn batch(&self) -> usize {
        self.b
    }
    /// Sequence length these buffers were planned for.
    pub fn seq_len(&self) -> usize {
        self.t
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.ln1.bytes()
            + self.ln2.bytes()
            + 4 * [
                &self.ln1_mean,
                &self.ln1_rstd,
                &self.qkv,
                &self.qk_raw,
                &self.qk_rstd,
                &self.atty,
                &self.lse,
                &self.res2,
                &self.ln2_mean,
                &self.ln2_rstd,
                &self.ffn_saved,
                &self.out,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
            + 4 * (self.pos.len() + self.mask.len())
    }
}

/// A saved activation that only linear layers' products read (the
/// input of the attention's QKV projection, and of a feed-forward block
/// that only multiplies its input): `f32`, or in
/// [`Precision::Bf16`] bf16 rounded as the products round their operands
/// ([`round_to_bf16_for_products`]) — half the bytes, the same results.
/// A bf16 one holds whole 4-byte slots (an even number of values), so
/// that its bytes are `4 ·` [`slots`](Self::slots).
#[derive(Clone, Debug)]
enum LinearAct {
    F32(Vec<f32>),
    /// The values, and how many of the buffer's are in use.
    Bf16(Vec<bf16>, usize),
}

impl LinearAct {
    fn new(len: usize, precision: Precision) -> Self {
        if precision == Precision::Bf16 {
            LinearAct::Bf16(vec![bf16::ZERO; 2 * Self::slots(len, precision)], len)
        } else {
            LinearAct::F32(vec![0.0; len])
        }
    }
    /// 4-byte slots `len` values take in `precision`.
    fn slots(len: usize, precision: Precision) -> usize {
        if precision == Precision::Bf16 {
            len.div_ceil(2)
        } else {
            len
        }
    }
    fn bytes(&self) -> usize {
        match self {
            LinearAct::F32(v) => 4 * v.len(),
            LinearAct::Bf16(v, _) => 2 * v.len(),
        }
    }
    fn is_bf16(&self) -> bool {
        matches!(self, LinearAct::Bf16(..))
    }
    /// The values as a product's input.
    fn input(&self) -> LinearInput<'_, f32> {
        match self {
            LinearAct::F32(v) => LinearInput::Wide(v),
            LinearAct::Bf16(v, len) => LinearInput::Bf16(&v[..*len]),
        }
    }
    /// Where the producer writes the values: the buffer itself in `f32`,
    /// else the front of `staging` (then [`settle`](Self::settle)).
    fn target<'s>(&'s mut self, staging: &'s mut [f32]) -> &'s mut [f32] {
        match self {
            LinearAct::F32(v) => v,
            LinearAct::Bf16(_, len) => &mut staging[..*len],
        }
    }
    /// Rounds what [`target`](Self::target) had written to `staging`.
    fn settle(&mut self, staging: &[f32]) -> Result<()> {
        if let LinearAct::Bf16(v, len) = self {
            round_to_bf16_for_products(&mut v[..*len], &staging[..*len])?;
        }
        Ok(())
    }
}

/// What the head's forward keeps for its backward (final layernorm,
/// logits, per-token losses, targets); plan it with
/// [`GptBlocks::head_acts`].
#[derive(Clone, Debug)]
pub struct HeadActs {
    b: usize,
    t: usize,
    chunk: usize,      // rows of logits held: B·T, or the loss chunk
    targets: Vec<u32>, // (B,T)
    has_targets: bool,
    lnf: Vec<f32>,      // (B·T, C), gathered under SP
    lnf_mean: Vec<f32>, // (rows)
    lnf_rstd: Vec<f32>, // (rows)
    logits: Vec<f32>,   // (chunk, V_l); holds dlogits after backward
    losses: Vec<f32>,   // (B·T)
    stats: Vec<f32>,    // (2·B·T) each chunk's rows' max logit and sum of exponentials
}

impl HeadActs {
    /// Logits `(B·T, V)` of the last forward — this rank's vocabulary
    /// columns under tensor parallelism (after a backward they hold the
    /// logits' gradient instead). Under a loss chunk smaller than the
    /// micro-batch ([`GptBlocks::set_loss_chunk`]) they are not kept:
    /// this buffer holds one chunk's rows, the last chunk's at its start.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// Per-token losses `(B·T)` of the last forward with targets (the same
    /// on every tensor-parallel rank).
    pub fn losses(&self) -> &[f32] {
        &self.losses
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.targets.len()
            + self.lnf.len()
            + self.lnf_mean.len()
            + self.lnf_rstd.len()
            + self.logits.len()
            + self.losses.len()
            + self.stats.len())
    }
}

/// Working buffers of one block's forward and backward, reusable across
/// blocks and micro-batches of the same shape; plan it with
/// [`GptBlocks::scratch`].
#[derive(Clone, Debug)]
pub struct BlockScratch {
    tmp: Vec<f32>,         // (B·T, C) block outputs before the residual add, bf16 staging
    dln: Vec<f32>,         // (B·T, C)
    datty: Vec<f32>,       // (B·T, Ca)
    dqkv: Vec<f32>,        // (B·T, 3Ca)
    ffn_scratch: Vec<f32>, // the feed-forward block's scratch_len
    /// Under sequence parallelism: the rank's rows `(rows, C)`, and the
    /// gathered whole `(B·T, C)`.
    rows: Vec<f32>,
    full: Vec<f32>,
    /// Sinks for the half a feed-forward block that cannot split its
    /// backward discards in B and W: an input gradient and the block's
    /// parameter gradients. Empty unless such a block needs them.
    sink_x: Vec<f32>,
    sink_p: Vec<f32>,
    /// One block's activations for recomputation, when the blocks'
    /// [`Recompute`] recomputes any.
    pub(crate) replay: Option<Box<BlockActs>>,
}

impl BlockScratch {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * [
            &self.tmp,
            &self.dln,
            &self.datty,
            &self.dqkv,
            &self.ffn_scratch,
            &self.rows,
            &self.full,
            &self.sink_x,
            &self.sink_p,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
            + self.replay.as_ref().map_or(0, |a| a.bytes())
    }
}

/// What [`GptBlocks::block_backward_input`] (B) saves for
/// [`GptBlocks::block_backward_weight`] (W): the gradients flowing into
/// each parameterised op of the block (7·B·T·C floats unsplit), and what
/// the feed-forward block's input half saves for its weight half
/// ([`FeedForward::split_saved_len`]: 4·B·T·C for the dense MLP). Plan one
/// per micro-batch whose W is pending with [`GptBlocks::weight_inputs`].
#[derive(Clone, Debug)]
pub struct WeightInputs {
    dres3: Vec<f32>, // (rows, C) d(block output) = d(ffn output)
    dln2: Vec<f32>,  // (rows, C) d(ln_2 output)
    dres2: Vec<f32>, // (B·T, C) d(attention proj output), gathered under SP
    dqkv: Vec<f32>,  // (B·T, Ca+2·Ckva) d(qkv)
    dqk: Vec<f32>,   // QK-norm's output gradient, as `BlockActs::qk_raw`
    dln1: Vec<f32>,  // (rows, C) d(ln_1 output)
    dffn: Vec<f32>,  // the feed-forward block's own
    ready: bool,
}

impl WeightInputs {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.dres3.len()
            + self.dln2.len()
            + self.dres2.len()
            + self.dqkv.len()
            + self.dqk.len()
            + self.dln1.len()
            + self.dffn.len())
    }
}

/// `a·b·…`, or an error naming `what` if it overflows (sizes a user
/// sets: a model or batch too large for any machine).
pub(crate) fn product(what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::Config {
            field: "size",
            reason: format!(
                "of {what}: {} overflows this machine's address space",
                factors
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" × ")
            ),
        })
}

/// `a + b + …`, or an error naming `what` if it overflows.
pub(crate) fn sum(what: &str, terms: &[usize]) -> Result<usize> {
    terms
        .iter()
        .try_fold(0usize, |acc, &x| acc.checked_add(x))
        .ok_or_else(|| Error::Config {
            field: "size",
            reason: format!("of {what} overflows this machine's address space"),
        })
}

/// Copies the query and key parts of each row of `qkv (n, cols)` to `q
/// (n, Cq)` and `k (n, Ckv)` (their widths are the buffers' over `n`).
fn gather_qk(qkv: &[f32], q: &mut [f32], k: &mut [f32], cols: usize) {
    let n = qkv.len() / cols.max(1);
    let (cq, ckv) = (q.len() / n.max(1), k.len() / n.max(1));
    for ((row, q), k) in qkv
        .chunks_exact(cols)
        .zip(q.chunks_exact_mut(cq))
        .zip(k.chunks_exact_mut(ckv))
    {
        q.copy_from_slice(&row[..cq]);
        k.copy_from_slice(&row[cq..cq + ckv]);
    }
}

/// The inverse of [`gather_qk`]: `q` and `k` back into each row of `qkv`.
fn scatter_qk(qkv: &mut [f32], q: &[f32], k: &[f32], cols: usize) {
    let n = qkv.len() / cols.max(1);
    let (cq, ckv) = (q.len() / n.max(1), k.len() / n.max(1));
    for ((row, q), k) in qkv
        .chunks_exact_mut(cols)
        .zip(q.chunks_exact(cq))
        .zip(k.chunks_exact(ckv))
    {
        row[..cq].copy_from_slice(q);
        row[cq..cq + ckv].copy_from_slice(k);
    }
}

/// A bias slice, or `None` for an architecture without it (an empty range).
pub(crate) fn bias<'a>(p: &'a [f32], r: &Range<usize>) -> Option<&'a [f32]> {
    (!r.is_empty()).then(|| &p[r.clone()])
}

fn two_mut(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&mut [f32], &mut [f32]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Batch {
            reason: format!("{what} holds {got} floats, expected {want}"),
        })
    }
}

/// The rows of the residual stream a rank holds, gathered to all `B·T`
/// under sequence parallelism.
fn gathered<'a>(
    tp: Option<&TensorParallel>,
    x: &'a [f32],
    full: &'a mut [f32],
) -> Result<&'a [f32]> {
    match tp {
        Some(tp) => tp.enter_column(x, full),
        None => Ok(x),
    }
}

impl GptBlocks {
    /// The per-block functions of a model with this configuration and
    /// feed-forward block, on one rank (the block's experts may still be
    /// sharded over an expert group: [`FeedForward::expert_parallel`]).
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn new(config: GptConfig, ffn: Arc<dyn FeedForward>) -> Result<Self> {
        Self::build(config, ffn, None)
    }

    /// The per-block functions of this rank's shard of a model split over
    /// the tensor-parallel group `tp` (see the [`tp`](crate::tp) module).
    /// A group of one rank is no split.
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent or does not
    /// split over `tp` (it must divide `n_head`; the vocabulary needs at
    /// least `tp` tokens).
    pub fn with_tp(
        config: GptConfig,
        ffn: Arc<dyn FeedForward>,
        tp: TensorParallel,
    ) -> Result<Self> {
        let tp = (tp.size() > 1).then_some(tp);
        Self::build(config, ffn, tp)
    }

    fn build(
        config: GptConfig,
        ffn: Arc<dyn FeedForward>,
        tp: Option<TensorParallel>,
    ) -> Result<Self> {
        let (rank, size) = tp.as_ref().map_or((0, 1), |t| (t.rank(), t.size()));
        let sharding = Sharding {
            coords: Coords {
                ep: ffn.expert_parallel(),
                tp: (rank, size),
            },
            sequence_parallel: tp.as_ref().is_some_and(TensorParallel::sequence_parallel),
        };
        let layout = param_layout(&config, ffn.as_ref(), &sharding)?;
        let pieces = Pieces::of(&layout, &config)?;
        let vocab = VocabShard::new(config.vocab_size, size, rank)?;
        let rope = match config.rope() {
            Some(r) => Some(Arc::new(r.table::<f32>(config.block_size)?)),
            None => None,
        };
        Ok(GptBlocks {
            rope,
            blk: pieces.block.clone(),
            config,
            ffn,
            layout,
            pieces,
            tp,
            cp: None,
            vocab,
            mode: Mode::default(),
            precision: Precision::default(),
            loss_scale: 1.0,
            doc_boundary: None,
            recompute: Recompute::None,
            loss_chunk: 0,
        })
    }

    /// Splits every sequence over the context-parallel group `cp` (see
    /// the [`cp`](crate::cp) module): from then on a micro-batch's `t` is
    /// this rank's rows of each sequence, `T / cp`, while tokens and
    /// targets are still given whole (`B·T`). A group of one rank (or
    /// `None`) is no split.
    pub fn set_context_parallel(&mut self, cp: Option<ContextParallel>) {
        self.cp = cp.filter(|c| c.size() > 1);
    }

    /// The context-parallel group, if sequences are split.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }

    /// The tokens of a whole sequence of which this rank holds `t` rows:
    /// `t · cp`.
    pub fn whole_seq(&self, t: usize) -> usize {
        t * self.cp.as_ref().map_or(1, ContextParallel::size)
    }

    /// The position in its whole sequence of row `i` of a rank's `t` rows.
    fn position(&self, i: usize, t: usize) -> usize {
        self.cp.as_ref().map_or(i, |cp| cp.position(i, t))
    }

    /// This rank's rows `(B, t)` of a per-token buffer of whole sequences
    /// (`(B, t · cp)`): the buffer itself without context parallelism.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong length.
    pub(crate) fn local_rows<'a, T: Copy>(
        &self,
        whole: &'a [T],
        b: usize,
        t: usize,
    ) -> Result<std::borrow::Cow<'a, [T]>> {
        match &self.cp {
            None => Ok(std::borrow::Cow::Borrowed(whole)),
            Some(cp) => Ok(std::borrow::Cow::Owned(cp.local(whole, b, t)?)),
        }
    }

    /// The document starts `(B, t)` of this rank's rows, by position in
    /// the whole sequence, from the micro-batch's whole `tokens` under
    /// document masking; `None` without it.
    ///
    /// # Errors
    /// [`Error::Batch`] if `tokens` is not `B·t·cp` long.
    pub(crate) fn row_starts(
        &self,
        tokens: &[u32],
        b: usize,
        t: usize,
    ) -> Result<Option<Vec<u32>>> {
        let Some(starts) = self.doc_starts(tokens, b, self.whole_seq(t))? else {
            return Ok(None);
        };
        Ok(Some(self.local_rows(&starts, b, t)?.into_owned()))
    }

    /// This rank's parameter layout (names, shapes, offsets, placements).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The offsets of a block's tensors inside its slice.
    pub fn block_layout(&self) -> &BlockLayout {
        &self.blk
    }

    /// The tensor-parallel group, if the blocks are split over one.
    pub fn tp(&self) -> Option<&TensorParallel> {
        self.tp.as_ref()
    }

    /// The pieces of the whole model in its buffer.
    pub(crate) fn whole_ranges(&self) -> PieceRanges {
        PieceRanges {
            embed: Some(self.pieces.embed.clone()),
            first_layer: 0,
            blocks: self.pieces.blocks.clone(),
            lnf: Some(self.pieces.lnf.clone()),
            lm: Lm::At(self.pieces.lm_head.clone()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The feed-forward block.
    pub fn ffn(&self) -> &Arc<dyn FeedForward> {
        &self.ffn
    }

    /// How the forward's linear layers split their work (see
    /// [`Gpt::set_mode`](crate::Gpt::set_mode)).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Sets the forward's [`Mode`].
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// The arithmetic of the linear layers' products (see
    /// [`set_precision`](Self::set_precision)).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Sets the arithmetic of every linear layer's products, forward and
    /// backward: the attention's and the feed-forward block's projections
    /// and the language-model head (`Precision::Bf16`: operands rounded to
    /// bf16, f32 accumulation — mixed precision). Parameters and gradients
    /// stay `f32`; layernorm, GELU, attention scores and softmax, the loss
    /// and the embedding are computed in `f32` whatever the precision. In
    /// `Precision::Bf16` the activations that only products read — the
    /// input of the QKV projection and of the dense MLP's output
    /// projection — are saved in bf16, rounded as the products round them:
    /// half their bytes, the same bits (the attention output, which the
    /// attention's backward also reads, stays f32). Plan
    /// activations ([`block_acts`](Self::block_acts)) after setting it
    /// (bf16 ones refuse to run in another precision). The decoder ([`Decoder`](crate::Decoder)) reads it
    /// from the model, so sampling reproduces the training forward's bits.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// The precision the feed-forward block's input is kept in: the
    /// products' one if the block only multiplies it
    /// ([`FeedForward::input_feeds_products_only`]), else `f32`.
    fn ffn_input_precision(&self) -> Precision {
        if self.ffn.input_feeds_products_only() {
            self.precision
        } else {
            Precision::F32
        }
    }

    /// Which blocks recompute their forward in the backward (see
    /// [`set_recompute`](Self::set_recompute)).
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Activation recomputation ([`Recompute`]): the blocks it names keep
    /// only their output in the forward ([`block_acts_for`](Self::block_acts_for))
    /// and run their forward again into the working buffers'
    /// [`BlockActs`] before their backward. Plan activations and working
    /// buffers ([`scratch`](Self::scratch)) after setting it.
    pub fn set_recompute(&mut self, recompute: Recompute) {
        self.recompute = recompute;
    }

    /// Tokens per chunk of the head's loss (see
    /// [`set_loss_chunk`](Self::set_loss_chunk)); 0 for the whole
    /// micro-batch at once.
    pub fn loss_chunk(&self) -> usize {
        self.loss_chunk
    }

    /// The loss without the whole logits: with `tokens > 0`, the head
    /// computes its logits, cross-entropy and their gradients in chunks
    /// of `tokens` rows of the micro-batch, holding one chunk's logits
    /// (`tokens · V/tp` floats) instead of `B·T·V/tp`. The forward keeps
    /// each row's maximum and sum of exponentials; the backward computes
    /// each chunk's logits again (one more head forward per micro-batch)
    /// and takes its gradient. Losses, gradients and weights are the bits
    /// of the unchunked head: the logits' and input gradient's rows do not
    /// depend on the other rows, and the weight gradient sums whole blocks
    /// of [`WT_SUM_ROWS`](weft_kernels::WT_SUM_ROWS) rows in order. Plan
    /// the head's activations after setting it; a forward without targets
    /// (logits for sampling) needs the whole micro-batch's logits and is
    /// refused under a chunk smaller than it.
    ///
    /// # Errors
    /// As [`check_loss_chunk`](Self::check_loss_chunk).
    pub fn set_loss_chunk(&mut self, tokens: usize) -> Result<()> {
        Self::check_loss_chunk(tokens)?;
        self.loss_chunk = tokens;
        Ok(())
    }

    /// Checks a loss chunk for [`set_loss_chunk`](Self::set_loss_chunk).
    ///
    /// # Errors
    /// [`Error::Config`] if `tokens` is not a multiple of
    /// [`WT_SUM_ROWS`](weft_kernels::WT_SUM_ROWS).
    pub fn check_loss_chunk(tokens: usize) -> Result<()> {
        if !tokens.is_multiple_of(weft_kernels::WT_SUM_ROWS) {
            return Err(Error::Config {
                field: "loss_chunk",
                reason: format!(
                    "must be a multiple of {} tokens (the rows the head's weight gradient \
                     sums at a time), or 0 for the whole micro-batch (got {tokens})",
                    weft_kernels::WT_SUM_ROWS
                ),
            });
        }
        Ok(())
    }

    /// Rows of the head's logits held at once for `n` tokens: the loss
    /// chunk, or all of them.
    pub fn head_chunk_rows(&self, n: usize) -> usize {
        if self.loss_chunk == 0 {
            n
        } else {
            self.loss_chunk.min(n)
        }
    }

    /// The token that ends a document when documents are masked (see
    /// [`set_doc_boundary`](Self::set_doc_boundary)).
    pub fn doc_boundary(&self) -> Option<u32> {
        self.doc_boundary
    }

    /// Document masking: with `Some(boundary)` (GPT-2's end-of-text,
    /// 50256), every document packed into a sequence is computed as if it
    /// were alone — attention stops at the boundary token before it
    /// ([`weft_kernels::attention_forward`]'s `docs`) and positions restart
    /// at 0 after it (Megatron-LM's `reset_attention_mask` and
    /// `reset_position_ids` together). `None` (the default) attends across
    /// documents, as GPT-2 and llm.c train. The starts are a function of
    /// each micro-batch's tokens ([`doc_starts`](Self::doc_starts)), so
    /// every pipeline stage, tensor-parallel rank and the decoder
    /// ([`Decoder`](crate::Decoder)) derive the same mask.
    pub fn set_doc_boundary(&mut self, boundary: Option<u32>) {
        self.doc_boundary = boundary;
    }

    /// Each row's document start `(B,T)` for `tokens (B,T)` under document
    /// masking ([`weft_kernels::doc_starts`]); `None` without it.
    ///
    /// # Errors
    /// [`Error::Batch`] if `tokens` is not `B·T` long.
    pub fn doc_starts(&self, tokens: &[u32], b: usize, t: usize) -> Result<Option<Vec<u32>>> {
        let Some(boundary) = self.doc_boundary else {
            return Ok(None);
        };
        check_len("tokens", tokens.len(), b * t)?;
        let mut starts = vec![0u32; b * t];
        weft_kernels::doc_starts(&mut starts, tokens, boundary, b, t)?;
        Ok(Some(starts))
    }

    /// The embedding's view of a micro-batch's whole `tokens`: this
    /// rank's rows of them, and each row's position `(B,t)` (its
    /// distance from its document's start under document masking); the
    /// positions are `None` when row `i` of a sequence is at position `i`
    /// (one rank of the sequence, no masking).
    fn embed_rows<'a>(&self, tokens: &'a [u32], b: usize, t: usize) -> Result<EmbedRows<'a>> {
        check_len("tokens", tokens.len(), b * self.whole_seq(t))?;
        let starts = self.row_starts(tokens, b, t)?;
        let rows = self.local_rows(tokens, b, t)?;
        if starts.is_none() && self.cp.is_none() {
            return Ok((rows, None));
        }
        Ok((rows, Some(self.row_positions(starts.as_deref(), b * t, t))))
    }

    /// The factor the backward's gradients carry (see
    /// [`set_loss_scale`](Self::set_loss_scale)).
    pub fn loss_scale(&self) -> f32 {
        self.loss_scale
    }

    /// Makes every backward the backward of the mean loss times `scale`
    /// (dynamic loss scaling, for fp16 products: gradients that would
    /// fall below fp16's smallest value are lifted into its range); the
    /// caller divides the gradients by `scale` before the update. The
    /// losses reported stay unscaled. A power of two keeps the division
    /// exact; 1 (the default) is the plain backward, bit for bit.
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Floats in the embedding slice (`wte` then `wpe`).
    pub fn embed_len(&self) -> usize {
        self.pieces.embed.len()
    }

    /// Floats in one block's slice (layer 0's: a feed-forward block that
    /// differs between layers makes the others' differ, see
    /// [`layer_len`](Self::layer_len)).
    pub fn block_len(&self) -> usize {
        self.blk.len()
    }

    /// Floats in layer `l`'s block slice.
    ///
    /// # Panics
    /// If `l` is not a layer of the model.
    pub fn layer_len(&self, l: usize) -> usize {
        self.pieces.blocks[l].len()
    }

    /// Floats in the language-model head's weight (`V·C`, this rank's
    /// vocabulary rows under tensor parallelism).
    pub fn lm_head_len(&self) -> usize {
        self.pieces.lm_head.len()
    }

    /// Floats in the `wte` weight (`V·C`), the first part of the embedding slice.
    pub fn wte_len(&self) -> usize {
        self.pieces.wte.len()
    }

    /// The embedding's range in the [`layout`](Self::layout)'s buffer.
    pub fn embed_range(&self) -> Range<usize> {
        self.pieces.embed.clone()
    }

    /// Block `l`'s range in the [`layout`](Self::layout)'s buffer.
    ///
    /// # Panics
    /// If `l` is not a layer of the model.
    pub fn block_range(&self, l: usize) -> Range<usize> {
        self.pieces.blocks[l].clone()
    }

    /// The final layernorm's range (`ln_f.weight` then `ln_f.bias`).
    pub fn lnf_range(&self) -> Range<usize> {
        self.pieces.lnf.clone()
    }

    /// The head weight's range: `wte`'s when tied, else `lm_head.weight`'s.
    pub fn lm_head_range(&self) -> Range<usize> {
        self.pieces.lm_head.clone()
    }

    /// The rotary positions' table, if positions are rotary.
    pub(crate) fn rope_table(&self) -> Option<&RopeTable<f32>> {
        self.rope.as_deref()
    }

    /// Query heads and attention width on this rank.
    fn heads(&self) -> (usize, usize) {
        let tp = self.tp.as_ref().map_or(1, TensorParallel::size);
        (self.config.n_head / tp, self.config.q_dim() / tp)
    }

    /// Key/value heads and their width on this rank: `n_kv_head / tp`,
    /// or with more ranks than key/value heads a copy of the one its
    /// query heads read.
    fn kv_heads(&self) -> (usize, usize) {
        let tp = self.tp.as_ref().map_or(1, TensorParallel::size);
        let nkv = (self.config.n_kv_head() / tp).max(1);
        (nkv, nkv * self.config.head_dim())
    }

    /// Columns of the fused query, key and value projection on this rank.
    fn qkv_cols(&self) -> usize {
        self.heads().1 + 2 * self.kv_heads().1
    }

    /// The attention kernels' heads on this rank.
    fn attn_heads(&self) -> Heads {
        Heads {
            q: self.heads().0,
            kv: self.kv_heads().0,
        }
    }

    fn layernorm(&self) -> bool {
        self.config.arch.norm == Norm::LayerNorm
    }

    /// `out = norm(inp)` over `rows` rows of C channels, with `w` and `b`
    /// the norm's weight and bias (empty under RMSNorm, which keeps no
    /// `mean`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: &[f32],
        rows: usize,
    ) -> Result<()> {
        let (c, eps) = (self.config.n_embd, self.config.layer_norm_epsilon);
        if self.layernorm() {
            layernorm_forward(out, mean, rstd, inp, w, b, rows, c, eps)?;
        } else {
            rmsnorm_forward(out, rstd, inp, w, rows, c, eps)?;
        }
        Ok(())
    }

    /// Backward of [`norm_forward`](Self::norm_forward), accumulating.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        (mean, rstd): (&[f32], &[f32]),
        rows: usize,
    ) -> Result<()> {
        let c = self.config.n_embd;
        if self.layernorm() {
            layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, rows, c)?;
        } else {
            rmsnorm_backward(dinp, dw, dout, inp, w, rstd, rows, c)?;
        }
        Ok(())
    }

    /// The input half of [`norm_backward`](Self::norm_backward).
    fn norm_backward_input(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        (mean, rstd): (&[f32], &[f32]),
        rows: usize,
    ) -> Result<()> {
        let c = self.config.n_embd;
        if self.layernorm() {
            layernorm_backward_input(dinp, dout, inp, w, mean, rstd, rows, c)?;
        } else {
            rmsnorm_backward_input(dinp, dout, inp, w, rstd, rows, c)?;
        }
        Ok(())
    }

    /// The weight half of [`norm_backward`](Self::norm_backward).
    #[allow(clippy::too_many_arguments)]
    fn norm_backward_weight(
        &self,
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        (mean, rstd): (&[f32], &[f32]),
        rows: usize,
    ) -> Result<()> {
        let c = self.config.n_embd;
        if self.layernorm() {
            layernorm_backward_weight(dw, db, dout, inp, mean, rstd, rows, c)?;
        } else {
            rmsnorm_backward_weight(dw, dout, inp, rstd, rows, c)?;
        }
        Ok(())
    }

    /// Floats of QK-norm's saved input (and of its output gradient):
    /// every query and key head of every token, 0 without QK-norm.
    fn qk_len(&self, n: usize) -> usize {
        if self.config.arch.qk_norm {
            n * (self.heads().1 + self.kv_heads().1)
        } else {
            0
        }
    }

    /// Under QK-norm, saves the queries and keys of `qkv (n, cols)` in
    /// `raw` (queries as `(n·NHa, HS)`, then keys as `(n·NKVa, HS)`) and
    /// replaces them by their RMSNorm with `w` (`q_norm` then `k_norm`).
    pub(crate) fn qk_norm_forward(
        &self,
        qkv: &mut [f32],
        raw: &mut [f32],
        rstd: &mut [f32],
        w: &[f32],
        n: usize,
    ) -> Result<()> {
        let ((nh, ca), (nkv, ckv)) = (self.heads(), self.kv_heads());
        let (cols, hs, eps) = (
            self.qkv_cols(),
            self.config.head_dim(),
            self.config.layer_norm_epsilon,
        );
        let (rq, rk) = raw.split_at_mut(n * ca);
        gather_qk(qkv, rq, rk, cols);
        let mut normed = vec![0.0f32; n * (ca + ckv)];
        let (nq, nk) = normed.split_at_mut(n * ca);
        let (sq, sk) = rstd.split_at_mut(n * nh);
        let (wq, wk) = w.split_at(hs);
        rmsnorm_forward(nq, sq, rq, wq, n * nh, hs, eps)?;
        rmsnorm_forward(nk, sk, rk, wk, n * nkv, hs, eps)?;
        scatter_qk(qkv, nq, nk, cols);
        Ok(())
    }

    /// The input half of QK-norm's backward: moves the normalised
    /// queries' and keys' gradient out of `dqkv` into `dqk` (for the
    /// weight half) and puts the raw ones' gradient in its place.
    fn qk_norm_backward_input(
        &self,
        dqkv: &mut [f32],
        dqk: &mut [f32],
        acts: &BlockActs,
        w: &[f32],
        n: usize,
    ) -> Result<()> {
        let ((nh, ca), (nkv, ckv)) = (self.heads(), self.kv_heads());
        let (cols, hs) = (self.qkv_cols(), self.config.head_dim());
        let (gq, gk) = dqk.split_at_mut(n * ca);
        gather_qk(dqkv, gq, gk, cols);
        let mut draw = vec![0.0f32; n * (ca + ckv)];
        let (dq, dk) = draw.split_at_mut(n * ca);
        let (rq, rk) = acts.qk_raw.split_at(n * ca);
        let (sq, sk) = acts.qk_rstd.split_at(n * nh);
        let (wq, wk) = w.split_at(hs);
        rmsnorm_backward_input(dq, gq, rq, wq, sq, n * nh, hs)?;
        rmsnorm_backward_input(dk, gk, rk, wk, sk, n * nkv, hs)?;
        scatter_qk(dqkv, dq, dk, cols);
        Ok(())
    }

    /// The weight half of QK-norm's backward, from what
    /// [`qk_norm_backward_input`](Self::qk_norm_backward_input) moved to
    /// `dqk`: accumulates `q_norm`'s then `k_norm`'s gradient into `dw`.
    fn qk_norm_backward_weight(
        &self,
        dw: &mut [f32],
        dqk: &[f32],
        acts: &BlockActs,
        n: usize,
    ) -> Result<()> {
        let ((nh, ca), (nkv, _)) = (self.heads(), self.kv_heads());
        let hs = self.config.head_dim();
        let (gq, gk) = dqk.split_at(n * ca);
        let (rq, rk) = acts.qk_raw.split_at(n * ca);
        let (sq, sk) = acts.qk_rstd.split_at(n * nh);
        let (dwq, dwk) = dw.split_at_mut(hs);
        rmsnorm_backward_weight(dwq, gq, rq, sq, n * nh, hs)?;
        rmsnorm_backward_weight(dwk, gk, rk, sk, n * nkv, hs)?;
        Ok(())
    }

    /// Each row's rotary position `(B·T)`: its index in its sequence, or
    /// in its document under document masking (`docs`, its start).
    fn row_positions(&self, docs: Option<&[u32]>, n: usize, t: usize) -> Vec<u32> {
        (0..n)
            .map(|r| {
                // a position is below the position table's length
                #[allow(clippy::cast_possible_truncation)]
                let i = self.position(r % t, t) as u32;
                i - docs.map_or(0, |d| d[r])
            })
            .collect()
    }

    /// Each row's first visible key `(B,t)` under a sliding window of `w`
    /// (and its document's start): [`weft_kernels::window_starts`] by the
    /// rows' positions in their whole sequences.
    fn window_rows(&self, docs: Option<&[u32]>, w: usize, b: usize, t: usize) -> Result<Vec<u32>> {
        let mut starts = vec![0u32; b * t];
        if w == 0 {
            return Err(Error::Config {
                field: "sliding_window",
                reason: "the window must hold at least one key".into(),
            });
        }
        for (r, s) in starts.iter_mut().enumerate() {
            let first = (self.position(r % t, t) + 1).saturating_sub(w);
            let doc = docs.map_or(0, |d| d[r] as usize);
            *s = u32::try_from(first.max(doc)).unwrap_or(u32::MAX);
        }
        Ok(starts)
    }

    /// The rows of `n` tokens a rank's residual stream holds.
    fn rows(&self, n: usize) -> usize {
        self.tp.as_ref().map_or(n, |tp| tp.rows(n))
    }

    /// Floats of a rank's residual stream for a `b`×`t` micro-batch:
    /// `B·T·C`, or its `1/tp` rows under sequence parallelism (what a
    /// pipeline stage sends and receives).
    pub fn residual_len(&self, b: usize, t: usize) -> usize {
        self.rows(b * t) * self.config.n_embd
    }

    fn sp(&self) -> bool {
        self.tp
            .as_ref()
            .is_some_and(TensorParallel::sequence_parallel)
    }

    fn check_shape(&self, b: usize, t: usize) -> Result<()> {
        if b == 0 || t == 0 || t > self.config.block_size {
            return Err(Error::Batch {
                reason: format!(
                    "B={b}, T={t}: need B >= 1 and 1 <= T <= block_size = {}",
                    self.config.block_size
                ),
            });
        }
        if let Some(tp) = &self.tp
            && tp.sequence_parallel()
            && !(b * t).is_multiple_of(tp.size())
        {
            return Err(split_err(
                "sequence parallelism",
                format!(
                    "B·T = {b}·{t} tokens do not split evenly over tp = {}",
                    tp.size()
                ),
            ));
        }
        Ok(())
    }

    fn dims(&self, b: usize, t: usize, mode: Mode, layer: usize) -> Dims<'_> {
        Dims {
            b,
            t,
            c: self.config.n_embd,
            mode,
            precision: self.precision,
            loss_scale: self.loss_scale,
            layer,
            tp: self.tp.as_ref(),
            replay: false,
            selective: self.recompute.selective(),
        }
    }

    /// The lengths of [`BlockActs`]' buffers, in field order, checked
    /// against overflow (sizes a user sets).
    fn block_act_lens(&self, b: usize, t: usize) -> Result<[usize; 16]> {
        self.check_shape(b, t)?;
        let c = self.config.n_embd;
        let (nh, ca) = self.heads();
        let n = product("B·T", &[b, t])?;
        let rows = self.rows(n);
        product("B·T·C (with room for the feed-forward block)", &[n, c, 64])?;
        product("B·T·(Cq+2·Ckv)", &[n, self.qkv_cols(), 64])?;
        let linear = |len| LinearAct::slots(len, self.precision);
        let mean = if self.layernorm() { rows } else { 0 };
        let qk = self.qk_len(n);
        Ok([
            linear(n * c),
            mean,
            rows,
            n * self.qkv_cols(),
            // the attention output stays f32: its backward reads it
            // (`Σ dO·O`); the projection rounds it as it multiplies
            n * ca,
            self.lse_len(b, t)?,
            rows * c,
            LinearAct::slots(n * c, self.ffn_input_precision()),
            mean,
            rows,
            self.ffn.saved_len(&self.dims(b, t, self.mode, 0)),
            rows * c,
            qk,
            if qk > 0 {
                n * (nh + self.kv_heads().0)
            } else {
                0
            },
            if self.rope.is_some() { n } else { 0 },
            if self.masks_attention() { n } else { 0 },
        ])
    }

    /// Floats of one block's attention log-sum-exps, `B·(NH/tp)·T`.
    fn lse_len(&self, b: usize, t: usize) -> Result<usize> {
        product(
            "the attention's B·NH·T log-sum-exps",
            &[b, self.heads().0, t],
        )
    }

    /// Whether some block's attention may be masked (document masking,
    /// or sliding windows): then each block keeps its row starts for the
    /// attention's backward.
    fn masks_attention(&self) -> bool {
        self.doc_boundary.is_some() || self.config.arch.sliding_window.is_some()
    }

    /// Floats of one block's activations for `b`×`t` (what
    /// [`block_acts`](Self::block_acts) allocates): `B·T·C` for each
    /// layernorm's output, `3·B·T·C/tp` for q, k, v, `B·T·C/tp` for the
    /// attention output, `B·(NH/tp)·T` for the attention's log-sum-exps,
    /// `rows·C` for the residual after attention and for the block's
    /// output, `2·rows` per layernorm's statistics, and the feed-forward
    /// block's [`saved_len`](FeedForward::saved_len) (`2·B·T·4C/tp` for
    /// the dense MLP), where `rows` is `B·T`, or `B·T/tp` under sequence
    /// parallelism; under document masking or sliding windows `B·T` row
    /// starts. In `Precision::Bf16` the outputs only products read (ln_1's,
    /// and with a feed-forward block that
    /// [only multiplies its input](FeedForward::input_feeds_products_only)
    /// ln_2's; the dense MLP's GELU output in its own count) are bf16, two
    /// to a float: these counts are 4-byte slots. The attention output
    /// stays f32: the attention's backward reads it.
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts); [`Error::Config`] if a size
    /// overflows.
    pub fn block_acts_len(&self, b: usize, t: usize) -> Result<usize> {
        sum("a block's activations", &self.block_act_lens(b, t)?)
    }

    /// Plans one block's activations for `b` sequences of `t` tokens.
    ///
    /// # Errors
    /// [`Error::Batch`] if `t` exceeds `block_size` or `b*t` is 0;
    /// [`Error::Split`] if sequence parallelism cannot split `b·t`;
    /// [`Error::Config`] if a size overflows.
    pub fn block_acts(&self, b: usize, t: usize) -> Result<BlockActs> {
        let l = self.block_act_lens(b, t)?;
        let z = |k: usize| vec![0.0f32; k];
        let n = b * t;
        let c = self.config.n_embd;
        Ok(BlockActs {
            b,
            t,
            layer: 0,
            ln1: LinearAct::new(n * c, self.precision),
            ln1_mean: z(l[1]),
            ln1_rstd: z(l[2]),
            qkv: z(l[3]),
            atty: z(l[4]),
            lse: z(l[5]),
            res2: z(l[6]),
            ln2: LinearAct::new(n * c, self.ffn_input_precision()),
            ln2_mean: z(l[8]),
            ln2_rstd: z(l[9]),
            ffn_saved: z(l[10]),
            out: z(l[11]),
            qk_raw: z(l[12]),
            qk_rstd: z(l[13]),
            pos: vec![0; l[14]],
            mask: vec![0; l[15]],
            masked: false,
        })
    }

    /// Plans block `layer`'s activations: [`block_acts`](Self::block_acts),
    /// or for a block that [recomputes](Self::set_recompute) only its
    /// output, `rows·C` floats ([`kept_len`](Self::kept_len)).
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts).
    pub fn block_acts_for(&self, layer: usize, b: usize, t: usize) -> Result<BlockActs> {
        if !self.recompute.recomputes(layer) {
            return self.block_acts(b, t);
        }
        let out = self.kept_len(b, t)?;
        Ok(BlockActs {
            b,
            t,
            layer,
            ln1: LinearAct::F32(Vec::new()),
            ln1_mean: Vec::new(),
            ln1_rstd: Vec::new(),
            qkv: Vec::new(),
            qk_raw: Vec::new(),
            qk_rstd: Vec::new(),
            pos: Vec::new(),
            atty: Vec::new(),
            lse: Vec::new(),
            mask: Vec::new(),
            masked: false,
            res2: Vec::new(),
            ln2: LinearAct::F32(Vec::new()),
            ln2_mean: Vec::new(),
            ln2_rstd: Vec::new(),
            ffn_saved: Vec::new(),
            out: vec![0.0; out],
        })
    }

    /// Floats a recomputed block keeps: its output, `rows·C`.
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts).
    pub fn kept_len(&self, b: usize, t: usize) -> Result<usize> {
        Ok(self.block_act_lens(b, t)?[11])
    }

    /// Floats of block `layer`'s activations as
    /// [`block_acts_for`](Self::block_acts_for) plans them.
    ///
    /// # Errors
    /// As [`block_acts_len`](Self::block_acts_len).
    pub fn block_acts_len_for(&self, layer: usize, b: usize, t: usize) -> Result<usize> {
        if self.recompute.recomputes(layer) {
            self.kept_len(b, t)
        } else {
            self.block_acts_len(b, t)
        }
    }

    /// Lengths of [`HeadActs`]' buffers: targets, `lnf`, its statistics,
    /// logits, losses, row statistics.
    fn head_act_lens(&self, b: usize, t: usize) -> Result<[usize; 7]> {
        self.check_shape(b, t)?;
        let c = self.config.n_embd;
        let n = product("B·T", &[b, t])?;
        let rows = self.rows(n);
        Ok([
            n,
            product("B·T·C", &[n, c])?,
            if self.layernorm() { rows } else { 0 },
            rows,
            product(
                "the logits (B·T or the loss chunk)·V",
                &[self.head_chunk_rows(n), self.vocab.len()],
            )?,
            n,
            2 * n,
        ])
    }

    /// Floats (and 4-byte targets) of the head's activations, what
    /// [`head_acts`](Self::head_acts) allocates: `B·T·C` for the final
    /// layernorm's output, `B·T·V/tp` logits (one loss chunk's rows
    /// under [`set_loss_chunk`](Self::set_loss_chunk)), `B·T` targets and losses,
    /// `2·B·T` row statistics of the cross-entropy, `2·rows` of the
    /// layernorm's.
    ///
    /// # Errors
    /// As [`head_acts`](Self::head_acts).
    pub fn head_acts_len(&self, b: usize, t: usize) -> Result<usize> {
        sum("the head's activations", &self.head_act_lens(b, t)?)
    }

    /// Bytes of the head's activations for micro-batches of `b × t`
    /// tokens: as planned (one loss chunk's logits under
    /// [`set_loss_chunk`](Self::set_loss_chunk)), and with the whole
    /// micro-batch's logits.
    ///
    /// # Errors
    /// As [`head_acts`](Self::head_acts).
    pub fn head_bytes(&self, b: usize, t: usize) -> Result<(usize, usize)> {
        let held = self.head_acts_len(b, t)?;
        let n = b * t;
        let whole = held + (n - self.head_chunk_rows(n)) * self.vocab.len();
        Ok((4 * held, 4 * whole))
    }

    /// Plans the head's activations.
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts).
    pub fn head_acts(&self, b: usize, t: usize) -> Result<HeadActs> {
        let l = self.head_act_lens(b, t)?;
        Ok(HeadActs {
            b,
            t,
            chunk: self.head_chunk_rows(b * t),
            targets: vec![0; l[0]],
            has_targets: false,
            lnf: vec![0.0; l[1]],
            lnf_mean: vec![0.0; l[2]],
            lnf_rstd: vec![0.0; l[3]],
            logits: vec![0.0; l[4]],
            losses: vec![0.0; l[5]],
            stats: vec![0.0; l[6]],
        })
    }

    /// Lengths of [`BlockScratch`]' planned buffers: `tmp`, `dln`,
    /// `datty`, `dqkv`, the feed-forward block's scratch, and the
    /// sequence-parallel `rows` and `full`.
    fn scratch_lens(&self, b: usize, t: usize) -> Result<[usize; 7]> {
        let l = self.block_act_lens(b, t)?;
        let c = self.config.n_embd;
        let n = b * t;
        let sp = |k: usize| if self.sp() { k } else { 0 };
        Ok([
            n * c,
            n * c,
            n * self.heads().1,
            l[3],
            self.ffn.scratch_len(&self.dims(b, t, self.mode, 0)),
            sp(self.rows(n) * c),
            sp(n * c),
        ])
    }

    /// Floats of the shared working buffers, what
    /// [`scratch`](Self::scratch) allocates: two `B·T·C`, the attention's
    /// gradients (as large as its q, k, v and output), the
    /// feed-forward block's [`scratch_len`](FeedForward::scratch_len),
    /// under sequence parallelism `rows·C` + `B·T·C` for the gathers, and
    /// with [recomputation](Self::set_recompute) one block's activations
    /// ([`block_acts_len`](Self::block_acts_len)).
    ///
    /// # Errors
    /// As [`scratch`](Self::scratch).
    pub fn scratch_len(&self, b: usize, t: usize) -> Result<usize> {
        let replay = if self.recompute.any(0..self.config.n_layer) {
            self.block_acts_len(b, t)?
        } else {
            0
        };
        sum(
            "the working buffers",
            &[
                sum("the working buffers", &self.scratch_lens(b, t)?)?,
                replay,
            ],
        )
    }

    /// Plans the shared working buffers.
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts).
    pub fn scratch(&self, b: usize, t: usize) -> Result<BlockScratch> {
        let l = self.scratch_lens(b, t)?;
        Ok(BlockScratch {
            tmp: vec![0.0; l[0]],
            dln: vec![0.0; l[1]],
            datty: vec![0.0; l[2]],
            dqkv: vec![0.0; l[3]],
            ffn_scratch: vec![0.0; l[4]],
            rows: vec![0.0; l[5]],
            full: vec![0.0; l[6]],
            sink_x: Vec::new(),
            sink_p: Vec::new(),
            replay: if self.recompute.any(0..self.config.n_layer) {
                Some(Box::new(self.block_acts(b, t)?))
            } else {
                None
            },
        })
    }

    /// Lengths of [`WeightInputs`]' buffers.
    fn weight_input_lens(&self, b: usize, t: usize) -> Result<[usize; 7]> {
        let l = self.block_act_lens(b, t)?;
        let c = self.config.n_embd;
        let n = b * t;
        let rc = self.rows(n) * c;
        Ok([
            rc,
            rc,
            n * c,
            l[3],
            rc,
            self.ffn
                .split_saved_len(&self.dims(b, t, Mode::Throughput, 0)),
            l[12],
        ])
    }

    /// Floats of what a block's B saves for its W, what
    /// [`weight_inputs`](Self::weight_inputs) allocates.
    ///
    /// # Errors
    /// As [`weight_inputs`](Self::weight_inputs).
    pub fn weight_inputs_len(&self, b: usize, t: usize) -> Result<usize> {
        sum("a block's saved gradients", &self.weight_input_lens(b, t)?)
    }

    /// Plans what a block's B saves for its W.
    ///
    /// # Errors
    /// As [`block_acts`](Self::block_acts).
    pub fn weight_inputs(&self, b: usize, t: usize) -> Result<WeightInputs> {
        let l = self.weight_input_lens(b, t)?;
        Ok(WeightInputs {
            dres3: vec![0.0; l[0]],
            dln2: vec![0.0; l[1]],
            dres2: vec![0.0; l[2]],
            dqkv: vec![0.0; l[3]],
            dln1: vec![0.0; l[4]],
            dffn: vec![0.0; l[5]],
            dqk: vec![0.0; l[6]],
            ready: false,
        })
    }

    /// Token plus position embedding: `out (rows,C) = wte[tokens] +
    /// wpe[pos]`; `params` is the embedding slice (`wte` then `wpe`).
    /// Vocabulary-parallel under tensor parallelism: each rank's rows of
    /// `wte`, summed over the group (exact: one non-zero term per element).
    /// `tokens` are the micro-batch's whole sequences, `B·T` (`T = t` but
    /// under [context parallelism](Self::set_context_parallel), which
    /// embeds this rank's `t` rows of each).
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a token
    /// outside the vocabulary; a collective error.
    pub fn embed_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        params: &[f32],
        b: usize,
        t: usize,
    ) -> Result<()> {
        check_len("embedding parameters", params.len(), self.embed_len())?;
        self.check_shape(b, t)?;
        let c = self.config.n_embd;
        let (wte, wpe) = params.split_at(self.wte_len());
        let (tokens, positions) = self.embed_rows(tokens, b, t)?;
        let tokens = &tokens[..];
        if wpe.is_empty() {
            // Rotary positions: the token embedding alone.
            let n = b * t;
            let Some(tp) = &self.tp else {
                self.vocab.embed(out, tokens, wte, c)?;
                return Ok(());
            };
            let mut all = vec![0.0f32; n * c];
            self.vocab.embed(&mut all, tokens, wte, c)?;
            if tp.sequence_parallel() {
                tp.reduce_scatter(&all, out)?;
            } else {
                tp.all_reduce(&mut all)?;
                out.copy_from_slice(&all);
            }
            return Ok(());
        }
        let Some(tp) = &self.tp else {
            encoder_forward(out, tokens, positions.as_deref(), wte, wpe, b, t, c)?;
            return Ok(());
        };
        let n = b * t;
        let mut all = vec![0.0f32; n * c];
        self.vocab.embed(&mut all, tokens, wte, c)?;
        if tp.sequence_parallel() {
            tp.reduce_scatter(&all, out)?;
        } else {
            tp.all_reduce(&mut all)?;
            out.copy_from_slice(&all);
        }
        let first = tp.first_row(n);
        for (i, row) in out.chunks_exact_mut(c).enumerate() {
            let pos = positions
                .as_ref()
                .map_or((first + i) % t, |p| p[first + i] as usize);
            for (o, &x) in row.iter_mut().zip(&wpe[pos * c..(pos + 1) * c]) {
                *o += x;
            }
        }
        Ok(())
    }

    /// Backward of [`embed_forward`](Self::embed_forward), accumulating into
    /// the embedding's gradient slice (`dwte` then `dwpe`) from this rank's
    /// rows of the output gradient. The embedding has no input gradient, so
    /// this is a weight-only (W) step. `tokens` as
    /// [`embed_forward`](Self::embed_forward)'s.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a token
    /// outside the vocabulary; a collective error.
    pub fn embed_backward(
        &self,
        grads: &mut [f32],
        dout: &[f32],
        tokens: &[u32],
        b: usize,
        t: usize,
    ) -> Result<()> {
        check_len("embedding gradients", grads.len(), self.embed_len())?;
        self.check_shape(b, t)?;
        let c = self.config.n_embd;
        let (dwte, dwpe) = grads.split_at_mut(self.wte_len());
        let (tokens, positions) = self.embed_rows(tokens, b, t)?;
        let tokens = &tokens[..];
        let dwpe = (!dwpe.is_empty()).then_some(dwpe);
        let Some(tp) = &self.tp else {
            match dwpe {
                Some(dwpe) => {
                    encoder_backward(dwte, dwpe, dout, tokens, positions.as_deref(), b, t, c)?;
                }
                None => self
                    .vocab
                    .embed_backward(dwte, None, dout, tokens, None, t, c)?,
            }
            return Ok(());
        };
        let mut full = vec![0.0f32; if tp.sequence_parallel() { b * t * c } else { 0 }];
        let dall = tp.enter_column(dout, &mut full)?;
        self.vocab
            .embed_backward(dwte, dwpe, dall, tokens, positions.as_deref(), t, c)?;
        Ok(())
    }

    /// One transformer block: `x + attn(ln_1(x))`, then `y + ffn(ln_2(y))`,
    /// over this rank's rows `inp (rows,C)` with the parameter slice of
    /// layer `layer` (its index in the whole model, which the feed-forward
    /// block sees in [`Dims::layer`]; the backward passes on the same
    /// index); the output is [`acts.out()`](BlockActs::out). `docs` is the
    /// micro-batch's document starts `(B,T)` under document masking
    /// ([`doc_starts`](Self::doc_starts)), else `None`.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong parameter slice length; a kernel error
    /// if `inp` or `scratch` does not fit `acts`' shape; a collective error.
    pub fn block_forward(
        &self,
        layer: usize,
        acts: &mut BlockActs,
        inp: &[f32],
        params: &[f32],
        docs: Option<&[u32]>,
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        self.forward_block(layer, acts, inp, params, docs, scratch, false)
    }

    /// [`block_forward`](Self::block_forward) again, for the backward of a
    /// block that [recomputes](Self::set_recompute): the same bits, and a
    /// feed-forward block that keeps statistics does not count them twice
    /// ([`Dims::replay`]).
    ///
    /// # Errors
    /// As [`block_forward`](Self::block_forward).
    pub(crate) fn block_replay(
        &self,
        layer: usize,
        acts: &mut BlockActs,
        inp: &[f32],
        params: &[f32],
        docs: Option<&[u32]>,
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        self.forward_block(layer, acts, inp, params, docs, scratch, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_block(
        &self,
        layer: usize,
        acts: &mut BlockActs,
        inp: &[f32],
        params: &[f32],
        docs: Option<&[u32]>,
        scratch: &mut BlockScratch,
        replay: bool,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.layer_len(layer))?;
        acts.layer = layer;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let rows = self.rows(n);
        let c = self.config.n_embd;
        let ca = self.heads().1;
        let (p, blk, mode) = (params, &self.blk, self.mode);
        let tp = self.tp.as_ref();
        if acts.ln1.is_bf16() && self.precision != Precision::Bf16 {
            return Err(Error::Config {
                field: "precision",
                reason: format!(
                    "the activations were planned for bf16 products, the blocks compute in {}: \
                     plan them after set_precision",
                    self.precision.name()
                ),
            });
        }
        // ln_1 over the rank's rows (gathered for the column-parallel QKV);
        // stored in bf16 (rounded from `tmp`, or from `full` under SP) when
        // the products round it to bf16 anyway
        let ln1: &mut [f32] = if self.sp() {
            &mut scratch.rows
        } else {
            acts.ln1.target(&mut scratch.tmp)
        };
        self.norm_forward(
            ln1,
            &mut acts.ln1_mean,
            &mut acts.ln1_rstd,
            inp,
            &p[blk.ln1_w.clone()],
            &p[blk.ln1_b.clone()],
            rows,
        )?;
        if let Some(tp) = tp.filter(|tp| tp.sequence_parallel()) {
            tp.all_gather(&scratch.rows, acts.ln1.target(&mut scratch.full))?;
            acts.ln1.settle(&scratch.full)?;
        } else {
            acts.ln1.settle(&scratch.tmp)?;
        }
        // column-parallel QKV over the rank's heads; QK-norm, rotation
        let cols = self.qkv_cols();
        matmul_forward(
            &mut acts.qkv,
            acts.ln1.input(),
            &p[blk.qkv_w.clone()],
            bias(p, &blk.qkv_b),
            b,
            t,
            c,
            cols,
            mode,
            self.precision,
        )?;
        if self.config.arch.qk_norm {
            self.qk_norm_forward(
                &mut acts.qkv,
                &mut acts.qk_raw,
                &mut acts.qk_rstd,
                &p[blk.qk_norm.clone()],
                n,
            )?;
        }
        if let Some(d) = docs {
            check_len("document starts", d.len(), n)?;
        }
        if let Some(table) = &self.rope {
            acts.pos = self.row_positions(docs, n, t);
            let heads = self.heads().0 + self.kv_heads().0;
            rope_forward(&mut acts.qkv, table, &acts.pos, n, cols, heads)?;
        }
        let starts = match self.config.window(layer) {
            Some(w) => Some(self.window_rows(docs, w, b, t)?),
            None => None,
        };
        let mask = starts.as_deref().or(docs);
        match &self.cp {
            None => attention_forward(
                &mut acts.atty,
                &mut acts.lse,
                &acts.qkv,
                mask,
                b,
                t,
                ca,
                self.attn_heads(),
            )?,
            Some(cp) => cp.forward(
                &mut acts.atty,
                &mut acts.lse,
                &self.ring_in(&acts.qkv, mask, layer, b, t),
            )?,
        }
        acts.masked = mask.is_some();
        if let Some(m) = mask {
            check_len("the kept attention mask", acts.mask.len(), m.len())?;
            acts.mask.copy_from_slice(m);
        }
        // row-parallel output projection, summed over the group
        let y: &mut [f32] = if self.sp() {
            &mut scratch.rows
        } else {
            &mut scratch.tmp[..rows * c]
        };
        match tp {
            None => matmul_forward(
                y,
                &acts.atty[..],
                &p[blk.proj_w.clone()],
                bias(p, &blk.proj_b),
                b,
                t,
                ca,
                c,
                mode,
                self.precision,
            )?,
            Some(tp) => tp.row_forward(
                y,
                &mut scratch.full,
                (&acts.atty).into(),
                &p[blk.proj_w.clone()],
                bias(p, &blk.proj_b),
                (b, t),
                (ca, c),
                mode,
                self.precision,
            )?,
        }
        let y: &[f32] = if self.sp() {
            &scratch.rows
        } else {
            &scratch.tmp[..rows * c]
        };
        residual_forward(&mut acts.res2, inp, y, rows * c)?;
        let ln2: &mut [f32] = if self.sp() {
            &mut scratch.rows
        } else {
            acts.ln2.target(&mut scratch.tmp)
        };
        self.norm_forward(
            ln2,
            &mut acts.ln2_mean,
            &mut acts.ln2_rstd,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            &p[blk.ln2_b.clone()],
            rows,
        )?;
        if let Some(tp) = tp.filter(|tp| tp.sequence_parallel()) {
            tp.all_gather(&scratch.rows, acts.ln2.target(&mut scratch.full))?;
            acts.ln2.settle(&scratch.full)?;
        } else {
            acts.ln2.settle(&scratch.tmp)?;
        }
        let y = &mut scratch.tmp[..rows * c];
        self.ffn.forward(
            y,
            &mut acts.ffn_saved,
            &mut scratch.ffn_scratch,
            acts.ln2.input(),
            &p[blk.ffn.start..],
            Dims {
                replay,
                ..self.dims(b, t, mode, layer)
            },
        )?;
        residual_forward(&mut acts.out, &acts.res2, y, rows * c)?;
        Ok(())
    }

    /// The attention's backward for `acts`' block: `dqkv` from the output
    /// gradient `datty`, with the kept queries, keys and values, output
    /// (kept in f32 in every precision), log-sum-exps and row starts.
    fn attention_backward(&self, dqkv: &mut [f32], datty: &[f32], acts: &BlockActs) -> Result<()> {
        let (b, t) = (acts.b, acts.t);
        let ca = self.heads().1;
        let mask = acts.masked.then_some(&acts.mask[..]);
        if let Some(cp) = &self.cp {
            return cp.backward(
                dqkv,
                (datty, &acts.atty, &acts.lse),
                &self.ring_in(&acts.qkv, mask, acts.layer, b, t),
            );
        }
        attention_backward(
            dqkv,
            datty,
            &acts.qkv,
            &acts.atty,
            &acts.lse,
            mask,
            b,
            t,
            ca,
            self.attn_heads(),
        )?;
        Ok(())
    }

    /// The ring's view of a block's attention inputs on this rank.
    fn ring_in<'a>(
        &self,
        qkv: &'a [f32],
        starts: Option<&'a [u32]>,
        layer: usize,
        b: usize,
        t: usize,
    ) -> RingIn<'a> {
        RingIn {
            qkv,
            starts,
            b,
            t,
            c: self.heads().1,
            heads: self.attn_heads(),
            window: self.config.window(layer),
        }
    }

    /// The whole backward of a block: on entry `dres (rows,C)` holds the
    /// gradient of the block's output, on return the gradient of its input
    /// `inp` (the same `inp` the forward saw); the block's parameter
    /// gradients are accumulated into `grads` (its gradient slice).
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error on a shape
    /// mismatch; a collective error.
    pub fn block_backward(
        &self,
        dres: &mut [f32],
        grads: &mut [f32],
        acts: &BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.layer_len(acts.layer))?;
        check_len("block gradients", grads.len(), self.layer_len(acts.layer))?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let rows = self.rows(n);
        let c = self.config.n_embd;
        let ca = self.heads().1;
        let cols = self.qkv_cols();
        let tp = self.tp.as_ref();
        // Parameter gradients sum over the batch whatever the mode, and input
        // gradients need no invariance: whole-batch GEMMs are faster.
        let mode = Mode::Throughput;
        let (p, g, blk) = (params, grads, &self.blk);
        // Feed-forward block: dres is d(res3) = d(ffn out) and part of d(res2).
        let dln2 = &mut scratch.dln[..rows * c];
        weft_kernels::zero(dln2);
        self.ffn.backward(
            dln2,
            &mut g[blk.ffn.start..],
            &mut scratch.ffn_scratch,
            dres,
            acts.ln2.input(),
            &acts.ffn_saved,
            &p[blk.ffn.start..],
            self.dims(b, t, mode, acts.layer),
        )?;
        let (dw, db) = two_mut(g, blk.ln2_w.clone(), blk.ln2_b.clone());
        self.norm_backward(
            dres,
            dw,
            db,
            dln2,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            (&acts.ln2_mean, &acts.ln2_rstd),
            rows,
        )?;
        // Attention: dres is now d(res2) = d(attn proj out) and part of
        // d(inp); the row-parallel projection needs all of it.
        weft_kernels::zero(&mut scratch.datty);
        let (dw, db) = two_mut(g, blk.proj_w.clone(), blk.proj_b.clone());
        let db = (!db.is_empty()).then_some(db);
        let dy = gathered(tp, dres, &mut scratch.full)?;
        matmul_backward(
            &mut scratch.datty,
            dw,
            db,
            dy,
            &acts.atty[..],
            &p[blk.proj_w.clone()],
            b,
            t,
            ca,
            c,
            mode,
            self.precision,
        )?;
        weft_kernels::zero(&mut scratch.dqkv);
        self.attention_backward(&mut scratch.dqkv, &scratch.datty, acts)?;
        if let Some(table) = &self.rope {
            let heads = self.heads().0 + self.kv_heads().0;
            rope_backward(&mut scratch.dqkv, table, &acts.pos, n, cols, heads)?;
        }
        if self.config.arch.qk_norm {
            let mut dqk = vec![0.0f32; self.qk_len(n)];
            let w = &p[blk.qk_norm.clone()];
            self.qk_norm_backward_input(&mut scratch.dqkv, &mut dqk, acts, w, n)?;
            self.qk_norm_backward_weight(&mut g[blk.qk_norm.clone()], &dqk, acts, n)?;
        }
        weft_kernels::zero(&mut scratch.dln);
        let (dw, db) = two_mut(g, blk.qkv_w.clone(), blk.qkv_b.clone());
        let db = (!db.is_empty()).then_some(db);
        matmul_backward(
            &mut scratch.dln,
            dw,
            db,
            &scratch.dqkv,
            acts.ln1.input(),
            &p[blk.qkv_w.clone()],
            b,
            t,
            c,
            cols,
            mode,
            self.precision,
        )?;
        // f's backward: the column-parallel QKV's input gradient, summed
        let dln1: &[f32] = match tp {
            Some(tp) => tp.column_input_grad(&mut scratch.dln, &mut scratch.rows)?,
            None => &scratch.dln,
        };
        let (dw, db) = two_mut(g, blk.ln1_w.clone(), blk.ln1_b.clone());
        self.norm_backward(
            dres,
            dw,
            db,
            dln1,
            inp,
            &p[blk.ln1_w.clone()],
            (&acts.ln1_mean, &acts.ln1_rstd),
            rows,
        )?;
        Ok(())
    }

    /// Sizes the sinks for the feed-forward block's discarded halves:
    /// empty for a block that splits its backward.
    fn sinks(&self, scratch: &mut BlockScratch, d: &Dims<'_>) {
        let (x, p) = if self.ffn.split_saved_len(d) == 0 {
            (d.rows() * d.c, self.layer_len(d.layer) - self.blk.ffn.start)
        } else {
            (0, 0)
        };
        if scratch.sink_x.len() != x {
            scratch.sink_x = vec![0.0; x];
        }
        if scratch.sink_p.len() != p {
            scratch.sink_p = vec![0.0; p];
        }
    }

    /// Backward-for-input (B) of a block: like
    /// [`block_backward`](Self::block_backward) for `dres`, but leaves the
    /// parameter gradients for [`block_backward_weight`](Self::block_backward_weight),
    /// saving what it needs in `saved`.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error on a shape
    /// mismatch; a collective error.
    pub fn block_backward_input(
        &self,
        dres: &mut [f32],
        saved: &mut WeightInputs,
        acts: &BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.layer_len(acts.layer))?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let rows = self.rows(n);
        let c = self.config.n_embd;
        let ca = self.heads().1;
        let cols = self.qkv_cols();
        let tp = self.tp.as_ref();
        check_len("B's saved gradients", saved.dres3.len(), rows * c)?;
        let mode = Mode::Throughput;
        let (p, blk) = (params, &self.blk);
        let d = self.dims(b, t, mode, acts.layer);
        self.sinks(scratch, &d);
        saved.dres3.copy_from_slice(dres);
        // A feed-forward block that cannot split its backward sends its
        // parameter gradients to the sink here and computes them again in W.
        weft_kernels::zero(&mut saved.dln2);
        let sink = &mut scratch.sink_p;
        self.ffn.backward_input(
            &mut saved.dln2,
            &mut saved.dffn,
            sink,
            &mut scratch.ffn_scratch,
            dres,
            acts.ln2.input(),
            &acts.ffn_saved,
            &p[blk.ffn.start..],
            d,
        )?;
        self.norm_backward_input(
            dres,
            &saved.dln2,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            (&acts.ln2_mean, &acts.ln2_rstd),
            rows,
        )?;
        let dy = gathered(tp, dres, &mut scratch.full)?;
        saved.dres2.copy_from_slice(dy);
        weft_kernels::zero(&mut scratch.datty);
        matmul_backward_input(
            &mut scratch.datty,
            &saved.dres2,
            &p[blk.proj_w.clone()],
            b,
            t,
            ca,
            c,
            mode,
            self.precision,
        )?;
        weft_kernels::zero(&mut saved.dqkv);
        self.attention_backward(&mut saved.dqkv, &scratch.datty, acts)?;
        if let Some(table) = &self.rope {
            let heads = self.heads().0 + self.kv_heads().0;
            rope_backward(&mut saved.dqkv, table, &acts.pos, n, cols, heads)?;
        }
        if self.config.arch.qk_norm {
            let w = &p[blk.qk_norm.clone()];
            self.qk_norm_backward_input(&mut saved.dqkv, &mut saved.dqk, acts, w, n)?;
        }
        let dln1: &[f32] = match tp {
            None => {
                weft_kernels::zero(&mut saved.dln1);
                matmul_backward_input(
                    &mut saved.dln1,
                    &saved.dqkv,
                    &p[blk.qkv_w.clone()],
                    b,
                    t,
                    c,
                    cols,
                    mode,
                    self.precision,
                )?;
                &saved.dln1
            }
            Some(tp) => {
                weft_kernels::zero(&mut scratch.dln);
                matmul_backward_input(
                    &mut scratch.dln,
                    &saved.dqkv,
                    &p[blk.qkv_w.clone()],
                    b,
                    t,
                    c,
                    cols,
                    mode,
                    self.precision,
                )?;
                let r = tp.column_input_grad(&mut scratch.dln, &mut scratch.rows)?;
                saved.dln1.copy_from_slice(r);
                &saved.dln1
            }
        };
        self.norm_backward_input(
            dres,
            dln1,
            inp,
            &p[blk.ln1_w.clone()],
            (&acts.ln1_mean, &acts.ln1_rstd),
            rows,
        )?;
        saved.ready = true;
        Ok(())
    }

    /// Backward-for-weights (W) of a block: accumulates the block's
    /// parameter gradients into `grads` from what
    /// [`block_backward_input`](Self::block_backward_input) saved.
    /// `acts`, `inp` and `params` must be those B saw.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length or if `saved` holds no B
    /// result (each B's result feeds exactly one W); a kernel error on a
    /// shape mismatch.
    pub fn block_backward_weight(
        &self,
        grads: &mut [f32],
        saved: &mut WeightInputs,
        acts: &BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.layer_len(acts.layer))?;
        check_len("block gradients", grads.len(), self.layer_len(acts.layer))?;
        if !saved.ready {
            return Err(Error::Batch {
                reason: "backward-for-weights needs a backward-for-input of the same block first"
                    .into(),
            });
        }
        saved.ready = false;
        let (b, t) = (acts.b, acts.t);
        let rows = self.rows(b * t);
        let c = self.config.n_embd;
        let ca = self.heads().1;
        let mode = Mode::Throughput;
        let (p, g, blk) = (params, grads, &self.blk);
        let d = self.dims(b, t, mode, acts.layer);
        self.sinks(scratch, &d);
        self.ffn.backward_weight(
            &mut g[blk.ffn.start..],
            &saved.dffn,
            &mut scratch.sink_x,
            &mut scratch.ffn_scratch,
            &saved.dres3,
            acts.ln2.input(),
            &acts.ffn_saved,
            &p[blk.ffn.start..],
            d,
        )?;
        let (dw, db) = two_mut(g, blk.ln2_w.clone(), blk.ln2_b.clone());
        self.norm_backward_weight(
            dw,
            db,
            &saved.dln2,
            &acts.res2,
            (&acts.ln2_mean, &acts.ln2_rstd),
            rows,
        )?;
        let (dw, db) = two_mut(g, blk.proj_w.clone(), blk.proj_b.clone());
        let db = (!db.is_empty()).then_some(db);
        matmul_backward_weight(
            dw,
            db,
            &saved.dres2,
            &acts.atty[..],
            b,
            t,
            ca,
            c,
            self.precision,
        )?;
        if self.config.arch.qk_norm {
            self.qk_norm_backward_weight(&mut g[blk.qk_norm.clone()], &saved.dqk, acts, b * t)?;
        }
        let (dw, db) = two_mut(g, blk.qkv_w.clone(), blk.qkv_b.clone());
        let db = (!db.is_empty()).then_some(db);
        matmul_backward_weight(
            dw,
            db,
            &saved.dqkv,
            acts.ln1.input(),
            b,
            t,
            c,
            self.qkv_cols(),
            self.precision,
        )?;
        let (dw, db) = two_mut(g, blk.ln1_w.clone(), blk.ln1_b.clone());
        self.norm_backward_weight(
            dw,
            db,
            &saved.dln1,
            inp,
            (&acts.ln1_mean, &acts.ln1_rstd),
            rows,
        )?;
        Ok(())
    }

    /// The head: final layernorm over this rank's rows `inp (rows,C)`,
    /// logits through `lm_head (V,C)`, and with `targets (B,T)` the
    /// per-token cross-entropy and the mean loss (accumulated in f64),
    /// returned; without targets it returns `None` and only the logits are
    /// meaningful. `lnf` is `ln_f.weight` then `ln_f.bias`. Under tensor
    /// parallelism the logits are this rank's vocabulary columns and the
    /// loss is computed without gathering them.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a
    /// target outside the vocabulary or a shape mismatch; a collective
    /// error.
    pub fn head_forward(
        &self,
        acts: &mut HeadActs,
        inp: &[f32],
        lnf: &[f32],
        lm_head: &[f32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let c = self.config.n_embd;
        let vl = self.vocab.len();
        check_len("ln_f parameters", lnf.len(), self.pieces.lnf.len())?;
        check_len("lm_head", lm_head.len(), self.lm_head_len())?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let rows = self.rows(n);
        if let Some(tg) = targets {
            check_len("targets", tg.len(), n)?;
            weft_kernels::check_tokens("targets", tg, self.config.vocab_size)?;
        }
        let (lw, lb) = lnf.split_at(c);
        let tp = self.tp.as_ref();
        let mut rows_buf = vec![0.0f32; if self.sp() { rows * c } else { 0 }];
        let out: &mut [f32] = if self.sp() {
            &mut rows_buf
        } else {
            &mut acts.lnf
        };
        self.norm_forward(
            out,
            &mut acts.lnf_mean,
            &mut acts.lnf_rstd,
            inp,
            lw,
            lb,
            rows,
        )?;
        if let Some(tp) = tp.filter(|tp| tp.sequence_parallel()) {
            tp.all_gather(&rows_buf, &mut acts.lnf)?;
        }
        let chunk = acts.chunk.max(1);
        if targets.is_none() && chunk < n {
            return Err(Error::Batch {
                reason: format!(
                    "logits without targets are the whole micro-batch's {n} rows, but the \
                     head holds a loss chunk of {chunk}: plan the activations without a loss \
                     chunk to read logits"
                ),
            });
        }
        acts.has_targets = false;
        for r0 in (0..n).step_by(chunk) {
            let len = chunk.min(n - r0);
            self.chunk_logits(acts, r0, len, lm_head)?;
            let Some(tg) = targets else { continue };
            let (tg, logits) = (&tg[r0..r0 + len], &acts.logits[..len * vl]);
            let losses = &mut acts.losses[r0..r0 + len];
            let stats = &mut acts.stats[2 * r0..2 * (r0 + len)];
            match tp {
                None => fused_classifier_forward(logits, losses, stats, tg, len, vl, vl)?,
                Some(tp) => self.vocab.cross_entropy(tp, logits, tg, losses, stats)?,
            }
        }
        let Some(tg) = targets else {
            return Ok(None);
        };
        acts.targets.copy_from_slice(tg);
        acts.has_targets = true;
        let sum: f64 = acts.losses.iter().map(|&x| f64::from(x)).sum();
        #[allow(clippy::cast_precision_loss)]
        Ok(Some(sum / n as f64))
    }

    /// Rows `r0..r0 + len` of the head's logits, from the final
    /// layernorm's output, into the front of `acts.logits`.
    fn chunk_logits(
        &self,
        acts: &mut HeadActs,
        r0: usize,
        len: usize,
        lm_head: &[f32],
    ) -> Result<()> {
        let (c, vl) = (self.config.n_embd, self.vocab.len());
        matmul_forward_wt(
            &mut acts.logits[..len * vl],
            &acts.lnf[r0 * c..(r0 + len) * c],
            lm_head,
            None,
            1,
            len,
            c,
            vl,
            self.mode,
            self.precision,
        )?;
        Ok(())
    }

    /// Backward of the head for the mean loss of the last
    /// [`head_forward`](Self::head_forward) (which must have had targets):
    /// overwrites `dinp (rows,C)` with the gradient of the head's input,
    /// accumulates `dlnf` (`ln_f` weight then bias) and `dlm_head (V,C)`,
    /// and turns the logits into their gradient. `inp` is the input the
    /// forward saw.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length or if the last forward had
    /// no targets; a kernel error on a shape mismatch; a collective error.
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward(
        &self,
        dinp: &mut [f32],
        dlnf: &mut [f32],
        dlm_head: &mut [f32],
        acts: &mut HeadActs,
        inp: &[f32],
        lnf: &[f32],
        lm_head: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        let c = self.config.n_embd;
        let vl = self.vocab.len();
        check_len("ln_f parameters", lnf.len(), self.pieces.lnf.len())?;
        check_len("ln_f gradients", dlnf.len(), self.pieces.lnf.len())?;
        check_len("lm_head", lm_head.len(), self.lm_head_len())?;
        check_len("lm_head gradient", dlm_head.len(), self.lm_head_len())?;
        if !acts.has_targets {
            return Err(Error::Batch {
                reason: "backward needs a forward with targets first".into(),
            });
        }
        acts.has_targets = false; // logits become dlogits below
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let rows = self.rows(n);
        let mode = Mode::Throughput;
        // the gradient of the mean loss, times the loss scale (exact for a
        // power of two: `scale / n` is `1 / n` rounded, then scaled)
        #[allow(clippy::cast_precision_loss)]
        let dloss = self.loss_scale / n as f32;
        let tp = self.tp.as_ref();
        weft_kernels::zero(&mut scratch.dln);
        let chunk = acts.chunk.max(1);
        for r0 in (0..n).step_by(chunk) {
            let len = chunk.min(n - r0);
            if chunk < n {
                // the forward kept only the rows' statistics
                self.chunk_logits(acts, r0, len, lm_head)?;
            }
            let logits = &mut acts.logits[..len * vl];
            let (tg, stats) = (
                &acts.targets[r0..r0 + len],
                &acts.stats[2 * r0..2 * (r0 + len)],
            );
            match tp {
                // One pass from the forward's row statistics: the bits
                // `fused_classifier` would write.
                None => fused_classifier_backward(logits, stats, tg, dloss, len, vl, vl)?,
                Some(_) => self
                    .vocab
                    .cross_entropy_backward(logits, tg, stats, dloss)?,
            }
            // rows of the input gradient and whole `WT_SUM_ROWS` blocks of
            // the weight gradient's sum: the bits of one call on all rows
            let lnf = &acts.lnf[r0 * c..(r0 + len) * c];
            let dln = &mut scratch.dln[r0 * c..(r0 + len) * c];
            matmul_backward_wt(
                dln,
                dlm_head,
                None,
                logits,
                lnf,
                lm_head,
                1,
                len,
                c,
                vl,
                mode,
                self.precision,
            )?;
        }
        // the vocabulary-parallel projection's input gradient, summed
        let dln: &[f32] = match tp {
            Some(tp) => tp.column_input_grad(&mut scratch.dln, &mut scratch.rows)?,
            None => &scratch.dln,
        };
        weft_kernels::zero(dinp);
        let (dlw, dlb) = dlnf.split_at_mut(c);
        self.norm_backward(
            dinp,
            dlw,
            dlb,
            dln,
            inp,
            &lnf[..c],
            (&acts.lnf_mean, &acts.lnf_rstd),
            rows,
        )?;
        Ok(())
    }
}
