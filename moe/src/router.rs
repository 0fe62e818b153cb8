//! Routers: which experts each token goes to, and with what gate weight.
//!
//! Every router reads router logits `(N, E)` for `N` tokens laid out as
//! consecutive sequences (`seq_lens`, summing to `N`) and produces a
//! [`Routing`]: for each token a fixed number of *slots*, each holding the
//! expert it chose (or [`DROPPED`]) and its gate weight.
//!
//! | router | causal | why |
//! |---|---|---|
//! | [`RouterKind::Dropless`] token-choice top-k | yes | a token's experts and gates are a function of its own logits (and the selection bias, which is fixed during a step) |
//! | [`RouterKind::Capacity`] with [`DropPolicy::ByPosition`] | yes | tokens of a sequence are admitted in position order against the capacity of the prefix up to them, so only earlier tokens of the same sequence matter |
//! | [`RouterKind::Capacity`] with [`DropPolicy::ByScore`] | **no** | each expert keeps its highest-scoring assignments of the whole batch: a later token (or another sequence) with a higher score evicts an earlier one |
//! | [`RouterKind::ExpertChoice`] | **no** | each expert takes its top-c tokens of the whole batch (Zhou et al. 2022): whether token n is taken depends on every other token |
//!
//! [`audit`](crate::audit()) checks these claims empirically.

use weft_kernels::Real;

use crate::error::{Error, Result, check};

/// Marks a slot whose assignment was dropped (or, for expert choice, a
/// slot whose expert did not pick the token).
pub const DROPPED: u32 = u32::MAX;

/// How router logits become scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum Gate {
    /// `s = softmax(logits)` over all experts (Switch, GShard, Mixtral).
    #[default]
    Softmax,
    /// `s = sigmoid(logits)` per expert (DeepSeek-V3).
    Sigmoid,
}

/// Which assignments a capacity-limited router drops when an expert is
/// full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum DropPolicy {
    /// Each expert keeps its highest-scoring assignments of the whole
    /// batch, capacity `ceil(cf·k·N/E)`. **Not causal.**
    #[cfg_attr(feature = "serde", serde(rename = "score"))]
    ByScore,
    /// Tokens of each sequence are admitted in position order (slot 0
    /// before slot 1 within a token); the token at position `t` is kept by
    /// expert `e` if `e` has kept fewer than `ceil(cf·k·(t+1)/E)` earlier
    /// assignments of that sequence. At the end of a sequence of length `T`
    /// that is the usual capacity `ceil(cf·k·T/E)`; enforcing it on every
    /// prefix makes a token's fate independent of the tokens after it and
    /// of the sequence's length. Causal.
    #[cfg_attr(feature = "serde", serde(rename = "position"))]
    ByPosition,
}

/// The routing algorithm.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum RouterKind {
    /// Token-choice top-k, every assignment kept (the default).
    Dropless,
    /// Token-choice top-k with a per-expert capacity.
    Capacity {
        /// Capacity factor `cf` (1.0: exactly the balanced load).
        capacity_factor: f64,
        /// What to drop when an expert is full.
        drop: DropPolicy,
    },
    /// Expert choice: each expert takes its `ceil(cf·k·N/E)` highest-scoring
    /// tokens of the batch, so tokens get a variable number of experts.
    /// **Not causal**: for comparison only.
    ExpertChoice {
        /// Capacity factor (1.0: on average `k` experts per token).
        capacity_factor: f64,
    },
}

/// A router configuration (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    /// Number of experts, E.
    pub experts: usize,
    /// Experts per token, k (for expert choice: the average).
    pub top_k: usize,
    /// Score function.
    pub gate: Gate,
    /// Whether the gate weights of a token's chosen experts are
    /// renormalised to sum to 1 (`g_i = s_i / Σ_{j∈chosen} s_j`) or are
    /// the raw scores `s_i`.
    pub normalize: bool,
    /// A factor on every gate weight, after any renormalisation
    /// (DeepSeek-V3's `routed_scaling_factor`, 2.5 there; 1: none).
    pub scale: f64,
    /// The algorithm.
    pub kind: RouterKind,
}

