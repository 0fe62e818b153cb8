//! A job's pipelines in one trace: every rank's measured timeline of a
//! step, assembled per pipeline, with the bubble of each step and its mean
//! over a run beside the simulator's prediction.
//!
//! A job of `world` ranks with `pp` stages runs `world / pp` pipelines side
//! by side (one per coordinate off the pipeline axis): world rank
//! `s · (world / pp) + q` holds stage `s` of pipeline `q`, the mesh's
//! order with the pipeline outermost. [`step_trace`] turns one step's
//! [`RankTimeline`]s of every rank into Chrome trace events whose
//! processes are world ranks; [`BubbleLog`] keeps the per-step bubbles of
//! a run and writes them into the trace's `otherData`, where viewers
//! (weft's own, Perfetto) find them.

use std::collections::BTreeMap;

use weft_trace::{ArgValue, Phase, TraceEvent};

use crate::execute::{Measured, RankTimeline};
use crate::schedule::Schedule;

/// The bubble of one step of pipeline 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepBubble {
    /// The stages' idle time within the step's own window over
    /// `p × makespan` ([`Timeline::bubble_fraction`](crate::Timeline::bubble_fraction)),
    /// so the time between steps is not bubble.
    pub fraction: f64,
    /// The step's makespan, microseconds.
    pub makespan_us: f64,
    /// The simulator's bubble for the schedule with the step's measured
    /// mean costs, when asked for.
    pub predicted: Option<f64>,
}

/// One step of a job's pipelines as trace events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTrace {
    /// The events, processes being world ranks.
    pub events: Vec<TraceEvent>,
    /// Pipeline 0's bubble (`pp > 1`).
    pub bubble: Option<StepBubble>,
    /// The schedule's description (`schedule`, `stages`, `microbatches`,
    /// `chunks`) for the trace's `otherData` (`pp > 1`).
    pub other_data: BTreeMap<String, ArgValue>,
}

/// One step of every pipeline of a job: `timelines` holds every world
/// rank's [`RankTimeline`] in rank order, measured `offset_us` after the
/// run's time origin, as step `step` (written into each slice's
/// `args.step`). With `first`, the processes are named (`name(rank)`),
/// sorted by rank and labelled with their stage. With `predict`, pipeline
/// 0's measured costs are simulated for the predicted bubble.
///
/// # Errors
/// A timeline missing for a rank, or one the schedule does not fit.
#[allow(clippy::too_many_arguments)]
pub fn step_trace(
    schedule: &Schedule,
    timelines: Vec<RankTimeline>,
    pp: usize,
    offset_us: f64,
    step: u64,
    first: bool,
    predict: bool,
    name: &dyn Fn(usize) -> String,
) -> crate::Result<StepTrace> {
    let world = timelines.len();
    let missing = |what: String| crate::Error::InvalidParameter {
        name: "rank timelines",
        value: what,
        expected: format!("one per rank of a world of {world} with pp = {pp}"),
    };
    if pp == 0 || !world.is_multiple_of(pp) {
        return Err(missing(format!("{world} timelines")));
    }
    let per_stage = world / pp;
    let mut by_rank: Vec<Option<RankTimeline>> = timelines.into_iter().map(Some).collect();
    let mut out = StepTrace::default();
    for q in 0..per_stage {
        let ranks: Vec<usize> = (0..pp).map(|s| s * per_stage + q).collect();
        let stages = ranks
            .iter()
            .map(|&r| by_rank[r].take())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| missing(format!("pipeline {q}: a rank's timeline is missing")))?;
        let measured = Measured::new(schedule, stages)?;
        let exported = measured.to_trace();
        if q == 0 && pp > 1 {
            let predicted = if predict {
                Some(measured.predicted(schedule)?.bubble_fraction())
            } else {
                None
            };
            out.bubble = Some(StepBubble {
                fraction: measured.timeline.bubble_fraction(),
                makespan_us: measured.timeline.makespan() * 1e6,
                predicted,
            });
            for key in ["schedule", "stages", "microbatches", "chunks"] {
                if let Some(v) = exported.other_data.get(key) {
                    out.other_data.insert(key.to_owned(), v.clone());
                }
            }
        }
        for mut e in exported.trace_events {
            let rank = ranks[usize::try_from(e.pid).unwrap_or(0).min(ranks.len() - 1)];
            e.pid = rank as u64;
            if e.ph == Phase::Complete {
                e.ts += offset_us;
                e.args.insert("step".to_owned(), step.into());
            } else if !first {
                continue;
            } else if e.name == "process_name" {
                e = TraceEvent::process_name(e.pid, name(rank));
            } else if e.name == "process_sort_index" {
                // ranks in mesh order: pp, then dp, then tp
                e = TraceEvent::process_sort_index(e.pid, i64::try_from(rank).unwrap_or(i64::MAX));
                out.events.push(TraceEvent::process_labels(
                    e.pid,
                    format!("pp {}", rank / per_stage),
                ));
            }
            out.events.push(e);
        }
    }
    Ok(out)
}

