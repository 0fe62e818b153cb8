//! The mixture-of-experts feed-forward block: a router, E experts of
//! hidden width H ([`Expert`]: GPT-2's MLP `c_proj(gelu(c_fc(x)))` with
//! biases, or SwiGLU `c_proj(silu(x·W_gate) ⊙ x·W_up)` without, as in
//! Qwen3-MoE and DeepSeek-V3) and optionally shared experts that every
//! token uses: `n` shared experts are one MLP of the same kind and width
//! `n·H` (transformers' DeepSeek-V3 `n_shared_experts`).
//!
//! `out[t] = Σ_{slots i of t, kept} g_i · expert_{e_i}(x[t]) + shared(x[t])`.
//!
//! Experts run grouped: the rows routed to each expert are gathered into
//! one contiguous matrix and multiplied in one GEMM of exactly that many
//! rows (no padding to a capacity), then scattered back.

use weft_kernels::{
    Mode, Precision, Real, gelu_backward, gelu_forward, matmul_backward, matmul_forward,
    swiglu_backward, swiglu_forward,
};

use crate::balance::AuxLoss;
use crate::error::{Error, Result, check};
use crate::router::{Router, Routing};
use crate::stats::LoadStats;

/// What each expert (and the shared expert) computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Expert {
    /// GPT-2's MLP with biases: `c_proj(gelu(x·c_fc + b) ) + b`; tensors
    /// `c_fc.weight (C, H)`, `c_fc.bias (H)`, `c_proj.weight (H, C)`,
    /// `c_proj.bias (C)`.
    #[default]
    Gelu,
    /// The gated MLP of Llama, Qwen3-MoE and DeepSeek-V3, no biases:
    /// `c_proj(silu(x·W_gate) ⊙ x·W_up)`; tensors `gate_up.weight (C, 2H)`
    /// (gate columns, then up columns) and `c_proj.weight (H, C)`.
    SwiGlu,
}

impl Expert {
    /// Columns of the input projection for hidden width `h`: `h`, or `2h`
    /// gated.
    #[must_use]
    pub fn fc(self, h: usize) -> usize {
        match self {
            Expert::Gelu => h,
            Expert::SwiGlu => 2 * h,
        }
    }

    /// Whether its projections have biases.
    #[must_use]
    pub fn biases(self) -> bool {
        self == Expert::Gelu
    }
}

/// Configuration of one MoE block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Channels, C.
    pub channels: usize,
    /// Hidden width of each expert, H (GPT-2: 4C; fine-grained experts
    /// are narrower: Qwen3-MoE's `moe_intermediate_size`).
    pub hidden: usize,
    /// The router (token choice only: dropless or with capacity).
    pub router: Router,
    /// What the experts compute.
    pub expert: Expert,
    /// Shared experts that process every token, as one MLP of hidden
    /// width `shared_experts·H` (DeepSeek-V3's `n_shared_experts`; 0:
    /// none, as in Qwen3-MoE).
    pub shared_experts: usize,
    /// The auxiliary loss whose gradient the backward adds to the router,
    /// if any.
    pub aux: Option<AuxLoss>,
}

/// A tensor of the block, in parameter-buffer order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name relative to the block, e.g. `experts.c_fc.weight`.
    pub name: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
    /// Whether weight decay applies.
    pub decay: bool,
    /// Whether the optimizer trains it (the selection bias is set by
    /// [`BiasBalancer`](crate::BiasBalancer), never by gradients: its
    /// gradient is always 0).
    pub trained: bool,
}

impl TensorSpec {
    /// Elements.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a forward reports besides its output.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeForward {
    /// Load statistics of this forward.
    pub stats: LoadStats,
    /// The auxiliary loss value (already multiplied by its coefficient;
    /// 0 without one). Add it to the training loss for reporting; its
    /// gradient is added by the backward.
    pub aux_loss: f64,
}

/// Parameter views of the block (experts possibly a shard of them).
/// Biases are empty slices for [`Expert::SwiGlu`]; `F` is `H` or `2H`
/// ([`Expert::fc`]).
pub(crate) struct Params<'a, T> {
    pub router_w: &'a [T], // (C, E)
    pub bias: &'a [T],     // (E)
    pub fc_w: &'a [T],     // (El, C, F)
    pub fc_b: &'a [T],     // (El, H) or empty
    pub proj_w: &'a [T],   // (El, H, C)
    pub proj_b: &'a [T],   // (El, C) or empty
    pub shared: Option<[&'a [T]; 4]>,
}

