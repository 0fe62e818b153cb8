//! Distributed checkpoints that are atomic, verifiable and reshard on load.
//!
//! This crate will own the checkpoint format (one safetensors file per rank
//! plus a `manifest.json` with shapes, shard offsets and checksums), atomic
//! commit, asynchronous saving, retention, loading onto a different layout,
//! and consolidated export.
//!
//! Nothing is implemented yet. See the checkpoint issue for the plan.
