//! Load balancing: the Switch/GShard auxiliary loss (batch- or
//! sequence-wise) and DeepSeek-V3's auxiliary-loss-free bias balancing.

use weft_kernels::Real;

use crate::error::{Error, Result, check};
use crate::router::{DROPPED, Gate, Routing, score_backward};

/// Over which tokens the auxiliary loss measures balance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuxScope {
    /// All tokens of the batch (Switch Transformer, GShard).
    #[default]
    Batch,
    /// Each sequence separately, averaged over sequences (DeepSeek-V3's
    /// complementary sequence-wise balance loss).
    Sequence,
}

/// The load-balancing auxiliary loss
/// `L = α · E · Σ_e f_e · P_e` (Switch Transformer eq. 4; GShard's
/// `l_aux`; DeepSeek-V3 eq. 17–20 with `f_e` scaled by `E/k`):
///
/// - `f_e` = fraction of the group's `k·n` chosen assignments that went to
///   expert `e` (counted before capacity drops; no gradient),
/// - `P_e` = mean over the group's tokens of the router probability `q_e`:
///   the softmax probabilities, or for sigmoid gates the scores
///   normalised over all experts, `s_e / Σ_j s_j`.
///
/// It equals `α` at perfect balance and `α·E` when every token goes to one
/// expert with probability 1. With [`AuxScope::Sequence`] it is computed
/// per sequence and averaged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AuxLoss {
    /// Coefficient α (Switch uses 1e-2).
    pub coef: f64,
    /// Batch- or sequence-wise.
    pub scope: AuxScope,
}

impl AuxLoss {
    /// Batch-wise auxiliary loss with coefficient `coef`.
    #[must_use]
    pub fn new(coef: f64) -> Self {
        AuxLoss {
            coef,
            scope: AuxScope::Batch,
        }
    }

    /// The loss value for a routing of `seq_lens` tokens.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for expert-choice routings,
    /// [`Error::ShapeMismatch`] if `seq_lens` does not sum to the tokens.
    pub fn forward<T: Real>(&self, routing: &Routing<T>, seq_lens: &[usize]) -> Result<f64> {
        let groups = self.groups(routing, seq_lens)?;
        let e = routing.experts;
        let mut total = 0.0;
        let mut q = vec![T::ZERO; e];
        for &(start, len) in &groups {
            let (f, _) = fractions(routing, start, len);
            let mut p = vec![0.0f64; e];
            for t in start..start + len {
                probs(routing, t, &mut q);
                for (pe, &qe) in p.iter_mut().zip(&q) {
                    *pe += qe.to_f64();
                }
            }
            let len_f = usize_f64(len);
            let dot: f64 = f.iter().zip(&p).map(|(fe, pe)| fe * pe / len_f).sum();
            total += usize_f64(e) * dot;
        }
        Ok(self.coef * total / usize_f64(groups.len()))
    }

    /// Accumulates `dlogits (N,E) += ∂L/∂logits` (gradient through `P_e`
    /// only, as in the papers).
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and [`Error::ShapeMismatch`] for
    /// `dlogits`.
    pub fn backward<T: Real>(
        &self,
        dlogits: &mut [T],
        routing: &Routing<T>,
        seq_lens: &[usize],
    ) -> Result<()> {
        let groups = self.groups(routing, seq_lens)?;
        let e = routing.experts;
        check(
            "aux_loss_backward",
            "dlogits",
            dlogits,
            routing.n_tokens() * e,
        )?;
        let g = usize_f64(groups.len());
        let mut q = vec![T::ZERO; e];
        let mut dq = vec![T::ZERO; e];
        let mut ds = vec![T::ZERO; e];
        for &(start, len) in &groups {
            let (f, _) = fractions(routing, start, len);
            // dL/dq_{t,e} = α E f_e / (n G)
            let scale = self.coef * usize_f64(e) / (usize_f64(len) * g);
            for (d, fe) in dq.iter_mut().zip(&f) {
                *d = T::from_f64(scale * fe);
            }
            for t in start..start + len {
                let s = &routing.scores[t * e..(t + 1) * e];
                let dl = &mut dlogits[t * e..(t + 1) * e];
                match routing.gate_fn {
                    Gate::Softmax => score_backward(Gate::Softmax, dl, s, &dq),
                    Gate::Sigmoid => {
                        // q = s / Σ s: ds_j = (dq_j - Σ_i dq_i q_i) / Σ s.
                        probs(routing, t, &mut q);
                        let total: T = s.iter().copied().sum();
                        let dot: T = dq.iter().zip(&q).map(|(&a, &b)| a * b).sum();
                        for (d, &dqe) in ds.iter_mut().zip(&dq) {
                            *d = (dqe - dot) / total;
                        }
                        score_backward(Gate::Sigmoid, dl, s, &ds);
                    }
                }
            }
        }
        Ok(())
    }