pub(crate) struct ParamsMut<'a, T> {
    pub router_w: &'a mut [T],
    pub fc_w: &'a mut [T],
    pub fc_b: &'a mut [T],
    pub proj_w: &'a mut [T],
    pub proj_b: &'a mut [T],
    pub shared: Option<[&'a mut [T]; 4]>,
}

fn take<'a, T>(p: &mut &'a [T], n: usize) -> &'a [T] {
    let (a, b) = p.split_at(n);
    *p = b;
    a
}

fn take_mut<'a, T>(p: &mut &'a mut [T], n: usize) -> &'a mut [T] {
    let (a, b) = std::mem::take(p).split_at_mut(n);
    *p = b;
    a
}

impl MoeConfig {
    /// A dropless top-k block of `experts` GPT-2 MLPs of hidden width 4C.
    #[must_use]
    pub fn new(channels: usize, experts: usize, top_k: usize) -> Self {
        MoeConfig {
            channels,
            hidden: 4 * channels,
            router: Router::top_k(experts, top_k),
            expert: Expert::Gelu,
            shared_experts: 0,
            aux: None,
        }
    }

    /// Hidden width of the shared MLP, `shared_experts·H` (0 without).
    #[must_use]
    pub fn shared_hidden(&self) -> usize {
        self.shared_experts * self.hidden
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] or [`Error::Unsupported`] (expert choice).
    pub fn validate(&self) -> Result<()> {
        self.router.validate()?;
        if !self.router.is_token_choice() {
            return Err(Error::Unsupported {
                op: "MoeConfig",
                router: self.router.name(),
                reason: "the expert block needs a fixed number of slots per token (token choice)"
                    .into(),
            });
        }
        for (field, v) in [("channels", self.channels), ("hidden", self.hidden)] {
            if v == 0 {
                return Err(Error::Config {
                    field,
                    reason: "must be positive".into(),
                });
            }
        }
        Ok(())
    }

    /// The block's tensors in buffer order, for `local_experts` experts
    /// (all of them without expert parallelism).
    #[must_use]
    pub fn tensors(&self, local_experts: usize) -> Vec<TensorSpec> {
        let (c, h, e, el) = (
            self.channels,
            self.hidden,
            self.router.experts,
            local_experts,
        );
        let t = |name, shape: Vec<usize>, decay, trained| TensorSpec {
            name,
            shape,
            decay,
            trained,
        };
        let s = self.shared_hidden();
        let mut v = vec![
            t("router.weight", vec![c, e], true, true),
            t("router.selection_bias", vec![e], false, false),
        ];
        match self.expert {
            Expert::Gelu => {
                v.extend([
                    t("experts.c_fc.weight", vec![el, c, h], true, true),
                    t("experts.c_fc.bias", vec![el, h], false, true),
                    t("experts.c_proj.weight", vec![el, h, c], true, true),
                    t("experts.c_proj.bias", vec![el, c], false, true),
                ]);
                if s > 0 {
                    v.extend([
                        t("shared_expert.c_fc.weight", vec![c, s], true, true),
                        t("shared_expert.c_fc.bias", vec![s], false, true),
                        t("shared_expert.c_proj.weight", vec![s, c], true, true),
                        t("shared_expert.c_proj.bias", vec![c], false, true),
                    ]);
                }
            }
            Expert::SwiGlu => {
                v.extend([
                    t("experts.gate_up.weight", vec![el, c, 2 * h], true, true),
                    t("experts.c_proj.weight", vec![el, h, c], true, true),
                ]);
                if s > 0 {
                    v.extend([
                        t("shared_expert.gate_up.weight", vec![c, 2 * s], true, true),
                        t("shared_expert.c_proj.weight", vec![s, c], true, true),
                    ]);
                }
            }
        }
        v
    }

    /// Parameter count for `local_experts` experts.
    #[must_use]
    pub fn num_params(&self, local_experts: usize) -> usize {
        self.tensors(local_experts)
            .iter()
            .map(TensorSpec::numel)
            .sum()
    }

    /// Offset range of the selection bias in the block's buffer.
    #[must_use]
    pub fn selection_bias_range(&self) -> std::ops::Range<usize> {
        let s = self.channels * self.router.experts;
        s..s + self.router.experts
    }

