//! Mixture-of-experts routing that keeps causality, balances load, and is
//! audited.
//!
//! Mixture-of-experts routing is where pretraining quietly breaks
//! causality: expert-choice routing and score-ordered token dropping let a
//! later token change what happens to an earlier one, information the
//! model sees in training and never in deployment. This crate provides
//! routers that say whether they are causal, an audit that checks the
//! claim, load balancing that keeps causality, the expert block itself
//! (forward and backward), expert parallelism over all-to-all, and the
//! load statistics the trainer logs.
//!
//! # Overview
//! - [`Router`] / [`RouterKind`] / [`Gate`] / [`DropPolicy`]: token-choice
//!   top-k with softmax or sigmoid scores (renormalised over the chosen k
//!   or not, scaled as DeepSeek-V3's `routed_scaling_factor`),
//!   capacity-limited top-k dropping by score (not causal) or by
//!   position (causal), expert choice (not causal). [`Router::route`]
//!   returns a [`Routing`]; [`Routing::gate_backward`] differentiates the
//!   gate weights.
//! - [`AuxLoss`] ([`AuxScope`]): the Switch/GShard load-balancing loss,
//!   batch- or sequence-wise, with its gradient into the router logits.
//!   [`BiasBalancer`]: DeepSeek-V3's auxiliary-loss-free balancing (a
//!   selection-only bias updated from the observed load after each step).
//! - [`audit()`] / [`audit_suite`]: the empirical causality audit behind
//!   `weft moe audit` ([`AuditReport`] implements `Display`).
//! - [`MoeBlock`] / [`MoeConfig`]: E experts ([`Expert`]: GPT-2 MLPs, or
//!   SwiGLU MLPs of a width set apart, fine-grained as in Qwen3-MoE and
//!   DeepSeek-V3), top-k, optional shared experts (one MLP `n` experts
//!   wide); forward and backward over flat slices (generic over
//!   `f32`/`f64`), experts computed grouped with no padding.
//! - [`ExpertParallel`]: the same block with experts sharded over an `ep`
//!   group of a [`weft_collectives::Communicator`], tokens dispatched and
//!   combined with `all_to_all_v`; activations kept in an [`EpSaved`] or,
//!   for a model's fixed-size activation buffers, in a flat buffer with
//!   the experts' hidden activations recomputed in the backward.
//! - [`LoadStats`]: tokens per expert, max/mean, MaxVio, dropped, router
//!   entropy (mean per-token entropy of the router's distribution over
//!   experts, in nats; defined in [`LoadStats`]);
//!   [`LoadStats::to_record`] gives the `expert_load.jsonl` line
//!   ([`weft_trace::ExpertLoadRecord`]); [`LoadStats::all_reduce`] sums
//!   it over data- or expert-parallel ranks.
//!
//! # Why the bias lives in the parameter buffer
//! The balancer's per-expert bias is state a resumed run must restore bit
//! for bit, so [`MoeConfig::tensors`] declares it
//! (`router.selection_bias`, not trained, never decayed, gradient always
//! 0) and checkpoints carry it like any weight; the trainer applies
//! [`BiasBalancer::update`] to that range after each optimizer step.
//!
//! # Example
//! ```
//! use weft_moe::{AuditOptions, BiasBalancer, DropPolicy, LoadStats, MoeBlock, MoeConfig,
//!                Router, audit};
//!
//! // Dropless top-2 of 4 experts is causal; dropping by score is not.
//! let opts = AuditOptions { trials: 50, ..AuditOptions::default() };
//! assert!(audit(&Router::top_k(4, 2), None, &opts)?.is_clean());
//! let by_score = Router::top_k(4, 2).with_capacity(1.0, DropPolicy::ByScore);
//! assert!(audit(&by_score, None, &opts)?.violation_rate() > 0.0);
//!
//! // An MoE block over 2 sequences of 3 tokens, C = 8.
//! let block = MoeBlock::new(MoeConfig::new(8, 4, 2))?;
//! let mut params = vec![0.0f32; block.num_params()];
//! block.init(&mut params, 1, 1.0)?;
//! let lens = [3, 3];
//! let inp: Vec<f32> = (0..6 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let mut out = vec![0.0f32; 6 * 8];
//! let mut saved = vec![0.0f32; 6 * block.config().saved_per_token()];
//! let fwd = block.forward(&mut out, &mut saved, &inp, &params, &lens)?;
//! assert_eq!(fwd.stats.tokens_per_expert.iter().sum::<u64>(), 12);
//! let mut dinp = vec![0.0f32; inp.len()];
//! let mut grads = vec![0.0f32; params.len()];
//! block.backward(&mut dinp, &mut grads, &out, &inp, &saved, &params, &lens)?;
//!
//! // After the optimizer step: update the selection bias from the load.
//! let bias = &mut params[block.config().selection_bias_range()];
//! BiasBalancer::new(1e-3).update(bias, &fwd.stats.tokens_per_expert)?;
//! let record = fwd.stats.to_record(1, 0); // one expert_load.jsonl line
//! assert_eq!(record.num_experts(), 4);
//! # Ok::<(), weft_moe::Error>(())
//! ```
//!
//! # Crate features
//! * `serde`: [`MoeOptions`] — a job's mixture-of-experts settings, the
//!   `[model.moe]` table of `weft train` — and its choices ([`Gate`],
//!   [`DropPolicy`], [`Balance`]) (de)serialize.
//!
//! Expert parallelism runs over any
//! [`Communicator`](weft_collectives::Communicator) backend (threads by
//! default; MPI and NCCL behind weft-collectives' features).
#![deny(missing_docs)]

mod audit;
mod balance;
mod block;
mod ep;
mod error;
mod options;
mod router;
mod stats;

/// The collectives crate that expert parallelism runs over, re-exported so
/// that dependents (weft-model's `MoeFfn`) name the same
/// [`Communicator`](weft_collectives::Communicator) without a direct
/// dependency.
pub use weft_collectives;

pub use audit::{
    AuditOptions, AuditReport, MAX_AUDIT_LOGITS, MAX_AUDIT_TRIALS, Perturbation,
    PerturbationResult, audit, audit_suite,
};
pub use balance::{AuxLoss, AuxScope, BiasBalancer};
pub use block::{Expert, MoeBlock, MoeConfig, MoeForward, TensorSpec};
pub use ep::{EpSaved, ExpertParallel};
pub use error::{Error, Result};
pub use options::{Balance, MoeOptions};
pub use router::{DROPPED, DropPolicy, Gate, Router, RouterKind, Routing};
pub use stats::LoadStats;
