//! Chrome trace events: the `trace.json` of a run.
//!
//! The format is the "JSON Object Format" of the Trace Event Format that
//! `chrome://tracing`, Perfetto (<https://ui.perfetto.dev>) and weft's own
//! visualizer read: an object whose `traceEvents` array holds one object per
//! event. Times (`ts`, `dur`) are in **microseconds**.
//!
//! weft writes one *process* per pipeline stage (or rank), named with a
//! `process_name` metadata event, and *complete* events (`"ph": "X"`) for
//! work, with structured `args` (for pipeline slices: `microbatch`, `chunk`).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A whole `trace.json` file.
///
/// Serializes as `{"traceEvents": [...], "displayTimeUnit": "ms",
/// "otherData": {...}}`; the last two keys are omitted when unset.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// The events, in any order (viewers sort by `ts`).
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
    /// How viewers should display times. Does not change the unit of `ts`
    /// and `dur`, which is always microseconds.
    #[serde(
        rename = "displayTimeUnit",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub display_time_unit: Option<DisplayTimeUnit>,
    /// Free-form metadata about the whole trace (schedule name, costs, ...).
    #[serde(
        rename = "otherData",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub other_data: BTreeMap<String, ArgValue>,
}

impl Trace {
    /// An empty trace.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Append an event.
    pub fn push(&mut self, event: TraceEvent) {
        self.trace_events.push(event);
    }

    /// The complete (`"X"`) events, in file order.
    pub fn complete_events(&self) -> impl Iterator<Item = &TraceEvent> {
        self.trace_events.iter().filter(|e| e.ph == Phase::Complete)
    }

    /// The name each process was given by a `process_name` metadata event.
    #[must_use]
    pub fn process_names(&self) -> BTreeMap<u64, String> {
        self.trace_events
            .iter()
            .filter(|e| e.ph == Phase::Metadata && e.name == "process_name")
            .filter_map(|e| match e.args.get("name") {
                Some(ArgValue::Str(s)) => Some((e.pid, s.clone())),
                _ => None,
            })
            .collect()
    }

    /// Check what viewers silently mis-draw: every timestamp finite and
    /// non-negative, every complete event with a finite, non-negative `dur`.
    ///
    /// # Errors
    /// [`TraceError`] naming the first offending event by index and name.
    pub fn check(&self) -> Result<(), TraceError> {
        for (index, e) in self.trace_events.iter().enumerate() {
            let bad = |problem: String| TraceError {
                index,
                name: e.name.clone(),
                problem,
            };
            if !e.ts.is_finite() || e.ts < 0.0 {
                return Err(bad(format!(
                    "ts = {} (expected a finite, non-negative number of microseconds)",
                    e.ts
                )));
            }
            if e.ph == Phase::Complete {
                match e.dur {
                    None => return Err(bad("complete event (\"X\") without dur".into())),
                    Some(d) if !d.is_finite() || d < 0.0 => {
                        return Err(bad(format!(
                            "dur = {d} (expected a finite, non-negative number of microseconds)"
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }
}

/// A problem found by [`Trace::check`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TraceError {
    /// Index of the event in `traceEvents`.
    pub index: usize,
    /// The event's name.
    pub name: String,
    /// What is wrong with it.
    pub problem: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "traceEvents[{}] ({:?}): {}",
            self.index, self.name, self.problem
        )
    }
}

impl std::error::Error for TraceError {}

/// The `displayTimeUnit` of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DisplayTimeUnit {
    /// Milliseconds.
    #[serde(rename = "ms")]
    Milliseconds,
    /// Nanoseconds.
    #[serde(rename = "ns")]
    Nanoseconds,
}

/// The kind of an event (its `ph` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// `"X"`: a slice with a start (`ts`) and a duration (`dur`).
    #[serde(rename = "X")]
    Complete,
    /// `"B"`: start of a slice closed by a later [`Phase::End`].
    #[serde(rename = "B")]
    Begin,
    /// `"E"`: end of the innermost open slice on the same thread.
    #[serde(rename = "E")]
    End,
    /// `"i"` (also read from the legacy `"I"`): a point in time.
    #[serde(rename = "i", alias = "I")]
    Instant,
    /// `"C"`: counter values; each arg is one series.
    #[serde(rename = "C")]
    Counter,
    /// `"M"`: metadata such as `process_name`, `thread_name`,
    /// `process_sort_index`.
    #[serde(rename = "M")]
    Metadata,
    /// `"s"`: start of a flow arrow (matched by `id`).
    #[serde(rename = "s")]
    FlowStart,
    /// `"t"`: intermediate step of a flow.
    #[serde(rename = "t")]
    FlowStep,
    /// `"f"`: end of a flow arrow.
    #[serde(rename = "f")]
    FlowEnd,
    /// `"b"`: start of an async (nestable) slice.
    #[serde(rename = "b")]
    AsyncBegin,
    /// `"e"`: end of an async slice.
    #[serde(rename = "e")]
    AsyncEnd,
    /// `"n"`: an async instant.
    #[serde(rename = "n")]
    AsyncInstant,
}

/// The scope of an instant event (its `s` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstantScope {
    /// `"g"`: the whole trace.
    #[serde(rename = "g")]
    Global,
    /// `"p"`: one process.
    #[serde(rename = "p")]
    Process,
    /// `"t"`: one thread (the default).
    #[serde(rename = "t")]
    Thread,
}

/// A value in an event's `args` (or the trace's `otherData`).
///
/// Untagged: it reads any JSON value, so traces written by other tools load
/// too. Integers that fit `i64` read as [`ArgValue::Int`], other numbers as
/// [`ArgValue::Float`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ArgValue {
    /// JSON `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// Any other number.
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    List(Vec<ArgValue>),
    /// An object.
    Map(BTreeMap<String, ArgValue>),
}

