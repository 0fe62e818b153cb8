//! What the loop measures of each step beyond its loss: `trace.json` (every
//! rank's pipeline actions and receive waits, FSDP's compute,
//! communication and wait tracks, for the first `run.trace_steps` steps,
//! gathered on rank 0) with the pipeline bubble beside the simulator's
//! prediction, the bytes sent per parallel axis, and each rank's work time
//! for the straggler detector.

use std::path::Path;
use std::time::Instant;

use weft_collectives::Communicator;
use weft_model::StepTelemetry;
use weft_parallel::{ParallelDims, TrafficAxis};
use weft_pipeline::{BubbleLog, Schedule};
use weft_trace::{AxisBytes, PipelineBubble, StepTraffic, Trace, TraceEvent};

/// The parallel axes whose traffic a run counts.
const AXES: usize = TrafficAxis::ALL.len();

use crate::ranks::tags;
use crate::run::folder::io_err;
use crate::train::TrainError;

/// The run's trace, bubbles and traffic so far.
pub(crate) struct Tracer {
    /// The loop's time origin, the same on every rank.
    origin: Instant,
    dims: ParallelDims,
    /// Steps (counted from the attempt's first) whose timelines are traced.
    trace_steps: u64,
    trace: Trace,
    bubbles: BubbleLog,
    /// Bytes this rank sent per axis over the steps (payload, then
    /// scalars), and the steps counted.
    traffic: [f64; 2 * AXES],
    steps: u64,
}

/// The seconds of the step this rank spent working: the step less its
/// time blocked — in a pipeline's receives and FSDP's waits, or, without
/// either, in the collectives between the model's actions.
pub(crate) fn work_time(step_s: f64, in_step: f64, telemetry: &StepTelemetry) -> f64 {
    let compute: f64 = telemetry
        .timeline
        .as_ref()
        .map_or(in_step, |tl| tl.slots.iter().map(|s| s.end - s.start).sum());
    let fsdp_wait: Option<f64> = telemetry
        .fsdp
        .iter()
        .flatten()
        .map(|spans| spans.total(weft_fsdp::Track::Wait))
        .reduce(|a, b| a + b);
    let blocked = match fsdp_wait {
        Some(w) => {
            w + telemetry
                .timeline
                .as_ref()
                .map_or(0.0, |tl| tl.waits.iter().map(|(a, b)| b - a).sum())
        }
        None => in_step - compute.min(in_step),
    };
    step_s - blocked
}

impl Tracer {
    /// A tracer for a run of layout `dims`, its clock started at `origin`,
    /// tracing the first `trace_steps` steps of the attempt.
    pub(crate) fn new(origin: Instant, dims: ParallelDims, trace_steps: u64) -> Self {
        Self {
            origin,
            dims,
            trace_steps,
            trace: Trace::new(),
            bubbles: BubbleLog::default(),
            traffic: [0.0; 2 * AXES],
            steps: 0,
        }
    }

