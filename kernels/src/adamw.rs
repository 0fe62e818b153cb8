//! The AdamW update (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", Algorithm 2), in the form `torch.optim.AdamW` computes.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay, e.g. 0.9.
    pub beta1: f32,
    /// Second-moment decay, e.g. 0.95 or 0.999.
    pub beta2: f32,
    /// Added to the denominator, e.g. 1e-8.
    pub eps: f32,
    /// Decoupled weight decay, applied only where the decay mask says so.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, decay 0.01.
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

const CHUNK: usize = 8192;

/// One AdamW step on a parameter tensor (or any contiguous run of them).
/// `step` counts from 1; `decay` is this tensor's entry of the decay mask
/// (GPT-2 practice: matrices decay, biases and layernorm gains do not).
///
/// ```text
/// p ← p·(1 − lr·wd·decay)
/// m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
/// p ← p − (lr / (1−β1^step)) · m / (sqrt(v)/sqrt(1−β2^step) + eps)
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`] if the four buffers differ in length,
/// [`Error::InvalidArgument`] if `step` is 0.
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u32,
    decay: bool,
) -> Result<()> {
    const OP: &str = "adamw_update";
    let n = params.len();
    check(OP, "grads", grads, n)?;
    check(OP, "m", m, n)?;
    check(OP, "v", v, n)?;
    let k = Consts::new(OP, hp, step, decay)?;
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| adamw_chunk(p, g, m, v, k));
    Ok(())
}

/// The per-step constants of the update, derived once (the CUDA kernel is
/// fed the same values, so both compute the same bits).
#[derive(Clone, Copy)]
pub(crate) struct Consts {
    pub(crate) keep: f32,
    pub(crate) b1: f32,
    pub(crate) b2: f32,
    pub(crate) step_size: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
}

impl Consts {
    /// `keep = 1 − lr·wd` (or 1 without decay), `step_size = lr / (1 −
    /// β1^step)` and `bc2_sqrt = sqrt(1 − β2^step)`, the bias corrections
    /// in f64 then rounded to f32.
    pub(crate) fn new(op: &'static str, hp: &AdamW, step: u32, decay: bool) -> Result<Self> {
        if step == 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: "step counts from 1".into(),
            });
        }
        let bc1 = 1.0 - f64::from(hp.beta1).powi(step.min(i32::MAX as u32) as i32);
        let bc2 = 1.0 - f64::from(hp.beta2).powi(step.min(i32::MAX as u32) as i32);
        Ok(Consts {
            keep: if decay {
                1.0 - hp.lr * hp.weight_decay
            } else {
                1.0
            },
            b1: hp.beta1,
            b2: hp.beta2,
            step_size: f32::from_f64(f64::from(hp.lr) / bc1),
            bc2_sqrt: f32::from_f64(bc2.sqrt()),
            eps: hp.eps,
        })
    }
}

crate::simd::multiversion! {
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: Consts) {
        for i in 0..p.len() {
            let gi = g[i];
            let mi = k.b1 * m[i] + (1.0 - k.b1) * gi;
            let vi = k.b2 * v[i] + (1.0 - k.b2) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
            p[i] = p[i] * k.keep - k.step_size * mi / denom;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Algorithm 2 of the paper (with η = 1 schedule multiplier and the
    /// decay scaled by lr as PyTorch does), evaluated in f64.
    fn reference(p: &mut [f64], g: &[Vec<f64>], hp: &AdamW, decay: bool) {
        let (b1, b2, lr, eps) = (
            f64::from(hp.beta1),
            f64::from(hp.beta2),
            f64::from(hp.lr),
            f64::from(hp.eps),
        );
        let wd = if decay {
            f64::from(hp.weight_decay)
        } else {
            0.0
        };
        let mut m = vec![0.0; p.len()];
        let mut v = vec![0.0; p.len()];
        for (t, gt) in g.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..p.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * gt[i];
                v[i] = b2 * v[i] + (1.0 - b2) * gt[i] * gt[i];
                let mh = m[i] / (1.0 - b1.powi(t));
                let vh = v[i] / (1.0 - b2.powi(t));
                p[i] -= lr * (mh / (vh.sqrt() + eps) + wd * p[i]);
            }
        }
    }

    #[test]
    fn matches_the_paper_over_ten_steps() {
        let n = 10_000;
        let hp = AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p0 = crate::testutil::rand_vec(n, 1);
        let grads: Vec<Vec<f64>> = (0..10)
            .map(|s| crate::testutil::rand_vec(n, 10 + s))
            .collect();
        for decay in [true, false] {
            let mut want = p0.clone();
            reference(&mut want, &grads, &hp, decay);
            let mut p: Vec<f32> = p0.iter().map(|&x| x as f32).collect();
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            for (s, g) in grads.iter().enumerate() {
                let g: Vec<f32> = g.iter().map(|&x| x as f32).collect();
                adamw_update(&mut p, &g, &mut m, &mut v, &hp, s as u32 + 1, decay).unwrap();
            }
            let worst = p
                .iter()
                .zip(&want)
                .map(|(&a, b)| (f64::from(a) - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 2e-6, "decay={decay}: max abs diff {worst}");
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let hp = AdamW::default();
        let (mut p, mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        assert!(matches!(
            adamw_update(&mut p, &[0.0; 2], &mut m, &mut v, &hp, 1, true),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            adamw_update(&mut p, &[0.0; 3], &mut m, &mut v, &hp, 0, true),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
