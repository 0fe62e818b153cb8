//! The GPT-2 model: parameters, planned activations, forward, backward,
//! and the AdamW step — built from the per-block functions of
//! [`GptBlocks`], which pipeline stages and FSDP units call directly with
//! their own parameter and gradient slices.

use std::ops::Range;
use std::sync::Arc;

use weft_kernels::{
    AdamW, Mode, attention_backward, attention_forward, encoder_backward, encoder_forward,
    fused_classifier_backward, fused_classifier_forward, layernorm_backward,
    layernorm_backward_input, layernorm_backward_weight, layernorm_forward, matmul_backward,
    matmul_backward_input, matmul_backward_weight, matmul_backward_wt, matmul_forward,
    matmul_forward_wt, residual_forward,
};

use weft_parallel::{AdamWState, Coords, ParamLayout};

use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::ffn::{Dims, FeedForward, Mlp};
use crate::params::{BlockLayout, Pieces, Sharding, param_layout};

/// The computation of a GPT-2, separated from its parameters: the
/// embedding, one transformer block and the head as functions over
/// explicit parameter, gradient and activation slices.
///
/// This is what [`Gpt`] runs, and what a pipeline stage
/// ([`GptStage`](crate::GptStage)) or an FSDP unit runs with its own (or a
/// just-gathered) parameter slice. Calling these functions in the order
/// [`Gpt::forward`] / [`Gpt::backward`] do gives bitwise their results.
///
/// # Parameter slices
///
/// The slices are cut from the flat [`ParamLayout`] buffer (or any buffer
/// with the same order):
///
/// * embedding, [`embed_range`](Self::embed_range): `wte (V,C)` then
///   `wpe (maxT,C)`, [`embed_len`](Self::embed_len) floats;
/// * block `l`, [`block_range`](Self::block_range): `ln_1.weight (C)`,
///   `ln_1.bias (C)`, `attn.c_attn.weight (C,3C)`, `attn.c_attn.bias
///   (3C)`, `attn.c_proj.weight (C,C)`, `attn.c_proj.bias (C)`,
///   `ln_2.weight (C)`, `ln_2.bias (C)`, then the feed-forward block's
///   tensors in [`FeedForward::params`] order (for [`Mlp`]: `mlp.c_fc.weight
///   (C,4C)`, `mlp.c_fc.bias (4C)`, `mlp.c_proj.weight (4C,C)`,
///   `mlp.c_proj.bias (C)`), [`block_len`](Self::block_len) floats;
/// * final layernorm, [`lnf_range`](Self::lnf_range): `ln_f.weight (C)`,
///   `ln_f.bias (C)`;
/// * language-model head, [`lm_head_range`](Self::lm_head_range): `wte`
///   itself when embeddings are tied, else `lm_head.weight (V,C)` at the
///   end of the buffer.
///
/// Gradient slices have the same shapes; every backward function
/// *accumulates* (`+=`) into them, with the same kernel calls on the same
/// buffer as [`Gpt::backward`], so accumulating micro-batches in place
/// gives bitwise the bits of a model doing the same.
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
/// split kernels ([`matmul_backward_input`](weft_kernels::matmul_backward_input)
/// in B, [`matmul_backward_weight`](weft_kernels::matmul_backward_weight) in
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
    mode: Mode,
}

/// What one block's forward keeps for its backward, for one micro-batch of
/// `B` sequences of `T` tokens; plan it with [`GptBlocks::block_acts`].
/// The block's output (the residual stream after the block) is
/// [`out`](Self::out); its input is not stored here (it is the previous
/// block's output, or the embedding, or what a pipeline stage received).
#[derive(Clone, Debug)]
pub struct BlockActs {
    b: usize,
    t: usize,
    layer: usize,             // set by the forward, read by the backward
    ln1: Vec<f32>,            // (B,T,C)
    ln1_mean: Vec<f32>,       // (B,T)
    ln1_rstd: Vec<f32>,       // (B,T)
    qkv: Vec<f32>,            // (B,T,3C)
    atty: Vec<f32>,           // (B,T,C)
    att: Vec<f32>,            // (B,NH,T,T)
    res2: Vec<f32>,           // (B,T,C)
    ln2: Vec<f32>,            // (B,T,C)
    ln2_mean: Vec<f32>,       // (B,T)
    ln2_rstd: Vec<f32>,       // (B,T)
    ffn_saved: Vec<f32>,      // (B,T,ffn.saved_per_token)
    pub(crate) out: Vec<f32>, // (B,T,C)
}

impl BlockActs {
    /// The block's output `(B,T,C)` after [`GptBlocks::block_forward`].
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
        4 * [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.res2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.ffn_saved,
            &self.out,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
    }
}

