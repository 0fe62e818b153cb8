//! weft's browser visualizer: replays a run's pipeline schedule, expert
//! load and training metrics.
//!
//! The crate builds two ways. For `wasm32-unknown-unknown` it is a yew app
//! (`viz-web/build.sh` builds it with cargo and `wasm-bindgen` into
//! `viz-web/dist/`). On the host it is a library: the parsing and layout
//! that the app draws with, testable with plain `cargo test`, and the small
//! HTTP server that `weft viz runs/<name> [runs/<other> ...]` uses to serve
//! the page and the run folders (several runs: their metrics overlaid, the
//! folder names as legend, and each run's loss step by step against the
//! first run's).
//!
//! The built page is committed in `viz-web/page/` and compiled into the
//! server ([`page::EMBEDDED`]), so `weft viz` needs no browser toolchain,
//! neither on a fresh clone nor from an installed binary. Its stamp
//! (`viz-web/page/SOURCES`, [`page::Stamp`]) records the sources it was
//! built from; a test fails when they have changed since, naming the
//! command that rebuilds it (`bash viz-web/build.sh --commit`). A page
//! built from the current sources (`bash viz-web/build.sh`, into
//! `viz-web/dist/`) is served with `weft viz --assets viz-web/dist`.
//!
//! # Overview
//! * [`load`] — parse `trace.json`, `metrics.jsonl` (records and health
//!   events), `expert_load.jsonl`, `summary.json`; every error is a
//!   [`LoadError`] naming file and line.
//! * [`timeline::Timeline`] — trace events in lanes, the pipeline bubble
//!   per step (the trainer's and the simulator's definition, step windows
//!   from the slices' `args.step`), makespan, and a level-of-detail layout
//!   whose rectangle count is bounded by the pixel width, so 100k-event
//!   traces stay responsive.
//! * [`expert::ExpertLoad`] — the steps × experts matrices, max/mean and
//!   MaxVio curves, and the heatmap as a BMP image.
//! * [`chart`] — line charts downsampled to pixel columns (spikes kept).
//! * [`compare`] — runs side by side: curves aligned by step, their
//!   per-step difference, Welch's interval for groups of seeds and the
//!   verdict (`weft compare` prints the same figures).
//! * [`run::Run`] — one run's state: one slot per run file;
//!   [`run::Runs`] — the runs on the page, named, the first the one the
//!   others are compared with.
//! * [`app::App`] — the yew components (rendered natively with yew's SSR in
//!   the tests).
//! * `serve` (native only) — [`serve::Server`]: `GET` on 127.0.0.1 for the
//!   page ([`serve::Assets`]: embedded or a folder) and the run files; no
//!   path traversal.
//! * `page` (native only) — the embedded page, its stamp, and the check
//!   that it is not stale.
//!
//! # Example
//! ```
//! use weft_viz_web::run::Run;
//!
//! let mut run = Run::default();
//! run.ingest("trace.json", r#"{"traceEvents":[
//!     {"name":"F","ph":"X","ts":0,"dur":10,"pid":0,"args":{"microbatch":0}},
//!     {"name":"F","ph":"X","ts":10,"dur":10,"pid":1,"args":{"microbatch":0}}]}"#);
//! let tl = run.trace.get().unwrap();
//! assert_eq!(tl.lanes.len(), 2);
//! assert_eq!(tl.makespan(), 20.0);
//! assert_eq!(tl.bubble_fraction, 0.5);
//!
//! run.ingest("metrics.jsonl", "{\"step\":1,\"loss\":3.0,\"lr\":0.001,\"grad_norm\":1,\"tokens_per_s\":9,\"time_s\":1}\n{\"step\":");
//! assert_eq!(run.metrics.get().unwrap().records.len(), 1);
//! assert_eq!(run.warnings()[0].line, 2); // the torn last line is skipped
//! ```
//!
//! # Crate features
//! None. Browser-only dependencies are target-specific (`wasm32`); on other
//! targets the browser glue is replaced by stand-ins that do nothing.

#![deny(missing_docs)]

pub mod app;
pub mod chart;
pub mod compare;
pub mod error;
pub mod expert;
pub mod load;
#[cfg(not(target_arch = "wasm32"))]
pub mod page;
pub mod run;
#[cfg(not(target_arch = "wasm32"))]
pub mod serve;
pub mod timeline;
mod web;

pub use error::{LoadError, Warning};

/// Entry point of the wasm module: mount [`app::App`] on `<body>`.
#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen(start)]
pub fn start() {
    yew::Renderer::<app::App>::with_props(app::AppProps {
        initial: run::Runs::default(),
        fetch: true,
        tab: None,
    })
    .render();
}