impl Router {
    /// Dropless token-choice top-k with softmax scores, not renormalised.
    #[must_use]
    pub fn top_k(experts: usize, top_k: usize) -> Self {
        Router {
            experts,
            top_k,
            gate: Gate::Softmax,
            normalize: false,
            scale: 1.0,
            kind: RouterKind::Dropless,
        }
    }

    /// Expert choice with capacity factor `cf` (average `top_k` experts per
    /// token at `cf = 1`). Not causal.
    #[must_use]
    pub fn expert_choice(experts: usize, top_k: usize, capacity_factor: f64) -> Self {
        Router {
            kind: RouterKind::ExpertChoice { capacity_factor },
            ..Router::top_k(experts, top_k)
        }
    }

    /// Sets the score function.
    #[must_use]
    pub fn with_gate(mut self, gate: Gate) -> Self {
        self.gate = gate;
        self
    }

    /// Sets gate renormalisation over the chosen experts.
    #[must_use]
    pub fn with_normalize(mut self, normalize: bool) -> Self {
        self.normalize = normalize;
        self
    }

    /// Sets the factor on every gate weight (see [`scale`](Self::scale)).
    #[must_use]
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = scale;
        self
    }

    /// Limits each expert's load to a capacity with a drop policy.
    #[must_use]
    pub fn with_capacity(mut self, capacity_factor: f64, drop: DropPolicy) -> Self {
        self.kind = RouterKind::Capacity {
            capacity_factor,
            drop,
        };
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad field.
    pub fn validate(&self) -> Result<()> {
        if self.experts == 0 || self.experts >= DROPPED as usize {
            return Err(Error::Config {
                field: "experts",
                reason: format!("is {}; must be at least 1", self.experts),
            });
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(Error::Config {
                field: "top_k",
                reason: format!(
                    "is {}; must be between 1 and the number of experts ({})",
                    self.top_k, self.experts
                ),
            });
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(Error::Config {
                field: "routed_scale",
                reason: format!("is {}; must be a positive number", self.scale),
            });
        }
        if let RouterKind::Capacity {
            capacity_factor: cf,
            ..
        }
        | RouterKind::ExpertChoice {
            capacity_factor: cf,
        } = self.kind
            && !(cf.is_finite() && cf > 0.0)
        {
            return Err(Error::Config {
                field: "capacity_factor",
                reason: format!("is {cf}; must be a positive number"),
            });
        }
        Ok(())
    }

    /// Whether the router is causal by construction (see the module docs;
    /// [`audit`](crate::audit()) checks it).
    #[must_use]
    pub fn is_causal(&self) -> bool {
        !matches!(
            self.kind,
            RouterKind::ExpertChoice { .. }
                | RouterKind::Capacity {
                    drop: DropPolicy::ByScore,
                    ..
                }
        )
    }

    /// Whether every token gets exactly `top_k` slots (token choice).
    #[must_use]
    pub fn is_token_choice(&self) -> bool {
        !matches!(self.kind, RouterKind::ExpertChoice { .. })
    }

    /// Slots per token in a [`Routing`]: `top_k` for token choice, `E` for
    /// expert choice.
    #[must_use]
    pub fn slots(&self) -> usize {
        if self.is_token_choice() {
            self.top_k
        } else {
            self.experts
        }
    }

    /// A short name, e.g. `top2/8-softmax-norm-dropless`.
    #[must_use]
    pub fn name(&self) -> String {
        let gate = match self.gate {
            Gate::Softmax => "softmax",
            Gate::Sigmoid => "sigmoid",
        };
        let norm = if self.normalize { "-norm" } else { "" };
        let scale = if self.scale == 1.0 {
            String::new()
        } else {
            format!("-x{}", self.scale)
        };
        let kind = match self.kind {
            RouterKind::Dropless => "dropless".to_string(),
            RouterKind::Capacity {
                capacity_factor,
                drop: DropPolicy::ByScore,
            } => format!("cap{capacity_factor}-drop-by-score"),
            RouterKind::Capacity {
                capacity_factor,
                drop: DropPolicy::ByPosition,
            } => format!("cap{capacity_factor}-drop-by-position"),
            RouterKind::ExpertChoice { capacity_factor } => {
                format!("expert-choice-cap{capacity_factor}")
            }
        };
        format!(
            "top{}/{}-{gate}{norm}{scale}-{kind}",
            self.top_k, self.experts
        )
    }

    /// Routes `N = Σ seq_lens` tokens given their router logits `(N, E)`.
    ///
    /// `bias` (E), if given, is added to the scores *for selection only*
    /// (auxiliary-loss-free balancing, DeepSeek-V3): gate weights are
    /// computed from the unbiased scores. Expert choice ignores it.
    /// Ties are broken towards the lower expert (or token) index.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid router, [`Error::ShapeMismatch`] if
    /// `logits` is not `(Σ seq_lens, E)` or `bias` not `(E)`.
    pub fn route<T: Real>(
        &self,
        logits: &[T],
        seq_lens: &[usize],
        bias: Option<&[T]>,
    ) -> Result<Routing<T>> {
        const OP: &str = "route";
        self.validate()?;
        let e = self.experts;
        let n: usize = seq_lens.iter().sum();
        check(OP, "logits", logits, n * e)?;
        if let Some(b) = bias {
            check(OP, "bias", b, e)?;
        }
        let mut scores = vec![T::ZERO; n * e];
        for (s, l) in scores.chunks_exact_mut(e).zip(logits.chunks_exact(e)) {
            score_row(self.gate, s, l);
        }
        let slots = self.slots();
        let mut r = Routing {
            experts: e,
            slots,
            gate_fn: self.gate,
            normalize: self.normalize,
            scale: self.scale,
            chosen: vec![DROPPED; n * slots],
            kept: vec![false; n * slots],
            gate: vec![T::ZERO; n * slots],
            scores,
            dropped: 0,
        };
        match self.kind {
            RouterKind::ExpertChoice { capacity_factor } => {
                self.expert_choice_into(&mut r, n, capacity_factor);
            }
            RouterKind::Dropless => self.top_k_into(&mut r, n, bias),
            RouterKind::Capacity {
                capacity_factor,
                drop,
            } => {
                self.top_k_into(&mut r, n, bias);
                match drop {
                    DropPolicy::ByScore => self.drop_by_score(&mut r, n, capacity_factor),
                    DropPolicy::ByPosition => {
                        self.drop_by_position(&mut r, seq_lens, capacity_factor);
                    }
                }
            }
        }
        Ok(r)
    }

    fn top_k_into<T: Real>(&self, r: &mut Routing<T>, n: usize, bias: Option<&[T]>) {
        let (e, k) = (self.experts, self.top_k);
        let scale = T::from_f64(self.scale);
        let mut sel = vec![0u32; k];
        let mut key = vec![T::ZERO; e];
        for t in 0..n {
            let s = &r.scores[t * e..(t + 1) * e];
            match bias {
                Some(b) => {
                    for ((kk, &si), &bi) in key.iter_mut().zip(s).zip(b) {
                        *kk = si + bi;
                    }
                }
                None => key.copy_from_slice(s),
            }
            top_k_indices(&key, &mut sel);
            let mut total = T::ZERO;
            for &j in &sel {
                total += s[j as usize];
            }
            for (i, &j) in sel.iter().enumerate() {
                let g = s[j as usize];
                r.chosen[t * k + i] = j;
                r.kept[t * k + i] = true;
                let g = if self.normalize { g / total } else { g };
                r.gate[t * k + i] = if self.scale == 1.0 { g } else { g * scale };
            }
        }
    }

    fn drop_by_score<T: Real>(&self, r: &mut Routing<T>, n: usize, cf: f64) {
        let (e, k) = (self.experts, self.top_k);
        let cap = capacity(cf, k, n, e);
        let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
        for (slot, &j) in r.chosen.iter().enumerate() {
            per_expert[j as usize].push(slot);
        }
        for (j, list) in per_expert.iter_mut().enumerate() {
            if list.len() <= cap {
                continue;
            }
            // Highest score first, earlier slot on ties.
            list.sort_by(|&a, &b| {
                let (sa, sb) = (r.scores[(a / k) * e + j], r.scores[(b / k) * e + j]);
                sb.partial_cmp(&sa)
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.cmp(&b))
            });
            for &slot in &list[cap..] {
                r.kept[slot] = false;
                r.dropped += 1;
            }
        }
    }

    fn drop_by_position<T: Real>(&self, r: &mut Routing<T>, seq_lens: &[usize], cf: f64) {
        let (e, k) = (self.experts, self.top_k);
        let mut count = vec![0usize; e];
        let mut start = 0;
        for &len in seq_lens {
            count.fill(0);
            for t in 0..len {
                let cap = capacity(cf, k, t + 1, e);
                for i in 0..k {
                    let slot = (start + t) * k + i;
                    let j = r.chosen[slot] as usize;
                    if count[j] < cap {
                        count[j] += 1;
                    } else {
                        r.kept[slot] = false;
                        r.dropped += 1;
                    }
                }
            }
            start += len;
        }
    }

    fn expert_choice_into<T: Real>(&self, r: &mut Routing<T>, n: usize, cf: f64) {
        let e = self.experts;
        let cap = capacity(cf, self.top_k, n, e).min(n);
        let mut order: Vec<usize> = (0..n).collect();
        for j in 0..e {
            order.sort_by(|&a, &b| {
                r.scores[b * e + j]
                    .partial_cmp(&r.scores[a * e + j])
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.cmp(&b))
            });
            for &t in &order[..cap] {
                r.chosen[t * e + j] = j as u32;
                r.kept[t * e + j] = true;
                r.gate[t * e + j] = r.scores[t * e + j];
            }
        }
        if self.normalize {
            for t in 0..n {
                let g = &mut r.gate[t * e..(t + 1) * e];
                let total: T = g.iter().copied().sum();
                if total > T::ZERO {
                    for x in g {
                        *x /= total;
                    }
                }
            }
        }
        if self.scale != 1.0 {
            let scale = T::from_f64(self.scale);
            for x in &mut r.gate {
                *x *= scale;
            }
        }
    }
}

