//! Parsing the files of a run folder, with errors that name file and line.
//!
//! `*.jsonl` files follow `weft-trace`'s rule: a final line that does not
//! parse is what a run killed mid-write leaves, so it is skipped with a
//! [`Warning`]; a bad line anywhere else is an error.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use weft_trace::{ExpertLoadRecord, MetricsEvent, MetricsRecord, RunEvent, Trace, TraceEvent};

use crate::error::{LoadError, Warning};

/// Which run file a name (or, failing that, its contents) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// `trace.json` or `*.trace.json`: Chrome trace events.
    Trace,
    /// `metrics.jsonl`.
    Metrics,
    /// `expert_load.jsonl`.
    ExpertLoad,
    /// `config.toml`.
    Config,
    /// `summary.json`.
    Summary,
    /// `events.jsonl`: the supervisor's and the trainer's health and
    /// recovery events (failures, restarts, rewinds, stragglers, faults).
    Events,
}

impl FileKind {
    /// The canonical file names the server offers, in display order.
    pub const RUN_FILES: [&'static str; 6] = [
        "trace.json",
        "metrics.jsonl",
        "expert_load.jsonl",
        "config.toml",
        "summary.json",
        "events.jsonl",
    ];

    /// Classify a file by its name, then by a peek at its first line.
    #[must_use]
    pub fn detect(name: &str, text: &str) -> Option<Self> {
        let base = name.rsplit(['/', '\\']).next().unwrap_or(name);
        match base {
            "metrics.jsonl" => return Some(Self::Metrics),
            "expert_load.jsonl" => return Some(Self::ExpertLoad),
            "summary.json" => return Some(Self::Summary),
            "config.toml" => return Some(Self::Config),
            "events.jsonl" => return Some(Self::Events),
            _ => {}
        }
        if base.ends_with(".toml") {
            return Some(Self::Config);
        }
        let head: String = text.chars().take(4096).collect();
        let first = head.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        if base.ends_with("trace.json") || head.contains("\"traceEvents\"") {
            return Some(Self::Trace);
        }
        if first.contains("\"tokens_per_expert\"") {
            return Some(Self::ExpertLoad);
        }
        if first.contains("\"loss\"") || first.contains("\"event\"") {
            return Some(Self::Metrics);
        }
        if base.ends_with(".json") && head.trim_start().starts_with('[') {
            return Some(Self::Trace);
        }
        None
    }
}

/// One entry of `weft viz`'s `/runs.json`: a run's legend name and the
/// run files it has (the server writes it, the page reads it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunListing {
    /// The legend's name (the run folder's name).
    pub name: String,
    /// The run files present, by name ([`FileKind::RUN_FILES`]).
    pub files: Vec<String>,
}

/// The parser's message without its " at line L column C" suffix.
fn message_of(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    full.strip_suffix(&suffix).unwrap_or(&full).to_owned()
}

fn syntax(file: &str, e: &serde_json::Error, line_offset: usize) -> LoadError {
    let mut message = message_of(e);
    if e.is_eof() {
        message.push_str(" (the file ends early: was it truncated?)");
    }
    LoadError::Syntax {
        file: file.to_owned(),
        line: e.line() + line_offset,
        column: e.column(),
        message,
    }
}

/// Parse a `trace.json`: the JSON Object Format (`{"traceEvents": [...]}`)
/// or the JSON Array Format (`[...]`), then [`Trace::check`] it.
///
/// # Errors
/// [`LoadError::Syntax`] with line and column for bad or truncated JSON,
/// [`LoadError::Invalid`] for an empty trace or an event that would be
/// mis-drawn.
pub fn parse_trace(file: &str, text: &str) -> Result<Trace, LoadError> {
    if text.trim().is_empty() {
        return Err(LoadError::Invalid {
            file: file.to_owned(),
            message: "the file is empty (expected {\"traceEvents\": [...]})".into(),
        });
    }
    let trace = if text.trim_start().starts_with('[') {
        let events: Vec<TraceEvent> =
            serde_json::from_str(text).map_err(|e| syntax(file, &e, 0))?;
        Trace {
            trace_events: events,
            ..Trace::default()
        }
    } else {
        serde_json::from_str::<Trace>(text).map_err(|e| syntax(file, &e, 0))?
    };
    trace.check().map_err(|e| LoadError::Invalid {
        file: file.to_owned(),
        message: e.to_string(),
    })?;
    if trace.complete_events().next().is_none() {
        return Err(LoadError::Invalid {
            file: file.to_owned(),
            message: "no complete (\"ph\": \"X\") events: nothing to draw".into(),
        });
    }
    Ok(trace)
}

