//! The events of a run, typed: the health and evaluation lines of
//! `metrics.jsonl` ([`MetricsEvent`]) and every line of `events.jsonl`
//! ([`RunEvent`]: what the supervisor saw — starts, failures, restarts,
//! the end — and what the ranks did about faults — rewinds, stragglers,
//! drilled faults firing).
//!
//! Both are JSON objects with an `event` key naming the kind; the other
//! keys are the kind's fields. Non-finite numbers are written as strings
//! (`"NaN"`, see [`crate::float`]) and `null` reads back as NaN. A kind a
//! reader does not know reads as [`EventKind::Unknown`] (or
//! [`MetricsEventKind::Unknown`]), so older readers skip newer kinds.

use serde::{Deserialize, Serialize};

/// A line of `metrics.jsonl` other than a [`MetricsRecord`](crate::MetricsRecord):
/// an evaluation or a health event of step `step`.
///
/// ```
/// use weft_trace::{MetricsEvent, MetricsEventKind};
///
/// let e = MetricsEvent { step: 7, kind: MetricsEventKind::Skip { loss: f64::NAN, grad_norm: 3.0 } };
/// let line = serde_json::to_string(&e).unwrap();
/// assert_eq!(line, r#"{"step":7,"event":"skip","loss":"NaN","grad_norm":3.0}"#);
/// let back: MetricsEvent = serde_json::from_str(&line).unwrap();
/// assert!(matches!(back.kind, MetricsEventKind::Skip { loss, .. } if loss.is_nan()));
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsEvent {
    /// The step it concerns (0: before training, for an evaluation).
    pub step: u64,
    /// What happened.
    #[serde(flatten)]
    pub kind: MetricsEventKind,
}

/// The kinds of [`MetricsEvent`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum MetricsEventKind {
    /// The validation loss after the step.
    Eval {
        /// Mean validation loss, nats per token.
        #[serde(with = "crate::float")]
        val_loss: f64,
        /// The data's loss floor, where known.
        #[serde(default, with = "crate::float::option")]
        floor: Option<f64>,
    },
    /// A non-finite loss or gradient: the update was skipped.
    Skip {
        /// The step's loss.
        #[serde(with = "crate::float")]
        loss: f64,
        /// The gradient norm.
        #[serde(with = "crate::float")]
        grad_norm: f64,
    },
    /// Dynamic loss scaling: the scaled gradients overflowed, the update
    /// was skipped and the scale backed off.
    Overflow {
        /// The step's loss.
        #[serde(with = "crate::float")]
        loss: f64,
        /// The loss scale of the step's backward.
        #[serde(with = "crate::float")]
        loss_scale: f64,
        /// The scale of the next step.
        #[serde(with = "crate::float")]
        next_loss_scale: f64,
    },
    /// The loss jumped above a factor of the rolling median.
    Spike {
        /// The step's loss.
        #[serde(with = "crate::float")]
        loss: f64,
        /// The median of the recent window.
        #[serde(with = "crate::float")]
        median: f64,
        /// The data the step read.
        batch: BatchPosition,
    },
    /// A kind this reader does not know.
    #[serde(other)]
    Unknown,
}

/// Where a step's data lies: the step that reads it in a run without
/// skipped batches, and the micro-batches of a global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchPosition {
    /// The 0-based step that reads the batch in a run without skips.
    pub step: u64,
    /// Micro-batches of the global batch.
    pub micro_batches: usize,
}

impl MetricsEventKind {
    /// The `event` value this kind is written with.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            MetricsEventKind::Eval { .. } => "eval",
            MetricsEventKind::Skip { .. } => "skip",
            MetricsEventKind::Overflow { .. } => "overflow",
            MetricsEventKind::Spike { .. } => "spike",
            MetricsEventKind::Unknown => "unknown",
        }
    }
}

/// One line of `events.jsonl`: when (seconds since the Unix epoch), and
/// what.
///
/// ```
/// use weft_trace::{EventKind, RunEvent};
///
/// let e = RunEvent { time: 1.5, kind: EventKind::Rewound { step: 30 } };
/// let line = serde_json::to_string(&e).unwrap();
/// assert_eq!(line, r#"{"time":1.5,"event":"rewound","step":30}"#);
/// assert_eq!(serde_json::from_str::<RunEvent>(&line).unwrap(), e);
/// let newer: RunEvent = serde_json::from_str(r#"{"time":2,"event":"from_the_future","x":1}"#).unwrap();
/// assert_eq!(newer.kind, EventKind::Unknown);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// Seconds since the Unix epoch.
    #[serde(with = "crate::float")]
    pub time: f64,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

