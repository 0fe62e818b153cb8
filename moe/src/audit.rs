//! An empirical causality audit for any router.
//!
//! A router is causal if what happens to token `n` of a sequence (its
//! experts and gate weights) depends only on tokens `0..=n` of the same
//! sequence: then training sees exactly what autoregressive inference
//! will. [`audit`] draws random router logits, picks a token `n`, and
//! re-routes after each of three [`Perturbation`]s — new logits for the
//! tokens after `n`, removing them, new logits for every other sequence of
//! the batch — and counts the trials where token `n`'s assignment or gate
//! weights changed (bitwise).

use std::fmt;

use crate::error::Result;
use crate::router::Router;

/// What an audit trial changes around token `n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Perturbation {
    /// Fresh random logits for the tokens after `n` in its sequence.
    ChangeLater,
    /// The tokens after `n` in its sequence are removed.
    RemoveLater,
    /// Fresh random logits for every other sequence of the batch.
    ChangeOtherSequences,
}

impl Perturbation {
    /// All perturbations, in report order.
    pub const ALL: [Perturbation; 3] = [
        Perturbation::ChangeLater,
        Perturbation::RemoveLater,
        Perturbation::ChangeOtherSequences,
    ];

    /// A short name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Perturbation::ChangeLater => "change-later",
            Perturbation::RemoveLater => "remove-later",
            Perturbation::ChangeOtherSequences => "change-other-seqs",
        }
    }
}

/// Audit parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AuditOptions {
    /// Random trials per perturbation.
    pub trials: usize,
    /// Sequences per batch, B (at least 2 for the other-sequence check).
    pub batch: usize,
    /// Tokens per sequence, T (at least 2).
    pub seq_len: usize,
    /// Logits are drawn uniformly from `[-scale, scale]`.
    pub logit_scale: f64,
    /// RNG seed.
    pub seed: u64,
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            trials: 200,
            batch: 4,
            seq_len: 32,
            logit_scale: 2.0,
            seed: 0x5eed,
        }
    }
}

/// Outcome of one perturbation's trials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerturbationResult {
    /// The perturbation.
    pub perturbation: Perturbation,
    /// Trials run.
    pub trials: usize,
    /// Trials where token `n`'s set of kept experts changed.
    pub assignment_changed: usize,
    /// Trials where the experts stayed but a gate weight changed.
    pub gate_changed: usize,
}

impl PerturbationResult {
    /// Trials with any change.
    #[must_use]
    pub fn violations(&self) -> usize {
        self.assignment_changed + self.gate_changed
    }

    /// Violations over trials.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn rate(&self) -> f64 {
        self.violations() as f64 / self.trials.max(1) as f64
    }
}

/// The audit of one router.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditReport {
    /// [`Router::name`], with `+bias` when audited with a selection bias.
    pub router: String,
    /// What [`Router::is_causal`] claims.
    pub causal_by_design: bool,
    /// One result per [`Perturbation::ALL`].
    pub results: Vec<PerturbationResult>,
}

impl AuditReport {
    /// Violating trials over all trials of all perturbations.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn violation_rate(&self) -> f64 {
        let v: usize = self
            .results
            .iter()
            .map(PerturbationResult::violations)
            .sum();
        let t: usize = self.results.iter().map(|r| r.trials).sum();
        v as f64 / t.max(1) as f64
    }

    /// Whether no trial found a violation.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.results.iter().all(|r| r.violations() == 0)
    }
}

impl fmt::Display for AuditReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<44} causal-by-design={:<5} violation-rate={:.4}",
            self.router,
            self.causal_by_design,
            self.violation_rate()
        )?;
        for r in &self.results {
            write!(
                f,
                "  {}={}/{}",
                r.perturbation.name(),
                r.violations(),
                r.trials
            )?;
        }
        Ok(())
    }
}

/// SplitMix64: a small, seedable generator (no dependency needed).
#[derive(Clone, Debug)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-s, s).
    pub(crate) fn sym(&mut self, s: f64) -> f64 {
        (2.0 * self.uniform() - 1.0) * s
    }
    #[allow(clippy::cast_possible_truncation)]
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The most router logits one trial draws (batch × seq_len × experts):
/// 2^24, 128 MiB of `f64`, held about three times over.
pub const MAX_AUDIT_LOGITS: usize = 1 << 24;

/// The most trials an audit runs.
pub const MAX_AUDIT_TRIALS: usize = 1 << 20;

/// Refuses audit sizes whose buffers or run time no machine has, before
/// anything is allocated.
fn check_size(experts: usize, opts: &AuditOptions) -> Result<()> {
    let logits = opts
        .batch
        .checked_mul(opts.seq_len)
        .and_then(|n| n.checked_mul(experts))
        .filter(|&n| n <= MAX_AUDIT_LOGITS);
    if logits.is_none() {
        return Err(crate::Error::Config {
            field: "experts",
            reason: format!(
                "= {experts}: a trial's logits (batch {} × seq_len {} × experts) exceed the audit's bound of {MAX_AUDIT_LOGITS} values",
                opts.batch, opts.seq_len
            ),
        });
    }
    if opts.trials > MAX_AUDIT_TRIALS {
        return Err(crate::Error::Config {
            field: "trials",
            reason: format!("= {}: at most {MAX_AUDIT_TRIALS}", opts.trials),
        });
    }
    Ok(())
}

