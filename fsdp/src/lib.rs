//! Fully sharded data parallelism: each rank keeps 1/N of every unit's
//! parameters, gradients and optimizer state, gathers a unit just before
//! using it, and hides the communication behind the computation.
//!
//! # Overview
//! - [`UnitPlan`] / [`Unit`]: the model's single parameter buffer
//!   ([`weft_model::ParamLayout`]) cut into flat units — `embed`, one per
//!   transformer block, `head` — each sharded evenly over the group with
//!   padding (see [`UnitPlan`] for padding and tied embeddings);
//!   [`UnitPlan::shard_pieces`] names what a rank's shard holds as Hugging
//!   Face tensors and row/column boxes, for checkpoints.
//! - [`Strategy`]: `none` (DDP), `optimizer` (ZeRO-1), `grad_op` (ZeRO-2),
//!   `full` (ZeRO-3), `hybrid` (HSDP over a 2-d mesh: shard within a group
//!   of ranks, replicate across groups).
//! - [`Precision`]: parameter dtype (f32 or bf16) for gathering and
//!   compute, gradient reduction dtype (f32 or bf16 on the wire, every
//!   addition in f32); master weights and AdamW moments are f32 on the shard.
//! - [`Fsdp`]: the runner. [`Fsdp::step`] runs forward and backward of this
//!   rank's micro-batches unit by unit with the model's per-block API
//!   ([`weft_model::GptBlocks`]), prefetching the next units' all-gathers
//!   and reducing each unit's gradients on a worker thread as soon as they
//!   are ready, then clips by the global norm and runs AdamW on the shard.
//!   [`StepReport`] gives the loss, the norm, the step's traffic and the
//!   exposed communication time.
//! - [`MemoryReport`]: bytes per [`Category`] from the buffers actually
//!   allocated, current and peak.
//! - [`SpanLog`]: compute, communication and wait spans, exported as
//!   Chrome trace events on separate tracks ([`SpanLog::trace_events`]).
//!
//! # The step
//! For each micro-batch, forward over the units in order: before unit `i`
//! computes, the all-gathers of units `i+1 ..= i+prefetch` are issued
//! (non-blocking), so they travel while `i` computes; after its forward a
//! unit is freed (`reshard_after_forward`) unless its backward comes next
//! (the last unit) or the head needs it (the tied embedding). Backward
//! runs the units in reverse with the same prefetch; as soon as a unit's
//! gradients are complete they go to the reducer thread, which
//! reduce-scatters them (ZeRO-2/3, and for hybrid then all-reduces the
//! shard across replicas) while the next unit's backward runs. Strategies
//! that keep whole gradients (DDP, ZeRO-1) accumulate micro-batches
//! locally and reduce each unit after its last backward. Then: the global
//! gradient norm, clipping, AdamW on this rank's ranges, and (ZeRO-1/2) an
//! all-gather of the updated shards.
//!
//! # Bitwise reproducibility
//! With [`FsdpConfig::reproducible`] on, the gradient is the *exact* sum
//! over every micro-batch of the global batch, rounded once: each rank
//! keeps exact partial sums (the block encoding of
//! [`weft_collectives::repro`]) and ranks exchange and merge those, never
//! rounded values. The gradient is the exact sum divided by the number `M`
//! of micro-batches of the global batch, rounded once — the rule of the
//! collectives' [`ExactPartial::mean_to`](weft_collectives::repro::ExactPartial::mean_to)
//! and `ReduceOp::Avg`, so a single rank accumulating its micro-batches in
//! an `ExactPartial` gets the same bits. The norm's sum of squares is exact (f32 squares are
//! exact in f64, summed in [`weft_numerics::ExactSum`] and merged across
//! shards as bytes), losses are summed in global micro-batch order, and
//! AdamW is elementwise. So:
//!
//! - **Guaranteed bitwise equal** to one rank running the same global batch
//!   (same micro-batch shape, micro-batch `k` of the global batch on rank
//!   `k / M_local`), for every strategy and every group size, and for
//!   every prefetch depth and `reshard_after_forward`: `reproducible =
//!   true` with either precision. With bf16 parameters the gathered bf16
//!   values are the same bits on every N (rounded from the same master),
//!   so bf16 runs equal the one-rank bf16 run (not the f32 run).
//!   bf16 gradient reduction rounds the exact sum to bf16 once, also the
//!   same for any N. With one rank and one micro-batch the step is bitwise
//!   [`weft_model::Gpt`]'s forward, backward and `adamw_step` (tested).
//! - **Not guaranteed**: `reproducible = false` (ring sums in an order that
//!   depends on N; bf16 gradients are rounded before the reduction), and
//!   different micro-batch shapes (the model's per-token losses are batch
//!   invariant, but a micro-batch's gradient is summed over its tokens).
//!
//! # Memory and traffic
//! Per rank, ZeRO-3 with [`Precision::BF16`] keeps 2 (bf16 shard) + 12
//! (f32 master, m, v) + 2 (bf16 gradient shard) = 16 bytes per parameter
//! divided by N, plus at most `prefetch + 2` gathered units (prefetched,
//! current, and the one kept for the head or for the next backward) —
//! tested exactly from the allocated buffers. Per micro-batch ZeRO-3
//! sends `(N−1)/N` of the unit bytes per gather — two per unit (forward
//! and backward) except the last unit and a tied embedding — and per
//! reduce-scatter, ≈ 3× the parameter bytes against DDP's 2× (ring
//! all-reduce); tested against the collectives' byte counters.
//! Reproducible mode sends exact partials, about 2× the bytes of f32
//! gradients, through all-to-all (counted as `all_to_all_v`).
//!
//! # Speed
//! `cargo bench -p weft-fsdp --bench step` prints a table of step times of
//! a single rank, DDP and ZeRO-3 (prefetch 0, 1, 2; f32 and bf16;
//! reproducible or not) at the same per-rank batch on the thread backend,
//! with the communication in flight, the part the training thread waited
//! for, and the share hidden behind compute.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use weft_collectives::LocalCluster;
//! use weft_fsdp::{Fsdp, FsdpConfig, MicroBatch, Strategy};
//! use weft_model::{Gpt, GptConfig, Mlp};
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5 };
//! let mut init = Gpt::new(cfg.clone())?;
//! init.init_gpt2(42);
//! let (b, t) = (2, 8);
//! let losses = LocalCluster::run(2, |comm| -> weft_fsdp::Result<Vec<f64>> {
//!     let fc = FsdpConfig { strategy: Strategy::Full, ..FsdpConfig::default() };
//!     let mut fsdp = Fsdp::new(&comm, cfg.clone(), Arc::new(Mlp), fc, &init.params)?;
//!     let mut losses = Vec::new();
//!     for step in 0..5 {
//!         // this rank's micro-batch: global position dp_rank
//!         let seed = (step * 2 + fsdp.dp_rank()) as u32;
//!         let tokens: Vec<u32> = (0..16).map(|i| (i * 7 + seed) % 50).collect();
//!         let targets: Vec<u32> = (0..16).map(|i| (i * 7 + seed + 1) % 50).collect();
//!         let mb = MicroBatch { tokens: &tokens, targets: &targets };
//!         losses.push(fsdp.step(b, t, &[mb], 1e-2)?.loss);
//!     }
//!     Ok(losses)
//! })?;
//! let rank0 = losses[0].as_ref().unwrap();
//! assert_eq!(rank0, losses[1].as_ref().unwrap()); // every rank reports the global loss
//! assert!(rank0[4] < rank0[0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! None. The runner works over any [`weft_collectives::Communicator`] that
//! can [`split`](weft_collectives::Communicator::split) (it splits off its
//! own parameter, gradient and loss groups, so the reducer thread is the
//! only one issuing on its group); on backends that cannot progress in the
//! background (no `detach`) prefetched gathers complete at issue. The
//! feed-forward block must be dense or replicated (an expert-parallel MoE
//! block's expert shards are not what a unit's shard holds).
#![deny(missing_docs)]

mod config;
mod error;
mod exact;
mod lowp;
mod memory;
mod reducer;
mod runner;
mod spans;
mod units;

pub use config::{FsdpConfig, Precision, Strategy};
pub use error::{Error, Result};
pub use memory::{Category, MemoryReport};
pub use runner::{Fsdp, MicroBatch, StepReport};
pub use spans::{Span, SpanLog, Track};
pub use units::{ShardBox, ShardPiece, Unit, UnitKind, UnitPlan};