/// The kinds of [`RunEvent`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// The supervisor started an attempt of the job.
    Start {
        /// The attempt, from 0.
        attempt: u32,
        /// Whether it continues from a checkpoint.
        resume: bool,
        /// The child's (or the launcher's) process id.
        pid: u32,
        /// Its data-parallel degree.
        dp: usize,
        /// Its ranks.
        ranks: usize,
    },
    /// The attempt has built, restored and is about to train (the
    /// restart's cost ends here).
    Running {
        /// The attempt.
        attempt: u32,
        /// The step it starts from.
        step: u64,
        /// Seconds since it was started.
        #[serde(with = "crate::float")]
        after_s: f64,
    },
    /// The attempt failed.
    Failure {
        /// The attempt.
        attempt: u32,
        /// How: an exit status, a signal, or a stopped heartbeat.
        failure: String,
        /// The failed rank, where known.
        rank: Option<usize>,
        /// Its host, where known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host: Option<String>,
        /// The last step any rank finished.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_step: Option<u64>,
        /// Seconds the attempt ran.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            with = "crate::float::option"
        )]
        ran_s: Option<f64>,
        /// The first attempt failed before training (a set-up error: not
        /// restarted).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        before_training: bool,
    },
    /// The supervisor restarted the job.
    Restart {
        /// The new attempt.
        attempt: u32,
        /// The checkpoint it resumes from (`None`: from the start).
        from_checkpoint_step: Option<u64>,
        /// Newer checkpoints that did not verify, each with why.
        unverified_checkpoints: Vec<String>,
        /// Steps trained since that checkpoint, to train again.
        lost_steps: u64,
        /// Who took the failed rank's place.
        action: String,
        /// The data-parallel degree it runs on.
        dp: usize,
        /// Its ranks.
        ranks: usize,
        /// Spare ranks left (`None`: no spares managed).
        spares_left: Option<u32>,
        /// Hosts left out of the hostfile.
        excluded_hosts: Vec<String>,
    },
    /// The job finished.
    Finished {
        /// The last attempt.
        attempt: u32,
        /// Restarts made.
        restarts: u32,
        /// The data-parallel degree it ended on.
        dp: usize,
    },
    /// The job stopped as asked (a signal), resumable.
    Stopped {
        /// The last attempt.
        attempt: u32,
        /// Restarts made.
        restarts: u32,
        /// The data-parallel degree it ended on.
        dp: usize,
    },
    /// An injected fault fired (a drill).
    Fault {
        /// The fault, as `--inject` spells it.
        fault: String,
        /// The rank it fired on.
        rank: usize,
    },
    /// The run went back to a checkpoint, leaving batches out.
    Rewind {
        /// The step (from 1) that made the rewind.
        step: u64,
        /// What was wrong.
        reason: String,
        /// The checkpoint's step it went back to (0: the start).
        to_step: u64,
        /// The batches left out from now on, by the step (from 1) that
        /// reads them in a run without skips.
        skipped_batches: Vec<u64>,
        /// Rewinds made so far.
        rewinds: u32,
    },
    /// A rewound run has rebuilt and restored, and trains again.
    Rewound {
        /// The step it continues from.
        step: u64,
    },
    /// A rank computed slower than its peers over two windows in a row.
    Straggler {
        /// The step (from 1) that ended the second window.
        step: u64,
        /// The world rank.
        rank: usize,
        /// Its work time over the window divided by its peers' median.
        #[serde(with = "crate::float")]
        ratio: f64,
        /// Steps per window.
        window_steps: u64,
    },
    /// A checkpoint was committed (written when the loop learns it: for
    /// a background save, when the next save starts or the run ends).
    Checkpoint {
        /// Its step.
        step: u64,
        /// Whether it was written in the background while training went
        /// on (else every rank stopped for the whole write).
        background: bool,
        /// Seconds the training loop stood still for it: the host copy,
        /// and for a synchronous save the write.
        #[serde(with = "crate::float")]
        stall_s: f64,
        /// Of those, seconds waiting for the previous save to end.
        #[serde(with = "crate::float")]
        waited_s: f64,
        /// Seconds from the start of the write to the commit (and
        /// retention).
        #[serde(with = "crate::float")]
        write_s: f64,
        /// Bytes of world rank 0's host copy (parameters and optimizer
        /// state it writes).
        bytes: u64,
    },
    /// A kind this reader does not know.
    #[serde(other)]
    Unknown,
}

