//! Pipeline timelines: trace events grouped into lanes, and their layout
//! for a time window at a given pixel width.
//!
//! Layout is level-of-detail: slices narrower than a pixel are merged into
//! one rectangle per pixel run, so the number of drawn rectangles is bounded
//! by lanes × width however many events the trace holds (a 100k-event trace
//! draws as fast as a 1k-event one once zoomed out).
//!
//! # The bubble
//!
//! [`Timeline::bubble_fraction`] means what `weft train` and
//! `weft-pipeline` mean by it, so the page and the trainer's summary agree:
//!
//! * **One step** (`weft_pipeline::Timeline::bubble_fraction`, in
//!   `pipeline/src/simulate.rs`): the idle time of all stages divided by
//!   `p × makespan`, for one iteration that ends with a synchronisation of
//!   all stages (Megatron-LM's accounting). A stage is busy only while it
//!   computes (`F`, `B`, `W`, `BW`); receive waits and p2p latency are idle.
//!   Here a stage is a lane running pipeline actions (`F`, `B`, `W`,
//!   `BW`; a rank's other tracks, such as FSDP's, are not stages), busy
//!   during any of its slices but `idle` and communication, and the step's window runs from the earliest start to
//!   the latest end of the step's slices of any kind (the trainer's explicit
//!   `idle` slices tile each stage from the step's origin to its makespan,
//!   so the window is exactly the trainer's).
//! * **Several steps** (`weft_trainer::train::Summary::pipeline_bubble`,
//!   in `trainer/src/train.rs`): each step's bubble within its own window,
//!   so the optimizer and everything else between steps is not counted,
//!   then the plain mean over steps (not weighted by their durations). The
//!   trainer leaves its first step (warm-up) out of the mean and names the
//!   steps it averaged in `otherData.bubble_steps`; the page averages the
//!   same ones.
//!
//! Steps are told apart by an integer `args.step` on the complete events
//! (`weft train` writes it on every slice of a traced step; any writer may).
//! When some slices carry a step, slices without one lie outside every
//! step's window and do not count; when none does, the whole trace is one
//! step.

use std::collections::BTreeMap;

use weft_trace::{ArgValue, Phase, Trace};

/// What a slice is, for colouring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SliceKind {
    /// `F`: forward.
    Forward,
    /// `B`: backward for the input gradient (zero-bubble split).
    BackwardInput,
    /// `W`: backward for the weight gradient.
    BackwardWeight,
    /// `BW`: whole backward (input and weight together).
    Backward,
    /// Communication (send/recv, collectives).
    Comm,
    /// An explicit `idle` slice.
    Idle,
    /// Anything else.
    Other,
}

impl SliceKind {
    /// Classify by event name and category.
    #[must_use]
    pub fn of(name: &str, cat: &str) -> Self {
        match name {
            "F" => Self::Forward,
            "B" => Self::BackwardInput,
            "W" => Self::BackwardWeight,
            "BW" => Self::Backward,
            "idle" => Self::Idle,
            _ if cat.split(',').any(|c| {
                // `comm`, or a namespaced `fsdp.comm`
                let last = c.rsplit('.').next().unwrap_or(c);
                matches!(last, "comm" | "communication" | "p2p" | "collective")
            }) =>
            {
                Self::Comm
            }
            _ => Self::Other,
        }
    }

    /// A pipeline action: `F`, `B`, `W` or `BW`.
    #[must_use]
    pub fn is_action(self) -> bool {
        matches!(
            self,
            Self::Forward | Self::BackwardInput | Self::BackwardWeight | Self::Backward
        )
    }

    /// CSS class used for its colour.
    #[must_use]
    pub fn class(self) -> &'static str {
        match self {
            Self::Forward => "k-f",
            Self::BackwardInput => "k-b",
            Self::BackwardWeight => "k-w",
            Self::Backward => "k-bw",
            Self::Comm => "k-comm",
            Self::Idle => "k-idle",
            Self::Other => "k-other",
        }
    }

    /// Human name for legends.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::Forward => "F forward",
            Self::BackwardInput => "B backward (input grad)",
            Self::BackwardWeight => "W backward (weight grad)",
            Self::Backward => "BW backward",
            Self::Comm => "communication",
            Self::Idle => "idle",
            Self::Other => "other",
        }
    }
}

/// One complete event on a lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    /// Start, microseconds.
    pub start: f64,
    /// Duration, microseconds.
    pub dur: f64,
    /// Colour class.
    pub kind: SliceKind,
    /// Index of the event in the trace (for details).
    pub event: usize,
    /// `microbatch` arg, if any.
    pub microbatch: Option<i64>,
    /// `chunk` arg, if any.
    pub chunk: Option<i64>,
    /// `step` arg, if any: the optimizer step the slice belongs to.
    pub step: Option<i64>,
}