    fn groups<T: Real>(
        &self,
        routing: &Routing<T>,
        seq_lens: &[usize],
    ) -> Result<Vec<(usize, usize)>> {
        if routing.slots != 0
            && routing.slots == routing.experts
            && routing.chosen.contains(&DROPPED)
        {
            return Err(Error::Unsupported {
                op: "aux_loss",
                router: "expert-choice".into(),
                reason: "expert choice balances by construction; the auxiliary loss assumes k experts per token".into(),
            });
        }
        let n = routing.n_tokens();
        let total: usize = seq_lens.iter().sum();
        if total != n {
            return Err(Error::ShapeMismatch {
                op: "aux_loss",
                buffer: "seq_lens (sum)",
                expected: n,
                got: total,
            });
        }
        Ok(match self.scope {
            AuxScope::Batch => vec![(0, n)],
            AuxScope::Sequence => {
                let mut start = 0;
                seq_lens
                    .iter()
                    .filter(|&&l| l > 0)
                    .map(|&l| {
                        let g = (start, l);
                        start += l;
                        g
                    })
                    .collect()
            }
        })
    }
}

/// `f_e` over tokens `start..start+len` and the assignment count.
fn fractions<T: Real>(routing: &Routing<T>, start: usize, len: usize) -> (Vec<f64>, usize) {
    let k = routing.slots;
    let mut f = vec![0.0f64; routing.experts];
    let mut count = 0;
    for &j in &routing.chosen[start * k..(start + len) * k] {
        if j != DROPPED {
            f[j as usize] += 1.0;
            count += 1;
        }
    }
    let denom = usize_f64(count.max(1));
    for x in &mut f {
        *x /= denom;
    }
    (f, count)
}

/// The router probability distribution `q` of token `t`.
pub(crate) fn probs<T: Real>(routing: &Routing<T>, t: usize, q: &mut [T]) {
    let e = routing.experts;
    let s = &routing.scores[t * e..(t + 1) * e];
    match routing.gate_fn {
        Gate::Softmax => q.copy_from_slice(s),
        Gate::Sigmoid => {
            let total: T = s.iter().copied().sum();
            for (qe, &se) in q.iter_mut().zip(s) {
                *qe = se / total;
            }
        }
    }
}

#[allow(clippy::cast_precision_loss)]
pub(crate) fn usize_f64(x: usize) -> f64 {
    x as f64
}

/// Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): a
/// per-expert bias `b` added to the scores for top-k *selection only*
/// (gate weights use the unbiased scores), updated after each step by
/// `b_e += γ · sign(mean load − load_e)`: an overloaded expert's bias
/// falls by γ, an underloaded one's rises by γ.
///
/// The bias is fixed during a step, so routing with it stays causal; the
/// update reads the whole batch's load and affects only later steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BiasBalancer {
    /// Update rate γ (DeepSeek-V3 uses 1e-3).
    pub rate: f64,
}

impl BiasBalancer {
    /// A balancer with update rate `rate`.
    #[must_use]
    pub fn new(rate: f64) -> Self {
        BiasBalancer { rate }
    }

    /// Applies one step's update to `bias (E)` from the observed kept
    /// load per expert (summed over the step's micro-batches and, under
    /// data parallelism, over ranks, so every rank applies the same
    /// update).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if the lengths differ.
    pub fn update<T: Real>(&self, bias: &mut [T], load: &[u64]) -> Result<()> {
        check("bias_update", "load", load, bias.len())?;
        if load.is_empty() {
            return Ok(());
        }
        let total: u64 = load.iter().sum();
        let mean = total as f64 / usize_f64(load.len());
        for (b, &l) in bias.iter_mut().zip(load) {
            let l = l as f64;
            let step = if l > mean {
                -self.rate
            } else if l < mean {
                self.rate
            } else {
                0.0
            };
            *b += T::from_f64(step);
        }
        Ok(())
    }
}