/// Parse JSON Lines: each non-blank line through `parse_line`. A final
/// line that fails is skipped with a warning (a run killed mid-write).
fn parse_jsonl<T>(
    file: &str,
    text: &str,
    mut parse_line: impl FnMut(&str) -> Result<T, serde_json::Error>,
) -> Result<(Vec<T>, Vec<Warning>), LoadError> {
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
        .collect();
    let mut out = Vec::with_capacity(lines.len());
    let mut warnings = Vec::new();
    for (k, &(line, l)) in lines.iter().enumerate() {
        match parse_line(l) {
            Ok(v) => out.push(v),
            Err(e) if k + 1 == lines.len() && (e.is_eof() || e.is_syntax()) => {
                warnings.push(Warning {
                    file: file.to_owned(),
                    line,
                    message: format!(
                        "last line does not parse ({}); skipped, as a run killed mid-write leaves one",
                        syntax(file, &e, line - 1)
                    ),
                });
            }
            Err(e) if e.is_data() => {
                return Err(LoadError::Schema {
                    file: file.to_owned(),
                    line,
                    message: message_of(&e),
                });
            }
            Err(e) => return Err(syntax(file, &e, line - 1)),
        }
    }
    Ok((out, warnings))
}

/// An event as a marker on a step axis, for display: its step, its kind
/// (the `event` value) and its other fields as `key=value` text. Built
/// from the typed events ([`Marker::of_metrics`], [`Marker::of_run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    /// The step it belongs to.
    pub step: u64,
    /// Its `event` value (`eval`, `skip`, `spike`, `restart`, ...).
    pub kind: String,
    /// The other fields, as `key=value` pairs (nulls left out).
    pub detail: Vec<(String, String)>,
}

impl Marker {
    /// The fields of `value` but `skip`'s, as `key=value` text.
    fn detail(value: &Value, skip: &[&str]) -> Vec<(String, String)> {
        value
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| !skip.contains(&k.as_str()) && !v.is_null())
            .map(|(k, v)| (k.clone(), value_text(v)))
            .collect()
    }

    /// A `metrics.jsonl` evaluation or health event.
    #[must_use]
    pub fn of_metrics(e: &MetricsEvent) -> Self {
        let value = serde_json::to_value(e).unwrap_or_default();
        Marker {
            step: e.step,
            kind: e.kind.name().to_owned(),
            detail: Self::detail(&value, &["event", "step"]),
        }
    }

    /// An `events.jsonl` event, where it has a place on the step axis
    /// ([`weft_trace::EventKind::step`]; `time` kept as a detail).
    #[must_use]
    pub fn of_run(e: &RunEvent) -> Option<Self> {
        let step = e.kind.step()?;
        let value = serde_json::to_value(e).unwrap_or_default();
        Some(Marker {
            step,
            kind: e.kind.name().to_owned(),
            detail: Self::detail(&value, &["event", "step"]),
        })
    }
}

/// `metrics.jsonl`: step records and the other lines, typed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsLog {
    /// Step records, in file order.
    pub records: Vec<MetricsRecord>,
    /// Evaluations and health events, in file order.
    pub events: Vec<MetricsEvent>,
}

enum MetricsLine {
    Record(MetricsRecord),
    Event(MetricsEvent),
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Parse `metrics.jsonl`. Lines with an `event` key are [`MetricsEvent`]s;
/// every other line is a [`MetricsRecord`].
///
/// # Errors
/// [`LoadError`] naming the first bad line (other than a truncated last
/// one).
pub fn parse_metrics(file: &str, text: &str) -> Result<(MetricsLog, Vec<Warning>), LoadError> {
    let (lines, warnings) = parse_jsonl(file, text, |l| {
        let map: Map<String, Value> = serde_json::from_str(l)?;
        if map.contains_key("event") {
            serde_json::from_value::<MetricsEvent>(Value::Object(map)).map(MetricsLine::Event)
        } else {
            serde_json::from_value::<MetricsRecord>(Value::Object(map)).map(MetricsLine::Record)
        }
    })?;
    let mut log = MetricsLog::default();
    for l in lines {
        match l {
            MetricsLine::Record(r) => log.records.push(r),
            MetricsLine::Event(e) => log.events.push(e),
        }
    }
    Ok((log, warnings))
}

/// Parse `events.jsonl` into [`RunEvent`]s.
///
/// # Errors
/// [`LoadError`] naming the first bad line (other than a truncated last
/// one): not an object, or no `event`.
pub fn parse_events(file: &str, text: &str) -> Result<(Vec<RunEvent>, Vec<Warning>), LoadError> {
    parse_jsonl(file, text, |l| serde_json::from_str(l))
}

/// Parse `expert_load.jsonl` into records (file order).
///
/// # Errors
/// [`LoadError`] naming the first bad line.
pub fn parse_expert_load(
    file: &str,
    text: &str,
) -> Result<(Vec<ExpertLoadRecord>, Vec<Warning>), LoadError> {
    parse_jsonl(file, text, |l| serde_json::from_str(l))
}

/// `summary.json` flattened to `(dotted.key, value)` rows.
///
/// # Errors
/// [`LoadError::Syntax`] when it is not JSON, [`LoadError::Invalid`] when
/// it is not an object.
pub fn parse_summary(file: &str, text: &str) -> Result<Vec<(String, String)>, LoadError> {
    let v: Value = serde_json::from_str(text).map_err(|e| syntax(file, &e, 0))?;
    if !v.is_object() {
        return Err(LoadError::Invalid {
            file: file.to_owned(),
            message: "expected a JSON object".into(),
        });
    }
    let mut rows = Vec::new();
    flatten("", &v, &mut rows);
    Ok(rows)
}

fn flatten(prefix: &str, v: &Value, rows: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, x, rows);
            }
        }
        other => rows.push((prefix.to_owned(), value_text(other))),
    }
}