impl Slice {
    /// End time.
    #[must_use]
    pub fn end(&self) -> f64 {
        self.start + self.dur
    }
}

/// One row of the timeline: a (process, thread) of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Lane {
    /// Display name (`stage 0`, or `stage 0 / comm` when a process has
    /// several threads).
    pub name: String,
    /// Process id.
    pub pid: u64,
    /// Thread id.
    pub tid: u64,
    /// The process's `process_labels` (e.g. `pp 1`: its pipeline stage
    /// on a mesh), grouping consecutive lanes; `None` without one.
    pub group: Option<String>,
    /// Slices sorted by start.
    pub slices: Vec<Slice>,
    /// Longest slice, bounding the backwards search in lookups.
    max_dur: f64,
    /// Time covered by non-idle slices (union of intervals).
    pub busy: f64,
}

/// One step's pipeline window and bubble, from the slices whose `args.step`
/// is [`StepBubble::step`] (see the [module docs](self) for the
/// definition).
#[derive(Debug, Clone, PartialEq)]
pub struct StepBubble {
    /// The step number (`args.step`; `weft train` counts from 1, as in
    /// `metrics.jsonl`).
    pub step: i64,
    /// Start of the step's window: earliest start of its slices, µs.
    pub start: f64,
    /// End of the step's window: latest end of its slices, µs.
    pub end: f64,
    /// Idle time of the stages within the window over `stages × (end −
    /// start)`; 0 for an empty window.
    pub bubble_fraction: f64,
    /// Whether the step is in [`Timeline::computed_bubble`]'s mean.
    pub in_mean: bool,
}

impl StepBubble {
    /// The step's makespan, `end − start`, µs.
    #[must_use]
    pub fn makespan(&self) -> f64 {
        self.end - self.start
    }
}

impl Lane {
    /// Index range of slices that may intersect `[t0, t1]`.
    fn visible(&self, t0: f64, t1: f64) -> std::ops::Range<usize> {
        let lo = self.slices.partition_point(|s| s.start < t0 - self.max_dur);
        let hi = self.slices.partition_point(|s| s.start <= t1);
        lo..hi.max(lo)
    }

    /// The slice running at time `t` (a non-idle one if several overlap).
    #[must_use]
    pub fn slice_at(&self, t: f64) -> Option<&Slice> {
        let r = self.visible(t, t);
        let mut found: Option<&Slice> = None;
        for s in &self.slices[r] {
            if s.start <= t && t < s.end() && (found.is_none() || s.kind != SliceKind::Idle) {
                found = Some(s);
            }
        }
        found
    }
}

/// A trace laid out for the pipeline view.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Where it came from (file name).
    pub file: String,
    /// The parsed trace (kept for hover details).
    pub trace: Trace,
    /// Lanes in display order.
    pub lanes: Vec<Lane>,
    /// Earliest start, µs.
    pub start: f64,
    /// Latest end, µs.
    pub end: f64,
    /// Schedule name from `otherData.schedule`, if any.
    pub schedule: Option<String>,
    /// Bubble fraction per step (see the [module docs](self)):
    /// `otherData.bubble_fraction` when the writer gave it, else
    /// [`Timeline::computed_bubble`].
    pub bubble_fraction: f64,
    /// Whether [`Timeline::bubble_fraction`] came from the file.
    pub bubble_from_file: bool,
    /// The bubble computed from the events: the mean of the per-step
    /// bubbles of [`Timeline::steps`] marked `in_mean`, or the whole
    /// trace's bubble when no slice carries a step.
    pub computed_bubble: f64,
    /// Per-step windows and bubbles, by step; empty when no slice carries
    /// `args.step`.
    pub steps: Vec<StepBubble>,
    /// Number of lanes counted as pipeline stages (the lanes running pipeline actions: `F`, `B`, `W`, `BW`).
    pub stages: usize,
    /// `otherData.bubble_predicted`: the bubble the writer's simulator
    /// predicts for the same steps (`weft train`: from the measured mean
    /// action costs).
    pub bubble_predicted: Option<f64>,
    /// Number of slices of each kind.
    pub counts: BTreeMap<SliceKind, usize>,
    /// Whether any slice has a `chunk` other than 0 (interleaved
    /// schedules): labels then read `microbatch.chunk`.
    pub chunked: bool,
}

fn arg_i64(a: Option<&ArgValue>) -> Option<i64> {
    a.and_then(ArgValue::as_i64)
}

