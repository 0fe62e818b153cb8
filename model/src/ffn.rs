//! The feed-forward block: the extension point where a mixture of experts
//! goes.
//!
//! A transformer block is `x + attn(ln_1(x))` then `y + ffn(ln_2(y))`. The
//! model owns everything except `ffn`, which is a [`FeedForward`]: it
//! declares its tensors (named under `transformer.h.{l}.`, placed
//! contiguously in the block's parameter range, each with its placement on
//! the tensor- and expert-parallel axes), how many activation floats it
//! saves for the backward and how much scratch it needs, and computes
//! forward and backward over its own slice of the parameter and gradient
//! buffers. [`Mlp`] is GPT-2's dense block; [`MoeFfn`](crate::MoeFfn) a
//! router and experts.
//!
//! # Under tensor parallelism
//! With [`Dims::tp`] set, `params` is this rank's shard (per the block's
//! placements), `inp` holds the layernorm output of every token of the
//! micro-batch (`B·T` rows, gathered under sequence parallelism), and
//! `out`, `dout` and `dinp` hold this rank's rows of the residual stream
//! ([`Dims::rows`]: all `B·T`, or its `B·T/tp` under sequence
//! parallelism); `out` and `dinp` are complete — the block does whatever
//! communication its split needs ([`Mlp`]: column- then row-parallel, a
//! sum over the group in each direction; a mixture of experts is
//! replicated and needs none).

use weft_kernels::{
    LinearInput, Mode, Precision, gelu_backward, gelu_forward, matmul_backward_input,
    matmul_backward_weight, matmul_forward, round_to_bf16_for_products, swiglu_backward,
    swiglu_forward,
};
use weft_numerics::bf16;
use weft_parallel::{Placement, Placements};

use crate::error::Result;
use crate::tp::TensorParallel;

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
#[derive(Clone, Copy, Debug)]
pub struct Dims<'a> {
    /// Batch size, B.
    pub b: usize,
    /// Sequence length, T.
    pub t: usize,
    /// Channels, C.
    pub c: usize,
    /// How linear layers split their work.
    pub mode: Mode,
    /// The arithmetic of the linear layers' products (see
    /// [`GptBlocks::set_precision`](crate::GptBlocks::set_precision)).
    pub precision: Precision,
    /// The factor the gradients of this backward carry: the loss is scaled
    /// by it (dynamic loss scaling, see
    /// [`GptBlocks::set_loss_scale`](crate::GptBlocks::set_loss_scale));
    /// 1 otherwise. A block that adds a loss of its own (MoE's auxiliary
    /// loss) scales that loss's gradient by it too.
    pub loss_scale: f32,
    /// Index of the transformer layer the block belongs to (0-based, in the
    /// whole model: a pipeline stage passes its layers' global indices), for
    /// blocks that keep per-layer statistics.
    pub layer: usize,
    /// The tensor-parallel group, when the block is split over one (see
    /// the module docs).
    pub tp: Option<&'a TensorParallel>,
    /// The forward is a [recomputation](crate::Recompute) for the backward:
    /// compute the same, but do not count statistics again (a mixture of
    /// experts' load and auxiliary loss).
    pub replay: bool,
    /// [Selective recomputation](crate::Recompute::Selective): keep no
    /// activation the backward can recompute cheaply (the dense blocks
    /// recompute their activation function's output from its kept input
    /// before the output projection's weight gradient).
    pub selective: bool,
}

impl Dims<'_> {
    /// Tokens of the micro-batch, `B·T`.
    pub fn n(&self) -> usize {
        self.b * self.t
    }

    /// Rows of the residual stream on this rank: `B·T`, or `B·T/tp` under
    /// sequence parallelism.
    pub fn rows(&self) -> usize {
        self.tp.map_or(self.n(), |tp| tp.rows(self.n()))
    }

    /// The tensor-parallel degree (1 without a group).
    pub fn tp_size(&self) -> usize {
        self.tp.map_or(1, TensorParallel::size)
    }

    /// Whether sequence parallelism is on.
    pub fn sequence_parallel(&self) -> bool {
        self.tp.is_some_and(TensorParallel::sequence_parallel)
    }
}

