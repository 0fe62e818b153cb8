//! Runs side by side, for the command line (`weft compare`) and the
//! browser (`weft viz` with several runs) alike: one crate both use, so
//! both show the same figures. Native-friendly and wasm-friendly: it
//! depends on serde, `weft-trace` and TOML only.
//!
//! # Overview
//! * [`load`] — parse a run folder's files (`trace.json`,
//!   `metrics.jsonl`, `events.jsonl`, `expert_load.jsonl`,
//!   `summary.json`) into `weft-trace`'s types, with errors that name
//!   the file and the line ([`LoadError`]; a torn last line is a
//!   [`Warning`]), and [`load::Marker`]s for showing events on a step
//!   axis.
//! * [`stats`] — curves aligned by step, their per-step difference
//!   ([`stats::StepDiff`]), the interval on two groups of seeds (paired
//!   by seed, [`stats::Paired`], where both ran the same seeds; Welch's,
//!   [`stats::Welch`], otherwise) and the [`stats::Verdict`].
//! * [`Report`] — runs (or groups of seeds, as `weft train --seeds N`
//!   writes them) against a baseline: configuration differences, curves,
//!   final figures, throughput, memory, bubble, MaxVio, health events and
//!   the verdict, as a table, JSON or SVG plots ([`write_plots`]).
//! * [`chart`] — the one SVG chart implementation: the page's curves,
//!   these plots and `weft plan --plot`'s.
//!
//! # Example
//! ```
//! use weft_compare::stats::{StepDiff, Verdict, verdict};
//!
//! let a = [(1, 3.0), (2, 2.5), (3, 2.25)];
//! let b = [(1, 3.0), (2, 2.5), (3, 2.0)];
//! let d = StepDiff::between(&a, &b);
//! assert_eq!((d.bitwise_span, d.first_differing), (2, Some(3)));
//! // three seeds a side, not paired by seed (`None`), no tolerance
//! let v = verdict(&d, &[2.30, 2.31, 2.29], &[2.20, 2.21, 2.19], None, None);
//! assert!(matches!(v, Verdict::Better { n_a: 3, n_b: 3, .. }), "{v}");
//! ```
//!
//! # Crate features
//! None.

#![deny(missing_docs)]

pub mod chart;
mod error;
pub mod load;
mod report;
pub mod stats;

pub use error::{LoadError, Warning};
pub use report::{
    Against, CompareError, Group, GroupFigures, Metric, Options, Report, RunData, load_group,
    load_run, write_plots,
};