/// `ceil(cf·k·n/e)`, at least 1.
#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
pub(crate) fn capacity(cf: f64, k: usize, n: usize, e: usize) -> usize {
    ((cf * (k * n) as f64 / e as f64).ceil() as usize).max(1)
}

/// Scores of one token's logits.
pub(crate) fn score_row<T: Real>(gate: Gate, s: &mut [T], l: &[T]) {
    match gate {
        Gate::Softmax => {
            let m = l.iter().fold(T::NEG_INFINITY, |m, &x| m.max(x));
            let mut total = T::ZERO;
            for (si, &li) in s.iter_mut().zip(l) {
                *si = (li - m).exp();
                total += *si;
            }
            for si in s.iter_mut() {
                *si /= total;
            }
        }
        Gate::Sigmoid => {
            for (si, &li) in s.iter_mut().zip(l) {
                *si = T::ONE / (T::ONE + (-li).exp());
            }
        }
    }
}

/// Indices of the `sel.len()` largest keys, largest first, lower index on
/// ties.
fn top_k_indices<T: Real>(key: &[T], sel: &mut [u32]) {
    let k = sel.len();
    let mut len = 0;
    for (j, &v) in key.iter().enumerate() {
        // NaN keys never enter a full selection.
        if len == k && v.partial_cmp(&key[sel[k - 1] as usize]) != Some(std::cmp::Ordering::Greater)
        {
            continue;
        }
        // Insertion position: after every kept key >= v (stable on ties).
        let mut pos = len.min(k - 1);
        if len < k {
            len += 1;
        }
        while pos > 0 && v > key[sel[pos - 1] as usize] {
            sel[pos] = sel[pos - 1];
            pos -= 1;
        }
        sel[pos] = j as u32;
    }
}

