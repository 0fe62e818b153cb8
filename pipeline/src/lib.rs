//! Pipeline parallelism for any model: schedules, their validation, their
//! bubble, and an executor over stages of your own.
//!
//! Pipeline parallelism cuts the layer stack into stages on different
//! devices and streams micro-batches through them; its enemy is the
//! *bubble*, the time stages sit idle waiting for each other. This crate
//! generates the known schedules, proves a schedule runnable, predicts its
//! bubble, makespan and activation memory before anything runs, chooses
//! where to cut the layers, exports the timeline as a trace, and runs a
//! schedule over real stages of any model (it does not depend on weft's
//! model crate).
//!
//! # Overview
//! * [`Schedule`]: per stage, the ordered [`Action`]s — forward `F`, whole
//!   backward `BW`, or the split backward `B` (input gradient) and `W`
//!   (weight gradient) — on (micro-batch, chunk). [`Placement`] maps each
//!   stage's chunks to positions in the layer stack (interleaved or V).
//!   Communication is implied by the dependencies (see [`Schedule`]). A
//!   text format ([`Schedule::parse`], `Display`) lets users write their own.
//! * Generators, each documenting its expected bubble and peak memory:
//!   [`gpipe`], [`one_f_one_b`], [`interleaved`], [`zb_h1`], [`zb_h2`],
//!   [`zb_v`], the memory-limited greedy [`list_schedule`]; by name through
//!   [`ScheduleKind`], whose [`ScheduleKind::expected_bubble`] holds the
//!   papers' formulas.
//! * [`validate()`] / [`validate_with_limit`]: exactly-once, local order,
//!   freedom from deadlock under buffered sends and blocking receives, and an
//!   in-flight memory limit; errors name the stage, step and action.
//! * [`simulate()`] with [`Costs`] (per-chunk `F`, `B`, `W`, memory; p2p
//!   latency) gives a [`Timeline`]: start and end of every action, makespan,
//!   bubble fraction, peak activation memory per stage;
//!   [`steady_state_period`] measures iterations run back to back (the
//!   zero-bubble papers' post-validation). [`Timeline::to_trace`] exports
//!   Chrome trace events ([`weft_trace::Trace`]).
//! * [`partition()`]: per-layer profiles ([`LayerProfile`]) to the contiguous
//!   split (and so chunk assignment) with the smallest simulated makespan
//!   under a per-stage memory limit; [`partition_transformer`] applies it
//!   to a decoder's per-layer FLOPs ([`transformer_profiles`] of a
//!   [`TransformerShape`]: blocks that may differ — grouped-query
//!   attention, SwiGLU, sliding windows, dense and mixture-of-experts
//!   layers — and the head on the last), and [`compare_splits`] shows
//!   what it removes against the equal-layer split.
//! * [`plan()`]: from command-line parameters ([`PlanRequest`]) to the table
//!   and trace that `weft pipeline` prints and writes.
//!
//! * [`Executor`]: runs a schedule for real over any model. Each rank (a
//!   thread of the local backend, or a process) owns one [`Stage`] per
//!   chunk — a contiguous range of the model's layers; the first virtual
//!   stage reads the micro-batch's input, the last computes the loss —
//!   and [`Executor::step`] runs its action list, activations and
//!   gradients flowing by send/recv. Parameters two stages share (tied
//!   embeddings) go through a generic hook ([`Shared`]); a
//!   [forward-only](Schedule::forward_only) schedule evaluates a pipelined
//!   model in place. Gradients accumulate in place, or are handed per
//!   micro-batch to a hook for exact accumulation. weft's GPT implements
//!   [`Stage`] in `weft-model` (`GptStage`); `examples/mlp_stack.rs` trains
//!   a stack of MLP layers written in the example itself over 2 and 4
//!   thread ranks and checks it against one rank. Each step's measured timeline
//!   ([`RankTimeline`], gathered with [`Executor::gather_timelines`])
//!   becomes a [`Measured`]: the measured bubble, the mean action costs,
//!   the simulator's prediction from those costs
//!   ([`Measured::predicted`]), and a Chrome trace with the receive waits
//!   ([`Measured::to_trace`]).
//!
//! `cargo run --release -p weft-model --example pipeline_bubble` runs
//! 1F1B and ZB-H1 over GPT stages at p = 2, m = 8 and prints measured
//! beside predicted bubble.
//!
//! # Example
//! ```
//! use weft_pipeline::{Costs, ScheduleKind, simulate, validate};
//!
//! let (p, m) = (4, 8);
//! let one = ScheduleKind::OneFOneB.generate(p, m, 1)?;
//! let zb = ScheduleKind::ZbH1.generate(p, m, 1)?;
//! validate(&zb)?;
//! let cost = |s| Costs::per_stage(s, 1.0, 1.0, 1.0, 0.0); // F = B = W
//! let t1 = simulate(&one, &cost(&one))?;
//! let tz = simulate(&zb, &cost(&zb))?;
//! // 1F1B: (p-1)/(m+p-1); ZB-H1 idles a third as long, at the same memory.
//! assert!((t1.bubble_fraction() - 3.0 / 11.0).abs() < 1e-12);
//! assert_eq!(t1.idle(0), 3.0 * tz.idle(0));
//! assert_eq!(one.peak_in_flight()[0], zb.peak_in_flight()[0]);
//!
//! let trace = tz.to_trace(1000.0); // serialize with serde_json into trace.json
//! assert!(trace.check().is_ok());
//! # Ok::<(), weft_pipeline::Error>(())
//! ```
//!
//! Run `cargo run -p weft-pipeline --example schedules` for every schedule's
//! table side by side.
//!
//! # Crate features
//! * `serde`: [`ScheduleKind`] (de)serializes by its name (`"gpipe"`,
//!   `"1f1b"`, `"interleaved"`, `"zb-h1"`, `"zb-h2"`, `"zb-v"`), the one
//!   spelling job files use.

#![deny(missing_docs)]

mod error;
mod execute;
mod export;
mod generate;
mod job_trace;
mod partition;
mod plan;
mod schedule;
mod simulate;
mod stage;
mod validate;

pub use error::{Error, Result, Wait};
pub use execute::{
    ExecError, ExecResult, Executor, GradEvent, Measured, RankTimeline, StepReport,
    gather_timelines, peak_in_flight_per_chunk,
};
pub use generate::{
    MAX_SCHEDULE_PASSES, ScheduleKind, gpipe, interleaved, list_schedule, one_f_one_b, zb_h1,
    zb_h2, zb_v,
};
pub use job_trace::{BubbleLog, StepBubble, StepTrace, step_trace};
pub use partition::{
    BlockShape, FeedForwards, FfnShape, LayerProfile, Partition, PartitionOptions, SplitComparison,
    TransformerShape, attended_keys, compare_splits, equal_split, evaluate, layer_profiles,
    partition, partition_transformer, transformer_profiles,
};
pub use plan::{Plan, PlanRequest, plan};
pub use schedule::{Action, ActionKind, Placement, Schedule};
pub use simulate::{ChunkCost, Costs, Slot, Timeline, simulate, steady_state_period};
pub use stage::{Shared, Stage};
pub use validate::{validate, validate_with_limit};
