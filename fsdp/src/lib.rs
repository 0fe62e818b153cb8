//! Fully sharded data parallelism.
//!
//! This crate will own per-unit flat parameters, the no-shard, ZeRO-1/2/3 and
//! hybrid (HSDP) strategies, all-gather prefetch overlapped with compute,
//! gradient reduce-scatter, sharded AdamW and gradient clipping, a
//! mixed-precision policy, and honest per-rank memory accounting.
//!
//! Nothing is implemented yet. See the fsdp issue for the plan.
