//! The Muon update for one 2-D weight (Jordan et al. 2024, "Muon: An
//! optimizer for hidden layers in neural networks"), as
//! `torch.optim.Muon` (`_single_tensor_muon`) computes it:
//!
//! ```text
//! buf ← lerp(buf, g, 1 − μ)                  = μ·buf + (1 − μ)·g
//! u   ← nesterov ? lerp(g, buf, μ) : buf     = (1 − μ)·g + μ·buf
//! O   ← NS(u)                                 (Newton–Schulz, below)
//! p   ← p·(1 − lr·wd)
//! p   ← p − lr·scale(fan_out, fan_in)·O
//! ```
//!
//! (torch's docstring writes the momentum as `B ← μB + g`; its code, which
//! this follows, keeps the exponential average above. The two differ by
//! the factor `1/(1 − μ)`, which Newton–Schulz normalises away except in
//! the Nesterov mix.)
//!
//! The step comes in three pieces so that a sharded optimizer can run
//! the element-wise ones on its shard and gather only what needs the
//! whole matrix: [`muon_momentum`] (element-wise, any slice),
//! [`newton_schulz`] (a whole matrix) and [`muon_apply`] (element-wise,
//! any slice, given the whole matrix's [`WeightShape`]). [`muon_update`]
//! is the three in a row.
//!
//! # Layouts
//!
//! weft stores a linear layer's weight as `[in, out]`
//! ([`matmul_forward`](crate::matmul_forward)); torch's `nn.Linear`
//! stores `[out, in]`. Every function here takes the weight's
//! [`WeightShape`], which names the buffer's layout and both fans, so a
//! caller passes what it has and gets torch's arithmetic:
//!
//! * Newton–Schulz commutes with transposition (`NS(Gᵀ) = NS(G)ᵀ`), but
//!   only mathematically: torch iterates on the wide orientation of the
//!   matrix, and on `[out, in]` when it is square. [`newton_schulz`]
//!   transposes into that same orientation whatever the buffer's layout,
//!   so both layouts give the same bits (the transpose of each other).
//! * The learning-rate scale [`MuonScale::Original`] is *not* symmetric
//!   in the two dimensions: it needs to know which one is fan-out.

use rayon::prelude::*;
use weft_numerics::bf16;

use crate::Precision;
use crate::error::{Error, Result, check};
use crate::gemm::{View, gemm};
use crate::gemm_bf16;

/// How the learning rate is scaled by a weight's shape (torch's
/// `adjust_lr_fn`), `A` being fan-out (rows of torch's `[out, in]`) and
/// `B` fan-in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum MuonScale {
    /// Keller Jordan's original: `sqrt(max(1, A/B))` (torch's
    /// `"original"`, its default when `adjust_lr_fn` is `None`).
    Original,
    /// `0.2·sqrt(max(A, B))`, which gives the update the RMS of an AdamW
    /// update, so that AdamW's learning rate and weight decay carry over
    /// (Liu et al. 2025, "Muon is Scalable for LLM Training"; torch's
    /// `"match_rms_adamw"`). weft's default.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "match_rms_adamw"))]
    MatchRmsAdamW,
}

impl MuonScale {
    /// The factor the learning rate is multiplied by for a weight with
    /// `fan_out` outputs and `fan_in` inputs, in f64 as torch computes it.
    ///
    /// ```
    /// use weft_kernels::MuonScale;
    /// assert_eq!(MuonScale::Original.factor(3072, 768), 2.0);
    /// assert_eq!(MuonScale::Original.factor(768, 3072), 1.0);
    /// assert_eq!(MuonScale::MatchRmsAdamW.factor(100, 25), 2.0);
    /// ```
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn factor(self, fan_out: usize, fan_in: usize) -> f64 {
        let (a, b) = (fan_out as f64, fan_in as f64);
        match self {
            MuonScale::Original => (a / b).max(1.0).sqrt(),
            MuonScale::MatchRmsAdamW => 0.2 * a.max(b).sqrt(),
        }
    }
}

/// A 2-D weight's shape: how its buffer is laid out and which dimension
/// is which. Element-wise steps and Newton–Schulz need only the buffer's
/// [`rows`](Self::rows) and [`cols`](Self::cols); the learning-rate scale
/// ([`MuonScale`]) needs the fans.
///
/// ```
/// use weft_kernels::WeightShape;
/// // GPT-2's c_fc as weft stores it and as torch stores it.
/// let weft = WeightShape::InOut { fan_in: 768, fan_out: 3072 };
/// let torch = WeightShape::OutIn { fan_out: 3072, fan_in: 768 };
/// assert_eq!((weft.rows(), weft.cols()), (768, 3072));
/// assert_eq!((torch.rows(), torch.cols()), (3072, 768));
/// assert_eq!(weft.fan_out(), torch.fan_out());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightShape {
    /// weft's linear layout `[in, out]` ([`matmul_forward`](crate::matmul_forward)):
    /// `fan_in` rows of `fan_out` values.
    InOut {
        /// Input features (rows).
        fan_in: usize,
        /// Output features (columns).
        fan_out: usize,
    },
    /// torch's `nn.Linear` layout `[out, in]`
    /// ([`matmul_forward_wt`](crate::matmul_forward_wt)): `fan_out` rows
    /// of `fan_in` values.
    OutIn {
        /// Output features (rows).
        fan_out: usize,
        /// Input features (columns).
        fan_in: usize,
    },
}

