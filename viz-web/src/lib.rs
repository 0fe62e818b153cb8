//! weft's browser visualizer: replays a run's pipeline schedule, expert
//! load and training metrics, and shows several runs side by side.
//!
//! The crate builds two ways. For `wasm32-unknown-unknown` it is a yew app
//! (`viz-web/build.sh` builds it with cargo and `wasm-bindgen` into
//! `viz-web/dist/`, or with `--commit` into `viz/page/`, the page that
//! `weft-viz` compiles in and serves for `weft viz runs/<name> ...`). On
//! the host it is a library: the layout the app draws with and the
//! components themselves, testable with plain `cargo test` (yew's SSR).
//! Reading the run files, the charts and the side-by-side statistics are
//! `weft-compare`'s, shared with `weft compare`, so the page and the
//! command line show the same figures.
//!
//! # Overview
//! * [`timeline::Timeline`] — trace events in lanes, the pipeline bubble
//!   per step (the trainer's and the simulator's definition, step windows
//!   from the slices' `args.step`), makespan, and a level-of-detail layout
//!   whose rectangle count is bounded by the pixel width, so 100k-event
//!   traces stay responsive.
//! * [`expert::ExpertLoad`] — the steps × experts matrices, max/mean and
//!   MaxVio curves, and the heatmap as a BMP image.
//! * [`plot`] — what the metrics charts compute before drawing, as
//!   TensorBoard's do: smoothing, a y-range that ignores outliers, the last
//!   part of a run, log ticks, tokens per step, readable numbers.
//! * [`run::Run`] — one run's state: one slot per run file;
//!   [`run::Runs`] — the runs on the page, named, the first the one the
//!   others are compared with.
//! * [`app::App`] — the yew components (rendered natively with yew's SSR in
//!   the tests).
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
pub mod expert;
pub mod plot;
pub mod run;
pub mod timeline;
mod web;

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