    /// Activation values saved per token by [`MoeBlock::forward`]:
    /// router logits (E), then per slot the expert's pre-activation (F =
    /// H, or 2H for SwiGLU), activation output (H) and output (C), then
    /// the shared MLP's pre-activation and activation output (F_s + S for
    /// its width S).
    #[must_use]
    pub fn saved_per_token(&self) -> usize {
        let h = self.hidden;
        self.router.experts
            + self.router.top_k * (self.expert.fc(h) + h + self.channels)
            + self.shared_saved_per_token()
    }

    /// The shared MLP's saved values per token, `F_s + S` (0 without).
    pub(crate) fn shared_saved_per_token(&self) -> usize {
        let s = self.shared_hidden();
        self.expert.fc(s) + s
    }

    /// Lengths of (fc_w, fc_b, proj_w, proj_b) of one MLP of width `h`.
    pub(crate) fn mlp_lens(&self, h: usize) -> [usize; 4] {
        let c = self.channels;
        let nb = usize::from(self.expert.biases());
        [c * self.expert.fc(h), nb * h, h * c, nb * c]
    }

    pub(crate) fn split<'a, T>(&self, mut p: &'a [T], el: usize) -> Params<'a, T> {
        let (c, e) = (self.channels, self.router.experts);
        let l = self.mlp_lens(self.hidden);
        let ls = self.mlp_lens(self.shared_hidden());
        Params {
            router_w: take(&mut p, c * e),
            bias: take(&mut p, e),
            fc_w: take(&mut p, el * l[0]),
            fc_b: take(&mut p, el * l[1]),
            proj_w: take(&mut p, el * l[2]),
            proj_b: take(&mut p, el * l[3]),
            shared: (self.shared_experts > 0).then(|| {
                [
                    take(&mut p, ls[0]),
                    take(&mut p, ls[1]),
                    take(&mut p, ls[2]),
                    take(&mut p, ls[3]),
                ]
            }),
        }
    }

    pub(crate) fn split_mut<'a, T>(&self, mut p: &'a mut [T], el: usize) -> ParamsMut<'a, T> {
        let (c, e) = (self.channels, self.router.experts);
        let l = self.mlp_lens(self.hidden);
        let ls = self.mlp_lens(self.shared_hidden());
        let router_w = take_mut(&mut p, c * e);
        let _bias = take_mut(&mut p, e);
        ParamsMut {
            router_w,
            fc_w: take_mut(&mut p, el * l[0]),
            fc_b: take_mut(&mut p, el * l[1]),
            proj_w: take_mut(&mut p, el * l[2]),
            proj_b: take_mut(&mut p, el * l[3]),
            shared: if self.shared_experts > 0 {
                Some([
                    take_mut(&mut p, ls[0]),
                    take_mut(&mut p, ls[1]),
                    take_mut(&mut p, ls[2]),
                    take_mut(&mut p, ls[3]),
                ])
            } else {
                None
            },
        }
    }
}

/// A bias slice as an optional bias (empty: none).
fn opt<T>(b: &[T]) -> Option<&[T]> {
    (!b.is_empty()).then_some(b)
}

fn opt_mut<T>(b: &mut [T]) -> Option<&mut [T]> {
    (!b.is_empty()).then_some(b)
}

/// One MLP's forward over `rows` rows: `hpre (rows, F) = x·w1(+b1)`,
/// `a (rows, H) = gelu(hpre)` or `swiglu(hpre)`, `y = a·w2(+b2)`, its
/// products in `precision`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mlp_forward<T: Real>(
    y: &mut [T],
    hpre: &mut [T],
    a: &mut [T],
    x: &[T],
    w: [&[T]; 4],
    rows: usize,
    c: usize,
    h: usize,
    kind: Expert,
    precision: Precision,
) -> Result<()> {
    matmul_forward(
        hpre,
        x,
        w[0],
        opt(w[1]),
        1,
        rows,
        c,
        kind.fc(h),
        Mode::Throughput,
        precision,
    )?;
    match kind {
        Expert::Gelu => gelu_forward(a, hpre, rows * h)?,
        Expert::SwiGlu => swiglu_forward(a, hpre, rows, h)?,
    }
    matmul_forward(
        y,
        a,
        w[2],
        opt(w[3]),
        1,
        rows,
        h,
        c,
        Mode::Throughput,
        precision,
    )?;
    Ok(())
}

