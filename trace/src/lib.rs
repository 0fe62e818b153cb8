//! The file formats that weft runs write and its visualizer reads.
//!
//! This crate will own the serde types for Chrome trace events
//! (`trace.json`, also readable by Perfetto), expert-load records
//! (`expert_load.jsonl`) and metrics records (`metrics.jsonl`). It depends on
//! nothing native so that it compiles for `wasm32` as well.
//!
//! Nothing is implemented yet. See the pipeline and viz-web issues.