impl ArgValue {
    /// The value as an integer, if it is one.
    #[must_use]
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Self::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The value as a number (integers included).
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Self::Int(i) => Some(*i as f64),
            Self::Float(x) => Some(*x),
            _ => None,
        }
    }

    /// The value as a string slice, if it is a string.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl From<bool> for ArgValue {
    fn from(v: bool) -> Self {
        Self::Bool(v)
    }
}
impl From<i64> for ArgValue {
    fn from(v: i64) -> Self {
        Self::Int(v)
    }
}
impl From<i32> for ArgValue {
    fn from(v: i32) -> Self {
        Self::Int(i64::from(v))
    }
}
impl From<u32> for ArgValue {
    fn from(v: u32) -> Self {
        Self::Int(i64::from(v))
    }
}
impl From<usize> for ArgValue {
    /// Values above `i64::MAX` saturate.
    fn from(v: usize) -> Self {
        Self::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<u64> for ArgValue {
    /// Values above `i64::MAX` saturate.
    fn from(v: u64) -> Self {
        Self::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<f64> for ArgValue {
    fn from(v: f64) -> Self {
        Self::Float(v)
    }
}
impl From<&str> for ArgValue {
    fn from(v: &str) -> Self {
        Self::Str(v.to_owned())
    }
}
impl From<String> for ArgValue {
    fn from(v: String) -> Self {
        Self::Str(v)
    }
}

/// One event of a trace.
///
/// Fields that are unset are omitted when written and default when read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// What happened (`"F"`, `"B"`, `"idle"`, `"process_name"`, ...).
    pub name: String,
    /// Comma-separated categories, used by viewers to filter.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cat: String,
    /// The kind of event.
    pub ph: Phase,
    /// Start time in microseconds.
    #[serde(default)]
    pub ts: f64,
    /// Duration in microseconds (complete events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// Process id: weft uses one per pipeline stage or rank.
    #[serde(default)]
    pub pid: u64,
    /// Thread id within the process.
    #[serde(default)]
    pub tid: u64,
    /// Structured details shown when the event is selected.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub args: BTreeMap<String, ArgValue>,
    /// Id matching flow and async events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Scope of an instant event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<InstantScope>,
    /// A reserved colour name (`"good"`, `"bad"`, `"grey"`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cname: Option<String>,
}

impl TraceEvent {
    fn bare(name: impl Into<String>, ph: Phase, ts: f64, pid: u64, tid: u64) -> Self {
        Self {
            name: name.into(),
            cat: String::new(),
            ph,
            ts,
            dur: None,
            pid,
            tid,
            args: BTreeMap::new(),
            id: None,
            s: None,
            cname: None,
        }
    }

    /// A complete event (`"X"`): `name` ran on (`pid`, `tid`) from `ts_us`
    /// for `dur_us` microseconds.
    #[must_use]
    pub fn complete(name: impl Into<String>, ts_us: f64, dur_us: f64, pid: u64, tid: u64) -> Self {
        let mut e = Self::bare(name, Phase::Complete, ts_us, pid, tid);
        e.dur = Some(dur_us);
        e
    }

    /// An instant event (`"i"`) with thread scope.
    #[must_use]
    pub fn instant(name: impl Into<String>, ts_us: f64, pid: u64, tid: u64) -> Self {
        let mut e = Self::bare(name, Phase::Instant, ts_us, pid, tid);
        e.s = Some(InstantScope::Thread);
        e
    }

    /// A counter event (`"C"`): each `(series, value)` pair is one line of
    /// the counter track `name` of process `pid`.
    #[must_use]
    pub fn counter<'a>(
        name: impl Into<String>,
        ts_us: f64,
        pid: u64,
        series: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Self {
        let mut e = Self::bare(name, Phase::Counter, ts_us, pid, 0);
        e.args = series
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ArgValue::Float(v)))
            .collect();
        e
    }

    /// Metadata naming process `pid` (shown as the track title).
    #[must_use]
    pub fn process_name(pid: u64, name: impl Into<String>) -> Self {
        Self::bare("process_name", Phase::Metadata, 0.0, pid, 0)
            .with_arg("name", ArgValue::Str(name.into()))
    }

    /// Metadata naming thread `tid` of process `pid`.
    #[must_use]
    pub fn thread_name(pid: u64, tid: u64, name: impl Into<String>) -> Self {
        Self::bare("thread_name", Phase::Metadata, 0.0, pid, tid)
            .with_arg("name", ArgValue::Str(name.into()))
    }

    /// Metadata labelling process `pid` (Chrome's `process_labels`): a
    /// group it belongs to, e.g. a mesh coordinate (`pp 1`), which viewers
    /// show beside the name — `weft viz` draws a boundary between
    /// consecutive processes of different labels.
    #[must_use]
    pub fn process_labels(pid: u64, labels: impl Into<String>) -> Self {
        Self::bare("process_labels", Phase::Metadata, 0.0, pid, 0)
            .with_arg("labels", ArgValue::Str(labels.into()))
    }

    /// Metadata ordering process `pid` among the tracks (ascending).
    #[must_use]
    pub fn process_sort_index(pid: u64, index: i64) -> Self {
        Self::bare("process_sort_index", Phase::Metadata, 0.0, pid, 0)
            .with_arg("sort_index", ArgValue::Int(index))
    }

    /// Set the categories.
    #[must_use]
    pub fn with_cat(mut self, cat: impl Into<String>) -> Self {
        self.cat = cat.into();
        self
    }

    /// Add (or replace) one arg.
    #[must_use]
    pub fn with_arg(mut self, key: impl Into<String>, value: impl Into<ArgValue>) -> Self {
        self.args.insert(key.into(), value.into());
        self
    }

    /// Set the colour name.
    #[must_use]
    pub fn with_cname(mut self, cname: impl Into<String>) -> Self {
        self.cname = Some(cname.into());
        self
    }

    /// End time (`ts + dur`) of a complete event; `ts` for others.
    #[must_use]
    pub fn end(&self) -> f64 {
        self.ts + self.dur.unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Trace {
        let mut t = Trace::new();
        t.display_time_unit = Some(DisplayTimeUnit::Milliseconds);
        t.other_data.insert("schedule".into(), "1f1b".into());
        t.push(TraceEvent::process_name(0, "stage 0"));
        t.push(TraceEvent::process_sort_index(0, 0));
        t.push(TraceEvent::thread_name(0, 0, "compute"));
        t.push(
            TraceEvent::complete("F", 0.0, 10.0, 0, 0)
                .with_cat("compute")
                .with_arg("microbatch", 3usize)
                .with_arg("chunk", 0u32),
        );
        t.push(TraceEvent::complete("idle", 10.0, 2.5, 0, 0).with_cname("grey"));
        t.push(TraceEvent::instant("step", 12.5, 0, 0));
        t.push(TraceEvent::counter(
            "memory",
            12.5,
            0,
            [("activations", 2.0)],
        ));
        t
    }

    #[test]
    fn round_trips_through_json() {
        let t = sample();
        let s = serde_json::to_string(&t).unwrap();
        let back: Trace = serde_json::from_str(&s).unwrap();
        assert_eq!(back, t);
        assert!(t.check().is_ok());
    }

    #[test]
    fn writes_the_chrome_field_names() {
        let v: serde_json::Value = serde_json::to_value(sample()).unwrap();
        assert_eq!(v["displayTimeUnit"], "ms");
        assert_eq!(v["otherData"]["schedule"], "1f1b");
        let f = &v["traceEvents"][3];
        assert_eq!(f["ph"], "X");
        assert_eq!(f["name"], "F");
        assert_eq!(f["dur"], 10.0);
        assert_eq!(f["args"]["microbatch"], 3);
        assert_eq!(v["traceEvents"][0]["ph"], "M");
        assert_eq!(v["traceEvents"][0]["args"]["name"], "stage 0");
        // unset optional fields are omitted, not written as null
        assert!(v["traceEvents"][0].get("dur").is_none());
        assert!(v["traceEvents"][0].get("id").is_none());
    }

    #[test]
    fn reads_a_trace_written_by_another_tool() {
        // Hand-written in the style of chrome://tracing output: string and
        // nested args, legacy "I" instants, missing optional fields.
        let text = r#"{"traceEvents":[
            {"name":"process_name","ph":"M","pid":7,"args":{"name":"GPU 0"}},
            {"name":"kernel","cat":"cuda","ph":"X","ts":1.5,"dur":2,"pid":7,"tid":3,
             "args":{"grid":[1,2,3],"stream":{"id":"7"},"x":null,"ok":true}},
            {"name":"mark","ph":"I","ts":4,"pid":7,"tid":3,"s":"g"},
            {"name":"flow","ph":"s","id":"0x1","ts":1,"pid":7,"tid":3}
        ]}"#;
        let t: Trace = serde_json::from_str(text).unwrap();
        assert_eq!(t.trace_events.len(), 4);
        assert_eq!(t.process_names()[&7], "GPU 0");
        let k = t.complete_events().next().unwrap();
        assert_eq!(k.end(), 3.5);
        assert_eq!(
            k.args["grid"],
            ArgValue::List(vec![ArgValue::Int(1), ArgValue::Int(2), ArgValue::Int(3)])
        );
        assert_eq!(t.trace_events[2].ph, Phase::Instant);
        assert_eq!(t.trace_events[2].s, Some(InstantScope::Global));
        assert_eq!(t.trace_events[3].id.as_deref(), Some("0x1"));
    }