impl Timeline {
    /// Group the complete events of `trace` into lanes.
    #[must_use]
    pub fn new(file: &str, trace: Trace) -> Self {
        let names = trace.process_names();
        let mut sort_index: BTreeMap<u64, i64> = BTreeMap::new();
        let mut thread_names: BTreeMap<(u64, u64), String> = BTreeMap::new();
        let mut labels: BTreeMap<u64, String> = BTreeMap::new();
        for e in &trace.trace_events {
            if e.ph == Phase::Metadata {
                match e.name.as_str() {
                    "process_sort_index" => {
                        if let Some(i) = arg_i64(e.args.get("sort_index")) {
                            sort_index.insert(e.pid, i);
                        }
                    }
                    "thread_name" => {
                        if let Some(n) = e.args.get("name").and_then(ArgValue::as_str) {
                            thread_names.insert((e.pid, e.tid), n.to_owned());
                        }
                    }
                    "process_labels" => {
                        if let Some(n) = e.args.get("labels").and_then(ArgValue::as_str) {
                            labels.insert(e.pid, n.to_owned());
                        }
                    }
                    _ => {}
                }
            }
        }
        let mut lanes: BTreeMap<(i64, u64, u64), Vec<Slice>> = BTreeMap::new();
        let mut counts = BTreeMap::new();
        for (i, e) in trace.trace_events.iter().enumerate() {
            if e.ph != Phase::Complete {
                continue;
            }
            let kind = SliceKind::of(&e.name, &e.cat);
            *counts.entry(kind).or_insert(0) += 1;
            let si = sort_index
                .get(&e.pid)
                .copied()
                .unwrap_or(i64::try_from(e.pid).unwrap_or(i64::MAX));
            lanes.entry((si, e.pid, e.tid)).or_default().push(Slice {
                start: e.ts,
                dur: e.dur.unwrap_or(0.0),
                kind,
                event: i,
                microbatch: arg_i64(e.args.get("microbatch")),
                chunk: arg_i64(e.args.get("chunk")),
                step: arg_i64(e.args.get("step")),
            });
        }
        let mut threads_per_pid: BTreeMap<u64, usize> = BTreeMap::new();
        for (_, pid, _) in lanes.keys() {
            *threads_per_pid.entry(*pid).or_insert(0) += 1;
        }
        let (mut start, mut end) = (f64::INFINITY, f64::NEG_INFINITY);
        let lanes: Vec<Lane> = lanes
            .into_iter()
            .map(|((_, pid, tid), mut slices)| {
                slices.sort_by(|a, b| a.start.total_cmp(&b.start));
                let max_dur = slices.iter().map(|s| s.dur).fold(0.0, f64::max);
                let mut busy = 0.0;
                let mut covered_to = f64::NEG_INFINITY;
                for s in slices.iter().filter(|s| s.kind != SliceKind::Idle) {
                    let from = s.start.max(covered_to);
                    if s.end() > from {
                        busy += s.end() - from;
                        covered_to = s.end();
                    }
                }
                for s in &slices {
                    start = start.min(s.start);
                    end = end.max(s.end());
                }
                let pname = names
                    .get(&pid)
                    .cloned()
                    .unwrap_or_else(|| format!("pid {pid}"));
                let name = if threads_per_pid.get(&pid).copied().unwrap_or(1) > 1 {
                    let t = thread_names
                        .get(&(pid, tid))
                        .cloned()
                        .unwrap_or_else(|| format!("tid {tid}"));
                    format!("{pname} / {t}")
                } else {
                    pname
                };
                Lane {
                    name,
                    pid,
                    tid,
                    group: labels.get(&pid).cloned(),
                    slices,
                    max_dur,
                    busy,
                }
            })
            .collect();
        if !start.is_finite() {
            start = 0.0;
            end = 0.0;
        }
        let from_file = trace
            .other_data
            .get("bubble_fraction")
            .and_then(ArgValue::as_f64);
        let mean_over: Option<Vec<i64>> = match trace.other_data.get("bubble_steps") {
            Some(ArgValue::List(v)) => Some(v.iter().filter_map(ArgValue::as_i64).collect()),
            _ => None,
        };
        let (steps, computed, stages) = pipeline_bubble(&lanes, (start, end), mean_over.as_deref());
        let schedule = trace
            .other_data
            .get("schedule")
            .and_then(ArgValue::as_str)
            .map(str::to_owned);
        let chunked = lanes
            .iter()
            .flat_map(|l| &l.slices)
            .any(|s| s.chunk.is_some_and(|c| c != 0));
        Self {
            file: file.to_owned(),
            chunked,
            lanes,
            start,
            end,
            schedule,
            bubble_fraction: from_file.unwrap_or(computed),
            bubble_from_file: from_file.is_some(),
            computed_bubble: computed,
            steps,
            stages,
            bubble_predicted: trace
                .other_data
                .get("bubble_predicted")
                .and_then(ArgValue::as_f64),
            counts,
            trace,
        }
    }