/// What the head's forward keeps for its backward (final layernorm,
/// logits, per-token losses, targets); plan it with
/// [`GptBlocks::head_acts`].
#[derive(Clone, Debug)]
pub struct HeadActs {
    b: usize,
    t: usize,
    targets: Vec<u32>, // (B,T)
    has_targets: bool,
    lnf: Vec<f32>,      // (B,T,C)
    lnf_mean: Vec<f32>, // (B,T)
    lnf_rstd: Vec<f32>, // (B,T)
    logits: Vec<f32>,   // (B,T,V); holds dlogits after backward
    losses: Vec<f32>,   // (B,T)
    stats: Vec<f32>,    // (B,T,2) each row's max logit and sum of exponentials
}

impl HeadActs {
    /// Logits `(B,T,V)` of the last forward (after a backward they hold the
    /// logits' gradient instead).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// Per-token losses `(B,T)` of the last forward with targets.
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
    tmp: Vec<f32>,         // (B,T,C) block outputs before the residual add
    dln: Vec<f32>,         // (B,T,C)
    datty: Vec<f32>,       // (B,T,C)
    dqkv: Vec<f32>,        // (B,T,3C)
    datt: Vec<f32>,        // (B,NH,T,T)
    ffn_scratch: Vec<f32>, // (B,T,ffn.scratch_per_token)
    /// Sinks for the half a feed-forward block that cannot split its
    /// backward discards in B and W: an input gradient (B,T,C) and the
    /// block's parameter gradients. Empty unless such a block needs them.
    sink_x: Vec<f32>,
    sink_p: Vec<f32>,
}

impl BlockScratch {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * [
            &self.tmp,
            &self.dln,
            &self.datty,
            &self.dqkv,
            &self.datt,
            &self.ffn_scratch,
            &self.sink_x,
            &self.sink_p,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
    }
}

/// What [`GptBlocks::block_backward_input`] (B) saves for
/// [`GptBlocks::block_backward_weight`] (W): the gradients flowing into
/// each parameterised op of the block, five `(B,T,·)` buffers (7·B·T·C
/// floats), and what the feed-forward block's input half saves for its
/// weight half ([`FeedForward::split_saved_per_token`] per token: 4·B·T·C
/// for the dense MLP). Plan one per micro-batch whose W is pending with
/// [`GptBlocks::weight_inputs`].
#[derive(Clone, Debug)]
pub struct WeightInputs {
    dres3: Vec<f32>, // d(block output) = d(ffn output)
    dln2: Vec<f32>,  // d(ln_2 output)
    dres2: Vec<f32>, // d(attention residual) = d(attn proj output)
    dqkv: Vec<f32>,  // d(qkv)
    dln1: Vec<f32>,  // d(ln_1 output)
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
            + self.dln1.len()
            + self.dffn.len())
    }
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

impl GptBlocks {
    /// The per-block functions of a model with this configuration and
    /// feed-forward block.
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn new(config: GptConfig, ffn: Arc<dyn FeedForward>) -> Result<Self> {
        let sharding = Sharding {
            coords: Coords {
                ep: ffn.expert_parallel(),
                ..Coords::SINGLE
            },
            sequence_parallel: false,
        };
        let layout = param_layout(&config, ffn.as_ref(), &sharding)?;
        let pieces = Pieces::of(&layout, &config)?;
        Ok(GptBlocks {
            blk: pieces.block.clone(),
            config,
            ffn,
            layout,
            pieces,
            mode: Mode::default(),
        })
    }

