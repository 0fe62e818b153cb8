//! Pipeline timelines: trace events grouped into lanes, and their layout
//! for a time window at a given pixel width.
//!
//! Layout is level-of-detail: slices narrower than a pixel are merged into
//! one rectangle per pixel run, so the number of drawn rectangles is bounded
//! by lanes × width however many events the trace holds (a 100k-event trace
//! draws as fast as a 1k-event one once zoomed out).

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
            _ if cat
                .split(',')
                .any(|c| matches!(c, "comm" | "communication" | "p2p" | "collective")) =>
            {
                Self::Comm
            }
            _ => Self::Other,
        }
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
    /// Slices sorted by start.
    pub slices: Vec<Slice>,
    /// Longest slice, bounding the backwards search in lookups.
    max_dur: f64,
    /// Time covered by non-idle slices (union of intervals).
    pub busy: f64,
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
    /// Bubble fraction: `otherData.bubble_fraction` when the writer gave
    /// it, else idle time over lanes × makespan.
    pub bubble_fraction: f64,
    /// Whether [`Timeline::bubble_fraction`] came from the file.
    pub bubble_from_file: bool,
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
        let makespan = end - start;
        let computed = if makespan > 0.0 && !lanes.is_empty() {
            let busy: f64 = lanes.iter().map(|l| l.busy).sum();
            #[allow(clippy::cast_precision_loss)]
            let total = makespan * lanes.len() as f64;
            1.0 - busy / total
        } else {
            0.0
        };
        let from_file = trace
            .other_data
            .get("bubble_fraction")
            .and_then(ArgValue::as_f64);
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
            counts,
            trace,
        }
    }

    /// Latest end minus earliest start, µs.
    #[must_use]
    pub fn makespan(&self) -> f64 {
        self.end - self.start
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

    #[test]
    fn ticks_are_round() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(3.0, 3.0, 5), Vec::<f64>::new());
        let t = ticks(0.0, 12_345.0, 6);
        assert_eq!(t[1] - t[0], 5000.0);
        assert_eq!(format_us(1500.0), "1.500 ms");
    }
}