    /// Latest end minus earliest start, µs.
    #[must_use]
    pub fn makespan(&self) -> f64 {
        self.end - self.start
    }

    /// The steps in the bubble's mean.
    #[must_use]
    pub fn averaged_steps(&self) -> usize {
        self.steps.iter().filter(|s| s.in_mean).count()
    }

    /// Mean makespan of the steps in the bubble's mean, µs; the whole
    /// trace's when no slice carries a step.
    #[must_use]
    pub fn step_makespan(&self) -> f64 {
        let (sum, n) = self
            .steps
            .iter()
            .filter(|s| s.in_mean)
            .fold((0.0, 0usize), |(a, n), s| (a + s.makespan(), n + 1));
        if n == 0 {
            return self.makespan();
        }
        #[allow(clippy::cast_precision_loss)]
        let n = n as f64;
        sum / n
    }

    /// The bubble computed from the events when it differs from the file's
    /// `otherData.bubble_fraction` by more than 0.05 percentage points
    /// (the writer and its events disagree); `None` otherwise.
    #[must_use]
    pub fn bubble_disagreement(&self) -> Option<f64> {
        (self.bubble_from_file
            && self.stages > 0
            && (self.computed_bubble - self.bubble_fraction).abs() > 5e-4)
            .then_some(self.computed_bubble)
    }

    /// The bubble as the page shows it: `bubble 25.00%` for one step;
    /// `bubble 10.23% per step (2 steps)` over several, or `(mean of 1 of
    /// 2 steps)` when the writer named the steps to average.
    #[must_use]
    pub fn bubble_label(&self) -> String {
        let pct = format!("bubble {:.2}%", 100.0 * self.bubble_fraction);
        let (n, all) = (self.averaged_steps(), self.steps.len());
        let plural = |k: usize| if k == 1 { "" } else { "s" };
        match (n, all) {
            (_, 0) => pct,
            (n, all) if n == all => format!("{pct} per step ({all} step{})", plural(all)),
            (n, all) => format!("{pct} per step (mean of {n} of {all} step{})", plural(all)),
        }
    }

    /// Each step's bubble, `step 1 35.10% (not in the mean) · step 2
    /// 10.23%`, at most `max` of them (then `… N more`); `None` without
    /// step marks.
    #[must_use]
    pub fn steps_label(&self, max: usize) -> Option<String> {
        if self.steps.is_empty() {
            return None;
        }
        let mut parts: Vec<String> = self
            .steps
            .iter()
            .take(max)
            .map(|s| {
                format!(
                    "step {} {:.2}%{}",
                    s.step,
                    100.0 * s.bubble_fraction,
                    if s.in_mean { "" } else { " (not in the mean)" }
                )
            })
            .collect();
        if self.steps.len() > max {
            parts.push(format!("… {} more", self.steps.len() - max));
        }
        Some(parts.join(" · "))
    }

    /// Number of non-idle slices.
    #[must_use]
    pub fn work_slices(&self) -> usize {
        self.counts
            .iter()
            .filter(|(k, _)| **k != SliceKind::Idle)
            .map(|(_, n)| n)
            .sum()
    }

    /// Rectangles for the window `[t0, t1]` drawn `width` pixels wide.
    /// Idle slices are not drawn (the lane background shows idle time).
    #[must_use]
    pub fn layout(&self, t0: f64, t1: f64, width: f64) -> Vec<Vec<Rect>> {
        let span = (t1 - t0).max(f64::MIN_POSITIVE);
        let scale = width / span;
        self.lanes
            .iter()
            .map(|lane| {
                let mut out = Vec::new();
                let mut pending: Option<Rect> = None;
                for s in &lane.slices[lane.visible(t0, t1)] {
                    if s.kind == SliceKind::Idle || s.end() < t0 {
                        continue;
                    }
                    let x0 = ((s.start - t0) * scale).max(0.0);
                    let x1 = ((s.end() - t0) * scale).min(width);
                    if x1 <= x0 && s.dur > 0.0 {
                        continue;
                    }
                    if x1 - x0 >= MIN_PX {
                        if let Some(p) = pending.take() {
                            out.push(p);
                        }
                        out.push(Rect {
                            x: x0,
                            w: x1 - x0,
                            kind: s.kind,
                            label: label(s, x1 - x0, self.chunked),
                            slice: Some(s.event),
                            merged: 1,
                        });
                        continue;
                    }
                    match &mut pending {
                        Some(p) if x0 <= p.x + p.w + 0.5 => {
                            p.w = (x1.max(x0 + 0.5) - p.x).max(p.w);
                            p.merged += 1;
                            if s.kind != p.kind {
                                p.kind = SliceKind::Other;
                            }
                            p.slice = None;
                        }
                        _ => {
                            if let Some(p) = pending.take() {
                                out.push(p);
                            }
                            pending = Some(Rect {
                                x: x0,
                                w: (x1 - x0).max(0.5),
                                kind: s.kind,
                                label: None,
                                slice: Some(s.event),
                                merged: 1,
                            });
                        }
                    }
                }
                if let Some(p) = pending {
                    out.push(p);
                }
                out
            })
            .collect()
    }