    /// This rank's parameter layout (names, shapes, offsets, placements).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The offsets of a block's tensors inside its slice.
    pub fn block_layout(&self) -> &BlockLayout {
        &self.blk
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
    /// [`Gpt::set_mode`]).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Sets the forward's [`Mode`].
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Floats in the embedding slice (`wte` then `wpe`).
    pub fn embed_len(&self) -> usize {
        self.pieces.embed.len()
    }

    /// Floats in one block's slice.
    pub fn block_len(&self) -> usize {
        self.blk.len()
    }

    /// Floats in the language-model head's weight (`V·C`).
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

    fn check_shape(&self, b: usize, t: usize) -> Result<()> {
        if b == 0 || t == 0 || t > self.config.block_size {
            return Err(Error::Batch {
                reason: format!(
                    "B={b}, T={t}: need B >= 1 and 1 <= T <= block_size = {}",
                    self.config.block_size
                ),
            });
        }
        Ok(())
    }

    /// Plans one block's activations for `b` sequences of `t` tokens.
    ///
    /// # Errors
    /// [`Error::Batch`] if `t` exceeds `block_size` or `b*t` is 0.
    pub fn block_acts(&self, b: usize, t: usize) -> Result<BlockActs> {
        self.check_shape(b, t)?;
        let (c, nh) = (self.config.n_embd, self.config.n_head);
        let n = b * t;
        let z = |k: usize| vec![0.0f32; k];
        Ok(BlockActs {
            b,
            t,
            layer: 0,
            ln1: z(n * c),
            ln1_mean: z(n),
            ln1_rstd: z(n),
            qkv: z(n * 3 * c),
            atty: z(n * c),
            att: z(b * nh * t * t),
            res2: z(n * c),
            ln2: z(n * c),
            ln2_mean: z(n),
            ln2_rstd: z(n),
            ffn_saved: z(n * self.ffn.saved_per_token(c)),
            out: z(n * c),
        })
    }

    /// Plans the head's activations.
    ///
    /// # Errors
    /// [`Error::Batch`] as for [`block_acts`](Self::block_acts).
    pub fn head_acts(&self, b: usize, t: usize) -> Result<HeadActs> {
        self.check_shape(b, t)?;
        let (c, v) = (self.config.n_embd, self.config.vocab_size);
        let n = b * t;
        Ok(HeadActs {
            b,
            t,
            targets: vec![0; n],
            has_targets: false,
            lnf: vec![0.0; n * c],
            lnf_mean: vec![0.0; n],
            lnf_rstd: vec![0.0; n],
            logits: vec![0.0; n * v],
            losses: vec![0.0; n],
            stats: vec![0.0; 2 * n],
        })
    }

    /// Plans the shared working buffers.
    ///
    /// # Errors
    /// [`Error::Batch`] as for [`block_acts`](Self::block_acts).
    pub fn scratch(&self, b: usize, t: usize) -> Result<BlockScratch> {
        self.check_shape(b, t)?;
        let (c, nh) = (self.config.n_embd, self.config.n_head);
        let n = b * t;
        Ok(BlockScratch {
            tmp: vec![0.0; n * c],
            dln: vec![0.0; n * c],
            datty: vec![0.0; n * c],
            dqkv: vec![0.0; n * 3 * c],
            datt: vec![0.0; b * nh * t * t],
            ffn_scratch: vec![0.0; n * self.ffn.scratch_per_token(c)],
            sink_x: Vec::new(),
            sink_p: Vec::new(),
        })
    }

    /// Plans what a block's B saves for its W.
    ///
    /// # Errors
    /// [`Error::Batch`] as for [`block_acts`](Self::block_acts).
    pub fn weight_inputs(&self, b: usize, t: usize) -> Result<WeightInputs> {
        self.check_shape(b, t)?;
        let (n, c) = (b * t, self.config.n_embd);
        let nc = n * c;
        Ok(WeightInputs {
            dres3: vec![0.0; nc],
            dln2: vec![0.0; nc],
            dres2: vec![0.0; nc],
            dqkv: vec![0.0; 3 * nc],
            dln1: vec![0.0; nc],
            dffn: vec![0.0; n * self.ffn.split_saved_per_token(c)],
            ready: false,
        })
    }

    fn dims(&self, b: usize, t: usize, mode: Mode, layer: usize) -> Dims {
        Dims {
            b,
            t,
            c: self.config.n_embd,
            mode,
            layer,
        }
    }

    /// Token plus position embedding: `out (B,T,C) = wte[tokens] + wpe[pos]`;
    /// `params` is the embedding slice (`wte` then `wpe`).
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a token
    /// outside the vocabulary.
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
        let (wte, wpe) = params.split_at(self.wte_len());
        encoder_forward(out, tokens, wte, wpe, b, t, self.config.n_embd)?;
        Ok(())
    }

