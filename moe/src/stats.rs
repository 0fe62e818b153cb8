//! Expert-load statistics per step and layer.

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp};
use weft_kernels::Real;
use weft_trace::ExpertLoadRecord;

use crate::balance::{probs, usize_f64};
use crate::router::Routing;

/// Load of one MoE layer over one or more routings (micro-batches, ranks):
/// merge them with [`merge`](Self::merge), or sum them over ranks with
/// [`all_reduce`](Self::all_reduce).
///
/// **Router entropy.** For token `t` the router's probability
/// distribution over experts is `q_t = softmax(logits_t)` for softmax
/// gates and `q_t,e = σ(logits_t,e) / Σ_j σ(logits_t,j)` for sigmoid gates
/// (the `q` of the auxiliary loss; the selection bias is not part of it).
/// Its entropy is `H_t = −Σ_e q_t,e ln q_t,e` nats (terms with `q = 0`
/// count 0), between 0 (certain) and `ln E` (uniform). A layer's router
/// entropy for a step is the mean `(1/N) Σ_t H_t` over the step's tokens
/// (all micro-batches and ranks). [`LoadStats`] keeps the sum and the
/// count, so merging routings is exact up to the f64 addition of the sums.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadStats {
    /// Kept assignments per expert (E).
    pub tokens_per_expert: Vec<u64>,
    /// Assignments dropped by capacity.
    pub dropped: u64,
    /// Tokens routed.
    pub tokens: u64,
    /// Sum over tokens of the router entropy `-Σ_e q_e ln q_e` (nats) of
    /// the router probabilities `q` (softmax, or sigmoid scores
    /// normalised over experts).
    pub entropy_sum: f64,
}

impl LoadStats {
    /// The statistics of one routing.
    #[must_use]
    pub fn from_routing<T: Real>(routing: &Routing<T>) -> Self {
        let n = routing.n_tokens();
        let mut q = vec![T::ZERO; routing.experts];
        let mut entropy_sum = 0.0;
        for t in 0..n {
            probs(routing, t, &mut q);
            entropy_sum -= q
                .iter()
                .map(|x| x.to_f64())
                .filter(|&x| x > 0.0)
                .map(|x| x * x.ln())
                .sum::<f64>();
        }
        LoadStats {
            tokens_per_expert: routing.load(),
            dropped: routing.dropped as u64,
            tokens: n as u64,
            entropy_sum,
        }
    }

    /// Adds another routing's statistics (same number of experts; an empty
    /// `self` takes `other`'s).
    pub fn merge(&mut self, other: &LoadStats) {
        if self.tokens_per_expert.is_empty() {
            self.tokens_per_expert = vec![0; other.tokens_per_expert.len()];
        }
        for (a, b) in self
            .tokens_per_expert
            .iter_mut()
            .zip(&other.tokens_per_expert)
        {
            *a += b;
        }
        self.dropped += other.dropped;
        self.tokens += other.tokens;
        self.entropy_sum += other.entropy_sum;
    }

    /// Mean kept load per expert.
    #[must_use]
    pub fn mean_load(&self) -> f64 {
        let total: u64 = self.tokens_per_expert.iter().sum();
        total as f64 / usize_f64(self.tokens_per_expert.len().max(1))
    }

    /// Busiest expert's load over the mean (1 is perfect balance); `None`
    /// when nothing was routed.
    #[must_use]
    pub fn max_over_mean(&self) -> Option<f64> {
        let mean = self.mean_load();
        let max = *self.tokens_per_expert.iter().max()?;
        (mean > 0.0).then(|| max as f64 / mean)
    }

    /// MaxVio = (max load − mean load) / mean load, as the
    /// auxiliary-loss-free balancing paper reports it; `None` when nothing
    /// was routed.
    #[must_use]
    pub fn max_vio(&self) -> Option<f64> {
        self.max_over_mean().map(|r| r - 1.0)
    }

    /// Mean router entropy per token (nats); 0 when no tokens.
    #[must_use]
    pub fn entropy(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.entropy_sum / self.tokens as f64
        }
    }

    /// The `expert_load.jsonl` line for this layer and step (router
    /// entropy `None` when no token was routed).
    #[must_use]
    pub fn to_record(&self, step: u64, layer: u32) -> ExpertLoadRecord {
        ExpertLoadRecord {
            step,
            layer,
            tokens_per_expert: self.tokens_per_expert.clone(),
            dropped: self.dropped,
            router_entropy: (self.tokens > 0).then(|| self.entropy()),
        }
    }

    /// Sums the statistics over every rank of `comm` (data- or
    /// expert-parallel ranks that routed different tokens), so that every
    /// rank logs the global load and applies the same
    /// [`BiasBalancer`](crate::BiasBalancer) update. Collective: every rank
    /// must call it with the same number of experts. Counts travel as f64,
    /// exact below 2^53.
    ///
    /// # Errors
    /// [`Error::Comm`](crate::Error::Comm) if the all-reduce fails (also
    /// when ranks disagree on the number of experts).
    pub fn all_reduce<C: Communicator + ?Sized>(&mut self, comm: &C) -> crate::Result<()> {
        #[allow(clippy::cast_precision_loss)]
        let mut buf: Vec<f64> = self
            .tokens_per_expert
            .iter()
            .chain([&self.dropped, &self.tokens])
            .map(|&x| x as f64)
            .chain([self.entropy_sum])
            .collect();
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        let e = self.tokens_per_expert.len();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let count = |x: f64| x as u64;
        for (t, &x) in self.tokens_per_expert.iter_mut().zip(&buf) {
            *t = count(x);
        }
        self.dropped = count(buf[e]);
        self.tokens = count(buf[e + 1]);
        self.entropy_sum = buf[e + 2];
        Ok(())
    }
}