impl WeightShape {
    /// Rows of the row-major buffer.
    #[must_use]
    pub fn rows(self) -> usize {
        match self {
            WeightShape::InOut { fan_in, .. } => fan_in,
            WeightShape::OutIn { fan_out, .. } => fan_out,
        }
    }

    /// Columns of the row-major buffer.
    #[must_use]
    pub fn cols(self) -> usize {
        match self {
            WeightShape::InOut { fan_out, .. } => fan_out,
            WeightShape::OutIn { fan_in, .. } => fan_in,
        }
    }

    /// Input features.
    #[must_use]
    pub fn fan_in(self) -> usize {
        match self {
            WeightShape::InOut { fan_in, .. } | WeightShape::OutIn { fan_in, .. } => fan_in,
        }
    }

    /// Output features.
    #[must_use]
    pub fn fan_out(self) -> usize {
        match self {
            WeightShape::InOut { fan_out, .. } | WeightShape::OutIn { fan_out, .. } => fan_out,
        }
    }
}

/// Muon hyper-parameters, torch's names and defaults except
/// [`scale`](Self::scale). The scalars are f64, as torch's Python floats
/// are, and rounded to f32 where torch rounds them (so `1 − momentum` is
/// the f32 nearest `1 − 0.95`, not `1 − 0.95f32`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Muon {
    /// Learning rate before the shape scale (torch: 1e-3).
    pub lr: f64,
    /// Momentum μ (0.95).
    pub momentum: f64,
    /// Nesterov momentum: orthogonalise `(1 − μ)·g + μ·buf` rather than
    /// `buf` (true).
    pub nesterov: bool,
    /// Decoupled weight decay, multiplied by `lr` (not by the scaled
    /// learning rate), as torch does (0.1).
    pub weight_decay: f64,
    /// Newton–Schulz iterations, 1 to 99 (5; torch refuses 100 or more).
    pub ns_steps: usize,
    /// The quintic's coefficients `(a, b, c)`: `X ← aX + (bA + cA²)X`
    /// with `A = XXᵀ` ((3.4445, −4.7750, 2.0315)).
    pub ns_coefficients: [f64; 3],
    /// The smallest Frobenius norm an update is divided by (1e-7).
    pub eps: f64,
    /// The learning rate's shape scale ([`MuonScale::MatchRmsAdamW`];
    /// torch's default is [`MuonScale::Original`]).
    pub scale: MuonScale,
}

impl Default for Muon {
    /// torch's defaults (lr 1e-3, momentum 0.95, Nesterov, decay 0.1, five
    /// steps of (3.4445, −4.7750, 2.0315), eps 1e-7) with weft's
    /// [`MuonScale::MatchRmsAdamW`].
    fn default() -> Self {
        Muon {
            lr: 1e-3,
            momentum: 0.95,
            nesterov: true,
            weight_decay: 0.1,
            ns_steps: 5,
            ns_coefficients: [3.4445, -4.7750, 2.0315],
            eps: 1e-7,
            scale: MuonScale::MatchRmsAdamW,
        }
    }
}

impl Muon {
    /// The learning rate a weight of this shape is stepped with:
    /// `lr · scale.factor(fan_out, fan_in)`, in f64.
    #[must_use]
    pub fn adjusted_lr(&self, shape: WeightShape) -> f64 {
        self.lr * self.scale.factor(shape.fan_out(), shape.fan_in())
    }

    /// Checks every setting's range: `lr` and `weight_decay` finite and
    /// ≥ 0, `momentum` in [0, 1), `ns_steps` in 1..=99, the coefficients
    /// finite, `eps` finite and > 0.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(Error::Config { field, reason });
        for (field, v) in [("lr", self.lr), ("weight_decay", self.weight_decay)] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, format!("must be a finite value >= 0 (got {v})"));
            }
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(
                "momentum",
                format!("must be in [0, 1) (got {})", self.momentum),
            );
        }
        if !(1..100).contains(&self.ns_steps) {
            return bad(
                "ns_steps",
                format!("must be in 1..=99 (got {})", self.ns_steps),
            );
        }
        if !self.ns_coefficients.iter().all(|c| c.is_finite()) {
            return bad(
                "ns_coefficients",
                format!("must be finite (got {:?})", self.ns_coefficients),
            );
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(
                "eps",
                format!("must be a finite value > 0 (got {})", self.eps),
            );
        }
        Ok(())
    }
}

const CHUNK: usize = 8192;

/// The per-call constants of [`muon_momentum`].
#[derive(Clone, Copy)]
struct MomentumConsts {
    /// `1 − μ`, computed in f64 and rounded (torch's `lerp_` weight).
    to_grad: f32,
    /// μ rounded to f32 (torch's Nesterov `lerp` weight).
    mu: f32,
    nesterov: bool,
}

/// The per-call constants of [`muon_apply`].
#[derive(Clone, Copy)]
struct ApplyConsts {
    /// `1 − lr·wd`, in f64 then rounded.
    keep: f32,
    /// `−lr·scale`, in f64 then rounded.
    step: f32,
}