    /// Details of trace event `event` as `(key, value)` rows for a tooltip.
    #[must_use]
    pub fn details(&self, event: usize) -> Vec<(String, String)> {
        let Some(e) = self.trace.trace_events.get(event) else {
            return Vec::new();
        };
        let mut rows = vec![
            ("name".to_owned(), e.name.clone()),
            ("start".to_owned(), format_us(e.ts)),
            ("duration".to_owned(), format_us(e.dur.unwrap_or(0.0))),
        ];
        if !e.cat.is_empty() {
            rows.push(("category".to_owned(), e.cat.clone()));
        }
        for (k, v) in &e.args {
            let v = match v {
                ArgValue::Str(s) => s.clone(),
                ArgValue::Int(i) => i.to_string(),
                ArgValue::Float(x) => format!("{x}"),
                ArgValue::Bool(b) => b.to_string(),
                ArgValue::Null => "null".into(),
                other => format!("{other:?}"),
            };
            rows.push((k.clone(), v));
        }
        rows
    }
}

/// Whether a slice is stage work for the bubble: everything but `idle`
/// and communication (receive waits and p2p latency are idle time in the
/// trainer's and the simulator's accounting).
fn is_work(kind: SliceKind) -> bool {
    !matches!(kind, SliceKind::Idle | SliceKind::Comm)
}

/// Per-step bubbles, the bubble to show, and the number of stages (see
/// the module docs). `whole` is the trace's `(start, end)`, the window
/// when no slice carries a step; `mean_over` the steps to average
/// (`otherData.bubble_steps`), all when `None` or when it names none of
/// the trace's steps.
fn pipeline_bubble(
    lanes: &[Lane],
    whole: (f64, f64),
    mean_over: Option<&[i64]>,
) -> (Vec<StepBubble>, f64, usize) {
    // stages: the lanes running pipeline actions (a rank's other tracks —
    // FSDP's compute and communication — are not stages of their own)
    let stage_lanes: Vec<&Lane> = lanes
        .iter()
        .filter(|l| l.slices.iter().any(|s| s.kind.is_action()))
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let p = stage_lanes.len() as f64;
    let bubble = |busy: f64, (t0, t1): (f64, f64)| {
        let span = t1 - t0;
        if span > 0.0 && p > 0.0 {
            1.0 - busy / (p * span)
        } else {
            0.0
        }
    };
    // Step windows over slices of any kind, on any lane.
    let mut windows: BTreeMap<i64, (f64, f64)> = BTreeMap::new();
    for s in lanes.iter().flat_map(|l| &l.slices) {
        if let Some(k) = s.step {
            let w = windows
                .entry(k)
                .or_insert((f64::INFINITY, f64::NEG_INFINITY));
            *w = (w.0.min(s.start), w.1.max(s.end()));
        }
    }
    // Busy time: each stage's union of work slices, per step (slices are
    // sorted by start within a lane, so also within a step).
    let stepped = !windows.is_empty();
    let mut busy: BTreeMap<Option<i64>, f64> = BTreeMap::new();
    for lane in &stage_lanes {
        let mut covered: BTreeMap<Option<i64>, f64> = BTreeMap::new();
        for s in lane.slices.iter().filter(|s| is_work(s.kind)) {
            let key = if stepped {
                match s.step {
                    Some(k) => Some(k),
                    None => continue,
                }
            } else {
                None
            };
            let to = covered.entry(key).or_insert(f64::NEG_INFINITY);
            let from = s.start.max(*to);
            if s.end() > from {
                *busy.entry(key).or_insert(0.0) += s.end() - from;
                *to = s.end();
            }
        }
    }
    if !stepped {
        let b = busy.get(&None).copied().unwrap_or(0.0);
        return (Vec::new(), bubble(b, whole), stage_lanes.len());
    }
    let chosen = |k: i64| mean_over.is_none_or(|m| m.contains(&k));
    let any_chosen = windows.keys().any(|k| chosen(*k));
    let steps: Vec<StepBubble> = windows
        .into_iter()
        .map(|(step, (start, end))| StepBubble {
            step,
            start,
            end,
            bubble_fraction: bubble(busy.get(&Some(step)).copied().unwrap_or(0.0), (start, end)),
            in_mean: !any_chosen || chosen(step),
        })
        .collect();
    let (sum, n) = steps
        .iter()
        .filter(|s| s.in_mean)
        .fold((0.0, 0usize), |(a, n), s| (a + s.bubble_fraction, n + 1));
    #[allow(clippy::cast_precision_loss)]
    let mean = sum / n.max(1) as f64;
    (steps, mean, stage_lanes.len())
}

