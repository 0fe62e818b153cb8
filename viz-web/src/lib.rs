//! The browser visualizer for weft runs.
//!
//! This crate will become a yew application built to WebAssembly that replays
//! pipeline schedules, expert-load heatmaps and training metrics from a run
//! folder, reading them through the types in `weft-trace`.
//!
//! Nothing is implemented yet. See the viz-web issue for the plan.