/// The momentum step on any run of a weight's elements (a shard, or the
/// whole matrix): `buf ← lerp(buf, g, 1 − μ)`, then `update ←
/// lerp(g, buf, μ)` with Nesterov, else `update ← buf`. `update` is the
/// input of [`newton_schulz`].
///
/// `lerp` is torch's: `a + w·(b − a)` for `|w| < 0.5`, else
/// `b − (b − a)·(1 − w)`.
///
/// # Errors
/// [`Error::ShapeMismatch`] if the three buffers differ in length;
/// [`Error::Config`] if `hp` is out of range ([`Muon::validate`]). On an
/// error nothing is written.
pub fn muon_momentum(
    update: &mut [f32],
    grads: &[f32],
    momentum_buf: &mut [f32],
    hp: &Muon,
) -> Result<()> {
    const OP: &str = "muon_momentum";
    let n = update.len();
    check(OP, "grads", grads, n)?;
    check(OP, "momentum_buf", momentum_buf, n)?;
    hp.validate()?;
    let k = momentum_consts(hp);
    update
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(momentum_buf.par_chunks_mut(CHUNK))
        .for_each(|((u, g), b)| momentum_chunk(u, g, b, k));
    Ok(())
}

#[allow(clippy::cast_possible_truncation)]
fn momentum_consts(hp: &Muon) -> MomentumConsts {
    MomentumConsts {
        to_grad: (1.0 - hp.momentum) as f32,
        mu: hp.momentum as f32,
        nesterov: hp.nesterov,
    }
}

/// torch's scalar `lerp` (ATen's `Lerp.h`).
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

crate::simd::multiversion! {
    fn momentum_chunk(u: &mut [f32], g: &[f32], buf: &mut [f32], k: MomentumConsts) {
        for i in 0..u.len() {
            let b = lerp(buf[i], g[i], k.to_grad);
            buf[i] = b;
            u[i] = if k.nesterov { lerp(g[i], b, k.mu) } else { b };
        }
    }
}

/// The weight step on any run of a weight's elements (a shard, or the
/// whole matrix), `ortho` being the same run of [`newton_schulz`]'s
/// output: `p ← p·(1 − lr·wd)`, then `p ← p − lr·s·ortho` with `s =
/// hp.scale.factor(fan_out, fan_in)` of the *whole* weight's `shape`
/// ([`Muon::adjusted_lr`]). Both factors are computed in f64 and rounded
/// to f32, as torch rounds its Python scalars.
///
/// # Errors
/// [`Error::ShapeMismatch`] if `ortho`'s length differs from `params`';
/// [`Error::InvalidArgument`] if a dimension of `shape` is zero;
/// [`Error::Config`] if `hp` is out of range. On an error nothing is
/// written.
pub fn muon_apply(params: &mut [f32], ortho: &[f32], hp: &Muon, shape: WeightShape) -> Result<()> {
    const OP: &str = "muon_apply";
    check(OP, "ortho", ortho, params.len())?;
    elements(OP, shape.rows(), shape.cols())?;
    hp.validate()?;
    let k = apply_consts(hp, shape);
    params
        .par_chunks_mut(CHUNK)
        .zip(ortho.par_chunks(CHUNK))
        .for_each(|(p, o)| apply_chunk(p, o, k));
    Ok(())
}

#[allow(clippy::cast_possible_truncation)]
fn apply_consts(hp: &Muon, shape: WeightShape) -> ApplyConsts {
    ApplyConsts {
        keep: (1.0 - hp.lr * hp.weight_decay) as f32,
        step: (-hp.adjusted_lr(shape)) as f32,
    }
}

crate::simd::multiversion! {
    fn apply_chunk(p: &mut [f32], o: &[f32], k: ApplyConsts) {
        for i in 0..p.len() {
            let decayed = p[i] * k.keep;
            p[i] = decayed + k.step * o[i];
        }
    }
}

/// `rows · cols`, or an error if either is zero or the product overflows.
fn elements(op: &'static str, rows: usize, cols: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("a {rows} × {cols} matrix is empty"),
        });
    }
    rows.checked_mul(cols)
        .ok_or_else(|| Error::InvalidArgument {
            op,
            reason: format!("{rows} × {cols} elements overflow"),
        })
}

/// Whether `precision` runs Newton–Schulz with bf16 operands.
fn bf16_ns(op: &'static str, precision: Precision) -> Result<bool> {
    match precision {
        Precision::F32 => Ok(false),
        Precision::Bf16 => Ok(true),
        Precision::F16 => Err(Error::InvalidArgument {
            op,
            reason: "Newton–Schulz runs in fp32 or bf16, not fp16 (its range is too narrow \
                     for the unnormalised products)"
                .into(),
        }),
    }
}

