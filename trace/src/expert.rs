//! The expert-load record: one line of a run's `expert_load.jsonl`.

use serde::{Deserialize, Serialize};

/// How many tokens each expert of one MoE layer received in one step.
///
/// Serialized as one JSON object per line of `expert_load.jsonl`:
///
/// | key | type | meaning |
/// |---|---|---|
/// | `step` | integer | optimizer step, counted from 1 |
/// | `layer` | integer | index of the transformer block (0-based) |
/// | `tokens_per_expert` | array of integers | `tokens_per_expert[e]`: token–expert assignments expert `e` processed (kept after capacity), summed over the step's global batch |
/// | `dropped` | integer | token–expert assignments the router chose but capacity dropped |
/// | `router_entropy` | number or string, optional | mean over the step's tokens of the entropy of the router's probability distribution over experts, in nats (see below) |
///
/// With top-k routing a token counts once for each of its k experts, so
/// `sum(tokens_per_expert) + dropped = k × tokens`. Unknown keys are
/// ignored when reading.
///
/// **Router entropy.** For token `t` let `q_t` be the router's probability
/// distribution over the E experts: `softmax(logits_t)` for softmax gates,
/// and for sigmoid gates the scores normalised over all experts,
/// `σ(logits_t,e) / Σ_j σ(logits_t,j)` (the same `q` the auxiliary loss
/// averages). The selection bias of auxiliary-loss-free balancing is *not*
/// included: `q` is what the router's weights say, not what the balancer
/// picked. Then `router_entropy = (1/N) Σ_t −Σ_e q_t,e ln q_t,e` over the
/// step's `N` tokens (all micro-batches and ranks; terms with `q = 0`
/// count 0). It lies in `[0, ln E]`: `ln E` when every token's router is
/// uniform, 0 when every token's router is certain. It does not say
/// whether the load is balanced (a uniform router is maximally uncertain
/// and perfectly balanced; confident routers can be balanced too), so read
/// it next to MaxVio: a router entropy collapsing towards 0 while MaxVio
/// grows is routing collapse. The key is absent in logs written before it
/// existed (read as `None`); non-finite values are written as the strings
/// `"NaN"`, `"Infinity"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertLoadRecord {
    /// Optimizer step, counted from 1.
    pub step: u64,
    /// Transformer block index (0-based).
    pub layer: u32,
    /// Kept assignments per expert; its length is the number of experts.
    pub tokens_per_expert: Vec<u64>,
    /// Assignments dropped by capacity.
    pub dropped: u64,
    /// Mean per-token router entropy in nats (see the type's docs); `None`
    /// when not recorded (older logs, or a step that routed no token).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::float::option"
    )]
    pub router_entropy: Option<f64>,
}

impl ExpertLoadRecord {
    /// Number of experts in the layer.
    #[must_use]
    pub fn num_experts(&self) -> usize {
        self.tokens_per_expert.len()
    }

    /// Assignments kept, over all experts.
    #[must_use]
    pub fn kept(&self) -> u64 {
        self.tokens_per_expert.iter().sum()
    }

    /// Fraction of the router's assignments that were dropped (0 when there
    /// were none).
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn drop_fraction(&self) -> f64 {
        let total = self.kept() + self.dropped;
        if total == 0 {
            0.0
        } else {
            self.dropped as f64 / total as f64
        }
    }

    /// Load of the busiest expert over the mean load (1 is perfect balance,
    /// `num_experts` is everything on one expert); `None` when no expert
    /// received a token.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn max_over_mean(&self) -> Option<f64> {
        let kept = self.kept();
        let max = *self.tokens_per_expert.iter().max()?;
        if kept == 0 {
            return None;
        }
        Some(max as f64 * self.num_experts() as f64 / kept as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn line_format_is_the_documented_schema() {
        let r = ExpertLoadRecord {
            step: 3,
            layer: 1,
            tokens_per_expert: vec![10, 0, 6],
            dropped: 4,
            router_entropy: None,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"step":3,"layer":1,"tokens_per_expert":[10,0,6],"dropped":4}"#
        );
        assert_eq!(r.kept(), 16);
        assert_eq!(r.drop_fraction(), 0.2);
        assert_eq!(r.max_over_mean(), Some(10.0 * 3.0 / 16.0));
    }

    #[test]
    fn empty_layers_have_no_imbalance() {
        let r = ExpertLoadRecord {
            step: 1,
            layer: 0,
            tokens_per_expert: vec![0, 0],
            dropped: 0,
            router_entropy: None,
        };
        assert_eq!(r.max_over_mean(), None);
        assert_eq!(r.drop_fraction(), 0.0);
    }

    #[test]
    fn negative_counts_are_rejected() {
        let err = serde_json::from_str::<ExpertLoadRecord>(
            r#"{"step":1,"layer":0,"tokens_per_expert":[1,-2],"dropped":0}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("-2"), "{err}");
    }

    #[test]
    fn router_entropy_is_optional_and_round_trips() {
        // A line written before the key existed still parses.
        let old: ExpertLoadRecord =
            serde_json::from_str(r#"{"step":2,"layer":0,"tokens_per_expert":[3,1],"dropped":0}"#)
                .unwrap();
        assert_eq!(old.router_entropy, None);
        let r = ExpertLoadRecord {
            router_entropy: Some(0.25),
            ..old.clone()
        };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"step":2,"layer":0,"tokens_per_expert":[3,1],"dropped":0,"router_entropy":0.25}"#
        );
        assert_eq!(serde_json::from_str::<ExpertLoadRecord>(&line).unwrap(), r);
        // A diverged router's NaN survives the trip.
        let nan = ExpertLoadRecord {
            router_entropy: Some(f64::NAN),
            ..old
        };
        let line = serde_json::to_string(&nan).unwrap();
        assert!(line.ends_with(r#""router_entropy":"NaN"}"#), "{line}");
        let back: ExpertLoadRecord = serde_json::from_str(&line).unwrap();
        assert!(back.router_entropy.unwrap().is_nan());
        let err = serde_json::from_str::<ExpertLoadRecord>(
            r#"{"step":1,"layer":0,"tokens_per_expert":[],"dropped":0,"router_entropy":"high"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("high"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn round_trips(step in any::<u64>(), layer in any::<u32>(),
                       load in proptest::collection::vec(any::<u64>(), 0..40), dropped in any::<u64>(),
                       router_entropy in proptest::option::of(0.0f64..10.0)) {
            let r = ExpertLoadRecord { step, layer, tokens_per_expert: load, dropped, router_entropy };
            let back: ExpertLoadRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
            prop_assert_eq!(back, r);
        }
    }
}