    #[test]
    fn unknown_phase_is_rejected_with_its_name() {
        let err = serde_json::from_str::<TraceEvent>(r#"{"name":"x","ph":"Q"}"#).unwrap_err();
        assert!(err.to_string().contains('Q'), "{err}");
    }

    #[test]
    fn check_names_the_bad_event() {
        let mut t = sample();
        t.push(TraceEvent::complete("B", 5.0, -1.0, 1, 0));
        let err = t.check().unwrap_err();
        assert_eq!(err.index, t.trace_events.len() - 1);
        assert!(err.to_string().contains("dur = -1"), "{err}");
        let mut t = Trace::new();
        t.push(TraceEvent::complete("F", f64::NAN, 1.0, 0, 0));
        assert!(t.check().unwrap_err().to_string().contains("ts = NaN"));
        let mut e = TraceEvent::complete("F", 0.0, 1.0, 0, 0);
        e.dur = None;
        let t = Trace {
            trace_events: vec![e],
            ..Trace::default()
        };
        assert!(t.check().unwrap_err().problem.contains("without dur"));
    }

    #[test]
    fn arg_value_accessors() {
        assert_eq!(ArgValue::from(3u64).as_i64(), Some(3));
        assert_eq!(ArgValue::from(3i32).as_f64(), Some(3.0));
        assert_eq!(ArgValue::from(u64::MAX), ArgValue::Int(i64::MAX));
        assert_eq!(ArgValue::from("a").as_str(), Some("a"));
        assert_eq!(ArgValue::from(true).as_str(), None);
        let v: ArgValue = serde_json::from_str("2.5").unwrap();
        assert_eq!(v, ArgValue::Float(2.5));
    }
}
