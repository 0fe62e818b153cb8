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
///
/// With top-k routing a token counts once for each of its k experts, so
/// `sum(tokens_per_expert) + dropped = k × tokens`. Unknown keys are
/// ignored when reading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLoadRecord {
    /// Optimizer step, counted from 1.
    pub step: u64,
    /// Transformer block index (0-based).
    pub layer: u32,
    /// Kept assignments per expert; its length is the number of experts.
    pub tokens_per_expert: Vec<u64>,
    /// Assignments dropped by capacity.
    pub dropped: u64,
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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn round_trips(step in any::<u64>(), layer in any::<u32>(),
                       load in proptest::collection::vec(any::<u64>(), 0..40), dropped in any::<u64>()) {
            let r = ExpertLoadRecord { step, layer, tokens_per_expert: load, dropped };
            let back: ExpertLoadRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
            prop_assert_eq!(back, r);
        }
    }
}
