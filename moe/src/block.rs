//! The mixture-of-experts feed-forward block: a router, E experts (each a
//! GPT-2 MLP `c_proj(gelu(c_fc(x)))` of hidden width H) and an optional
//! shared expert that every token uses.
//!
//! `out[t] = Σ_{slots i of t, kept} g_i · expert_{e_i}(x[t]) + shared(x[t])`.
//!
//! Experts run grouped: the rows routed to each expert are gathered into
//! one contiguous matrix and multiplied in one GEMM of exactly that many
//! rows (no padding to a capacity), then scattered back.

use weft_kernels::{
    Mode, Precision, Real, gelu_backward, gelu_forward, matmul_backward, matmul_forward,
};

use crate::balance::AuxLoss;
use crate::error::{Error, Result, check};
use crate::router::{Router, Routing};
use crate::stats::LoadStats;

/// Configuration of one MoE block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Channels, C.
    pub channels: usize,
    /// Hidden width of each expert, H (GPT-2: 4C).
    pub hidden: usize,
    /// The router (token choice only: dropless or with capacity).
    pub router: Router,
    /// Whether a shared expert (hidden width H) processes every token.
    pub shared_expert: bool,
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
pub(crate) struct Params<'a, T> {
    pub router_w: &'a [T], // (C, E)
    pub bias: &'a [T],     // (E)
    pub fc_w: &'a [T],     // (El, C, H)
    pub fc_b: &'a [T],     // (El, H)
    pub proj_w: &'a [T],   // (El, H, C)
    pub proj_b: &'a [T],   // (El, C)
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
            shared_expert: false,
            aux: None,
        }
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
        let mut v = vec![
            t("router.weight", vec![c, e], true, true),
            t("router.selection_bias", vec![e], false, false),
            t("experts.c_fc.weight", vec![el, c, h], true, true),
            t("experts.c_fc.bias", vec![el, h], false, true),
            t("experts.c_proj.weight", vec![el, h, c], true, true),
            t("experts.c_proj.bias", vec![el, c], false, true),
        ];
        if self.shared_expert {
            v.extend([
                t("shared_expert.c_fc.weight", vec![c, h], true, true),
                t("shared_expert.c_fc.bias", vec![h], false, true),
                t("shared_expert.c_proj.weight", vec![h, c], true, true),
                t("shared_expert.c_proj.bias", vec![c], false, true),
            ]);
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
    /// router logits (E), then per slot the expert's pre-activation and
    /// GELU output (2H) and output (C), then the shared expert's 2H.
    #[must_use]
    pub fn saved_per_token(&self) -> usize {
        let shared = if self.shared_expert {
            2 * self.hidden
        } else {
            0
        };
        self.router.experts + self.router.top_k * (2 * self.hidden + self.channels) + shared
    }

    pub(crate) fn split<'a, T>(&self, mut p: &'a [T], el: usize) -> Params<'a, T> {
        let (c, h, e) = (self.channels, self.hidden, self.router.experts);
        Params {
            router_w: take(&mut p, c * e),
            bias: take(&mut p, e),
            fc_w: take(&mut p, el * c * h),
            fc_b: take(&mut p, el * h),
            proj_w: take(&mut p, el * h * c),
            proj_b: take(&mut p, el * c),
            shared: self.shared_expert.then(|| {
                [
                    take(&mut p, c * h),
                    take(&mut p, h),
                    take(&mut p, h * c),
                    take(&mut p, c),
                ]
            }),
        }
    }

    pub(crate) fn split_mut<'a, T>(&self, mut p: &'a mut [T], el: usize) -> ParamsMut<'a, T> {
        let (c, h, e) = (self.channels, self.hidden, self.router.experts);
        let router_w = take_mut(&mut p, c * e);
        let _bias = take_mut(&mut p, e);
        ParamsMut {
            router_w,
            fc_w: take_mut(&mut p, el * c * h),
            fc_b: take_mut(&mut p, el * h),
            proj_w: take_mut(&mut p, el * h * c),
            proj_b: take_mut(&mut p, el * c),
            shared: if self.shared_expert {
                Some([
                    take_mut(&mut p, c * h),
                    take_mut(&mut p, h),
                    take_mut(&mut p, h * c),
                    take_mut(&mut p, c),
                ])
            } else {
                None
            },
        }
    }
}