/// The corpus' entropy floor (the best achievable loss), looked for under
/// the keys weft's trainer uses (`entropy_floor`, `loss_floor`,
/// `val_floor`, at any depth) in `summary.json` rows or `config.toml` text.
#[must_use]
pub fn entropy_floor(summary: &[(String, String)], config: Option<&str>) -> Option<f64> {
    const KEYS: [&str; 4] = ["entropy_floor", "loss_floor", "val_floor", "floor"];
    let is_floor = |k: &str| {
        let last = k.rsplit('.').next().unwrap_or(k);
        KEYS.contains(&last)
    };
    for (k, v) in summary {
        if is_floor(k)
            && let Ok(x) = v.parse::<f64>()
            && x.is_finite()
        {
            return Some(x);
        }
    }
    for line in config?.lines() {
        let line = line.split('#').next().unwrap_or("");
        if let Some((k, v)) = line.split_once('=')
            && is_floor(k.trim())
            && let Ok(x) = v.trim().parse::<f64>()
            && x.is_finite()
        {
            return Some(x);
        }
    }
    None
}

/// Parse any JSON value type line by line (used by tests and tools).
///
/// # Errors
/// As for the other `*.jsonl` parsers.
pub fn parse_jsonl_of<T: DeserializeOwned>(
    file: &str,
    text: &str,
) -> Result<(Vec<T>, Vec<Warning>), LoadError> {
    parse_jsonl(file, text, |l| serde_json::from_str(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_trace_names_file_and_line() {
        let text = "{\"traceEvents\": [\n{\"name\":\"F\",\"ph\":\"X\",\"ts\":0,\"dur\":1},\n{\"name\":\"B\",\"ph\":\"X\",\"ts\":1,";
        let err = parse_trace("trace.json", text).unwrap_err();
        match &err {
            LoadError::Syntax { file, line, .. } => {
                assert_eq!(file, "trace.json");
                assert_eq!(*line, 3);
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn bad_phase_and_bad_duration_are_named() {
        let err = parse_trace(
            "t.json",
            "{\"traceEvents\":[\n{\"name\":\"F\",\"ph\":\"Q\",\"ts\":0}]}",
        )
        .unwrap_err();
        assert!(matches!(err, LoadError::Syntax { line: 2, .. }), "{err:?}");
        let err = parse_trace(
            "t.json",
            "{\"traceEvents\":[{\"name\":\"F\",\"ph\":\"X\",\"ts\":0,\"dur\":-2}]}",
        )
        .unwrap_err();
        assert!(err.to_string().contains("dur = -2"), "{err}");
        let err = parse_trace("t.json", "  ").unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        let err = parse_trace("t.json", "{\"traceEvents\":[]}").unwrap_err();
        assert!(err.to_string().contains("nothing to draw"), "{err}");
    }

    #[test]
    fn array_format_is_read() {
        let t = parse_trace(
            "a.json",
            "[{\"name\":\"F\",\"ph\":\"X\",\"ts\":0,\"dur\":1}]",
        )
        .unwrap();
        assert_eq!(t.trace_events.len(), 1);
    }

    #[test]
    fn metrics_with_events_and_a_torn_last_line() {
        let text = r#"{"step":1,"loss":3.0,"lr":0.001,"grad_norm":1.0,"tokens_per_s":100,"time_s":1}
{"step":1,"event":"eval","val_loss":2.9}
{"step":2,"loss":"NaN","lr":0.001,"grad_norm":"Infinity","tokens_per_s":100,"time_s":2}
{"step":2,"event":"skip","loss":"NaN","grad_norm":null}
{"step":3,"loss":2.8,"lr":0.0"#;
        let (log, warnings) = parse_metrics("metrics.jsonl", text).unwrap();
        assert_eq!(log.records.len(), 2);
        assert!(log.records[1].loss.is_nan());
        assert_eq!(log.events.len(), 2);
        let skip = Marker::of_metrics(&log.events[1]);
        assert_eq!((skip.step, skip.kind.as_str()), (2, "skip"));
        assert_eq!(
            skip.detail,
            vec![
                ("grad_norm".to_owned(), "NaN".to_owned()),
                ("loss".to_owned(), "NaN".to_owned())
            ]
        );
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].line, 5);
    }

    #[test]
    fn a_bad_line_in_the_middle_is_an_error_naming_it() {
        let text = "{\"step\":1,\"loss\":3.0,\"lr\":0.001,\"grad_norm\":1.0,\"tokens_per_s\":100,\"time_s\":1}\n{\"step\":2,\"loss\":3.0}\n{\"step\":3,\"event\":\"spike\"}\n";
        let err = parse_metrics("metrics.jsonl", text).unwrap_err();
        assert!(
            matches!(&err, LoadError::Schema { line: 2, message, .. } if message.contains("lr")),
            "{err:?}"
        );
        let err =
            parse_metrics("metrics.jsonl", "{oops\n{\"step\":1,\"event\":\"x\"}\n").unwrap_err();
        assert!(matches!(err, LoadError::Syntax { line: 1, .. }), "{err:?}");
        let err = parse_expert_load(
            "expert_load.jsonl",
            "{\"step\":1,\"layer\":0,\"tokens_per_expert\":[1,-2],\"dropped\":0}\n\n{\"step\":1,\"layer\":0,\"tokens_per_expert\":[1],\"dropped\":0}",
        )
        .unwrap_err();
        assert!(matches!(err, LoadError::Schema { line: 1, .. }), "{err:?}");
    }

    #[test]
    fn run_events_are_typed_and_placed_on_the_step_axis() {
        let text = concat!(
            r#"{"time":1.0,"event":"start","attempt":0,"resume":false,"pid":4,"dp":1,"ranks":1}"#,
            "\n",
            r#"{"time":2.0,"event":"rewind","step":9,"reason":"spike","to_step":5,"skipped_batches":[9],"rewinds":1}"#,
            "\n"
        );
        let (events, warnings) = parse_events("events.jsonl", text).unwrap();
        assert!(warnings.is_empty());
        let markers: Vec<Marker> = events.iter().filter_map(Marker::of_run).collect();
        assert_eq!(markers.len(), 1, "a start has no step");
        assert_eq!((markers[0].step, markers[0].kind.as_str()), (9, "rewind"));
        assert!(
            markers[0]
                .detail
                .contains(&("to_step".to_owned(), "5".to_owned()))
        );
        let e = parse_events("events.jsonl", "{\"time\":1}\n{\"time\":2}\n").unwrap_err();
        assert!(e.to_string().contains("event"), "{e}");
    }

    #[test]
    fn detection_by_name_and_content() {
        assert_eq!(
            FileKind::detect("runs/x/trace.json", ""),
            Some(FileKind::Trace)
        );
        assert_eq!(FileKind::detect("zb.trace.json", ""), Some(FileKind::Trace));
        assert_eq!(
            FileKind::detect(
                "a.jsonl",
                "{\"step\":1,\"layer\":0,\"tokens_per_expert\":[1]}"
            ),
            Some(FileKind::ExpertLoad)
        );
        assert_eq!(
            FileKind::detect("m.jsonl", "{\"step\":1,\"loss\":2}"),
            Some(FileKind::Metrics)
        );
        assert_eq!(FileKind::detect("notes.txt", "hello"), None);
    }

    #[test]
    fn summary_flattens_and_floor_is_found() {
        let rows = parse_summary(
            "summary.json",
            r#"{"steps":10,"data":{"entropy_floor":1.25}}"#,
        )
        .unwrap();
        assert_eq!(
            rows[0],
            ("data.entropy_floor".to_owned(), "1.25".to_owned())
        );
        assert_eq!(entropy_floor(&rows, None), Some(1.25));
        assert_eq!(
            entropy_floor(&[], Some("[data]\nloss_floor = 0.5 # nats\n")),
            Some(0.5)
        );
        assert_eq!(entropy_floor(&[], Some("lr = 3e-4")), None);
        assert!(parse_summary("summary.json", "[1]").is_err());
    }
}
