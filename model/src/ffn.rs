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

use weft_kernels::{
    Mode, gelu_backward, gelu_forward, matmul_backward_input, matmul_backward_weight,
    matmul_forward,
};

use weft_parallel::{Placement, Placements};

use crate::error::Result;

/// A tensor a feed-forward block owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShape {
    /// Name under `transformer.h.{l}.`, e.g. `mlp.c_fc.weight`.
    pub suffix: String,
    /// The whole tensor's shape (Hugging Face layout); a rank's part
    /// follows from `placements`.
    pub shape: Vec<usize>,
    /// Whether AdamW decays it.
    pub decay: bool,
    /// Where it sits on the tensor- and expert-parallel axes.
    pub placements: Placements,
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
    /// The tensors of one layer's block, in buffer order, with their
    /// whole shapes and placements.
    fn params(&self, c: usize) -> Vec<ParamShape>;
    /// This block's `(index, size)` in its expert-parallel group: `(0, 1)`
    /// (the default) for a block whose tensors no rank shares out.
    fn expert_parallel(&self) -> (usize, usize) {
        (0, 1)
    }
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

    /// Floats per token that [`backward_input`](Self::backward_input)
    /// saves for [`backward_weight`](Self::backward_weight); 0 (the
    /// default) for a block whose halves each run the whole
    /// [`backward`](Self::backward).
    fn split_saved_per_token(&self, _c: usize) -> usize {
        0
    }

    /// The input half of [`backward`](Self::backward), a zero-bubble
    /// pipeline's B: accumulates `dinp` from `dout` and saves in `wsaved`
    /// (`B*T*split_saved_per_token` floats) what
    /// [`backward_weight`](Self::backward_weight) needs. `sink` (as long as
    /// the block's gradient range) takes parameter gradients the block
    /// cannot help computing: the default runs the whole backward with its
    /// parameter gradients going to `sink`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes.
    #[allow(clippy::too_many_arguments)]
    fn backward_input(
        &self,
        dinp: &mut [f32],
        wsaved: &mut [f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let _ = wsaved;
        weft_kernels::zero(sink);
        self.backward(dinp, sink, scratch, dout, inp, saved, params, d)
    }

    /// The weight half of [`backward`](Self::backward), a zero-bubble
    /// pipeline's W: accumulates `dparams` from the `dout`, `inp` and
    /// `saved` the matching [`backward_input`](Self::backward_input) saw
    /// and what it saved in `wsaved`. `sink` (`B*T*C` floats) takes an
    /// input gradient the block cannot help computing: the default runs the
    /// whole backward with its input gradient going to `sink`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes.
    #[allow(clippy::too_many_arguments)]
    fn backward_weight(
        &self,
        dparams: &mut [f32],
        wsaved: &[f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let _ = wsaved;
        weft_kernels::zero(sink);
        self.backward(sink, dparams, scratch, dout, inp, saved, params, d)
    }
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
    /// Megatron's split of the MLP over `tp`: `c_fc` column-parallel
    /// (weight and bias by columns), `c_proj` row-parallel (weight by
    /// rows, bias replicated).
    fn params(&self, c: usize) -> Vec<ParamShape> {
        let p = |s: &str, shape: Vec<usize>, decay, tp: Placement| ParamShape {
            suffix: s.into(),
            shape,
            decay,
            placements: Placements::tp(tp),
        };
        vec![
            p("mlp.c_fc.weight", vec![c, 4 * c], true, Placement::shard(1)),
            p("mlp.c_fc.bias", vec![4 * c], false, Placement::shard(0)),
            p(
                "mlp.c_proj.weight",
                vec![4 * c, c],
                true,
                Placement::shard(0),
            ),
            p("mlp.c_proj.bias", vec![c], false, Placement::Replicate),
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
        // Forward GEMMs compute each row from its own input row alone, so
        // the mode does not change their bits.
        let Dims { b, t, c, mode, .. } = d;
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
        // The two halves in turn: each gradient is computed from the same
        // operands as by a fused backward, so the bits are the same.
        let (dgelu, dfch) = scratch.split_at_mut(d.b * d.t * 4 * d.c);
        self.backward_input(dinp, dfch, &mut [], dgelu, dout, inp, saved, params, d)?;
        self.backward_weight(dparams, dfch, &mut [], &mut [], dout, inp, saved, params, d)
    }

    fn split_saved_per_token(&self, c: usize) -> usize {
        4 * c // d fch
    }

    fn backward_input(
        &self,
        dinp: &mut [f32],
        wsaved: &mut [f32],
        _sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        _inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let Dims { b, t, c, mode, .. } = d;
        let n = b * t;
        let (fw, _, pw, _) = split(params, c);
        let fch = &saved[..n * 4 * c];
        let dgelu = &mut scratch[..n * 4 * c];
        weft_kernels::zero(dgelu);
        matmul_backward_input(dgelu, dout, pw, b, t, 4 * c, c, mode)?;
        let dfch = wsaved;
        weft_kernels::zero(dfch);
        gelu_backward(dfch, fch, dgelu, n * 4 * c)?;
        matmul_backward_input(dinp, dfch, fw, b, t, c, 4 * c, mode)?;
        Ok(())
    }

    fn backward_weight(
        &self,
        dparams: &mut [f32],
        wsaved: &[f32],
        _sink: &mut [f32],
        _scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        _params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let Dims { b, t, c, .. } = d;
        let n = b * t;
        let (dfw, dfb, dpw, dpb) = split_mut(dparams, c);
        let fch_gelu = &saved[n * 4 * c..];
        matmul_backward_weight(dpw, Some(dpb), dout, fch_gelu, b, t, 4 * c, c)?;
        matmul_backward_weight(dfw, Some(dfb), wsaved, inp, b, t, c, 4 * c)?;
        Ok(())
    }
}