    /// Backward of [`embed_forward`](Self::embed_forward), accumulating into
    /// the embedding's gradient slice (`dwte` then `dwpe`). The embedding
    /// has no input gradient, so this is a weight-only (W) step.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a token
    /// outside the vocabulary.
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
        let (dwte, dwpe) = grads.split_at_mut(self.wte_len());
        encoder_backward(dwte, dwpe, dout, tokens, b, t, self.config.n_embd)?;
        Ok(())
    }

    /// One transformer block: `x + attn(ln_1(x))`, then `y + ffn(ln_2(y))`,
    /// over `inp (B,T,C)` with the parameter slice of layer `layer` (its
    /// index in the whole model, which the feed-forward block sees in
    /// [`Dims::layer`]; the backward passes on the same index); the output
    /// is [`acts.out()`](BlockActs::out).
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong parameter slice length; a kernel error
    /// if `inp` or `scratch` does not fit `acts`' shape.
    pub fn block_forward(
        &self,
        layer: usize,
        acts: &mut BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.block_len())?;
        acts.layer = layer;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let GptConfig {
            n_head: nh,
            n_embd: c,
            layer_norm_epsilon: eps,
            ..
        } = self.config;
        let (p, blk, mode) = (params, &self.blk, self.mode);
        layernorm_forward(
            &mut acts.ln1,
            &mut acts.ln1_mean,
            &mut acts.ln1_rstd,
            inp,
            &p[blk.ln1_w.clone()],
            &p[blk.ln1_b.clone()],
            n,
            c,
            eps,
        )?;
        matmul_forward(
            &mut acts.qkv,
            &acts.ln1,
            &p[blk.qkv_w.clone()],
            Some(&p[blk.qkv_b.clone()]),
            b,
            t,
            c,
            3 * c,
            mode,
        )?;
        attention_forward(&mut acts.atty, &mut acts.att, &acts.qkv, b, t, c, nh)?;
        matmul_forward(
            &mut scratch.tmp,
            &acts.atty,
            &p[blk.proj_w.clone()],
            Some(&p[blk.proj_b.clone()]),
            b,
            t,
            c,
            c,
            mode,
        )?;
        residual_forward(&mut acts.res2, inp, &scratch.tmp, n * c)?;
        layernorm_forward(
            &mut acts.ln2,
            &mut acts.ln2_mean,
            &mut acts.ln2_rstd,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            &p[blk.ln2_b.clone()],
            n,
            c,
            eps,
        )?;
        self.ffn.forward(
            &mut scratch.tmp,
            &mut acts.ffn_saved,
            &acts.ln2,
            &p[blk.ffn.clone()],
            self.dims(b, t, mode, layer),
        )?;
        residual_forward(&mut acts.out, &acts.res2, &scratch.tmp, n * c)?;
        Ok(())
    }

    /// The whole backward of a block: on entry `dres (B,T,C)` holds the
    /// gradient of the block's output, on return the gradient of its input
    /// `inp` (the same `inp` the forward saw); the block's parameter
    /// gradients are accumulated into `grads` (its gradient slice).
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error on a shape
    /// mismatch.
    pub fn block_backward(
        &self,
        dres: &mut [f32],
        grads: &mut [f32],
        acts: &BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.block_len())?;
        check_len("block gradients", grads.len(), self.block_len())?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let GptConfig {
            n_head: nh,
            n_embd: c,
            ..
        } = self.config;
        // Parameter gradients sum over the batch whatever the mode, and input
        // gradients need no invariance: whole-batch GEMMs are faster.
        let mode = Mode::Throughput;
        let (p, g, blk) = (params, grads, &self.blk);
        // Feed-forward block: dres is d(res3) = d(ffn out) and part of d(res2).
        weft_kernels::zero(&mut scratch.dln);
        self.ffn.backward(
            &mut scratch.dln,
            &mut g[blk.ffn.clone()],
            &mut scratch.ffn_scratch,
            dres,
            &acts.ln2,
            &acts.ffn_saved,
            &p[blk.ffn.clone()],
            self.dims(b, t, mode, acts.layer),
        )?;
        let (dw, db) = two_mut(g, blk.ln2_w.clone(), blk.ln2_b.clone());
        layernorm_backward(
            dres,
            dw,
            db,
            &scratch.dln,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            &acts.ln2_mean,
            &acts.ln2_rstd,
            n,
            c,
        )?;
        // Attention: dres is now d(res2) = d(attn proj out) and part of d(inp).
        weft_kernels::zero(&mut scratch.datty);
        let (dw, db) = two_mut(g, blk.proj_w.clone(), blk.proj_b.clone());
        matmul_backward(
            &mut scratch.datty,
            dw,
            Some(db),
            dres,
            &acts.atty,
            &p[blk.proj_w.clone()],
            b,
            t,
            c,
            c,
            mode,
        )?;
        weft_kernels::zero(&mut scratch.dqkv);
        attention_backward(
            &mut scratch.dqkv,
            &mut scratch.datt,
            &scratch.datty,
            &acts.qkv,
            &acts.att,
            b,
            t,
            c,
            nh,
        )?;
        weft_kernels::zero(&mut scratch.dln);
        let (dw, db) = two_mut(g, blk.qkv_w.clone(), blk.qkv_b.clone());
        matmul_backward(
            &mut scratch.dln,
            dw,
            Some(db),
            &scratch.dqkv,
            &acts.ln1,
            &p[blk.qkv_w.clone()],
            b,
            t,
            c,
            3 * c,
            mode,
        )?;
        let (dw, db) = two_mut(g, blk.ln1_w.clone(), blk.ln1_b.clone());
        layernorm_backward(
            dres,
            dw,
            db,
            &scratch.dln,
            inp,
            &p[blk.ln1_w.clone()],
            &acts.ln1_mean,
            &acts.ln1_rstd,
            n,
            c,
        )?;
        Ok(())
    }

    /// Sizes the sinks for the feed-forward block's discarded halves:
    /// empty for a block that splits its backward.
    fn sinks(&self, scratch: &mut BlockScratch, nc: usize) {
        let (x, p) = if self.ffn.split_saved_per_token(self.config.n_embd) == 0 {
            (nc, self.blk.ffn.len())
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
    /// mismatch.
    pub fn block_backward_input(
        &self,
        dres: &mut [f32],
        saved: &mut WeightInputs,
        acts: &BlockActs,
        inp: &[f32],
        params: &[f32],
        scratch: &mut BlockScratch,
    ) -> Result<()> {
        check_len("block parameters", params.len(), self.block_len())?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let GptConfig {
            n_head: nh,
            n_embd: c,
            ..
        } = self.config;
        check_len("B's saved gradients", saved.dres3.len(), n * c)?;
        let mode = Mode::Throughput;
        let (p, blk) = (params, &self.blk);
        self.sinks(scratch, n * c);
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
            &acts.ln2,
            &acts.ffn_saved,
            &p[blk.ffn.clone()],
            self.dims(b, t, mode, acts.layer),
        )?;
        layernorm_backward_input(
            dres,
            &saved.dln2,
            &acts.res2,
            &p[blk.ln2_w.clone()],
            &acts.ln2_mean,
            &acts.ln2_rstd,
            n,
            c,
        )?;
        saved.dres2.copy_from_slice(dres);
        weft_kernels::zero(&mut scratch.datty);
        matmul_backward_input(
            &mut scratch.datty,
            dres,
            &p[blk.proj_w.clone()],
            b,
            t,
            c,
            c,
            mode,
        )?;
        weft_kernels::zero(&mut saved.dqkv);
        attention_backward(
            &mut saved.dqkv,
            &mut scratch.datt,
            &scratch.datty,
            &acts.qkv,
            &acts.att,
            b,
            t,
            c,
            nh,
        )?;
        weft_kernels::zero(&mut saved.dln1);
        matmul_backward_input(
            &mut saved.dln1,
            &saved.dqkv,
            &p[blk.qkv_w.clone()],
            b,
            t,
            c,
            3 * c,
            mode,
        )?;
        layernorm_backward_input(
            dres,
            &saved.dln1,
            inp,
            &p[blk.ln1_w.clone()],
            &acts.ln1_mean,
            &acts.ln1_rstd,
            n,
            c,
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
        check_len("block parameters", params.len(), self.block_len())?;
        check_len("block gradients", grads.len(), self.block_len())?;
        if !saved.ready {
            return Err(Error::Batch {
                reason: "backward-for-weights needs a backward-for-input of the same block first"
                    .into(),
            });
        }
        saved.ready = false;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let c = self.config.n_embd;
        let mode = Mode::Throughput;
        let (p, g, blk) = (params, grads, &self.blk);
        self.sinks(scratch, n * c);
        self.ffn.backward_weight(
            &mut g[blk.ffn.clone()],
            &saved.dffn,
            &mut scratch.sink_x,
            &mut scratch.ffn_scratch,
            &saved.dres3,
            &acts.ln2,
            &acts.ffn_saved,
            &p[blk.ffn.clone()],
            self.dims(b, t, mode, acts.layer),
        )?;
        let (dw, db) = two_mut(g, blk.ln2_w.clone(), blk.ln2_b.clone());
        layernorm_backward_weight(
            dw,
            db,
            &saved.dln2,
            &acts.res2,
            &acts.ln2_mean,
            &acts.ln2_rstd,
            n,
            c,
        )?;
        let (dw, db) = two_mut(g, blk.proj_w.clone(), blk.proj_b.clone());
        matmul_backward_weight(dw, Some(db), &saved.dres2, &acts.atty, b, t, c, c)?;
        let (dw, db) = two_mut(g, blk.qkv_w.clone(), blk.qkv_b.clone());
        matmul_backward_weight(dw, Some(db), &saved.dqkv, &acts.ln1, b, t, c, 3 * c)?;
        let (dw, db) = two_mut(g, blk.ln1_w.clone(), blk.ln1_b.clone());
        layernorm_backward_weight(
            dw,
            db,
            &saved.dln1,
            inp,
            &acts.ln1_mean,
            &acts.ln1_rstd,
            n,
            c,
        )?;
        Ok(())
    }

    /// The head: final layernorm over `inp (B,T,C)`, logits through
    /// `lm_head (V,C)`, and with `targets (B,T)` the per-token
    /// cross-entropy and the mean loss (accumulated in f64), returned;
    /// without targets it returns `None` and only the logits are
    /// meaningful. `lnf` is `ln_f.weight` then `ln_f.bias`.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length; a kernel error for a
    /// target outside the vocabulary or a shape mismatch.
    pub fn head_forward(
        &self,
        acts: &mut HeadActs,
        inp: &[f32],
        lnf: &[f32],
        lm_head: &[f32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let GptConfig {
            n_embd: c,
            vocab_size: v,
            layer_norm_epsilon: eps,
            ..
        } = self.config;
        check_len("ln_f parameters", lnf.len(), 2 * c)?;
        check_len("lm_head", lm_head.len(), self.lm_head_len())?;
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        if let Some(tg) = targets {
            check_len("targets", tg.len(), n)?;
        }
        let (lw, lb) = lnf.split_at(c);
        layernorm_forward(
            &mut acts.lnf,
            &mut acts.lnf_mean,
            &mut acts.lnf_rstd,
            inp,
            lw,
            lb,
            n,
            c,
            eps,
        )?;
        matmul_forward_wt(
            &mut acts.logits,
            &acts.lnf,
            lm_head,
            None,
            b,
            t,
            c,
            v,
            self.mode,
        )?;
        match targets {
            None => {
                acts.has_targets = false;
                Ok(None)
            }
            Some(tg) => {
                acts.targets.copy_from_slice(tg);
                acts.has_targets = true;
                fused_classifier_forward(
                    &acts.logits,
                    &mut acts.losses,
                    &mut acts.stats,
                    tg,
                    n,
                    v,
                    v,
                )?;
                let sum: f64 = acts.losses.iter().map(|&x| f64::from(x)).sum();
                #[allow(clippy::cast_precision_loss)]
                Ok(Some(sum / n as f64))
            }
        }
    }

    /// Backward of the head for the mean loss of the last
    /// [`head_forward`](Self::head_forward) (which must have had targets):
    /// overwrites `dinp (B,T,C)` with the gradient of the head's input,
    /// accumulates `dlnf` (`ln_f` weight then bias) and `dlm_head (V,C)`,
    /// and turns the logits into their gradient. `inp` is the input the
    /// forward saw; `dln` is a `(B,T,C)` working buffer.
    ///
    /// # Errors
    /// [`Error::Batch`] on a wrong slice length or if the last forward had
    /// no targets; a kernel error on a shape mismatch.
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
        let GptConfig {
            n_embd: c,
            vocab_size: v,
            ..
        } = self.config;
        check_len("ln_f parameters", lnf.len(), 2 * c)?;
        check_len("ln_f gradients", dlnf.len(), 2 * c)?;
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
        let mode = Mode::Throughput;
        #[allow(clippy::cast_precision_loss)]
        let dloss = 1.0 / n as f32;
        // One pass from the forward's row statistics: the bits
        // `fused_classifier` would write.
        fused_classifier_backward(&mut acts.logits, &acts.stats, &acts.targets, dloss, n, v, v)?;
        weft_kernels::zero(&mut scratch.dln);
        matmul_backward_wt(
            &mut scratch.dln,
            dlm_head,
            None,
            &acts.logits,
            &acts.lnf,
            lm_head,
            b,
            t,
            c,
            v,
            mode,
        )?;
        weft_kernels::zero(dinp);
        let (dlw, dlb) = dlnf.split_at_mut(c);
        layernorm_backward(
            dinp,
            dlw,
            dlb,
            &scratch.dln,
            inp,
            &lnf[..c],
            &acts.lnf_mean,
            &acts.lnf_rstd,
            n,
            c,
        )?;
        Ok(())
    }
}

/// One micro-batch: `B·T` input tokens and their `B·T` next-token targets.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    /// Input token ids `(B,T)`.
    pub tokens: &'a [u32],
    /// Target token ids `(B,T)`.
    pub targets: &'a [u32],
}