impl EventKind {
    /// The `event` value this kind is written with.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Start { .. } => "start",
            EventKind::Running { .. } => "running",
            EventKind::Failure { .. } => "failure",
            EventKind::Restart { .. } => "restart",
            EventKind::Finished { .. } => "finished",
            EventKind::Stopped { .. } => "stopped",
            EventKind::Fault { .. } => "fault",
            EventKind::Rewind { .. } => "rewind",
            EventKind::Rewound { .. } => "rewound",
            EventKind::Straggler { .. } => "straggler",
            EventKind::Checkpoint { .. } => "checkpoint",
            EventKind::Unknown => "unknown",
        }
    }

    /// The training step the event belongs to on a step axis: the step it
    /// names, else the last step a failed attempt finished, else the
    /// checkpoint a restart goes back to; `None` for an attempt's start
    /// and the end.
    #[must_use]
    pub fn step(&self) -> Option<u64> {
        match self {
            EventKind::Running { step, .. }
            | EventKind::Rewind { step, .. }
            | EventKind::Rewound { step }
            | EventKind::Straggler { step, .. }
            | EventKind::Checkpoint { step, .. } => Some(*step),
            EventKind::Failure { last_step, .. } => *last_step,
            EventKind::Restart {
                from_checkpoint_step,
                ..
            } => *from_checkpoint_step,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines weft has always written read into the typed events, and
    /// the typed events write the same keys back.
    #[test]
    fn lines_of_earlier_runs_read_and_write_back() {
        let lines = [
            r#"{"time":1.0,"event":"start","attempt":0,"resume":false,"pid":42,"dp":2,"ranks":2}"#,
            r#"{"time":2.0,"event":"running","attempt":0,"step":0,"after_s":0.5}"#,
            r#"{"time":3.0,"event":"fault","fault":"kill:step=5,rank=1","rank":1}"#,
            r#"{"time":4.0,"event":"failure","attempt":0,"failure":"signal 9","rank":1,"host":"vm","last_step":4,"ran_s":3.0}"#,
            r#"{"time":5.0,"event":"restart","attempt":1,"from_checkpoint_step":2,"unverified_checkpoints":[],"lost_steps":2,"action":"same layout","dp":2,"ranks":2,"spares_left":null,"excluded_hosts":[]}"#,
            r#"{"time":6.0,"event":"rewind","step":9,"reason":"loss 9.0 > 2 × 3.0","to_step":5,"skipped_batches":[9],"rewinds":1}"#,
            r#"{"time":7.0,"event":"rewound","step":5}"#,
            r#"{"time":8.0,"event":"straggler","step":40,"rank":1,"ratio":2.5,"window_steps":20}"#,
            r#"{"time":9.0,"event":"finished","attempt":1,"restarts":1,"dp":2}"#,
            r#"{"time":9.5,"event":"checkpoint","step":40,"background":true,"stall_s":0.25,"waited_s":0.0,"write_s":3.5,"bytes":1024}"#,
        ];
        for line in lines {
            let e: RunEvent = serde_json::from_str(line).unwrap();
            assert_ne!(e.kind, EventKind::Unknown, "{line}");
            assert_eq!(serde_json::to_string(&e).unwrap(), line);
        }
        // earlier writers sorted the keys
        let sorted: RunEvent = serde_json::from_str(
            r#"{"attempt":1,"dp":2,"event":"finished","restarts":1,"time":9.0}"#,
        )
        .unwrap();
        assert_eq!(
            sorted.kind,
            EventKind::Finished {
                attempt: 1,
                restarts: 1,
                dp: 2
            }
        );
        let failed: RunEvent = serde_json::from_str(
            r#"{"time":1,"event":"failure","attempt":0,"failure":"exit status 1","rank":null,"before_training":true}"#,
        )
        .unwrap();
        assert!(matches!(
            failed.kind,
            EventKind::Failure {
                before_training: true,
                ..
            }
        ));
        let metrics = [
            r#"{"step":0,"event":"eval","val_loss":2.5,"floor":1.5}"#,
            r#"{"step":3,"event":"skip","loss":"NaN","grad_norm":"Infinity"}"#,
            r#"{"step":4,"event":"overflow","loss":2.0,"loss_scale":65536.0,"next_loss_scale":32768.0}"#,
            r#"{"step":5,"event":"spike","loss":9.0,"median":3.0,"batch":{"step":4,"micro_batches":8}}"#,
        ];
        for line in metrics {
            let e: MetricsEvent = serde_json::from_str(line).unwrap();
            assert_eq!(serde_json::to_string(&e).unwrap(), line);
        }
        // the null an earlier writer left for a NaN loss reads as NaN
        let old: MetricsEvent =
            serde_json::from_str(r#"{"step":3,"event":"skip","loss":null,"grad_norm":null}"#)
                .unwrap();
        assert!(matches!(old.kind, MetricsEventKind::Skip { loss, .. } if loss.is_nan()));
        let none: MetricsEvent =
            serde_json::from_str(r#"{"step":0,"event":"eval","val_loss":2.5,"floor":null}"#)
                .unwrap();
        assert!(matches!(
            none.kind,
            MetricsEventKind::Eval { floor: None, .. }
        ));
    }
}