/// Backward of [`mlp_forward`], accumulating into `dx` and `dw`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mlp_backward<T: Real>(
    dx: &mut [T],
    dw: [&mut [T]; 4],
    dy: &[T],
    x: &[T],
    hpre: &[T],
    a: &[T],
    w: [&[T]; 4],
    rows: usize,
    c: usize,
    h: usize,
    kind: Expert,
    precision: Precision,
) -> Result<()> {
    let [dw1, db1, dw2, db2] = dw;
    let f = kind.fc(h);
    let mut da = vec![T::ZERO; rows * h];
    let mut dh = vec![T::ZERO; rows * f];
    matmul_backward(
        &mut da,
        dw2,
        opt_mut(db2),
        dy,
        a,
        w[2],
        1,
        rows,
        h,
        c,
        Mode::Throughput,
        precision,
    )?;
    match kind {
        Expert::Gelu => gelu_backward(&mut dh, hpre, &da, rows * h)?,
        Expert::SwiGlu => swiglu_backward(&mut dh, hpre, &da, rows, h)?,
    }
    matmul_backward(
        dx,
        dw1,
        opt_mut(db1),
        &dh,
        x,
        w[0],
        1,
        rows,
        c,
        f,
        Mode::Throughput,
        precision,
    )?;
    Ok(())
}

/// Slots grouped by expert: `order[offsets[e]..offsets[e+1]]` are the kept
/// slots routed to expert `e`, in slot order.
pub(crate) fn group<T: Real>(r: &Routing<T>) -> (Vec<usize>, Vec<usize>) {
    let e = r.experts;
    let mut offsets = vec![0usize; e + 1];
    for (slot, &j) in r.chosen.iter().enumerate() {
        if r.kept[slot] {
            offsets[j as usize + 1] += 1;
        }
    }
    for i in 0..e {
        offsets[i + 1] += offsets[i];
    }
    let mut fill = offsets.clone();
    let mut order = vec![0usize; offsets[e]];
    for (slot, &j) in r.chosen.iter().enumerate() {
        if r.kept[slot] {
            order[fill[j as usize]] = slot;
            fill[j as usize] += 1;
        }
    }
    (order, offsets)
}

/// A mixture-of-experts feed-forward block (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeBlock {
    cfg: MoeConfig,
    /// The arithmetic of the experts' products (the router's are f32).
    pub(crate) precision: Precision,
    /// The scale the loss's gradient carries into the backward (dynamic
    /// loss scaling), applied to the auxiliary loss's gradient too.
    loss_scale: f64,
}

impl MoeBlock {
    /// A block with configuration `cfg`.
    ///
    /// # Errors
    /// As [`MoeConfig::validate`].
    pub fn new(cfg: MoeConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(MoeBlock {
            cfg,
            precision: Precision::F32,
            loss_scale: 1.0,
        })
    }

    /// This block with its experts' (and the shared expert's) matrix
    /// products in `precision` ([`Precision::Bf16`]: mixed precision). The
    /// router's logits and their gradients stay f32 whatever the
    /// precision: routing decisions are where a rounding flips a choice.
    #[must_use]
    pub fn with_precision(&self, precision: Precision) -> Self {
        MoeBlock {
            precision,
            ..self.clone()
        }
    }

