//! One call from parameters to the bubble/makespan/memory table and the
//! trace: what `weft pipeline` prints and writes.

use std::fmt;

use weft_trace::Trace;

use crate::error::{Error, Result};
use crate::generate::ScheduleKind;
use crate::schedule::Schedule;
use crate::simulate::{Costs, Timeline, simulate, steady_state_period};
use crate::validate::validate;

/// Parameters of [`plan`], as a command line gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanRequest {
    /// Which schedule.
    pub kind: ScheduleKind,
    /// Stages `p`.
    pub stages: usize,
    /// Micro-batches `m`.
    pub microbatches: usize,
    /// Chunks per stage `v`; `None` for the kind's default.
    pub chunks: Option<usize>,
    /// Forward time of one stage (all its chunks) per micro-batch.
    pub forward: f64,
    /// Input-gradient backward time of one stage.
    pub backward_input: f64,
    /// Weight-gradient backward time of one stage.
    pub backward_weight: f64,
    /// Point-to-point latency.
    pub p2p_latency: f64,
    /// Microseconds per time unit in the trace (1000: a unit is 1 ms).
    pub us_per_unit: f64,
}

impl PlanRequest {
    /// A request with the paper's unit costs `F = B = W = 1`, no latency,
    /// the kind's default chunks, and 1 unit = 1 ms in the trace.
    #[must_use]
    pub fn new(kind: ScheduleKind, stages: usize, microbatches: usize) -> Self {
        Self {
            kind,
            stages,
            microbatches,
            chunks: None,
            forward: 1.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            p2p_latency: 0.0,
            us_per_unit: 1000.0,
        }
    }
}

/// What [`plan`] returns.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The request it answers.
    pub request: PlanRequest,
    /// The generated (and validated) schedule.
    pub schedule: Schedule,
    /// Its simulated timeline.
    pub timeline: Timeline,
    /// Iteration period with iterations back to back (no global sync).
    pub steady_state_period: f64,
    /// The paper's bubble formula for these parameters, where one exists.
    pub expected_bubble: Option<f64>,
    /// The timeline as Chrome trace events, ready for `trace.json`.
    pub trace: Trace,
}

/// Generate, validate and simulate a schedule from command-line style
/// parameters.
///
/// # Errors
/// [`Error::InvalidParameter`] naming the bad parameter (zero stages or
/// micro-batches, a chunk count the kind does not allow, `m` not a multiple
/// of `p` for interleaving, a negative or non-finite cost).
pub fn plan(request: &PlanRequest) -> Result<Plan> {
    let r = *request;
    if !(r.us_per_unit.is_finite() && r.us_per_unit > 0.0) {
        return Err(Error::InvalidParameter {
            name: "us_per_unit",
            value: r.us_per_unit.to_string(),
            expected: "a finite, positive number".into(),
        });
    }
    let v = r.chunks.unwrap_or_else(|| r.kind.default_chunks());
    let schedule = r.kind.generate(r.stages, r.microbatches, v)?;
    validate(&schedule)?;
    let costs = Costs::per_stage(
        &schedule,
        r.forward,
        r.backward_input,
        r.backward_weight,
        r.p2p_latency,
    );
    let timeline = simulate(&schedule, &costs)?;
    let steady_state_period = steady_state_period(&schedule, &costs)?;
    let expected_bubble = if r.p2p_latency == 0.0 {
        r.kind.expected_bubble(
            r.stages,
            r.microbatches,
            v,
            r.forward,
            r.backward_input,
            r.backward_weight,
        )
    } else {
        None
    };
    let trace = timeline.to_trace(r.us_per_unit);
    Ok(Plan {
        request: r,
        schedule,
        timeline,
        steady_state_period,
        expected_bubble,
        trace,
    })
}

impl Plan {
    /// The table `weft pipeline` prints.
    #[must_use]
    pub fn table(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.request;
        let t = &self.timeline;
        let pct = |x: f64| format!("{:.2}%", 100.0 * x);
        writeln!(
            f,
            "schedule {}: p = {} stages, m = {} micro-batches, v = {} chunk(s) per stage",
            r.kind,
            t.num_stages(),
            t.microbatches(),
            t.chunks()
        )?;
        writeln!(
            f,
            "costs per stage and micro-batch: F = {}, B = {}, W = {}, p2p latency = {}",
            r.forward, r.backward_input, r.backward_weight, r.p2p_latency
        )?;
        let mut line = format!(
            "makespan {:.3}   bubble {}",
            t.makespan(),
            pct(t.bubble_fraction())
        );
        // Qi et al. count ZB-H2's bubble with iterations back to back.
        let paper = |e: f64| format!(" (paper: {})", pct(e));
        let back_to_back = r.kind == ScheduleKind::ZbH2;
        if let (Some(e), false) = (self.expected_bubble, back_to_back) {
            line.push_str(&paper(e));
        }
        writeln!(f, "{line}")?;
        let mut line = format!(
            "back to back (no sync between iterations): period {:.3}, bubble {}",
            self.steady_state_period,
            pct(t.bubble_fraction_at_period(self.steady_state_period))
        );
        if let (Some(e), true) = (self.expected_bubble, back_to_back) {
            line.push_str(&paper(e));
        }
        writeln!(f, "{line}")?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>5}  {:>10}  {:>10}  {:>7}  {:>14}  {:>16}",
            "stage", "busy", "idle", "bubble", "peak in-flight", "peak activations"
        )?;
        let inflight = self.schedule.peak_in_flight();
        let mem = t.peak_memory();
        for s in 0..t.num_stages() {
            let bubble = if t.makespan() > 0.0 {
                t.idle(s) / t.makespan()
            } else {
                0.0
            };
            writeln!(
                f,
                "{:>5}  {:>10.3}  {:>10.3}  {:>7}  {:>14}  {:>16.3}",
                s,
                t.busy(s),
                t.idle(s),
                pct(bubble),
                inflight[s],
                mem[s]
            )?;
        }
        writeln!(
            f,
            "(in-flight: activation chunks alive, 1/v of a stage each; activations: in units of one stage's M_B)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1f1b_table_has_the_formula_and_every_stage() {
        let p = plan(&PlanRequest::new(ScheduleKind::OneFOneB, 4, 8)).unwrap();
        let text = p.table();
        assert!(text.contains("makespan 33.000"), "{text}");
        assert!(text.contains("bubble 27.27% (paper: 27.27%)"), "{text}");
        assert_eq!(
            text.lines()
                .filter(|l| l.trim_start().starts_with(char::is_numeric))
                .count(),
            4
        );
        assert!(!p.trace.trace_events.is_empty());
    }

    #[test]
    fn bad_parameters_become_errors() {
        let mut r = PlanRequest::new(ScheduleKind::Interleaved, 4, 6);
        let e = plan(&r).unwrap_err();
        assert!(e.to_string().contains("microbatches = 6"), "{e}");
        r.microbatches = 8;
        r.forward = f64::NAN;
        assert!(plan(&r).unwrap_err().to_string().contains("forward cost"));
        let r = PlanRequest {
            us_per_unit: 0.0,
            ..PlanRequest::new(ScheduleKind::GPipe, 2, 2)
        };
        assert!(plan(&r).is_err());
    }
}