/// A GPT-2-style transformer: configuration, the flat parameter and
/// gradient buffers (same [`ParamLayout`]), and the feed-forward block.
#[derive(Debug)]
pub struct Gpt {
    blocks: GptBlocks,
    /// All parameters in one allocation, in [`ParamLayout`] order.
    pub params: Vec<f32>,
    /// Gradients, same layout; [`Gpt::backward`] accumulates into them.
    pub grads: Vec<f32>,
}

/// Activation buffers for one batch shape, allocated once up front: one
/// [`BlockActs`] per layer, the head's [`HeadActs`], and one layer's worth
/// of backward working buffers, reused.
#[derive(Debug)]
pub struct Activations {
    b: usize,
    t: usize,
    tokens: Vec<u32>,  // (B,T)
    encoded: Vec<f32>, // (B,T,C)
    layers: Vec<BlockActs>,
    head: HeadActs,
    scratch: BlockScratch,
    dres: Vec<f32>, // (B,T,C) gradient of the residual stream
}

impl Activations {
    /// Batch size these buffers were planned for.
    pub fn batch(&self) -> usize {
        self.b
    }
    /// Sequence length these buffers were planned for.
    pub fn seq_len(&self) -> usize {
        self.t
    }
    /// Total bytes of all activation and backward buffers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(BlockActs::bytes).sum::<usize>()
            + self.head.bytes()
            + self.scratch.bytes()
            + 4 * (self.tokens.len() + self.encoded.len() + self.dres.len())
    }
    /// [`bytes`](Self::bytes) divided by the B·T tokens of the batch.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes() / (self.b * self.t).max(1)
    }
    /// Logits `(B,T,V)` of the last forward (after a backward they hold the
    /// logits' gradient instead).
    pub fn logits(&self) -> &[f32] {
        self.head.logits()
    }
    /// Per-token losses `(B,T)` of the last forward with targets.
    pub fn losses(&self) -> &[f32] {
        self.head.losses()
    }
}