    /// The arithmetic of the experts' products.
    #[must_use]
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// This block for a backward whose output gradient is that of the
    /// loss times `scale` (dynamic loss scaling, as fp16 training does):
    /// the auxiliary loss's gradient is added times `scale` as well, so
    /// that dividing every gradient by `scale` afterwards gives the
    /// unscaled ones. 1 (the default) changes nothing.
    #[must_use]
    pub fn with_loss_scale(&self, scale: f64) -> Self {
        MoeBlock {
            loss_scale: scale,
            ..self.clone()
        }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// Parameter count.
    #[must_use]
    pub fn num_params(&self) -> usize {
        self.cfg.num_params(self.cfg.router.experts)
    }

    /// GPT-2-style initialisation of `params`: weights `N(0, 0.02²)`
    /// (c_proj weights scaled by `proj_scale`, GPT-2 uses
    /// `1/sqrt(2·n_layer)`), biases and the selection bias 0.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a wrong buffer length.
    pub fn init<T: Real>(&self, params: &mut [T], seed: u64, proj_scale: f64) -> Result<()> {
        check("init", "params", params, self.num_params())?;
        let mut rng = crate::audit::SplitMix::new(seed);
        let mut off = 0;
        for t in self.cfg.tensors(self.cfg.router.experts) {
            let n = t.numel();
            let dst = &mut params[off..off + n];
            off += n;
            if t.name.ends_with("weight") {
                let std = if t.name.ends_with("c_proj.weight") {
                    0.02 * proj_scale
                } else {
                    0.02
                };
                for x in dst {
                    // Box–Muller.
                    let u1 = rng.uniform().max(1e-300);
                    let u2 = rng.uniform();
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    *x = T::from_f64(std * z);
                }
            } else {
                dst.fill(T::ZERO);
            }
        }
        Ok(())
    }

    fn check_io<T>(
        &self,
        op: &'static str,
        inp: &[T],
        saved: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<usize> {
        let n: usize = seq_lens.iter().sum();
        check(op, "inp", inp, n * self.cfg.channels)?;
        check(op, "saved", saved, n * self.cfg.saved_per_token())?;
        check(op, "params", params, self.num_params())?;
        Ok(n)
    }

    /// Routes with the selection bias in `params`, from router logits.
    pub(crate) fn route<T: Real>(
        &self,
        logits: &[T],
        bias: &[T],
        seq_lens: &[usize],
    ) -> Result<Routing<T>> {
        self.cfg.router.route(logits, seq_lens, Some(bias))
    }

    /// `out (N,C) = moe(inp (N,C))` for `N = Σ seq_lens` tokens laid out
    /// as consecutive sequences; fills `saved (N, saved_per_token)`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] on a wrong buffer length.
    pub fn forward<T: Real>(
        &self,
        out: &mut [T],
        saved: &mut [T],
        inp: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<MoeForward> {
        const OP: &str = "moe_forward";
        let n = self.check_io(OP, inp, saved, params, seq_lens)?;
        let cfg = &self.cfg;
        let (c, h, e, k) = (
            cfg.channels,
            cfg.hidden,
            cfg.router.experts,
            cfg.router.top_k,
        );
        check(OP, "out", out, n * c)?;
        let f = cfg.expert.fc(h);
        let p = cfg.split(params, e);
        let (logits, rest) = saved.split_at_mut(n * e);
        let (slot_saved, shared_saved) = rest.split_at_mut(n * k * (f + h + c));
        matmul_forward(
            logits,
            inp,
            p.router_w,
            None,
            1,
            n,
            c,
            e,
            Mode::Throughput,
            Precision::F32,
        )?;
        let routing = self.route(logits, p.bias, seq_lens)?;
        let (order, offsets) = group(&routing);
        // Per-slot storage: [hpre (N*k, F) | a (N*k, H) | y (N*k, C)].
        let (s_h, rest) = slot_saved.split_at_mut(n * k * f);
        let (s_a, s_y) = rest.split_at_mut(n * k * h);
        s_h.fill(T::ZERO);
        s_a.fill(T::ZERO);
        s_y.fill(T::ZERO);
        let max_rows = (0..e)
            .map(|j| offsets[j + 1] - offsets[j])
            .max()
            .unwrap_or(0);
        let mut gx = vec![T::ZERO; max_rows * c];
        let mut gh = vec![T::ZERO; max_rows * f];
        let mut ga = vec![T::ZERO; max_rows * h];
        let mut gy = vec![T::ZERO; max_rows * c];
        for j in 0..e {
            let slots = &order[offsets[j]..offsets[j + 1]];
            let rows = slots.len();
            if rows == 0 {
                continue;
            }
            for (r, &slot) in slots.iter().enumerate() {
                let tok = slot / k;
                gx[r * c..(r + 1) * c].copy_from_slice(&inp[tok * c..(tok + 1) * c]);
            }
            let w = expert_weights(&p, j, cfg);
            mlp_forward(
                &mut gy[..rows * c],
                &mut gh[..rows * f],
                &mut ga[..rows * h],
                &gx[..rows * c],
                w,
                rows,
                c,
                h,
                cfg.expert,
                self.precision,
            )?;
            for (r, &slot) in slots.iter().enumerate() {
                s_h[slot * f..(slot + 1) * f].copy_from_slice(&gh[r * f..(r + 1) * f]);
                s_a[slot * h..(slot + 1) * h].copy_from_slice(&ga[r * h..(r + 1) * h]);
                s_y[slot * c..(slot + 1) * c].copy_from_slice(&gy[r * c..(r + 1) * c]);
            }
        }
        combine(out, s_y, &routing, c);
        if let Some(w) = p.shared {
            let s = cfg.shared_hidden();
            let (sh, sa) = shared_saved.split_at_mut(n * cfg.expert.fc(s));
            let mut y = vec![T::ZERO; n * c];
            mlp_forward(&mut y, sh, sa, inp, w, n, c, s, cfg.expert, self.precision)?;
            for (o, yi) in out.iter_mut().zip(&y) {
                *o += *yi;
            }
        }
        let aux_loss = match cfg.aux {
            Some(aux) => aux.forward(&routing, seq_lens)?,
            None => 0.0,
        };
        Ok(MoeForward {
            stats: LoadStats::from_routing(&routing),
            aux_loss,
        })
    }

    /// Backward of [`forward`](Self::forward): accumulates `dinp (N,C)` and
    /// `dparams` (same layout as `params`; the selection bias's gradient
    /// stays 0) from `dout (N,C)`, plus the auxiliary loss's gradient
    /// into the router if configured.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] on a wrong buffer length.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: Real>(
        &self,
        dinp: &mut [T],
        dparams: &mut [T],
        dout: &[T],
        inp: &[T],
        saved: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<()> {
        const OP: &str = "moe_backward";
        let n = self.check_io(OP, inp, saved, params, seq_lens)?;
        let cfg = &self.cfg;
        let (c, h, e, k) = (
            cfg.channels,
            cfg.hidden,
            cfg.router.experts,
            cfg.router.top_k,
        );
        check(OP, "dinp", dinp, n * c)?;
        check(OP, "dout", dout, n * c)?;
        check(OP, "dparams", dparams, self.num_params())?;
        let f = cfg.expert.fc(h);
        let p = cfg.split(params, e);
        let mut g = cfg.split_mut(dparams, e);
        let (logits, rest) = saved.split_at(n * e);
        let (slot_saved, shared_saved) = rest.split_at(n * k * (f + h + c));
        let (s_h, rest) = slot_saved.split_at(n * k * f);
        let (s_a, s_y) = rest.split_at(n * k * h);
        let routing = self.route(logits, p.bias, seq_lens)?;
        let (order, offsets) = group(&routing);
        // Gate gradients: dgate[slot] = dout[tok] · y[slot].
        let mut dgate = vec![T::ZERO; n * k];
        for (slot, dg) in dgate.iter_mut().enumerate() {
            if routing.kept[slot] {
                let tok = slot / k;
                *dg = dot(
                    &dout[tok * c..(tok + 1) * c],
                    &s_y[slot * c..(slot + 1) * c],
                );
            }
        }
        let max_rows = (0..e)
            .map(|j| offsets[j + 1] - offsets[j])
            .max()
            .unwrap_or(0);
        let mut gx = vec![T::ZERO; max_rows * c];
        let mut gh = vec![T::ZERO; max_rows * f];
        let mut ga = vec![T::ZERO; max_rows * h];
        let mut gdy = vec![T::ZERO; max_rows * c];
        let mut gdx = vec![T::ZERO; max_rows * c];
        for j in 0..e {
            let slots = &order[offsets[j]..offsets[j + 1]];
            let rows = slots.len();
            if rows == 0 {
                continue;
            }
            for (r, &slot) in slots.iter().enumerate() {
                let tok = slot / k;
                gx[r * c..(r + 1) * c].copy_from_slice(&inp[tok * c..(tok + 1) * c]);
                gh[r * f..(r + 1) * f].copy_from_slice(&s_h[slot * f..(slot + 1) * f]);
                ga[r * h..(r + 1) * h].copy_from_slice(&s_a[slot * h..(slot + 1) * h]);
                let gt = routing.gate[slot];
                for (d, &o) in gdy[r * c..(r + 1) * c]
                    .iter_mut()
                    .zip(&dout[tok * c..(tok + 1) * c])
                {
                    *d = gt * o;
                }
            }
            gdx[..rows * c].fill(T::ZERO);
            let w = expert_weights(&p, j, cfg);
            let dw = expert_weights_mut(&mut g, j, cfg);
            mlp_backward(
                &mut gdx[..rows * c],
                dw,
                &gdy[..rows * c],
                &gx[..rows * c],
                &gh[..rows * f],
                &ga[..rows * h],
                w,
                rows,
                c,
                h,
                cfg.expert,
                self.precision,
            )?;
            for (r, &slot) in slots.iter().enumerate() {
                let tok = slot / k;
                for (d, &v) in dinp[tok * c..(tok + 1) * c]
                    .iter_mut()
                    .zip(&gdx[r * c..(r + 1) * c])
                {
                    *d += v;
                }
            }
        }
        self.router_backward(
            dinp, g.router_w, &dgate, &routing, inp, p.router_w, seq_lens,
        )?;
        if let (Some(w), Some(dw)) = (p.shared, g.shared) {
            let s = cfg.shared_hidden();
            let (sh, sa) = shared_saved.split_at(n * cfg.expert.fc(s));
            mlp_backward(
                dinp,
                dw,
                dout,
                inp,
                sh,
                sa,
                w,
                n,
                c,
                s,
                cfg.expert,
                self.precision,
            )?;
        }
        Ok(())
    }

    /// Router backward: gate gradient plus auxiliary loss into the logits,
    /// then through `logits = inp · router_w`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn router_backward<T: Real>(
        &self,
        dinp: &mut [T],
        drouter_w: &mut [T],
        dgate: &[T],
        routing: &Routing<T>,
        inp: &[T],
        router_w: &[T],
        seq_lens: &[usize],
    ) -> Result<()> {
        let (c, e) = (self.cfg.channels, self.cfg.router.experts);
        let n = routing.n_tokens();
        let mut dlogits = vec![T::ZERO; n * e];
        routing.gate_backward(&mut dlogits, dgate)?;
        if let Some(aux) = self.cfg.aux {
            let aux = AuxLoss {
                coef: aux.coef * self.loss_scale,
                ..aux
            };
            aux.backward(&mut dlogits, routing, seq_lens)?;
        }
        matmul_backward(
            dinp,
            drouter_w,
            None,
            &dlogits,
            inp,
            router_w,
            1,
            n,
            c,
            e,
            Mode::Throughput,
            Precision::F32,
        )?;
        Ok(())
    }
}

/// `out[tok] = Σ_i gate_i · y[slot_i]` over kept slots (slot order).
pub(crate) fn combine<T: Real>(out: &mut [T], y: &[T], routing: &Routing<T>, c: usize) {
    let k = routing.slots;
    for (tok, o) in out.chunks_exact_mut(c).enumerate() {
        o.fill(T::ZERO);
        for slot in tok * k..(tok + 1) * k {
            if routing.kept[slot] {
                let g = routing.gate[slot];
                for (oi, &yi) in o.iter_mut().zip(&y[slot * c..(slot + 1) * c]) {
                    *oi += g * yi;
                }
            }
        }
    }
}

pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// Expert `j`'s (fc_w, fc_b, proj_w, proj_b) within the (local) expert
/// tensors (biases empty for [`Expert::SwiGlu`]).
pub(crate) fn expert_weights<'a, T>(p: &Params<'a, T>, j: usize, cfg: &MoeConfig) -> [&'a [T]; 4] {
    let l = cfg.mlp_lens(cfg.hidden);
    [
        &p.fc_w[j * l[0]..(j + 1) * l[0]],
        &p.fc_b[j * l[1]..(j + 1) * l[1]],
        &p.proj_w[j * l[2]..(j + 1) * l[2]],
        &p.proj_b[j * l[3]..(j + 1) * l[3]],
    ]
}

pub(crate) fn expert_weights_mut<'b, T>(
    g: &'b mut ParamsMut<'_, T>,
    j: usize,
    cfg: &MoeConfig,
) -> [&'b mut [T]; 4] {
    let l = cfg.mlp_lens(cfg.hidden);
    [
        &mut g.fc_w[j * l[0]..(j + 1) * l[0]],
        &mut g.fc_b[j * l[1]..(j + 1) * l[1]],
        &mut g.proj_w[j * l[2]..(j + 1) * l[2]],
        &mut g.proj_b[j * l[3]..(j + 1) * l[3]],
    ]
}