/// A feed-forward block of a transformer layer (see the module docs).
pub trait FeedForward: Send + Sync + std::fmt::Debug {
    /// The tensors of one layer's block, in buffer order, with their
    /// whole shapes and placements.
    fn params(&self, c: usize) -> Vec<ParamShape>;
    /// The tensors of layer `layer`'s block: [`params`](Self::params)
    /// (the default) unless the block differs between layers, as a
    /// mixture of experts whose first layers are dense does
    /// ([`MoeFfn::with_first_dense`](crate::MoeFfn::with_first_dense));
    /// [`saved_len`](Self::saved_len) and
    /// [`scratch_len`](Self::scratch_len) then cover every layer's.
    fn layer_params(&self, c: usize, layer: usize) -> Vec<ParamShape> {
        let _ = layer;
        self.params(c)
    }
    /// The mixture of experts this block is, if it is one (what a
    /// Hugging Face export reads its routing from); `None` (the default)
    /// for a dense block.
    fn moe(&self) -> Option<&crate::MoeFfn> {
        None
    }
    /// This block's `(index, size)` in its expert-parallel group: `(0, 1)`
    /// (the default) for a block whose tensors no rank shares out.
    fn expert_parallel(&self) -> (usize, usize) {
        (0, 1)
    }
    /// True if the block reads its input (the second layernorm's output)
    /// only as the left operand of linear layers' products, as the dense
    /// MLP's `c_fc` does: in `Precision::Bf16` the blocks then keep that
    /// input in bf16 (rounded as the products round it: half the bytes,
    /// the same bits) and pass it as [`LinearInput::Bf16`]. The default,
    /// false, always passes it in `f32` ([`LinearInput::Wide`]): a
    /// router, say, reads it.
    fn input_feeds_products_only(&self) -> bool {
        false
    }
    /// Activation floats [`forward`](Self::forward) saves for a
    /// micro-batch of `d`.
    fn saved_len(&self, d: &Dims<'_>) -> usize;
    /// Scratch floats [`forward`](Self::forward) and
    /// [`backward`](Self::backward) need for a micro-batch of `d`.
    fn scratch_len(&self, d: &Dims<'_>) -> usize;
    /// `out = ffn(inp)`; `params` is this block's range of the parameter
    /// buffer, `saved` its [`saved_len`](Self::saved_len) floats. `inp`
    /// comes in `f32` ([`LinearInput::Wide`]), or in bf16 to a block that
    /// declares [`input_feeds_products_only`](Self::input_feeds_products_only)
    /// in a bf16 run; the backwards receive the same `inp`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes; a collective error.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        scratch: &mut [f32],
        inp: LinearInput<'_, f32>,
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()>;
    /// Accumulates `dinp` and `dparams` (this block's gradient range) from
    /// `dout`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes; a collective error.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()>;

    /// Floats [`backward_input`](Self::backward_input) saves for
    /// [`backward_weight`](Self::backward_weight); 0 (the default) for a
    /// block whose halves each run the whole [`backward`](Self::backward).
    fn split_saved_len(&self, d: &Dims<'_>) -> usize {
        let _ = d;
        0
    }

    /// The input half of [`backward`](Self::backward), a zero-bubble
    /// pipeline's B: accumulates `dinp` from `dout` and saves in `wsaved`
    /// ([`split_saved_len`](Self::split_saved_len) floats) what
    /// [`backward_weight`](Self::backward_weight) needs. `sink` (as long as
    /// the block's gradient range) takes parameter gradients the block
    /// cannot help computing: the default runs the whole backward with its
    /// parameter gradients going to `sink`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes; a collective error.
    #[allow(clippy::too_many_arguments)]
    fn backward_input(
        &self,
        dinp: &mut [f32],
        wsaved: &mut [f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        let _ = wsaved;
        weft_kernels::zero(sink);
        self.backward(dinp, sink, scratch, dout, inp, saved, params, d)
    }

    /// The weight half of [`backward`](Self::backward), a zero-bubble
    /// pipeline's W: accumulates `dparams` from the `dout`, `inp` and
    /// `saved` the matching [`backward_input`](Self::backward_input) saw
    /// and what it saved in `wsaved`. `sink` (as long as `dinp`) takes an
    /// input gradient the block cannot help computing: the default runs the
    /// whole backward with its input gradient going to `sink`.
    ///
    /// # Errors
    /// A kernel error on inconsistent shapes; a collective error.
    #[allow(clippy::too_many_arguments)]
    fn backward_weight(
        &self,
        dparams: &mut [f32],
        wsaved: &[f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        let _ = wsaved;
        weft_kernels::zero(sink);
        self.backward(sink, dparams, scratch, dout, inp, saved, params, d)
    }
}

/// GPT-2's dense MLP: `c_proj(gelu(c_fc(x)))`, hidden width 4C; under
/// tensor parallelism `c_fc` column-parallel and `c_proj` row-parallel
/// (Megatron's split: one sum over the group forward, one backward).
#[derive(Clone, Copy, Debug, Default)]
pub struct Mlp;

/// The gated MLP of Llama, Qwen and Mistral (Shazeer 2020):
/// `c_proj(silu(x·W_gate) ⊙ x·W_up)`, hidden width `hidden`
/// (`intermediate_size`), no biases. The gate and up projections are one
/// fused `mlp.gate_up.weight (C, 2H)` (gate columns, then up columns;
/// transformers' `gate_proj` and `up_proj` transposed), column-parallel
/// under tensor parallelism (each half by columns, so a rank holds the
/// gate and up columns of the same hidden units); `mlp.c_proj.weight
/// (H, C)` (`down_proj` transposed) row-parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGlu {
    /// Hidden width H (`intermediate_size`).
    pub hidden: usize,
}

/// What differs between the two dense blocks.
#[derive(Clone, Copy, Debug)]
struct Dense {
    /// SwiGLU (two fused projections in, no biases) or GELU.
    gated: bool,
    /// Whole hidden width H.
    hidden: usize,
}

impl Dense {
    /// Hidden width on this rank, `H / tp`.
    fn h(self, d: &Dims<'_>) -> usize {
        self.hidden / d.tp_size()
    }

    /// Columns of the input projection on this rank: `H/tp`, or `2H/tp`
    /// gated.
    fn fc(self, d: &Dims<'_>) -> usize {
        if self.gated { 2 * self.h(d) } else { self.h(d) }
    }

    /// Splits a parameter range into (fc_w, fc_b, proj_w, proj_b), the
    /// biases empty when gated.
    fn split<'p, T>(
        self,
        p: &'p [T],
        c: usize,
        d: &Dims<'_>,
    ) -> (&'p [T], &'p [T], &'p [T], &'p [T]) {
        let (h, fc) = (self.h(d), self.fc(d));
        let nb = usize::from(!self.gated);
        let (fw, rest) = p.split_at(c * fc);
        let (fb, rest) = rest.split_at(nb * fc);
        let (pw, pb) = rest.split_at(h * c);
        (fw, fb, pw, pb)
    }

    fn split_mut<'p, T>(
        self,
        p: &'p mut [T],
        c: usize,
        d: &Dims<'_>,
    ) -> (&'p mut [T], &'p mut [T], &'p mut [T], &'p mut [T]) {
        let (h, fc) = (self.h(d), self.fc(d));
        let nb = usize::from(!self.gated);
        let (fw, rest) = p.split_at_mut(c * fc);
        let (fb, rest) = rest.split_at_mut(nb * fc);
        let (pw, pb) = rest.split_at_mut(h * c);
        (fw, fb, pw, pb)
    }

    /// The activation: GELU of `fch (n, h)`, or SwiGLU of `fch (n, 2h)`.
    fn act_forward(self, out: &mut [f32], fch: &[f32], n: usize, h: usize) -> Result<()> {
        if self.gated {
            swiglu_forward(out, fch, n, h)?;
        } else {
            gelu_forward(out, fch, n * h)?;
        }
        Ok(())
    }

    fn act_backward(
        self,
        dfch: &mut [f32],
        fch: &[f32],
        dact: &[f32],
        n: usize,
        h: usize,
    ) -> Result<()> {
        if self.gated {
            swiglu_backward(dfch, fch, dact, n, h)?;
        } else {
            gelu_backward(dfch, fch, dact, n * h)?;
        }
        Ok(())
    }

    /// Scratch of the input half: d act `(N, h)`, and under tensor
    /// parallelism the partial input gradient `(N, C)` (and its rows under
    /// sequence parallelism).
    fn input_scratch(self, d: &Dims<'_>) -> usize {
        let n = d.n();
        let mut s = n * self.h(d);
        if d.tp.is_some() {
            s += n * d.c;
        }
        if d.sequence_parallel() {
            s += d.rows() * d.c;
        }
        s
    }

    fn saved_len(self, d: &Dims<'_>) -> usize {
        // fch, and act(fch): the output projection's input, kept in bf16
        // (two per float) when the products round it to bf16 anyway, and
        // not at all under selective recomputation
        let nh = d.n() * self.h(d);
        d.n() * self.fc(d)
            + if d.selective {
                0
            } else {
                gelu_slots(nh, d.precision)
            }
    }

    fn split_saved_len(self, d: &Dims<'_>) -> usize {
        // d fch, and under SP the gathered output gradient
        d.n() * self.fc(d)
            + if d.sequence_parallel() {
                d.n() * d.c
            } else {
                0
            }
    }

    fn scratch_len(self, d: &Dims<'_>) -> usize {
        // the whole backward: the input half's scratch, then what it saves
        // for the weight half; the forward's row-parallel partial under SP,
        // and the activation before rounding in bf16
        (self.input_scratch(d) + self.split_saved_len(d))
            .max(d.n() * d.c)
            .max(d.n() * self.h(d))
    }

    fn forward(
        self,
        out: &mut [f32],
        saved: &mut [f32],
        scratch: &mut [f32],
        inp: LinearInput<'_, f32>,
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        // Forward GEMMs compute each row from its own input row alone, so
        // the mode does not change their bits.
        let Dims { b, t, c, mode, .. } = d;
        let (n, h, fc) = (b * t, self.h(&d), self.fc(&d));
        let (fw, fb, pw, pb) = self.split(params, c, &d);
        let (fch, act_saved) = saved.split_at_mut(n * fc);
        let fb = (!fb.is_empty()).then_some(fb);
        let pb = (!pb.is_empty()).then_some(pb);
        matmul_forward(fch, inp, fw, fb, b, t, c, fc, mode, d.precision)?;
        // under selective recomputation the activation lives in the
        // scratch (the products round it to bf16 as they pack: the bits
        // of a bf16 copy), after it the row-parallel partial
        let (act_buf, partial) = scratch.split_at_mut(if d.selective { n * h } else { 0 });
        let act = if d.selective {
            self.act_forward(act_buf, fch, n, h)?;
            LinearInput::Wide(&*act_buf)
        } else {
            if d.precision == Precision::Bf16 {
                self.act_forward(&mut partial[..n * h], fch, n, h)?;
                round_to_bf16_for_products(
                    &mut as_bf16_mut(act_saved)[..n * h],
                    &partial[..n * h],
                )?;
            } else {
                self.act_forward(&mut act_saved[..n * h], fch, n, h)?;
            }
            gelu_input(act_saved, n * h, d.precision)
        };
        match d.tp {
            None => matmul_forward(out, act, pw, pb, b, t, h, c, mode, d.precision)?,
            Some(tp) => {
                tp.row_forward(
                    out,
                    &mut partial[..n * c],
                    act,
                    pw,
                    pb,
                    (b, t),
                    (h, c),
                    mode,
                    d.precision,
                )?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn backward(
        self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        // The two halves in turn: each gradient is computed from the same
        // operands as by a fused backward, so the bits are the same.
        let (first, wsaved) = scratch.split_at_mut(self.input_scratch(&d));
        let wsaved = &mut wsaved[..self.split_saved_len(&d)];
        self.backward_input(dinp, wsaved, first, dout, saved, params, d)?;
        self.backward_weight(dparams, wsaved, first, dout, inp, saved, d)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_input(
        self,
        dinp: &mut [f32],
        wsaved: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        let Dims { b, t, c, mode, .. } = d;
        let (n, h, fc) = (b * t, self.h(&d), self.fc(&d));
        let (fw, _, pw, _) = self.split(params, c, &d);
        let fch = &saved[..n * fc];
        let (dact, rest) = scratch.split_at_mut(n * h);
        let (dfch, dfull) = wsaved.split_at_mut(n * fc);
        // c_proj is row-parallel: its input gradient needs the whole
        // output gradient (gathered under SP)
        let dy = match d.tp {
            Some(tp) => tp.row_output_grad(dout, dfull)?,
            None => dout,
        };
        weft_kernels::zero(dact);
        matmul_backward_input(dact, dy, pw, b, t, h, c, mode, d.precision)?;
        weft_kernels::zero(dfch);
        self.act_backward(dfch, fch, dact, n, h)?;
        match d.tp {
            None => matmul_backward_input(dinp, dfch, fw, b, t, c, fc, mode, d.precision)?,
            Some(tp) => {
                // c_fc is column-parallel: its input gradient is a partial
                // sum, summed over the group (this rank's rows under SP)
                let (partial, rows) = rest.split_at_mut(n * c);
                weft_kernels::zero(partial);
                matmul_backward_input(partial, dfch, fw, b, t, c, fc, mode, d.precision)?;
                let sp_rows = if d.sequence_parallel() {
                    d.rows() * c
                } else {
                    0
                };
                let r = tp.column_input_grad(partial, &mut rows[..sp_rows])?;
                weft_kernels::accumulate(dinp, r)?;
            }
        }
        Ok(())
    }

    /// `act_buf` (`n·h` floats at least) takes the activation recomputed
    /// under selective recomputation.
    #[allow(clippy::too_many_arguments)]
    fn backward_weight(
        self,
        dparams: &mut [f32],
        wsaved: &[f32],
        act_buf: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        let Dims { b, t, c, .. } = d;
        let (n, h, fc) = (b * t, self.h(&d), self.fc(&d));
        let (dfw, dfb, dpw, dpb) = self.split_mut(dparams, c, &d);
        let act = if d.selective {
            let a = &mut act_buf[..n * h];
            self.act_forward(a, &saved[..n * fc], n, h)?;
            LinearInput::Wide(&*a)
        } else {
            gelu_input(&saved[n * fc..], n * h, d.precision)
        };
        let (dfch, dfull) = wsaved.split_at(n * fc);
        let dy = if d.sequence_parallel() { dfull } else { dout };
        let dpb = (!dpb.is_empty()).then_some(dpb);
        let dfb = (!dfb.is_empty()).then_some(dfb);
        matmul_backward_weight(dpw, dpb, dy, act, b, t, h, c, d.precision)?;
        matmul_backward_weight(dfw, dfb, dfch, inp, b, t, c, fc, d.precision)?;
        Ok(())
    }
}

/// Floats the dense MLP's saved activation output takes for `nh` values:
/// `nh`, or in bf16 two values per float.
fn gelu_slots(nh: usize, precision: Precision) -> usize {
    if precision == Precision::Bf16 {
        nh.div_ceil(2)
    } else {
        nh
    }
}

/// The `f32` values of the input of a block that does not declare
/// [`FeedForward::input_feeds_products_only`], which always receives them
/// so; an error names the block otherwise.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for a bf16 input.
pub fn wide_input<'a>(inp: LinearInput<'a, f32>, block: &str) -> Result<&'a [f32]> {
    match inp {
        LinearInput::Wide(x) => Ok(x),
        LinearInput::Bf16(_) => Err(crate::Error::Config {
            field: "precision",
            reason: format!("{block} reads its input in f32, and was given bf16 values"),
        }),
    }
}

/// `slots` floats seen as the bf16 values they hold (two per float).
fn as_bf16_mut(slots: &mut [f32]) -> &mut [bf16] {
    bytemuck::cast_slice_mut(slots)
}

/// The saved activation output (`nh` values from the start of `saved`) as
/// the output projection's input: `f32`, or the bf16 values it holds in
/// [`Precision::Bf16`].
fn gelu_input(saved: &[f32], nh: usize, precision: Precision) -> LinearInput<'_, f32> {
    if precision == Precision::Bf16 {
        let v: &[bf16] = bytemuck::cast_slice(&saved[..nh.div_ceil(2)]);
        LinearInput::Bf16(&v[..nh])
    } else {
        LinearInput::Wide(&saved[..nh])
    }
}

/// The dense blocks' `FeedForward` methods, delegated to [`Dense`].
macro_rules! dense_feed_forward {
    ($ty:ty) => {
        impl FeedForward for $ty {
            fn input_feeds_products_only(&self) -> bool {
                true
            }

            fn params(&self, c: usize) -> Vec<ParamShape> {
                self.dense(c).params(c)
            }

            fn saved_len(&self, d: &Dims<'_>) -> usize {
                self.dense(d.c).saved_len(d)
            }

            fn scratch_len(&self, d: &Dims<'_>) -> usize {
                self.dense(d.c).scratch_len(d)
            }

            fn forward(
                &self,
                out: &mut [f32],
                saved: &mut [f32],
                scratch: &mut [f32],
                inp: LinearInput<'_, f32>,
                params: &[f32],
                d: Dims<'_>,
            ) -> Result<()> {
                self.dense(d.c).forward(out, saved, scratch, inp, params, d)
            }

            fn backward(
                &self,
                dinp: &mut [f32],
                dparams: &mut [f32],
                scratch: &mut [f32],
                dout: &[f32],
                inp: LinearInput<'_, f32>,
                saved: &[f32],
                params: &[f32],
                d: Dims<'_>,
            ) -> Result<()> {
                self.dense(d.c)
                    .backward(dinp, dparams, scratch, dout, inp, saved, params, d)
            }

            fn split_saved_len(&self, d: &Dims<'_>) -> usize {
                self.dense(d.c).split_saved_len(d)
            }

            fn backward_input(
                &self,
                dinp: &mut [f32],
                wsaved: &mut [f32],
                _sink: &mut [f32],
                scratch: &mut [f32],
                dout: &[f32],
                _inp: LinearInput<'_, f32>,
                saved: &[f32],
                params: &[f32],
                d: Dims<'_>,
            ) -> Result<()> {
                self.dense(d.c)
                    .backward_input(dinp, wsaved, scratch, dout, saved, params, d)
            }

            fn backward_weight(
                &self,
                dparams: &mut [f32],
                wsaved: &[f32],
                _sink: &mut [f32],
                scratch: &mut [f32],
                dout: &[f32],
                inp: LinearInput<'_, f32>,
                saved: &[f32],
                _params: &[f32],
                d: Dims<'_>,
            ) -> Result<()> {
                self.dense(d.c)
                    .backward_weight(dparams, wsaved, scratch, dout, inp, saved, d)
            }
        }
    };
}

impl Dense {
    /// The block's tensors: GPT-2's `c_fc` (weight and bias by columns)
    /// and `c_proj` (weight by rows, bias replicated) — Megatron's split —
    /// or the gated block's fused `gate_up` (each half by columns) and
    /// bias-free `c_proj`.
    fn params(self, c: usize) -> Vec<ParamShape> {
        let p = |s: &str, shape: Vec<usize>, decay, tp: Placement| ParamShape {
            suffix: s.into(),
            shape,
            decay,
            placements: Placements::tp(tp),
        };
        let h = self.hidden;
        if self.gated {
            return vec![
                p(
                    "mlp.gate_up.weight",
                    vec![c, 2 * h],
                    true,
                    Placement::strided(1, 2),
                ),
                p("mlp.c_proj.weight", vec![h, c], true, Placement::shard(0)),
            ];
        }
        vec![
            p("mlp.c_fc.weight", vec![c, h], true, Placement::shard(1)),
            p("mlp.c_fc.bias", vec![h], false, Placement::shard(0)),
            p("mlp.c_proj.weight", vec![h, c], true, Placement::shard(0)),
            p("mlp.c_proj.bias", vec![c], false, Placement::Replicate),
        ]
    }
}

impl Mlp {
    fn dense(self, c: usize) -> Dense {
        Dense {
            gated: false,
            hidden: 4 * c,
        }
    }
}

impl SwiGlu {
    fn dense(self, _c: usize) -> Dense {
        Dense {
            gated: true,
            hidden: self.hidden,
        }
    }
}

dense_feed_forward!(Mlp);
dense_feed_forward!(SwiGlu);