/// The bubbles of a run's traced steps: each step's, and the means over
/// the steps after the first (which is warm-up).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BubbleLog {
    /// `(step, bubble, makespan µs, averaged)` per traced step.
    steps: Vec<(u64, f64, f64, bool)>,
    /// Sums of the measured and predicted bubbles of the averaged steps.
    sum: (f64, f64, usize),
}

impl BubbleLog {
    /// Records step `step`'s bubble; `averaged` steps count towards the
    /// means (give them a prediction).
    pub fn record(&mut self, step: u64, bubble: &StepBubble, averaged: bool) {
        self.steps
            .push((step, bubble.fraction, bubble.makespan_us, averaged));
        if averaged {
            self.sum.0 += bubble.fraction;
            self.sum.1 += bubble.predicted.unwrap_or(f64::NAN);
            self.sum.2 += 1;
        }
    }

    /// The mean measured and predicted bubble over the averaged steps, if
    /// any.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn mean(&self) -> Option<(f64, f64)> {
        let (m, p, n) = self.sum;
        (n > 0).then(|| (m / n as f64, p / n as f64))
    }

    /// Whether no step was recorded.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Writes the log into a trace's `otherData`: `bubble_fraction` and
    /// `bubble_predicted` (the means), `bubble_steps` (the steps they
    /// average) and `step_bubble_fractions`, one `{step,
    /// bubble_fraction, makespan_us}` per traced step.
    pub fn write_other_data(&self, other: &mut BTreeMap<String, ArgValue>) {
        if self.steps.is_empty() {
            return;
        }
        if let Some((measured, predicted)) = self.mean() {
            other.insert("bubble_fraction".into(), measured.into());
            other.insert("bubble_predicted".into(), predicted.into());
            let averaged = self.steps.iter().filter(|s| s.3).map(|s| s.0.into());
            other.insert("bubble_steps".into(), ArgValue::List(averaged.collect()));
        }
        let per_step = self.steps.iter().map(|&(step, bubble, makespan_us, _)| {
            let fields = [
                ("step", step.into()),
                ("bubble_fraction", bubble.into()),
                ("makespan_us", makespan_us.into()),
            ];
            ArgValue::Map(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
        });
        other.insert(
            "step_bubble_fractions".into(),
            ArgValue::List(per_step.collect()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_averages_the_steps_after_warm_up() {
        let mut log = BubbleLog::default();
        let b = |fraction, predicted| StepBubble {
            fraction,
            makespan_us: 100.0,
            predicted,
        };
        log.record(1, &b(0.9, None), false);
        log.record(2, &b(0.2, Some(0.1)), true);
        log.record(3, &b(0.4, Some(0.3)), true);
        let (m, p) = log.mean().unwrap();
        assert!((m - 0.3).abs() < 1e-12 && (p - 0.2).abs() < 1e-12);
        let mut other = BTreeMap::new();
        log.write_other_data(&mut other);
        assert_eq!(
            other["bubble_steps"],
            ArgValue::List(vec![2u64.into(), 3u64.into()])
        );
        assert!(matches!(&other["step_bubble_fractions"], ArgValue::List(v) if v.len() == 3));
    }
}
