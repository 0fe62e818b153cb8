//! `summary.json`: a finished run's figures.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The figures `weft train` writes when a run finishes, and `weft
/// compare` and the visualizer read. Non-finite numbers are written as
/// strings (`"NaN"`, see [`crate::float`]); `null` reads back as NaN (or
/// `None`). Keys a reader does not know are ignored, and the optional
/// ones may be absent in runs written before they existed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The run folder.
    pub run_dir: PathBuf,
    /// Steps of the run.
    pub steps: u64,
    /// Steps whose update was skipped.
    pub skipped_steps: u64,
    /// Mean training loss of the last step.
    #[serde(with = "crate::float")]
    pub final_train_loss: f64,
    /// Validation loss at the end.
    #[serde(with = "crate::float")]
    pub final_eval_loss: f64,
    /// First validation loss (before training).
    #[serde(with = "crate::float")]
    pub initial_eval_loss: f64,
    /// The data's loss floor, if known.
    #[serde(default, with = "crate::float::option")]
    pub floor: Option<f64>,
    /// Mean training throughput, tokens per second.
    #[serde(with = "crate::float")]
    pub tokens_per_s: f64,
    /// Mean model FLOP/s.
    #[serde(with = "crate::float")]
    pub flops_per_s: f64,
    /// Mean utilisation of the peak.
    #[serde(with = "crate::float")]
    pub utilisation: f64,
    /// Wall-clock seconds.
    #[serde(with = "crate::float")]
    pub wall_s: f64,
    /// MaxVio of the last step (mixture-of-experts models).
    #[serde(default, with = "crate::float::option")]
    pub final_max_vio: Option<f64>,
    /// Pipeline runs: the measured bubble and the simulator's prediction.
    #[serde(default)]
    pub pipeline_bubble: Option<PipelineBubble>,
    /// Layouts of several ranks: the bytes a step sends on each parallel
    /// axis, every rank's together (mean over the steps of the run).
    #[serde(default)]
    pub traffic_per_step: Option<StepTraffic>,
    /// Mixed precision: bytes the products' rounded operand copies held
    /// at the end (every rank of a process together); 0 in fp32.
    #[serde(default)]
    pub operand_copy_bytes: u64,
    /// Memory of one rank (rank 0) by category.
    #[serde(default)]
    pub memory: MemoryBytes,
}

/// Measured and predicted pipeline bubble (fractions of the makespan).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineBubble {
    /// The schedule.
    pub schedule: String,
    /// Mean measured bubble fraction over the traced steps after the first.
    #[serde(with = "crate::float")]
    pub measured: f64,
    /// Mean bubble fraction the simulator predicts from the measured costs.
    #[serde(with = "crate::float")]
    pub predicted: f64,
}

/// Bytes per step of a run, by parallel axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTraffic {
    /// Activations and their gradients (tp, pp, ep), gradients and
    /// parameters (dp), the tied embedding (pp).
    pub payload: AxisBytes,
    /// The step's scalars: the losses and the gradient norm's partial sums.
    pub scalars: AxisBytes,
}

/// Bytes on each parallel axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AxisBytes {
    /// The tensor-parallel groups.
    pub tp: f64,
    /// The data-parallel groups (and FSDP's shard and replica groups).
    pub dp: f64,
    /// The pipeline groups.
    pub pp: f64,
    /// The context-parallel groups (ring attention's keys, values and
    /// their gradients; absent from summaries written before it).
    #[serde(default)]
    pub cp: f64,
    /// The expert groups.
    pub ep: f64,
    /// Groups of several axes.
    pub other: f64,
}

impl From<[f64; 6]> for AxisBytes {
    /// The bytes of `[tp, dp, pp, cp, ep, other]` (the order of
    /// `weft_parallel::TrafficAxis::ALL`).
    fn from([tp, dp, pp, cp, ep, other]: [f64; 6]) -> Self {
        AxisBytes {
            tp,
            dp,
            pp,
            cp,
            ep,
            other,
        }
    }
}

/// Bytes one rank holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBytes {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Activations and working buffers.
    pub activations: u64,
    /// Communication buffers.
    pub comm: u64,
}

impl MemoryBytes {
    /// Every category, in order, with its name.
    #[must_use]
    pub fn categories(&self) -> [(&'static str, u64); 5] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("comm", self.comm),
        ]
    }

    /// All of them.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.categories().iter().map(|c| c.1).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_round_trips_and_older_ones_read() {
        let s = Summary {
            run_dir: "runs/x".into(),
            steps: 10,
            skipped_steps: 1,
            final_train_loss: f64::NAN,
            final_eval_loss: 2.0,
            initial_eval_loss: 5.5,
            floor: Some(1.5),
            tokens_per_s: 1000.0,
            flops_per_s: 1e9,
            utilisation: 0.25,
            wall_s: 12.0,
            final_max_vio: None,
            pipeline_bubble: Some(PipelineBubble {
                schedule: "1f1b".into(),
                measured: 0.2,
                predicted: 0.18,
            }),
            traffic_per_step: None,
            operand_copy_bytes: 0,
            memory: MemoryBytes {
                params: 4,
                ..MemoryBytes::default()
            },
        };
        let text = serde_json::to_string_pretty(&s).unwrap();
        assert!(text.contains(r#""final_train_loss": "NaN""#), "{text}");
        let back: Summary = serde_json::from_str(&text).unwrap();
        assert!(back.final_train_loss.is_nan());
        assert_eq!(back.pipeline_bubble, s.pipeline_bubble);
        // an earlier run: NaN as null, no memory or copies
        let old = r#"{"run_dir":"r","steps":1,"skipped_steps":0,"final_train_loss":null,
            "final_eval_loss":1,"initial_eval_loss":2,"floor":null,"tokens_per_s":1,
            "flops_per_s":1,"utilisation":0.1,"wall_s":1,"final_max_vio":null,
            "pipeline_bubble":null,"traffic_per_step":null}"#;
        let old: Summary = serde_json::from_str(old).unwrap();
        assert!(old.final_train_loss.is_nan() && old.floor.is_none());
        assert_eq!(old.memory.total(), 0);
    }
}
