//! The metrics record: one line of a run's `metrics.jsonl`.

use serde::{Deserialize, Serialize};

/// What the trainer logs after each optimizer step.
///
/// Serialized as one JSON object per line of `metrics.jsonl`:
///
/// | key | type | meaning |
/// |---|---|---|
/// | `step` | integer | optimizer step, counted from 1 |
/// | `loss` | number or string | mean training loss over the step's global batch (nats/token) |
/// | `lr` | number or string | learning rate used for the step |
/// | `grad_norm` | number or string | global L2 norm of the gradient, before clipping |
/// | `tokens_per_s` | number or string | training throughput over the step, in tokens per second |
/// | `time_s` | number or string | wall-clock seconds since the run (or resumed run) started |
/// | `loss_scale` | number, optional | the loss scale of the step's backward (dynamic loss scaling, fp16 runs only) |
/// | `mfu` | number or string, optional | model FLOP/s utilisation of the step: training FLOPs per token × tokens/s over the machine's matmul peak |
/// | `max_vio` | number or string, optional | mixture of experts: the step's MaxVio, (max − mean)/mean tokens per expert averaged over the expert layers |
/// | `rss_bytes` | integer, optional | resident memory of the process that writes the log after the step (Linux; every thread rank of that process together) |
///
/// Non-finite values — a diverging loss is the reason this log exists — are
/// written as the strings `"NaN"`, `"Infinity"` and `"-Infinity"`, since
/// JSON has no literal for them; `null` reads back as NaN. Unknown keys are
/// ignored when reading, so later versions may add fields.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// Optimizer step, counted from 1.
    pub step: u64,
    /// Mean training loss of the step (nats per token).
    #[serde(with = "crate::float")]
    pub loss: f64,
    /// Learning rate used for the step.
    #[serde(with = "crate::float")]
    pub lr: f64,
    /// Global gradient L2 norm before clipping.
    #[serde(with = "crate::float")]
    pub grad_norm: f64,
    /// Throughput of the step, tokens per second.
    #[serde(with = "crate::float")]
    pub tokens_per_s: f64,
    /// Wall-clock seconds since the run started.
    #[serde(with = "crate::float")]
    pub time_s: f64,
    /// The loss scale the step's backward ran with, in runs with dynamic
    /// loss scaling (fp16); absent (and not written) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Model FLOP/s utilisation of the step (absent in older logs).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::float::option"
    )]
    pub mfu: Option<f64>,
    /// The step's MaxVio averaged over the expert layers (mixture of
    /// experts only).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::float::option"
    )]
    pub max_vio: Option<f64>,
    /// Resident memory of the writing process after the step, in bytes
    /// (where the system tells it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
}

impl MetricsRecord {
    /// Whether every number of the record is finite (the health check a
    /// supervisor applies before trusting a step).
    #[must_use]
    pub fn is_finite(&self) -> bool {
        [
            self.loss,
            self.lr,
            self.grad_norm,
            self.tokens_per_s,
            self.time_s,
        ]
        .iter()
        .all(|x| x.is_finite())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rec(loss: f64) -> MetricsRecord {
        MetricsRecord {
            step: 12,
            loss,
            lr: 3e-4,
            grad_norm: 0.75,
            tokens_per_s: 1010.0,
            time_s: 61.25,
            loss_scale: None,
            mfu: None,
            max_vio: None,
            rss_bytes: None,
        }
    }

    #[test]
    fn line_format_is_the_documented_schema() {
        let line = serde_json::to_string(&rec(2.5)).unwrap();
        assert_eq!(
            line,
            r#"{"step":12,"loss":2.5,"lr":0.0003,"grad_norm":0.75,"tokens_per_s":1010.0,"time_s":61.25}"#
        );
        let scaled = MetricsRecord {
            loss_scale: Some(32768.0),
            ..rec(2.5)
        };
        let line = serde_json::to_string(&scaled).unwrap();
        assert!(
            line.ends_with(r#","time_s":61.25,"loss_scale":32768.0}"#),
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<MetricsRecord>(&line).unwrap(),
            scaled
        );
    }

    #[test]
    fn a_diverged_step_survives_the_round_trip() {
        let r = rec(f64::NAN);
        assert!(!r.is_finite());
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.contains(r#""loss":"NaN""#), "{line}");
        let back: MetricsRecord = serde_json::from_str(&line).unwrap();
        assert!(back.loss.is_nan());
        assert!(rec(1.0).is_finite());
    }

    #[test]
    fn unknown_keys_are_ignored_and_missing_keys_are_named() {
        let back: MetricsRecord = serde_json::from_str(
            r#"{"step":1,"loss":1,"lr":0,"grad_norm":0,"tokens_per_s":0,"time_s":0,"mfu":0.4}"#,
        )
        .unwrap();
        assert_eq!(back.step, 1);
        let err = serde_json::from_str::<MetricsRecord>(r#"{"step":1,"loss":1}"#).unwrap_err();
        assert!(err.to_string().contains("lr"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn any_record_round_trips_bitwise(
            step in any::<u64>(), loss in any::<f64>(), lr in any::<f64>(),
            g in any::<f64>(), tps in any::<f64>(), t in any::<f64>(),
        ) {
            let r = MetricsRecord { step, loss, lr, grad_norm: g, tokens_per_s: tps, time_s: t, loss_scale: None, mfu: None, max_vio: None, rss_bytes: None };
            let back: MetricsRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
            prop_assert_eq!(back.step, r.step);
            for (a, b) in [(back.loss, loss), (back.lr, lr), (back.grad_norm, g),
                           (back.tokens_per_s, tps), (back.time_s, t)] {
                // NaN payloads are not preserved; every other value is, bit for bit.
                prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
            }
        }
    }
}