/// The result of routing `N` tokens (see [`Router::route`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing<T> {
    /// Number of experts, E.
    pub experts: usize,
    /// Slots per token.
    pub slots: usize,
    /// The score function used.
    pub gate_fn: Gate,
    /// Whether gates were renormalised over the chosen experts.
    pub normalize: bool,
    /// The factor on every gate weight ([`Router::scale`]).
    pub scale: f64,
    /// (N, slots): the expert each slot chose before any capacity drop
    /// ([`DROPPED`] for an expert-choice slot whose expert did not pick
    /// the token).
    pub chosen: Vec<u32>,
    /// (N, slots): whether the assignment was kept.
    pub kept: Vec<bool>,
    /// (N, slots): gate weight (computed before dropping; a dropped
    /// assignment contributes nothing).
    pub gate: Vec<T>,
    /// (N, E): scores, `softmax(logits)` or `sigmoid(logits)`.
    pub scores: Vec<T>,
    /// Assignments dropped by capacity.
    pub dropped: usize,
}

impl<T: Real> Routing<T> {
    /// Number of tokens, N.
    #[must_use]
    pub fn n_tokens(&self) -> usize {
        self.kept.len() / self.slots.max(1)
    }

    /// The expert a slot is sent to, `None` if dropped or empty.
    #[must_use]
    pub fn expert(&self, slot: usize) -> Option<usize> {
        self.kept[slot].then(|| self.chosen[slot] as usize)
    }