impl Gpt {
    /// A dense GPT-2 with all parameters zero (load or initialise them next).
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn new(config: GptConfig) -> Result<Self> {
        Self::with_ffn(config, Box::new(Mlp))
    }

    /// A GPT-2 whose blocks use a custom feed-forward block.
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn with_ffn(config: GptConfig, ffn: Box<dyn FeedForward>) -> Result<Self> {
        let blocks = GptBlocks::new(config, Arc::from(ffn))?;
        let n = blocks.layout().len();
        Ok(Gpt {
            blocks,
            params: vec![0.0; n],
            grads: vec![0.0; n],
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        self.blocks.config()
    }

    /// The per-block functions this model runs (and their parameter
    /// ranges).
    pub fn blocks(&self) -> &GptBlocks {
        &self.blocks
    }

    /// The parameter layout (names, shapes, offsets, placements).
    pub fn layout(&self) -> &ParamLayout {
        self.blocks.layout()
    }

    /// How the forward's linear layers split their work (default:
    /// batch-invariant, so logits and per-token losses of a sequence are
    /// bitwise the same in any batch). The backward always runs whole-batch
    /// GEMMs: parameter gradients are sums over the batch anyway.
    pub fn set_mode(&mut self, mode: Mode) {
        self.blocks.set_mode(mode);
    }

    /// A named parameter tensor.
    pub fn param(&self, name: &str) -> Option<&[f32]> {
        self.layout().get(name).map(|s| &self.params[s.range()])
    }

    /// A named gradient tensor.
    pub fn grad(&self, name: &str) -> Option<&[f32]> {
        self.layout().get(name).map(|s| &self.grads[s.range()])
    }

    /// GPT-2's initialisation: N(0, 0.02) weights (the residual projections
    /// scaled by 1/sqrt(2L)), zero biases, unit layernorm gains. Uses a
    /// simple seeded generator (not PyTorch's stream).
    pub fn init_gpt2(&mut self, seed: u64) {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut normal = move || {
            // Box–Muller over xorshift64.
            let mut u = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                #[allow(clippy::cast_precision_loss)]
                let x = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                x
            };
            let (a, b) = (u(), u());
            (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        };
        #[allow(clippy::cast_precision_loss)]
        let proj_std = 0.02 / (2.0 * self.config().n_layer as f64).sqrt();
        for spec in self.layout().specs().to_vec() {
            let p = &mut self.params[spec.range()];
            if spec.shape.len() == 1 {
                let one = if spec.name.contains("ln_") { 1.0 } else { 0.0 };
                p.fill(one);
            } else {
                let std = if spec.name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                #[allow(clippy::cast_possible_truncation)]
                p.iter_mut().for_each(|x| *x = (normal() * std) as f32);
            }
        }
    }

    /// Plans (allocates) activation buffers for batches of `b` sequences of
    /// `t` tokens.
    ///
    /// # Errors
    /// [`Error::Batch`] if `t` exceeds the model's `block_size` or `b*t` is 0.
    pub fn activations(&self, b: usize, t: usize) -> Result<Activations> {
        let bl = &self.blocks;
        let layers = (0..self.config().n_layer)
            .map(|_| bl.block_acts(b, t))
            .collect::<Result<Vec<_>>>()?;
        let n = b * t;
        let c = self.config().n_embd;
        Ok(Activations {
            b,
            t,
            tokens: vec![0; n],
            encoded: vec![0.0; n * c],
            layers,
            head: bl.head_acts(b, t)?,
            scratch: bl.scratch(b, t)?,
            dres: vec![0.0; n * c],
        })
    }

    /// Forward pass over `tokens (B,T)`. With `targets (B,T)` it also
    /// computes the per-token cross-entropy and returns the mean loss
    /// (accumulated in f64); without, it returns `None` and only the logits
    /// are meaningful.
    ///
    /// # Errors
    /// [`Error::Batch`] if `tokens`/`targets` do not hold B·T ids for the
    /// planned `acts`; a kernel error ([`weft_kernels::Error::TokenOutOfRange`])
    /// for an id outside the vocabulary.
    pub fn forward(
        &self,
        acts: &mut Activations,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        if tokens.len() != n || targets.is_some_and(|x| x.len() != n) {
            return Err(Error::Batch {
                reason: format!(
                    "activations planned for B*T = {b}*{t} = {n} tokens, got {} inputs and {} targets",
                    tokens.len(),
                    targets.map_or(0, <[u32]>::len)
                ),
            });
        }
        acts.tokens.copy_from_slice(tokens);
        let (bl, p) = (&self.blocks, &self.params);
        bl.embed_forward(&mut acts.encoded, tokens, &p[bl.embed_range()], b, t)?;
        for l in 0..acts.layers.len() {
            let (prev, cur) = acts.layers.split_at_mut(l);
            let inp: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &prev[l - 1].out
            };
            bl.block_forward(
                l,
                &mut cur[0],
                inp,
                &p[bl.block_range(l)],
                &mut acts.scratch,
            )?;
        }
        let last = &acts.layers[acts.layers.len() - 1].out;
        bl.head_forward(
            &mut acts.head,
            last,
            &p[bl.lnf_range()],
            &p[bl.lm_head_range()],
            targets,
        )
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        weft_kernels::zero(&mut self.grads);
    }

    /// Backward pass of the mean loss of the last [`forward`](Self::forward)
    /// (which must have had targets), accumulating into
    /// [`grads`](Self::grads). Overwrites the logits with their gradient.
    ///
    /// # Errors
    /// [`Error::Batch`] if the last forward had no targets.
    pub fn backward(&mut self, acts: &mut Activations) -> Result<()> {
        let bl = &self.blocks;
        let (p, g) = (&self.params, &mut self.grads);
        let nl = acts.layers.len();
        let lm = bl.lm_head_range();
        // The head's weight: `lm_head` after ln_f, or `wte` at the start.
        let (dlnf, dlm) = if bl.config().tied_embeddings {
            let (lo, hi) = g.split_at_mut(lm.end);
            let lnf = bl.lnf_range();
            (&mut hi[lnf.start - lm.end..lnf.end - lm.end], lo)
        } else {
            two_mut(g, bl.lnf_range(), lm.clone())
        };
        bl.head_backward(
            &mut acts.dres,
            dlnf,
            dlm,
            &mut acts.head,
            &acts.layers[nl - 1].out,
            &p[bl.lnf_range()],
            &p[lm.clone()],
            &mut acts.scratch,
        )?;
        for l in (0..nl).rev() {
            let inp: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &acts.layers[l - 1].out
            };
            bl.block_backward(
                &mut acts.dres,
                &mut g[bl.block_range(l)],
                &acts.layers[l],
                inp,
                &p[bl.block_range(l)],
                &mut acts.scratch,
            )?;
        }
        bl.embed_backward(
            &mut g[bl.embed_range()],
            &acts.dres,
            &acts.tokens,
            acts.b,
            acts.t,
        )?;
        Ok(())
    }

    /// One AdamW step over every parameter, decaying those whose
    /// [`ParamSpec::decay`](weft_parallel::ParamSpec::decay) is set.
    /// `state` holds the moments (create it with
    /// [`adamw_state`](Self::adamw_state)).
    ///
    /// # Errors
    /// [`Error::Parallel`] if `state` was made for another model size
    /// (nothing is updated then).
    pub fn adamw_step(&mut self, state: &mut AdamWState, hp: &AdamW) -> Result<()> {
        let runs = self.blocks.layout.decay_runs();
        state.step(runs, &mut self.params, &self.grads, hp)?;
        Ok(())
    }

    /// Zero AdamW moments for this model's parameters.
    pub fn adamw_state(&self) -> AdamWState {
        AdamWState::zeros(self.params.len())
    }
}