    /// Takes in step `step` (1-based; the `nth` of the attempt, from 0),
    /// started at `began`: its traffic, and while traced its lanes — every
    /// rank's timeline of `schedule` and FSDP spans, gathered on rank 0 —
    /// and pipeline 0's bubble. Collective over `world` while traced.
    ///
    /// # Errors
    /// A failed exchange; a timeline the schedule does not fit.
    pub(crate) fn step(
        &mut self,
        world: &dyn Communicator,
        schedule: Option<&Schedule>,
        telemetry: StepTelemetry,
        (step, nth, began): (u64, u64, Instant),
    ) -> Result<(), TrainError> {
        if let Some(tr) = &telemetry.traffic {
            for (i, a) in TrafficAxis::ALL.into_iter().enumerate() {
                self.traffic[i] += tr.payload.sent(a) as f64;
                self.traffic[AXES + i] += tr.scalars.sent(a) as f64;
            }
        }
        self.steps += 1;
        let traced = nth < self.trace_steps;
        let mut fsdp = Vec::new();
        for (c, spans) in telemetry.fsdp.iter().enumerate() {
            if let Some(spans) = spans
                && traced
            {
                // threads 0 and 1 are the pipeline's compute and receives
                fsdp.extend(spans.lanes(c, 2, self.origin, step));
            }
        }
        if traced {
            fsdp.extend(weft_model::cp::ring_lanes(&telemetry.cp, self.origin, step));
        }
        let lanes = self.dims.world_size() > 1 || !fsdp.is_empty();
        let (Some(schedule), Some(local), true, true) =
            (schedule, telemetry.timeline, traced, lanes)
        else {
            return Ok(());
        };
        let timelines = weft_pipeline::gather_timelines(world, &local, schedule)?;
        let fsdp_all = gather_events(world, &fsdp)?;
        let (Some(timelines), Some(fsdp_all)) = (timelines, fsdp_all) else {
            return Ok(());
        };
        let first = nth == 0;
        let dims = self.dims;
        let name = |rank: usize| format!("rank {rank}: {}", dims.coords_of(rank));
        let offset_us = began.duration_since(self.origin).as_secs_f64() * 1e6;
        let merged = weft_pipeline::step_trace(
            schedule, timelines, dims.pp, offset_us, step, first, !first, &name,
        )?;
        if let Some(b) = &merged.bubble {
            self.bubbles.record(step, b, !first);
        }
        if first {
            self.trace.other_data.extend(merged.other_data);
        }
        self.trace.trace_events.extend(merged.events);
        for (rank, events) in fsdp_all.into_iter().enumerate() {
            for mut e in events {
                if e.ph != weft_trace::Phase::Complete && !first {
                    continue;
                }
                e.pid = rank as u64;
                self.trace.trace_events.push(e);
            }
        }
        Ok(())
    }

    /// The pipeline's mean bubble against the prediction, of a run with
    /// schedule `schedule` (pipelines only).
    pub(crate) fn bubble(&self, schedule: &str) -> Option<PipelineBubble> {
        self.bubbles
            .mean()
            .map(|(measured, predicted)| PipelineBubble {
                schedule: schedule.to_owned(),
                measured,
                predicted,
            })
    }

    /// The bytes a step sent per axis, every rank's together (mean over
    /// the steps; layouts of several ranks). Collective over `world`.
    ///
    /// # Errors
    /// A failed all-reduce.
    pub(crate) fn traffic(
        &mut self,
        world: &dyn Communicator,
    ) -> Result<Option<StepTraffic>, TrainError> {
        use weft_collectives::{CommunicatorExt, ReduceOp};
        // every rank's bytes together (exact in f64 below 2^53)
        if world.size() > 1 {
            world.all_reduce(&mut self.traffic, ReduceOp::Sum)?;
        }
        #[allow(clippy::cast_precision_loss)]
        let n = self.steps.max(1) as f64;
        let axis = |k: usize| AxisBytes::from(std::array::from_fn(|i| self.traffic[k + i] / n));
        Ok((self.dims.world_size() > 1).then(|| StepTraffic {
            payload: axis(0),
            scalars: axis(AXES),
        }))
    }

    /// Writes `trace.json` into `run_dir` (world rank 0: `writer`) when
    /// anything was traced.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn write(mut self, writer: bool, run_dir: &Path) -> Result<(), TrainError> {
        self.bubbles.write_other_data(&mut self.trace.other_data);
        if !writer || self.trace.trace_events.is_empty() {
            return Ok(());
        }
        let path = run_dir.join("trace.json");
        let json = serde_json::to_string(&self.trace).map_err(std::io::Error::other);
        json.and_then(|j| std::fs::write(&path, j))
            .map_err(io_err(&path))
    }
}

/// Every rank's `events` on world rank 0 (in rank order; `None`
/// elsewhere), as JSON point to point. Collective over `world`.
fn gather_events(
    world: &dyn Communicator,
    events: &[TraceEvent],
) -> Result<Option<Vec<Vec<TraceEvent>>>, TrainError> {
    let bad = TrainError::Trace;
    let bytes = serde_json::to_vec(events).map_err(|e| bad(e.to_string()))?;
    let Some(all) = crate::ranks::gather_bytes(world, tags::TRACE, &bytes)? else {
        return Ok(None);
    };
    all.iter()
        .enumerate()
        .map(|(rank, b)| {
            serde_json::from_slice(b).map_err(|e| bad(format!("rank {rank}'s trace events: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
