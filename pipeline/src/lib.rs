//! Pipeline parallelism: schedules and the bubble.
//!
//! This crate will own schedule generators (GPipe, 1F1B, interleaved 1F1B,
//! zero-bubble ZB-H1/ZB-H2 and a bidirectional schedule), a validator, a
//! simulator that predicts bubble fraction and peak activation memory, a stage
//! partitioner, trace export and an executor over real stages.
//!
//! Nothing is implemented yet. See the pipeline issue for the plan.