/// The Newton–Schulz orthogonalisation of torch's
/// `_zeropower_via_newtonschulz`: `out ≈ U·S'·Vᵀ` for `g = U·S·Vᵀ` (`g`
/// and `out` row-major `shape.rows() × shape.cols()`), `S'` near the
/// identity (the quintic's fixed steps leave each singular value
/// somewhere in about [0.7, 1.2]).
///
/// ```text
/// X ← g in torch's orientation: [out, in], transposed if out > in
///     (so that X is wide)
/// X ← X / max(‖X‖_F, eps)
/// hp.ns_steps times:  A ← X·Xᵀ ;  B ← b·A + c·A·A ;  X ← a·X + B·X
/// out ← X (transposed back)
/// ```
///
/// with `(a, b, c) = hp.ns_coefficients`; other fields of `hp` are not
/// used. The products are the crate's GEMMs (split over the rayon pool).
/// `precision`:
///
/// * [`Precision::F32`]: f32 throughout (torch's code with
///   `dtype=torch.float32`);
/// * [`Precision::Bf16`]: as torch computes it (in bf16): `g` is rounded
///   to bf16, then its norm, the normalised `X`, and every result (`A`,
///   `B`, each new `X`) are rounded to bf16; the products multiply bf16
///   operands and sum in f32 ([`matmul_bf16`](crate::matmul_bf16)'s
///   arithmetic), their scalings and additions are in f32 before the
///   rounding;
/// * [`Precision::F16`] is refused.
///
/// The layout only decides the orientation (see the module docs on
/// layouts): `g` in one layout and `gᵀ` in the other give `out` and
/// `outᵀ`, bit for bit. A caller with a plain matrix may pass either.
///
/// Scratch is allocated per call: two `rows × cols` and two `m × m`
/// f32 buffers, `m = min(rows, cols)` (for 768 × 3072, 22.5 MiB). The
/// products cost `ns_steps · (4·m²·k + 2·m³)` flops, `k = max(rows,
/// cols)`.
///
/// ```
/// use weft_kernels::{Muon, Precision, WeightShape, newton_schulz};
/// // An orthogonal matrix (times 3) keeps its direction: NS(Q) = s·Q.
/// let g = [0.0f32, 3.0, -3.0, 0.0];
/// let shape = WeightShape::OutIn { fan_out: 2, fan_in: 2 };
/// let mut out = [0.0f32; 4];
/// newton_schulz(&mut out, &g, shape, &Muon::default(), Precision::F32)?;
/// assert_eq!(out[0], 0.0);
/// assert!((1.0..1.2).contains(&out[1]), "{out:?}");
/// assert_eq!(out[2], -out[1]);
/// # Ok::<(), weft_kernels::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] if a dimension of `shape` is 0 or
/// `precision` is `F16`; [`Error::ShapeMismatch`] if `out` or `g` does
/// not hold `rows · cols` values; [`Error::Config`] if `hp` is out of
/// range ([`Muon::validate`]).
#[allow(clippy::cast_possible_truncation, clippy::many_single_char_names)]
pub fn newton_schulz(
    out: &mut [f32],
    g: &[f32],
    shape: WeightShape,
    hp: &Muon,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "newton_schulz";
    let (rows, cols) = (shape.rows(), shape.cols());
    let len = elements(OP, rows, cols)?;
    check(OP, "out", out, len)?;
    check(OP, "g", g, len)?;
    hp.validate()?;
    let bf = bf16_ns(OP, precision)?;
    let round = |v: f32| if bf { bf16::from_f32(v).to_f32() } else { v };
    let [ca, cb, cc] = hp.ns_coefficients.map(|c| c as f32);

    // X is m × k with m <= k, in torch's orientation.
    let (fan_out, fan_in) = (shape.fan_out(), shape.fan_in());
    let torch_transposes = fan_out > fan_in;
    let is_out_in = matches!(shape, WeightShape::OutIn { .. });
    let transposed = torch_transposes == is_out_in;
    let (m, k) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let mut x = vec![0.0f32; len];
    if transposed {
        transpose(&mut x, g, rows, cols);
    } else {
        x.copy_from_slice(g);
    }
    if bf {
        round_all(&mut x);
    }
    // (fixed chunks summed in order: the same bits whatever the threads)
    let squares: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>())
        .collect();
    let norm = round(squares.iter().sum::<f64>().sqrt() as f32);
    let norm = norm.max(round(hp.eps as f32));
    x.par_chunks_mut(CHUNK).for_each(|c| {
        for v in c {
            *v = round(*v / norm);
        }
    });

    let mut y = vec![0.0f32; len];
    let mut a = vec![0.0f32; m * m];
    let mut b = vec![0.0f32; m * m];
    for _ in 0..hp.ns_steps {
        // A = X·Xᵀ
        let (xr, xt) = (View::rows(&x, k), View::t(&x, k));
        if bf {
            gemm_bf16::product(m, m, k, &mut a, false, xr, xt);
            round_all(&mut a);
        } else {
            gemm(m, m, k, &mut a, m, false, xr, xt, 1.0, true);
        }
        // B = b·A + c·A·A
        let ar = View::rows(&a, m);
        if bf {
            gemm_bf16::product(m, m, m, &mut b, false, ar, ar);
            b.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK))
                .for_each(|(b, a)| {
                    for (b, &a) in b.iter_mut().zip(a) {
                        *b = round(cb * a + cc * *b);
                    }
                });
        } else {
            scale_into(&mut b, &a, cb);
            gemm(m, m, m, &mut b, m, true, ar, ar, cc, true);
        }
        // X ← a·X + B·X
        scale_into(&mut y, &x, ca);
        let (br, xr) = (View::rows(&b, m), View::rows(&x, k));
        if bf {
            gemm_bf16::product(m, k, m, &mut y, true, br, xr);
            round_all(&mut y);
        } else {
            gemm(m, k, m, &mut y, k, true, br, xr, 1.0, true);
        }
        std::mem::swap(&mut x, &mut y);
    }
    if transposed {
        transpose(out, &x, m, k);
    } else {
        out.copy_from_slice(&x);
    }
    Ok(())
}

/// `dst = s · src`, over the pool.
fn scale_into(dst: &mut [f32], src: &[f32], s: f32) {
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, x)| {
            for (d, &x) in d.iter_mut().zip(x) {
                *d = s * x;
            }
        });
}