/// Slices narrower than this many pixels are merged with their neighbours
/// (bounds a lane to about width / 3 rectangles).
pub const MIN_PX: f64 = 3.0;

/// A rectangle of the layout: `x` and `w` in pixels from the window start.
#[derive(Debug, Clone, PartialEq)]
pub struct Rect {
    /// Left edge, px.
    pub x: f64,
    /// Width, px.
    pub w: f64,
    /// Colour class ([`SliceKind::Other`] for a merge of mixed kinds).
    pub kind: SliceKind,
    /// Text drawn inside, when it fits.
    pub label: Option<String>,
    /// The trace event it draws; `None` for a merge of several.
    pub slice: Option<usize>,
    /// How many slices it stands for.
    pub merged: usize,
}

fn label(s: &Slice, w: f64, show_chunk: bool) -> Option<String> {
    let mb = s.microbatch?;
    let text = match s.chunk {
        Some(c) if show_chunk => format!("{mb}.{c}"),
        _ => mb.to_string(),
    };
    #[allow(clippy::cast_precision_loss)]
    let need = 7.0 * text.len() as f64 + 4.0;
    (w >= need).then_some(text)
}

/// A duration in µs as text with a sensible unit.
#[must_use]
pub fn format_us(us: f64) -> String {
    let a = us.abs();
    if a >= 1e6 {
        format!("{:.3} s", us / 1e6)
    } else if a >= 1e3 {
        format!("{:.3} ms", us / 1e3)
    } else {
        format!("{us:.1} µs")
    }
}