    /// Kept assignments per expert (E).
    #[must_use]
    pub fn load(&self) -> Vec<u64> {
        let mut load = vec![0u64; self.experts];
        for (slot, &j) in self.chosen.iter().enumerate() {
            if self.kept[slot] {
                load[j as usize] += 1;
            }
        }
        load
    }

    /// Backward of the gate weights: accumulates `dlogits (N,E) +=
    /// ∂(Σ dgate·gate)/∂logits` for `dgate (N, slots)`.
    ///
    /// Only token-choice renormalisation is differentiated through the
    /// chosen set (which is piecewise constant in the logits).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] on wrong lengths.
    pub fn gate_backward(&self, dlogits: &mut [T], dgate: &[T]) -> Result<()> {
        const OP: &str = "gate_backward";
        let (e, k) = (self.experts, self.slots);
        let n = self.n_tokens();
        check(OP, "dlogits", dlogits, n * e)?;
        check(OP, "dgate", dgate, n * k)?;
        let mut ds = vec![T::ZERO; e];
        // With a scale σ the gates are σ·ĝ: the chain rule multiplies the
        // gates' gradient by σ.
        let scale = T::from_f64(self.scale);
        let mut dgs = vec![T::ZERO; k];
        for t in 0..n {
            ds.fill(T::ZERO);
            let s = &self.scores[t * e..(t + 1) * e];
            let ch = &self.chosen[t * k..(t + 1) * k];
            let dg_raw = &dgate[t * k..(t + 1) * k];
            let mut dg = dg_raw;
            if self.scale != 1.0 {
                for (d, &x) in dgs.iter_mut().zip(dg) {
                    *d = x * scale;
                }
                dg = &dgs;
            }
            if self.normalize {
                // g_i = s_i / S over the chosen set:
                // ds_j = (σ·dg_j - Σ_i dg_i g_i) / S (g_i the scaled gates).
                let mut total = T::ZERO;
                let mut dot = T::ZERO;
                for (i, &j) in ch.iter().enumerate() {
                    if j != DROPPED {
                        total += s[j as usize];
                        dot += dg_raw[i] * self.gate[t * k + i];
                    }
                }
                for (i, &j) in ch.iter().enumerate() {
                    if j != DROPPED {
                        ds[j as usize] += (dg[i] - dot) / total;
                    }
                }
            } else {
                for (i, &j) in ch.iter().enumerate() {
                    if j != DROPPED {
                        ds[j as usize] += dg[i];
                    }
                }
            }
            score_backward(self.gate_fn, &mut dlogits[t * e..(t + 1) * e], s, &ds);
        }
        Ok(())
    }
}

/// `dl += ∂s/∂l · ds` for one token's scores.
pub(crate) fn score_backward<T: Real>(gate: Gate, dl: &mut [T], s: &[T], ds: &[T]) {
    match gate {
        Gate::Softmax => {
            let dot: T = s.iter().zip(ds).map(|(&a, &b)| a * b).sum();
            for ((d, &si), &dsi) in dl.iter_mut().zip(s).zip(ds) {
                *d += si * (dsi - dot);
            }
        }
        Gate::Sigmoid => {
            for ((d, &si), &dsi) in dl.iter_mut().zip(s).zip(ds) {
                *d += dsi * si * (T::ONE - si);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_largest_with_stable_ties() {
        let key = [0.1, 0.5, 0.3, 0.5, 0.2];
        let mut sel = [0u32; 3];
        top_k_indices(&key, &mut sel);
        assert_eq!(sel, [1, 3, 2]);
        let mut one = [0u32; 1];
        top_k_indices(&key, &mut one);
        assert_eq!(one, [1]);
        let mut all = [0u32; 5];
        top_k_indices(&key, &mut all);
        assert_eq!(all, [1, 3, 2, 4, 0]);
    }
}