/// Every value rounded to the nearest bf16 (ties to even), over the pool.
fn round_all(buf: &mut [f32]) {
    buf.par_chunks_mut(CHUNK).for_each(|c| {
        for v in c {
            *v = bf16::from_f32(*v).to_f32();
        }
    });
}

/// `dst (cols × rows) = srcᵀ` for `src` row-major `rows × cols`, in
/// 32 × 32 tiles, blocks of rows of `dst` over the pool.
fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    const T: usize = 32;
    dst.par_chunks_mut(T * rows)
        .enumerate()
        .for_each(|(jb, d)| {
            let j0 = jb * T;
            let nj = d.len() / rows;
            for i0 in (0..rows).step_by(T) {
                for j in 0..nj {
                    let drow = &mut d[j * rows..(j + 1) * rows];
                    for i in i0..(i0 + T).min(rows) {
                        drow[i] = src[i * cols + j0 + j];
                    }
                }
            }
        });
}

/// One Muon step on a whole 2-D weight, exactly `torch.optim.Muon`'s
/// `_single_tensor_muon` for one parameter: [`muon_momentum`], then
/// [`newton_schulz`] in `precision` (torch's own is
/// [`Precision::Bf16`]), then [`muon_apply`]. `params`, `grads` and
/// `momentum_buf` (zeros before the first step) are row-major
/// `shape.rows() × shape.cols()`.
///
/// Allocates the update and the orthogonalised update (`rows · cols`
/// f32 each) besides [`newton_schulz`]'s scratch.
///
/// ```
/// use weft_kernels::{Muon, MuonScale, Precision, WeightShape, muon_update};
/// // A 2 × 2 weight in weft's [in, out] layout.
/// let shape = WeightShape::InOut { fan_in: 2, fan_out: 2 };
/// let hp = Muon { lr: 0.1, weight_decay: 0.0, scale: MuonScale::Original, ..Muon::default() };
/// let mut p = [1.0f32, 0.0, 0.0, 1.0];
/// let mut buf = [0.0f32; 4];
/// muon_update(&mut p, &[2.0, 0.0, 0.0, 2.0], &mut buf, shape, &hp, Precision::F32)?;
/// // The gradient is orthogonal already (2·I, normalised to I/√2): the
/// // update is s·I, s the quintic's five steps from 1/√2 (about 1.108).
/// let mut s = 1.0f64 / 2f64.sqrt();
/// for _ in 0..5 {
///     s = 3.4445 * s - 4.7750 * s.powi(3) + 2.0315 * s.powi(5);
/// }
/// assert!((f64::from(p[0]) - (1.0 - 0.1 * s)).abs() < 1e-6);
/// assert_eq!(p[1], 0.0);
/// # Ok::<(), weft_kernels::Error>(())
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`] if a buffer does not hold `rows · cols`
/// values; [`Error::InvalidArgument`] if a dimension is zero or
/// `precision` is `F16`; [`Error::Config`] if `hp` is out of range. On an
/// error nothing is written.
pub fn muon_update(
    params: &mut [f32],
    grads: &[f32],
    momentum_buf: &mut [f32],
    shape: WeightShape,
    hp: &Muon,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "muon_update";
    let (rows, cols) = (shape.rows(), shape.cols());
    let len = elements(OP, rows, cols)?;
    check(OP, "params", params, len)?;
    check(OP, "grads", grads, len)?;
    check(OP, "momentum_buf", momentum_buf, len)?;
    hp.validate()?;
    bf16_ns(OP, precision)?;
    let mut update = vec![0.0f32; len];
    muon_momentum(&mut update, grads, momentum_buf, hp)?;
    let mut ortho = vec![0.0f32; len];
    newton_schulz(&mut ortho, &update, shape, hp, precision)?;
    muon_apply(params, &ortho, hp, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    fn rand32(n: usize, seed: u64) -> Vec<f32> {
        rand_vec(n, seed).iter().map(|&x| x as f32).collect()
    }

    /// The quintic on one singular value, in f64.
    fn quintic(mut s: f64, hp: &Muon) -> f64 {
        let [a, b, c] = hp.ns_coefficients;
        for _ in 0..hp.ns_steps {
            s = a * s + b * s.powi(3) + c * s.powi(5);
        }
        s
    }

    /// An `n × n` orthogonal matrix: a product of two Householder
    /// reflections, in f64.
    fn orthogonal(n: usize, seed: u64) -> Vec<f64> {
        let mut q = vec![0.0; n * n];
        for i in 0..n {
            q[i * n + i] = 1.0;
        }
        for s in 0..2 {
            let v = rand_vec(n, seed + s);
            let vv: f64 = v.iter().map(|x| x * x).sum();
            // q ← q·(I − 2vvᵀ/vᵀv)
            for i in 0..n {
                let qv: f64 = (0..n).map(|j| q[i * n + j] * v[j]).sum();
                for j in 0..n {
                    q[i * n + j] -= 2.0 * qv * v[j] / vv;
                }
            }
        }
        q
    }

    /// `U·diag(s)·Vᵀ` (`rows × cols`) for orthogonal `U` (`rows × rows`)
    /// and `V` (`cols × cols`), in f64.
    fn compose(u: &[f64], s: &[f64], v: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                out[i * cols + j] = s
                    .iter()
                    .enumerate()
                    .map(|(l, &sl)| u[i * rows + l] * sl * v[j * cols + l])
                    .sum();
            }
        }
        out
    }

    fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
        let num: f64 = got
            .iter()
            .zip(want)
            .map(|(&g, w)| (f64::from(g) - w).powi(2))
            .sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den).sqrt()
    }

    /// With a known SVD `G = U·S·Vᵀ`, `NS(G) = U·f(S/‖S‖)·Vᵀ` for the
    /// quintic `f` iterated: square, wide and tall (the transposed path).
    #[test]
    fn singular_vectors_kept_singular_values_through_the_quintic() {
        let hp = Muon::default();
        for (rows, cols) in [(48, 48), (24, 40), (40, 24)] {
            let u = orthogonal(rows, 3);
            let v = orthogonal(cols, 7);
            let r = rows.min(cols);
            // well conditioned: singular values in [1, 3]
            let s: Vec<f64> = (0..r).map(|l| 1.0 + 2.0 * l as f64 / r as f64).collect();
            let g = compose(&u, &s, &v, rows, cols);
            let norm = s.iter().map(|x| x * x).sum::<f64>().sqrt();
            let fs: Vec<f64> = s.iter().map(|&x| quintic(x / norm, &hp)).collect();
            for &f in &fs {
                assert!((0.6..1.25).contains(&f), "singular value {f}");
            }
            let want = compose(&u, &fs, &v, rows, cols);
            let g32: Vec<f32> = g.iter().map(|&x| x as f32).collect();
            let mut out = vec![0.0f32; rows * cols];
            for shape in [
                WeightShape::OutIn {
                    fan_out: rows,
                    fan_in: cols,
                },
                WeightShape::InOut {
                    fan_in: rows,
                    fan_out: cols,
                },
            ] {
                newton_schulz(&mut out, &g32, shape, &hp, Precision::F32).unwrap();
                let err = rel_l2(&out, &want);
                assert!(err < 1e-5, "{shape:?} f32: relative error {err}");
                newton_schulz(&mut out, &g32, shape, &hp, Precision::Bf16).unwrap();
                let err = rel_l2(&out, &want);
                assert!(err < 3e-2, "{shape:?} bf16: relative error {err}");
            }
        }
    }

    /// `λ_max` of a symmetric `n × n` matrix by power iteration.
    fn top_eigenvalue(m: &[f64], n: usize) -> f64 {
        let mut x = rand_vec(n, 5);
        let mut lambda = 0.0;
        for _ in 0..500 {
            let y: Vec<f64> = (0..n)
                .map(|i| (0..n).map(|j| m[i * n + j] * x[j]).sum())
                .collect();
            let ny = y.iter().map(|v| v * v).sum::<f64>().sqrt();
            lambda = x.iter().zip(&y).map(|(a, b)| a * b).sum::<f64>()
                / x.iter().map(|v| v * v).sum::<f64>();
            x = y.iter().map(|v| v / ny).collect();
        }
        lambda
    }

    /// A random well-conditioned square matrix comes out with every
    /// singular value in the quintic's band: `OᵀO`'s eigenvalues, its
    /// largest and (by the largest of `2I − OᵀO`) its smallest, lie in
    /// [0.6², 1.25²].
    #[test]
    fn singular_values_land_in_the_band() {
        let n = 64;
        let mut g = rand32(n * n, 11);
        for v in &mut g {
            *v *= 0.3;
        }
        for i in 0..n {
            g[i * n + i] += 2.0;
        }
        for precision in [Precision::F32, Precision::Bf16] {
            let mut o = vec![0.0f32; n * n];
            let shape = WeightShape::OutIn {
                fan_out: n,
                fan_in: n,
            };
            newton_schulz(&mut o, &g, shape, &Muon::default(), precision).unwrap();
            let mut oto = vec![0.0f64; n * n];
            for i in 0..n {
                for j in 0..n {
                    oto[i * n + j] = (0..n)
                        .map(|l| f64::from(o[l * n + i]) * f64::from(o[l * n + j]))
                        .sum();
                }
            }
            let hi = top_eigenvalue(&oto, n);
            let shifted: Vec<f64> = oto
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % (n + 1) == 0 { 2.0 - v } else { -v })
                .collect();
            let lo = 2.0 - top_eigenvalue(&shifted, n);
            let (lo, hi) = (lo.sqrt(), hi.sqrt());
            assert!(
                0.6 < lo && lo <= hi && hi < 1.25,
                "{precision}: singular values in [{lo}, {hi}]"
            );
        }
    }

    /// An orthogonal input is a fixed direction: `NS(Q) = f(1/√n)·Q`.
    #[test]
    fn orthogonal_input_is_only_scaled() {
        let n = 32;
        let hp = Muon::default();
        let q = orthogonal(n, 21);
        let q32: Vec<f32> = q.iter().map(|&x| (3.0 * x) as f32).collect();
        let mut o = vec![0.0f32; n * n];
        let shape = WeightShape::InOut {
            fan_in: n,
            fan_out: n,
        };
        newton_schulz(&mut o, &q32, shape, &hp, Precision::F32).unwrap();
        let s = quintic(1.0 / (n as f64).sqrt(), &hp);
        let want: Vec<f64> = q.iter().map(|&x| s * x).collect();
        let err = rel_l2(&o, &want);
        assert!(err < 1e-5, "relative error {err}");
    }

    fn transpose64(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0; m.len()];
        transpose(&mut t, m, rows, cols);
        t
    }

    /// The same weight in either layout gives the same bits, transposed;
    /// a square matrix and its transpose in the *same* layout agree to
    /// rounding (`NS(Gᵀ) = NS(G)ᵀ` in exact arithmetic).
    #[test]
    fn transposition_commutes() {
        let hp = Muon::default();
        for precision in [Precision::F32, Precision::Bf16] {
            for (fan_out, fan_in) in [(20, 70), (70, 20), (33, 33)] {
                // g: torch's [out, in]; gt: weft's [in, out]
                let g = rand32(fan_out * fan_in, 31);
                let gt = transpose64(&g, fan_out, fan_in);
                let n = g.len();
                let (mut o, mut ot) = (vec![0.0f32; n], vec![0.0f32; n]);
                let out_in = WeightShape::OutIn { fan_out, fan_in };
                let in_out = WeightShape::InOut { fan_in, fan_out };
                newton_schulz(&mut o, &g, out_in, &hp, precision).unwrap();
                newton_schulz(&mut ot, &gt, in_out, &hp, precision).unwrap();
                let back = transpose64(&ot, fan_in, fan_out);
                assert_eq!(back, o, "{precision} {fan_out}x{fan_in}");
                if fan_out == fan_in {
                    // gt as if it were [out, in]: the other orientation
                    newton_schulz(&mut ot, &gt, out_in, &hp, precision).unwrap();
                    let back = transpose64(&ot, fan_in, fan_out);
                    assert_ne!(back, o, "{precision}: the same arithmetic?");
                    let want: Vec<f64> = o.iter().map(|&x| f64::from(x)).collect();
                    let err = rel_l2(&back, &want);
                    let tol = if precision == Precision::F32 {
                        1e-5
                    } else {
                        3e-2
                    };
                    assert!(err < tol, "{precision} {fan_out}x{fan_in}: {err}");
                }
            }
        }
    }

    #[test]
    fn transpose_moves_every_element() {
        for (rows, cols) in [(1, 1), (3, 70), (70, 3), (33, 65)] {
            let m: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transpose64(&m, rows, cols);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(t[j * rows + i], m[i * cols + j]);
                }
            }
        }
    }

    #[test]
    fn zero_gradient_gives_zero_update() {
        let g = vec![0.0f32; 12];
        let mut o = vec![1.0f32; 12];
        for precision in [Precision::F32, Precision::Bf16] {
            let shape = WeightShape::OutIn {
                fan_out: 3,
                fan_in: 4,
            };
            newton_schulz(&mut o, &g, shape, &Muon::default(), precision).unwrap();
            assert!(o.iter().all(|&x| x == 0.0), "{precision}: {o:?}");
        }
    }

    #[test]
    fn momentum_is_torchs_lerp() {
        let g = [1.0f32, -2.0, 0.5];
        for nesterov in [true, false] {
            let hp = Muon {
                momentum: 0.75,
                nesterov,
                ..Muon::default()
            };
            let mut buf = [4.0f32, 0.0, -1.0];
            let mut u = [0.0f32; 3];
            muon_momentum(&mut u, &g, &mut buf, &hp).unwrap();
            // buf = 0.75·buf + 0.25·g (exact in binary)
            assert_eq!(buf, [3.25, -0.5, -0.625]);
            let want = if nesterov {
                // 0.25·g + 0.75·buf
                [2.6875, -0.875, -0.34375]
            } else {
                buf
            };
            assert_eq!(u, want, "nesterov {nesterov}");
        }
    }

    /// The element-wise steps split into shards give the bits of one call
    /// on the whole matrix.
    #[test]
    fn element_wise_steps_shard() {
        let n = 3 * CHUNK + 77;
        let hp = Muon::default();
        let shape = WeightShape::OutIn {
            fan_out: n / 7,
            fan_in: 7,
        };
        let g = rand32(n, 1);
        let buf0 = rand32(n, 2);
        let p0 = rand32(n, 3);
        let o = rand32(n, 4);
        let (mut u, mut buf, mut p) = (vec![0.0f32; n], buf0.clone(), p0.clone());
        muon_momentum(&mut u, &g, &mut buf, &hp).unwrap();
        muon_apply(&mut p, &o, &hp, shape).unwrap();
        let (mut us, mut bufs, mut ps) = (vec![0.0f32; n], buf0, p0);
        for (lo, hi) in [(0, 1000), (1000, 2 * CHUNK + 5), (2 * CHUNK + 5, n)] {
            muon_momentum(&mut us[lo..hi], &g[lo..hi], &mut bufs[lo..hi], &hp).unwrap();
            muon_apply(&mut ps[lo..hi], &o[lo..hi], &hp, shape).unwrap();
        }
        assert_eq!((u, buf, p), (us, bufs, ps));
    }

    #[test]
    fn apply_decays_then_steps_by_the_scaled_lr() {
        let hp = Muon {
            lr: 0.5,
            weight_decay: 0.5,
            scale: MuonScale::Original,
            ..Muon::default()
        };
        // fan_out 4, fan_in 1: sqrt(max(1, 4)) = 2
        for shape in [
            WeightShape::OutIn {
                fan_out: 4,
                fan_in: 1,
            },
            WeightShape::InOut {
                fan_in: 1,
                fan_out: 4,
            },
        ] {
            assert_eq!(hp.adjusted_lr(shape), 1.0);
            let mut p = [2.0f32, -4.0];
            muon_apply(&mut p, &[1.0, 0.5], &hp, shape).unwrap();
            // p·0.75 − 1·o
            assert_eq!(p, [0.5, -3.5]);
        }
        let flipped = WeightShape::OutIn {
            fan_out: 1,
            fan_in: 4,
        };
        assert_eq!(hp.adjusted_lr(flipped), 0.5);
        let rms = Muon {
            scale: MuonScale::MatchRmsAdamW,
            ..hp
        };
        assert!((rms.adjusted_lr(flipped) - 0.5 * 0.2 * 2.0).abs() < 1e-15);
    }

    /// [`muon_update`] is its three pieces in a row, bit for bit.
    #[test]
    fn update_is_its_pieces() {
        let shape = WeightShape::InOut {
            fan_in: 24,
            fan_out: 40,
        };
        let n = 24 * 40;
        let hp = Muon {
            lr: 0.02,
            ..Muon::default()
        };
        let (p0, buf0, g) = (rand32(n, 1), rand32(n, 2), rand32(n, 3));
        for precision in [Precision::F32, Precision::Bf16] {
            let (mut p, mut buf) = (p0.clone(), buf0.clone());
            muon_update(&mut p, &g, &mut buf, shape, &hp, precision).unwrap();
            let (mut q, mut buf2) = (p0.clone(), buf0.clone());
            let (mut u, mut o) = (vec![0.0f32; n], vec![0.0f32; n]);
            muon_momentum(&mut u, &g, &mut buf2, &hp).unwrap();
            newton_schulz(&mut o, &u, shape, &hp, precision).unwrap();
            muon_apply(&mut q, &o, &hp, shape).unwrap();
            assert_eq!((p, buf), (q, buf2), "{precision}");
        }
    }

    #[test]
    fn bad_arguments_are_errors_and_write_nothing() {
        let hp = Muon::default();
        let shape = WeightShape::OutIn {
            fan_out: 2,
            fan_in: 3,
        };
        let (mut p, mut buf) = (vec![1.0f32; 6], vec![1.0f32; 6]);
        let g = vec![1.0f32; 6];
        let mut call = |p: &mut [f32], g: &[f32], shape, hp: &Muon, precision| {
            muon_update(p, g, &mut buf, shape, hp, precision)
        };
        let f32 = Precision::F32;
        assert!(matches!(
            call(&mut p[..5], &g, shape, &hp, f32),
            Err(Error::ShapeMismatch {
                buffer: "params",
                ..
            })
        ));
        assert!(matches!(
            call(&mut p, &g[..5], shape, &hp, f32),
            Err(Error::ShapeMismatch {
                buffer: "grads",
                ..
            })
        ));
        let empty = WeightShape::InOut {
            fan_in: 0,
            fan_out: 3,
        };
        assert!(matches!(
            call(&mut p[..0], &g[..0], empty, &hp, f32),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            call(&mut p, &g, shape, &hp, Precision::F16),
            Err(Error::InvalidArgument { .. })
        ));
        for (bad, field) in [
            (Muon { ns_steps: 0, ..hp }, "ns_steps"),
            (
                Muon {
                    ns_steps: 100,
                    ..hp
                },
                "ns_steps",
            ),
            (
                Muon {
                    momentum: 1.0,
                    ..hp
                },
                "momentum",
            ),
            (Muon { lr: -1.0, ..hp }, "lr"),
            (
                Muon {
                    weight_decay: f64::NAN,
                    ..hp
                },
                "weight_decay",
            ),
            (
                Muon {
                    ns_coefficients: [1.0, f64::INFINITY, 0.0],
                    ..hp
                },
                "ns_coefficients",
            ),
            (Muon { eps: 0.0, ..hp }, "eps"),
        ] {
            assert!(
                matches!(call(&mut p, &g, shape, &bad, f32), Err(Error::Config { field: f, .. }) if f == field),
                "{field}"
            );
        }
        assert!(p.iter().all(|&x| x == 1.0));
        assert!(buf.iter().all(|&x| x == 1.0));

        let mut out = vec![0.0f32; 6];
        let ns_shape = |fan_out, fan_in| WeightShape::OutIn { fan_out, fan_in };
        assert!(matches!(
            newton_schulz(&mut out, &g, ns_shape(3, 3), &hp, f32),
            Err(Error::ShapeMismatch { buffer: "out", .. })
        ));
        assert!(matches!(
            newton_schulz(&mut out, &g[..5], ns_shape(2, 3), &hp, f32),
            Err(Error::ShapeMismatch { buffer: "g", .. })
        ));
        assert!(matches!(
            newton_schulz(&mut out, &g, ns_shape(0, 6), &hp, f32),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            newton_schulz(&mut out, &g, ns_shape(usize::MAX, 2), &hp, f32),
            Err(Error::InvalidArgument { .. })
        ));
        let mut u = vec![0.0f32; 6];
        assert!(matches!(
            muon_momentum(&mut u, &g, &mut buf[..4], &hp),
            Err(Error::ShapeMismatch {
                buffer: "momentum_buf",
                ..
            })
        ));
        assert!(matches!(
            muon_apply(&mut p, &g[..2], &hp, shape),
            Err(Error::ShapeMismatch {
                buffer: "ortho",
                ..
            })
        ));
    }
}
