//! The feed-forward block: the extension point where a mixture of experts
//! goes.
//!
//! A transformer block is `x + attn(ln_1(x))` then `y + ffn(ln_2(y))`. The
//! model owns everything except `ffn`, which is a [`FeedForward`]: it
//! declares its tensors (named under `transformer.h.{l}.`, placed
//! contiguously in the block's parameter range), how many activation floats
//! per token it saves for the backward and how much scratch the backward
//! needs, and computes forward and backward over its own slice of the
//! parameter and gradient buffers. [`Mlp`] is GPT-2's dense block; the MoE
//! issue adds a router + experts implementation of the same trait.

use weft_kernels::{Mode, gelu_backward, gelu_forward, matmul_backward, matmul_forward};

use crate::error::Result;

/// A tensor a feed-forward block owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShape {
    /// Name under `transformer.h.{l}.`, e.g. `mlp.c_fc.weight`.
    pub suffix: String,
    /// Shape (Hugging Face layout).
    pub shape: Vec<usize>,
    /// Whether AdamW decays it.
    pub decay: bool,
}

/// Batch dimensions passed to a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Batch size, B.
    pub b: usize,
    /// Sequence length, T.
    pub t: usize,
    /// Channels, C.
    pub c: usize,
    /// How linear layers split their work.
    pub mode: Mode,
    /// Index of the transformer layer the block belongs to (0-based, in the
    /// whole model: a pipeline stage passes its layers' global indices), for
    /// blocks that keep per-layer statistics.
    pub layer: usize,
}

/// A feed-forward block of a transformer layer (see the module docs).
pub trait FeedForward: Send + Sync + std::fmt::Debug {
    /// The tensors of one layer's block, in buffer order.
    fn params(&self, c: usize) -> Vec<ParamShape>;
    /// Activation floats saved per token by [`forward`](Self::forward).
    fn saved_per_token(&self, c: usize) -> usize;
    /// Scratch floats per token needed by [`backward`](Self::backward).
    fn scratch_per_token(&self, c: usize) -> usize;
    /// `out (B,T,C) = ffn(inp (B,T,C))`; `params` is this block's range of
    /// the parameter buffer, `saved` its `B*T*saved_per_token` floats.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes.
    fn forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        inp: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()>;
    /// Accumulates `dinp` and `dparams` (this block's gradient range) from
    /// `dout`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()>;
}

/// GPT-2's dense MLP: `c_proj(gelu(c_fc(x)))`, hidden width 4C.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mlp;

/// Splits an MLP parameter range into (fc_w, fc_b, proj_w, proj_b).
fn split<T>(p: &[T], c: usize) -> (&[T], &[T], &[T], &[T]) {
    let (fw, rest) = p.split_at(c * 4 * c);
    let (fb, rest) = rest.split_at(4 * c);
    let (pw, pb) = rest.split_at(4 * c * c);
    (fw, fb, pw, pb)
}

fn split_mut<T>(p: &mut [T], c: usize) -> (&mut [T], &mut [T], &mut [T], &mut [T]) {
    let (fw, rest) = p.split_at_mut(c * 4 * c);
    let (fb, rest) = rest.split_at_mut(4 * c);
    let (pw, pb) = rest.split_at_mut(4 * c * c);
    (fw, fb, pw, pb)
}

impl FeedForward for Mlp {
    fn params(&self, c: usize) -> Vec<ParamShape> {
        let p = |s: &str, shape: Vec<usize>, decay| ParamShape {
            suffix: s.into(),
            shape,
            decay,
        };
        vec![
            p("mlp.c_fc.weight", vec![c, 4 * c], true),
            p("mlp.c_fc.bias", vec![4 * c], false),
            p("mlp.c_proj.weight", vec![4 * c, c], true),
            p("mlp.c_proj.bias", vec![c], false),
        ]
    }

    fn saved_per_token(&self, c: usize) -> usize {
        8 * c // fch (4C) and gelu(fch) (4C)
    }

    fn scratch_per_token(&self, c: usize) -> usize {
        8 * c // d gelu(fch) (4C) and d fch (4C)
    }

    fn forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        inp: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let Dims { b, t, c, .. } = d;
        // Backward GEMMs run over the whole batch (see `Gpt::set_mode`).
        let mode = Mode::Throughput;
        let n = b * t;
        let (fw, fb, pw, pb) = split(params, c);
        let (fch, fch_gelu) = saved.split_at_mut(n * 4 * c);
        matmul_forward(fch, inp, fw, Some(fb), b, t, c, 4 * c, mode)?;
        gelu_forward(fch_gelu, fch, n * 4 * c)?;
        matmul_forward(out, fch_gelu, pw, Some(pb), b, t, 4 * c, c, mode)?;
        Ok(())
    }

    fn backward(
        &self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let Dims { b, t, c, mode, .. } = d;
        let n = b * t;
        let (fw, _, pw, _) = split(params, c);
        let (dfw, dfb, dpw, dpb) = split_mut(dparams, c);
        let (fch, fch_gelu) = saved.split_at(n * 4 * c);
        let (dgelu, dfch) = scratch.split_at_mut(n * 4 * c);
        dgelu.fill(0.0);
        dfch.fill(0.0);
        matmul_backward(
            dgelu,
            dpw,
            Some(dpb),
            dout,
            fch_gelu,
            pw,
            b,
            t,
            4 * c,
            c,
            mode,
        )?;
        gelu_backward(dfch, fch, dgelu, n * 4 * c)?;
        matmul_backward(dinp, dfw, Some(dfb), dfch, inp, fw, b, t, c, 4 * c, mode)?;
        Ok(())
    }
}