/// Round tick positions (1, 2 or 5 × 10^k apart) covering `[lo, hi]`, at
/// most about `target` of them.
#[must_use]
pub fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater)
        || !lo.is_finite()
        || !hi.is_finite()
        || target == 0
    {
        return Vec::new();
    }
    #[allow(clippy::cast_precision_loss)]
    let raw = (hi - lo) / target as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() <= 4 * target {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_trace::TraceEvent;

    fn two_stage() -> Trace {
        let mut t = Trace::new();
        t.push(TraceEvent::process_name(0, "stage 0"));
        t.push(TraceEvent::process_name(1, "stage 1"));
        let f = |mb: u32, ts: f64, pid: u64, name: &str| {
            TraceEvent::complete(name, ts, 10.0, pid, 0)
                .with_arg("microbatch", mb)
                .with_arg("chunk", 0u32)
        };
        t.push(f(0, 0.0, 0, "F"));
        t.push(f(1, 10.0, 0, "F"));
        t.push(f(0, 10.0, 1, "F"));
        t.push(f(0, 20.0, 1, "B"));
        t.push(f(0, 30.0, 0, "B"));
        t.push(TraceEvent::complete("idle", 0.0, 10.0, 1, 0).with_cat("idle"));
        t
    }

    #[test]
    fn lanes_bubble_and_lookup() {
        let tl = Timeline::new("t.json", two_stage());
        assert_eq!(tl.lanes.len(), 2);
        assert_eq!(tl.lanes[1].name, "stage 1");
        assert_eq!(tl.makespan(), 40.0);
        // stage 0 busy 30 of 40, stage 1 busy 20 of 40.
        assert!((tl.bubble_fraction - 30.0 / 80.0).abs() < 1e-12);
        assert!(!tl.bubble_from_file);
        assert_eq!(tl.work_slices(), 5);
        assert_eq!(tl.counts[&SliceKind::Idle], 1);
        let s = tl.lanes[0].slice_at(15.0).unwrap();
        assert_eq!((s.kind, s.microbatch), (SliceKind::Forward, Some(1)));
        assert!(tl.lanes[0].slice_at(25.0).is_none());
        // Idle slice loses to nothing but is found when alone.
        assert_eq!(tl.lanes[1].slice_at(5.0).unwrap().kind, SliceKind::Idle);
        let d = tl.details(s.event);
        assert!(
            d.contains(&("microbatch".to_owned(), "1".to_owned())),
            "{d:?}"
        );
    }

    #[test]
    fn layout_draws_wide_slices_one_to_one_with_labels() {
        let tl = Timeline::new("t.json", two_stage());
        let rects = tl.layout(0.0, 40.0, 400.0);
        assert_eq!(rects[0].len(), 3);
        assert_eq!(rects[1].len(), 2, "idle is not drawn");
        assert_eq!(rects[0][1].x, 100.0);
        assert_eq!(rects[0][1].w, 100.0);
        assert_eq!(rects[0][1].label.as_deref(), Some("1"));
        // Zoomed into [12, 22]: stage 0 shows only F1 clipped to the window.
        let rects = tl.layout(12.0, 22.0, 100.0);
        assert_eq!(rects[0].len(), 1);
        assert_eq!((rects[0][0].x, rects[0][0].w), (0.0, 80.0));
    }

    #[test]
    fn dense_traces_merge_to_at_most_a_rect_per_pixel() {
        let mut t = Trace::new();
        for i in 0..100_000u32 {
            t.push(TraceEvent::complete(
                if i % 2 == 0 { "F" } else { "B" },
                f64::from(i),
                1.0,
                0,
                0,
            ));
        }
        let tl = Timeline::new("big.json", t);
        let rects = tl.layout(tl.start, tl.end, 1000.0);
        assert!(rects[0].len() <= 1000, "{}", rects[0].len());
        let merged: usize = rects[0].iter().map(|r| r.merged).sum();
        assert_eq!(merged, 100_000, "every slice is accounted for");
        // Zoomed in far enough, slices are drawn one by one again.
        let rects = tl.layout(500.0, 600.0, 1000.0);
        assert!(rects[0].iter().all(|r| r.merged == 1));
        assert_eq!(
            rects[0].len(),
            100,
            "slices 500..=599; 600 starts at the edge"
        );
    }

    #[test]
    fn bubble_from_other_data_wins() {
        let mut t = two_stage();
        t.other_data
            .insert("bubble_fraction".into(), ArgValue::Float(0.25));
        t.other_data
            .insert("schedule".into(), ArgValue::from("1F1B"));
        let tl = Timeline::new("t.json", t);
        assert_eq!(tl.bubble_fraction, 0.25);
        assert_eq!(tl.schedule.as_deref(), Some("1F1B"));
    }

    /// GPipe over 2 stages, 2 micro-batches, `F = B = 10` µs (stage 0's
    /// first `F` takes `f00`), at `t0`, every slice tagged with `step`; a
    /// `p2p` track per stage with a receive wait, the trainer's explicit
    /// idle tiles up to the step's makespan, and an `optimizer` slice after
    /// the step that carries no step.
    fn gpipe_step(t: &mut Trace, step: i64, t0: f64, f00: f64) -> f64 {
        let s0 = [("F", 0, 0.0, f00), ("F", 1, f00, 10.0)];
        let f1 = f00 + 10.0; // stage 0's F1 ends, stage 1's F1 may start
        let s1 = [
            ("F", 0, f00, 10.0),
            ("F", 1, f1, 10.0),
            ("B", 1, f1 + 10.0, 10.0),
            ("B", 0, f1 + 20.0, 10.0),
        ];
        let s0b = [("B", 1, f1 + 20.0, 10.0), ("B", 0, f1 + 30.0, 10.0)];
        let end = f1 + 40.0;
        for (pid, slices) in [(0u64, [&s0[..], &s0b[..]].concat()), (1, s1.to_vec())] {
            let mut clock = 0.0;
            for (name, mb, start, dur) in slices {
                if start > clock {
                    t.push(
                        TraceEvent::complete("idle", t0 + clock, start - clock, pid, 0)
                            .with_cat("idle")
                            .with_arg("step", step),
                    );
                }
                t.push(
                    TraceEvent::complete(name, t0 + start, dur, pid, 0)
                        .with_arg("microbatch", mb)
                        .with_arg("step", step),
                );
                clock = start + dur;
            }
            if end > clock {
                t.push(
                    TraceEvent::complete("idle", t0 + clock, end - clock, pid, 0)
                        .with_cat("idle")
                        .with_arg("step", step),
                );
            }
            t.push(
                TraceEvent::complete("recv wait", t0 + 1.0, 2.0, pid, 1)
                    .with_cat("p2p")
                    .with_arg("step", step),
            );
        }
        t.push(TraceEvent::complete("optimizer", t0 + end, 100.0, 0, 0));
        end
    }

    #[test]
    fn multi_step_bubble_is_per_step_and_skips_the_gap() {
        let mut t = Trace::new();
        // Step 1 (warm-up): stage 0's first F takes 30 µs, makespan 80;
        // busy 60 + 40 of 2 × 80: bubble 1 − 100/160 = 0.375.
        let m1 = gpipe_step(&mut t, 1, 0.0, 30.0);
        assert_eq!(m1, 80.0);
        // 100 µs of optimizer between the steps, then step 2 with uniform
        // costs: GPipe's bubble (p − 1)/(m + p − 1) = 1/3.
        let t2 = m1 + 100.0;
        let m2 = gpipe_step(&mut t, 2, t2, 10.0);
        assert_eq!(m2, 60.0);
        let (p, m) = (2.0, 2.0);
        let gpipe = (p - 1.0) / (m + p - 1.0);
        let tl = Timeline::new("t.json", t.clone());
        assert_eq!(tl.stages, 2, "p2p tracks are not stages");
        assert_eq!(tl.steps.len(), 2);
        let (s1, s2) = (&tl.steps[0], &tl.steps[1]);
        assert_eq!((s1.step, s1.start, s1.end), (1, 0.0, 80.0));
        assert_eq!((s2.step, s2.start, s2.end), (2, t2, t2 + 60.0));
        assert!((s1.bubble_fraction - 0.375).abs() < 1e-12, "{s1:?}");
        assert!((s2.bubble_fraction - gpipe).abs() < 1e-12, "{s2:?}");
        assert_eq!(tl.bubble_label(), "bubble 35.42% per step (2 steps)");
        assert_eq!(tl.steps_label(1).unwrap(), "step 1 37.50% · … 1 more");
        // No `bubble_steps`: the plain mean over both steps.
        assert!(s1.in_mean && s2.in_mean);
        let mean = (0.375 + gpipe) / 2.0;
        assert!((tl.bubble_fraction - mean).abs() < 1e-12);
        assert!(!tl.bubble_from_file);
        assert!((tl.step_makespan() - 70.0).abs() < 1e-12);
        // The optimizer after each step is in the trace but in no window.
        assert_eq!(tl.makespan(), t2 + 60.0 + 100.0);

        // The trainer names the steps it averaged (after its warm-up) and
        // gives its own figure: the page averages the same steps.
        t.other_data.insert(
            "bubble_steps".into(),
            ArgValue::List(vec![ArgValue::Int(2)]),
        );
        let tl = Timeline::new("t.json", t.clone());
        assert!(!tl.steps[0].in_mean && tl.steps[1].in_mean);
        assert!((tl.computed_bubble - gpipe).abs() < 1e-12);
        assert_eq!(tl.averaged_steps(), 1);
        assert_eq!(
            tl.bubble_label(),
            "bubble 33.33% per step (mean of 1 of 2 steps)"
        );
        assert_eq!(
            tl.steps_label(10).unwrap(),
            "step 1 37.50% (not in the mean) · step 2 33.33%"
        );
        assert_eq!(tl.step_makespan(), 60.0);
        t.other_data
            .insert("bubble_fraction".into(), ArgValue::Float(gpipe));
        let tl = Timeline::new("t.json", t.clone());
        assert!(tl.bubble_from_file);
        assert_eq!(tl.bubble_disagreement(), None);
        t.other_data
            .insert("bubble_fraction".into(), ArgValue::Float(0.5));
        let tl = Timeline::new("t.json", t);
        let d = tl.bubble_disagreement().unwrap();
        assert!((d - gpipe).abs() < 1e-12);
    }

    #[test]
    fn without_step_marks_the_whole_trace_is_one_step() {
        let mut t = Trace::new();
        gpipe_step(&mut t, 1, 0.0, 10.0);
        for e in &mut t.trace_events {
            e.args.remove("step");
        }
        let tl = Timeline::new("t.json", t);
        assert!(tl.steps.is_empty());
        // The optimizer slice now counts as stage 0's work, up to 160 µs:
        // busy 40 + 100 + 40 over 2 × 160.
        assert_eq!(tl.makespan(), 160.0);
        assert!((tl.bubble_fraction - (1.0 - 180.0 / 320.0)).abs() < 1e-12);
        assert_eq!(tl.step_makespan(), 160.0);
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(3.0, 3.0, 5), Vec::<f64>::new());
        let t = ticks(0.0, 12_345.0, 6);
        assert_eq!(t[1] - t[0], 5000.0);
        assert_eq!(format_us(1500.0), "1.500 ms");
    }
}
