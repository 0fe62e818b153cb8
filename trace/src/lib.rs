//! The file formats that weft runs write and its visualizer reads.
//!
//! Every run writes into its own folder; this crate owns the types of the
//! files in it that are meant to be read back by tools, so the writers (the
//! trainer, `weft-pipeline`, `weft-moe`) and the readers (weft's browser
//! visualizer, scripts) agree on one schema. It depends on `serde` alone —
//! nothing native — so the visualizer compiles it for `wasm32`. Writing and
//! reading JSON is left to the caller's choice of serializer
//! (`serde_json` everywhere in weft).
//!
//! # Overview
//! * [`Trace`] and [`TraceEvent`] — `trace.json`, Chrome trace events (the
//!   Trace Event Format's JSON object form; it opens in Perfetto and
//!   `chrome://tracing`). Times are microseconds. weft writes one process per
//!   pipeline stage or rank and complete slices ([`Phase::Complete`]) with
//!   structured [`ArgValue`] args; [`Trace::check`] catches what viewers
//!   mis-draw.
//! * [`MetricsRecord`] — one line of `metrics.jsonl` per optimizer step:
//!   step, loss, learning rate, gradient norm, tokens/s, elapsed time.
//! * [`ExpertLoadRecord`] — one line of `expert_load.jsonl` per (step, MoE
//!   layer): tokens per expert, tokens dropped and the router's entropy.
//! * [`MetricsEvent`] — the other lines of `metrics.jsonl`: evaluations
//!   and health events (skipped updates, fp16 overflows, loss spikes).
//! * [`RunEvent`] — one line of `events.jsonl`: the supervisor's starts,
//!   failures, restarts and end, and the ranks' rewinds, stragglers and
//!   drilled faults ([`EventKind`]).
//! * [`Summary`] — `summary.json`, a finished run's figures.
//! * [`input`] — how every weft reader opens a file a user named: regular
//!   files only, with bounds on file, line and decompressed sizes.
//! * [`tensorboard`] — TensorBoard event files ([`EventWriter`]: scalars
//!   and texts as TFRecords of `Event` protobufs, encoded by hand) and
//!   [`read_records`], which checks both checksums of every record.
//!
//! # Schema
//! `*.jsonl` files hold one JSON object per line, each a complete record;
//! readers must skip a final line that does not parse (a run killed mid-write
//! leaves one). Each record type documents its keys in a table: see
//! [`MetricsRecord`] and [`ExpertLoadRecord`]. Floating-point fields of
//! records write NaN and infinities as the strings `"NaN"`, `"Infinity"`,
//! `"-Infinity"` (JSON has no literal for them). Readers ignore unknown
//! keys, so new optional keys can be added without breaking old readers.
//! Numbers are written in shortest round-trip form; a reader gets the
//! writer's values bit for bit if its parser rounds correctly (serde_json
//! does with its `float_roundtrip` feature, as the tests here use).
//!
//! # Example
//! ```
//! use weft_trace::{MetricsRecord, Trace, TraceEvent};
//!
//! // A two-slice trace for stage 0 of a pipeline.
//! let mut trace = Trace::new();
//! trace.push(TraceEvent::process_name(0, "stage 0"));
//! trace.push(TraceEvent::complete("F", 0.0, 100.0, 0, 0).with_arg("microbatch", 0u32));
//! trace.push(TraceEvent::complete("B", 100.0, 200.0, 0, 0).with_arg("microbatch", 0u32));
//! trace.check().unwrap();
//! let json = serde_json::to_string(&trace).unwrap();
//! assert_eq!(serde_json::from_str::<Trace>(&json).unwrap(), trace);
//!
//! // One metrics line, with a loss that diverged.
//! let m = MetricsRecord { step: 7, loss: f64::NAN, lr: 1e-3, grad_norm: 1.5,
//!                         tokens_per_s: 900.0, time_s: 12.0, loss_scale: None,
//!                         mfu: Some(0.4), max_vio: None, rss_bytes: None };
//! let line = serde_json::to_string(&m).unwrap();
//! assert!(line.contains(r#""loss":"NaN""#));
//! assert!(serde_json::from_str::<MetricsRecord>(&line).unwrap().loss.is_nan());
//! ```
//!
//! # Crate features
//! None. The crate always builds for `wasm32-unknown-unknown`.

#![deny(missing_docs)]

mod chrome;
mod events;
mod expert;
pub mod float;
pub mod input;
mod metrics;
mod summary;
pub mod tensorboard;

pub use chrome::{ArgValue, DisplayTimeUnit, InstantScope, Phase, Trace, TraceError, TraceEvent};
pub use events::{BatchPosition, EventKind, MetricsEvent, MetricsEventKind, RunEvent};
pub use expert::ExpertLoadRecord;
pub use metrics::MetricsRecord;
pub use summary::{AxisBytes, MemoryBytes, PipelineBubble, StepTraffic, Summary};
pub use tensorboard::{EventWriter, RecordError, read_records};