/// Token `t`'s kept (expert, gate) pairs, in slot order.
fn outcome(r: &crate::router::Routing<f64>, t: usize) -> (Vec<usize>, Vec<u64>) {
    let k = r.slots;
    let mut experts = Vec::new();
    let mut gates = Vec::new();
    for slot in t * k..(t + 1) * k {
        if let Some(e) = r.expert(slot) {
            experts.push(e);
            gates.push(r.gate[slot].to_bits());
        }
    }
    (experts, gates)
}

/// Audits `router` (with an optional selection `bias (E)`, as the
/// auxiliary-loss-free balancer would set it): see the module docs.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) if the router is invalid or
/// `opts` has fewer than 2 sequences or 2 tokens per sequence, or sizes
/// over [`MAX_AUDIT_LOGITS`] or [`MAX_AUDIT_TRIALS`];
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) for a bias of the
/// wrong length.
pub fn audit(router: &Router, bias: Option<&[f64]>, opts: &AuditOptions) -> Result<AuditReport> {
    router.validate()?;
    check_size(router.experts, opts)?;
    if opts.batch < 2 || opts.seq_len < 2 {
        return Err(crate::Error::Config {
            field: "audit batch/seq_len",
            reason: format!(
                "are {}/{}; need at least 2 sequences of at least 2 tokens",
                opts.batch, opts.seq_len
            ),
        });
    }
    let e = router.experts;
    let (b, t) = (opts.batch, opts.seq_len);
    let mut rng = SplitMix::new(opts.seed);
    let mut results: Vec<PerturbationResult> = Perturbation::ALL
        .iter()
        .map(|&p| PerturbationResult {
            perturbation: p,
            trials: 0,
            assignment_changed: 0,
            gate_changed: 0,
        })
        .collect();
    let lens = vec![t; b];
    for _ in 0..opts.trials {
        let logits: Vec<f64> = (0..b * t * e).map(|_| rng.sym(opts.logit_scale)).collect();
        let seq = rng.below(b);
        let pos = rng.below(t - 1);
        let tok = seq * t + pos;
        let base = router.route(&logits, &lens, bias)?;
        let want = outcome(&base, tok);
        for res in &mut results {
            let (l2, lens2) = match res.perturbation {
                Perturbation::ChangeLater => {
                    let mut l = logits.clone();
                    for x in &mut l[(tok + 1) * e..(seq + 1) * t * e] {
                        *x = rng.sym(opts.logit_scale);
                    }
                    (l, lens.clone())
                }
                Perturbation::RemoveLater => {
                    let mut l = logits[..(tok + 1) * e].to_vec();
                    l.extend_from_slice(&logits[(seq + 1) * t * e..]);
                    let mut ls = lens.clone();
                    ls[seq] = pos + 1;
                    (l, ls)
                }
                Perturbation::ChangeOtherSequences => {
                    let mut l = logits.clone();
                    for (i, x) in l.iter_mut().enumerate() {
                        if i / (t * e) != seq {
                            *x = rng.sym(opts.logit_scale);
                        }
                    }
                    (l, lens.clone())
                }
            };
            let got = outcome(&router.route(&l2, &lens2, bias)?, tok);
            res.trials += 1;
            if got.0 != want.0 {
                res.assignment_changed += 1;
            } else if got.1 != want.1 {
                res.gate_changed += 1;
            }
        }
    }
    let mut name = router.name();
    if bias.is_some() {
        name.push_str("+bias");
    }
    Ok(AuditReport {
        router: name,
        causal_by_design: router.is_causal(),
        results,
    })
}

/// The routers `weft moe audit` compares for `experts` and `top_k`:
/// dropless top-k (softmax, softmax renormalised, sigmoid renormalised
/// with a random selection bias as the bias balancer leaves it),
/// capacity 1.0 with drop by position and by score, and expert choice.
///
/// # Errors
/// As [`audit`].
pub fn audit_suite(experts: usize, top_k: usize, opts: &AuditOptions) -> Result<Vec<AuditReport>> {
    check_size(experts, opts)?;
    let mut rng = SplitMix::new(opts.seed ^ 0xb1a5);
    let bias: Vec<f64> = (0..experts).map(|_| rng.sym(0.5)).collect();
    let base = Router::top_k(experts, top_k);
    let cases: Vec<(Router, Option<&[f64]>)> = vec![
        (base, None),
        (base.with_normalize(true), None),
        (
            base.with_gate(crate::Gate::Sigmoid).with_normalize(true),
            Some(&bias),
        ),
        (base.with_capacity(1.0, crate::DropPolicy::ByPosition), None),
        (base.with_capacity(1.0, crate::DropPolicy::ByScore), None),
        (Router::expert_choice(experts, top_k, 1.0), None),
    ];
    cases.iter().map(|(r, b)| audit(r, *b, opts)).collect()
}