/// One MLP's forward over `rows` rows: `hpre = x·w1+b1`, `a = gelu(hpre)`,
/// `y = a·w2+b2`, its products in `precision`.
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
    precision: Precision,
) -> Result<()> {
    matmul_forward(
        hpre,
        x,
        w[0],
        Some(w[1]),
        1,
        rows,
        c,
        h,
        Mode::Throughput,
        precision,
    )?;
    gelu_forward(a, hpre, rows * h)?;
    matmul_forward(
        y,
        a,
        w[2],
        Some(w[3]),
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
    precision: Precision,
) -> Result<()> {
    let [dw1, db1, dw2, db2] = dw;
    let mut da = vec![T::ZERO; rows * h];
    let mut dh = vec![T::ZERO; rows * h];
    matmul_backward(
        &mut da,
        dw2,
        Some(db2),
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
    gelu_backward(&mut dh, hpre, &da, rows * h)?;
    matmul_backward(
        dx,
        dw1,
        Some(db1),
        &dh,
        x,
        w[0],
        1,
        rows,
        c,
        h,
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
        let p = cfg.split(params, e);
        let (logits, rest) = saved.split_at_mut(n * e);
        let (slot_saved, shared_saved) = rest.split_at_mut(n * k * (2 * h + c));
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
        // Per-slot storage: [hpre (N*k, H) | a (N*k, H) | y (N*k, C)].
        let (s_h, rest) = slot_saved.split_at_mut(n * k * h);
        let (s_a, s_y) = rest.split_at_mut(n * k * h);
        s_h.fill(T::ZERO);
        s_a.fill(T::ZERO);
        s_y.fill(T::ZERO);
        let max_rows = (0..e)
            .map(|j| offsets[j + 1] - offsets[j])
            .max()
            .unwrap_or(0);
        let mut gx = vec![T::ZERO; max_rows * c];
        let mut gh = vec![T::ZERO; max_rows * h];
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
            let w = expert_weights(&p, j, c, h);
            mlp_forward(
                &mut gy[..rows * c],
                &mut gh[..rows * h],
                &mut ga[..rows * h],
                &gx[..rows * c],
                w,
                rows,
                c,
                h,
                self.precision,
            )?;
            for (r, &slot) in slots.iter().enumerate() {
                s_h[slot * h..(slot + 1) * h].copy_from_slice(&gh[r * h..(r + 1) * h]);
                s_a[slot * h..(slot + 1) * h].copy_from_slice(&ga[r * h..(r + 1) * h]);
                s_y[slot * c..(slot + 1) * c].copy_from_slice(&gy[r * c..(r + 1) * c]);
            }
        }
        combine(out, s_y, &routing, c);
        if let Some(w) = p.shared {
            let (sh, sa) = shared_saved.split_at_mut(n * h);
            let mut y = vec![T::ZERO; n * c];
            mlp_forward(&mut y, sh, sa, inp, w, n, c, h, self.precision)?;
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
        let p = cfg.split(params, e);
        let mut g = cfg.split_mut(dparams, e);
        let (logits, rest) = saved.split_at(n * e);
        let (slot_saved, shared_saved) = rest.split_at(n * k * (2 * h + c));
        let (s_h, rest) = slot_saved.split_at(n * k * h);
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
        let mut gh = vec![T::ZERO; max_rows * h];
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
                gh[r * h..(r + 1) * h].copy_from_slice(&s_h[slot * h..(slot + 1) * h]);
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
            let w = expert_weights(&p, j, c, h);
            let dw = expert_weights_mut(&mut g, j, c, h);
            mlp_backward(
                &mut gdx[..rows * c],
                dw,
                &gdy[..rows * c],
                &gx[..rows * c],
                &gh[..rows * h],
                &ga[..rows * h],
                w,
                rows,
                c,
                h,
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
            let (sh, sa) = shared_saved.split_at(n * h);
            mlp_backward(dinp, dw, dout, inp, sh, sa, w, n, c, h, self.precision)?;
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
/// tensors.
pub(crate) fn expert_weights<'a, T>(
    p: &Params<'a, T>,
    j: usize,
    c: usize,
    h: usize,
) -> [&'a [T]; 4] {
    [
        &p.fc_w[j * c * h..(j + 1) * c * h],
        &p.fc_b[j * h..(j + 1) * h],
        &p.proj_w[j * h * c..(j + 1) * h * c],
        &p.proj_b[j * c..(j + 1) * c],
    ]
}

pub(crate) fn expert_weights_mut<'b, T>(
    g: &'b mut ParamsMut<'_, T>,
    j: usize,
    c: usize,
    h: usize,
) -> [&'b mut [T]; 4] {
    [
        &mut g.fc_w[j * c * h..(j + 1) * c * h],
        &mut g.fc_b[j * h..(j + 1) * h],
        &mut g.proj_w[j * h * c..(j + 1) * h * c],
        &mut g.proj_b[j * c..(j + 1) * c],
    ]
}
