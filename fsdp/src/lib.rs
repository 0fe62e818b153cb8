//! Fully sharded data parallelism for any model: each rank keeps 1/N of
//! every unit's parameters, gradients and optimizer state, gathers a unit
//! just before using it, and hides the communication behind the
//! computation.
//!
//! This crate does not know the model. A model whose parameters live in
//! one flat buffer ([`weft_parallel::ParamLayout`]) declares its units
//! ([`UnitSpec`]: contiguous ranges, in forward order) and calls the hooks
//! of [`Fsdp`] around each unit in its own forward and backward, the way
//! PyTorch's FSDP2 hooks a module: gather before, free after, reduce-scatter
//! the gradients when the unit's backward is done; then the sharded AdamW
//! update. weft's GPT does this in `weft-model` (its FSDP adapter);
//! `examples/mlp_sharded.rs` does it for a stack of MLP layers written in
//! the example, in a few dozen lines.
//!
//! # Overview
//! - [`UnitPlan`] / [`Unit`]: the buffer cut into units, each sharded
//!   evenly over the group with padding; [`UnitPlan::shard_pieces`] names
//!   what a rank's shard holds as tensors and row/column boxes, for
//!   checkpoints.
//! - [`Strategy`]: `optimizer` (ZeRO-1), `grad_op` (ZeRO-2), `full`
//!   (ZeRO-3), `hybrid` (HSDP over a 2-d mesh: shard within a group of
//!   ranks, replicate across groups). Plain replicas (DDP) are not a
//!   sharding: `weft_parallel::GradReducer` reduces them for every layout.
//! - [`Precision`]: parameter dtype (f32 or bf16) for gathering and
//!   compute, gradient reduction dtype (f32 or bf16 on the wire, every
//!   addition in f32); master weights and AdamW moments are f32 on the shard.
//! - [`Fsdp`]: the sharded state and its hooks ([`Fsdp::pre_forward`],
//!   [`Fsdp::post_forward`], [`Fsdp::pre_backward`],
//!   [`Fsdp::post_backward`]), prefetching the next units' all-gathers and
//!   reducing each unit's gradients on a worker thread as soon as they are
//!   ready; [`Fsdp::grad_norm`] (this shard's exact part of the global
//!   norm) and [`Fsdp::apply`] (AdamW on the shards, `weft_parallel`'s one
//!   optimizer; [`Fsdp::apply_with`] with a [`MuonStep`]: Muon for the
//!   matrices of a `weft_parallel::MuonPlan` over the shards) end the step.
//! - [`MemoryReport`]: bytes per [`Category`] from the buffers actually
//!   allocated, current and peak.
//! - [`SpanLog`]: compute, communication and wait spans, exported as
//!   Chrome trace events on separate tracks ([`SpanLog::trace_events`]).
//!
//! # The step
//! For each micro-batch, the model's forward walks the units in order:
//! [`pre_forward`](Fsdp::pre_forward) of unit `i` waits for its gather and
//! issues the all-gathers of units `i+1 ..= i+prefetch` (non-blocking), so
//! they travel while `i` computes; [`post_forward`](Fsdp::post_forward)
//! frees it (`reshard_after_forward`) unless its backward comes next (the
//! last unit) or it is kept gathered for a later unit. The backward walks
//! them in reverse with the same prefetch; as soon as a unit's gradients
//! are complete ([`post_backward`](Fsdp::post_backward)) they go to the
//! reducer thread, which reduce-scatters them (and for hybrid then
//! all-reduces the shard across replicas) while the next unit's backward
//! runs. ZeRO-1 accumulates whole gradients locally and reduce-scatters
//! each unit after its last micro-batch. Then the exact gradient norm, the
//! clipping coefficient (the caller's: it knows the rest of its model) and
//! AdamW on this rank's shards, and (ZeRO-1/2) an all-gather of the
//! updated shards.
//!
//! # Bitwise reproducibility
//! With [`FsdpConfig::reproducible`] on, the gradient is the *exact* sum
//! over every micro-batch of the global batch, rounded once, never a sum
//! of rounded values. With one micro-batch per rank the collectives'
//! exact reduce-scatter sums the ranks' values and rounds once. With
//! several (or with replicas of the shards), each micro-batch's gradient
//! travels as f32 values, chunk `r` to rank `r` (the plain
//! reduce-scatter's bytes), and the owner of a shard adds every rank's
//! chunk exactly into an [`ExactPartial`](weft_collectives::repro::ExactPartial)
//! of its shard, kept by the reducer thread until the last micro-batch;
//! hybrid sharding then sums those partials exactly across the replicas.
//! The gradient is the exact sum divided by the number `M`
//! of micro-batches of the global batch, rounded once — the rule of the
//! collectives' [`ExactPartial::mean_to`](weft_collectives::repro::ExactPartial::mean_to)
//! and `weft_parallel::GradReducer`, so a single rank accumulating its
//! micro-batches exactly gets the same bits. The norm's sum of squares is
//! exact (f32 squares are exact in f64, summed in
//! [`weft_numerics::ExactSum`] and merged across shards), and AdamW is
//! elementwise. So:
//!
//! - **Guaranteed bitwise equal** to one rank running the same global batch
//!   (same micro-batch shape, micro-batch `k` of the global batch on rank
//!   `k / M_local`), for every strategy and every group size, and for
//!   every prefetch depth and `reshard_after_forward`: `reproducible =
//!   true` with either precision. With bf16 parameters the gathered bf16
//!   values are the same bits on every N (rounded from the same master),
//!   so bf16 runs equal the one-rank bf16 run (not the f32 run). A model
//!   whose products round their operands to bf16 anyway (weft's GPT in
//!   bf16 mixed precision) and which keeps everything else in f32
//!   ([`UnitSpec::keep_f32`]: norms, biases, embeddings) computes the same
//!   bits from bf16 gathers as from f32 ones, in about half the bytes.
//!   bf16 gradient reduction rounds the exact sum to bf16 once, also the
//!   same for any N. Tested on the MLP stack here and on weft's GPT (whose
//!   one-rank, one-micro-batch FSDP step is bitwise the plain model's).
//! - **Not guaranteed**: `reproducible = false` (ring sums in an order that
//!   depends on N; bf16 gradients are rounded before the reduction).
//!
//! # Memory and traffic
//! Per rank, ZeRO-3 with [`Precision::BF16`] keeps 14 bytes per
//! parameter divided by N: 12 of f32 master, m and v, and 2 of the bf16
//! gradient shard (the bf16 parameters are rounded from the master as
//! each gather is written, as in PyTorch's FSDP2, rather than kept as a
//! 2-byte copy); plus at most `prefetch + 2` gathered units (prefetched,
//! current, and one kept for a later unit or for the next backward) —
//! tested exactly from the allocated buffers. Per micro-batch ZeRO-3
//! sends `(N−1)/N` of the unit bytes per gather — two per unit (forward
//! and backward) except the last unit and a kept one — and per
//! reduce-scatter, ≈ 3× the parameter bytes against DDP's 2× (ring
//! all-reduce); tested against the collectives' byte counters in
//! weft-model. Reproducible mode with one micro-batch per rank sends the
//! plain reduce-scatter's bytes; with several it sends them per
//! micro-batch ([`reduce_scatter_add_exact`](weft_collectives::CommunicatorExt::reduce_scatter_add_exact)), and hybrid
//! sharding adds an exact all-reduce of the shard partials (about 8 bytes
//! per element) across the replicas.
//!
//! # Speed
//! `cargo bench -p weft-model --bench fsdp_step` prints a table of step
//! times of weft's GPT on a single rank, DDP and ZeRO-3 (prefetch 0, 1, 2;
//! f32 and bf16; reproducible or not) at the same per-rank batch on the
//! thread backend, with the communication in flight, the part the
//! training thread waited for, and the share hidden behind compute.
//!
//! # Example
//! Two ranks shard a two-unit model; each unit's gradient is the mean of
//! the ranks' contributions, and AdamW updates the shards.
//! ```
//! use weft_collectives::{Communicator, LocalCluster};
//! use weft_fsdp::{Fsdp, FsdpConfig, UnitSpec};
//! use weft_kernels::AdamW;
//! use weft_parallel::{Coords, LayoutBuilder, Placements};
//!
//! let mut b = LayoutBuilder::new(Coords::SINGLE);
//! let w = b.push("w", &[3], true, Placements::REPLICATED)?;
//! let v = b.push("v", &[2], false, Placements::REPLICATED)?;
//! let layout = b.finish()?;
//! let units = vec![
//!     UnitSpec { name: "w".into(), range: w, ..UnitSpec::default() },
//!     UnitSpec { name: "v".into(), range: v, ..UnitSpec::default() },
//! ];
//! let out = LocalCluster::run(2, |comm| -> weft_fsdp::Result<Vec<f32>> {
//!     let mut f = Fsdp::new(&comm, &layout, units.clone(), FsdpConfig::default(), &[1.0; 5])?;
//!     f.begin_step(1)?;
//!     for u in 0..2 {
//!         f.pre_forward(u)?;
//!         assert_eq!(f.params(u)?[0], 1.0); // gathered whole
//!         f.post_forward(u)?;
//!     }
//!     for u in (0..2).rev() {
//!         f.pre_backward(u, 0)?; // micro-batch 0
//!         f.grads_mut(u, 0)?.fill(comm.rank() as f32); // this rank's gradient
//!         f.post_backward(u, 0)?;
//!     }
//!     f.finish_backward()?;
//!     let norm = f.grad_norm()?.finish(None)?;
//!     assert!((norm - (5.0f64 * 0.25).sqrt()).abs() < 1e-12); // mean 0.5 everywhere
//!     f.apply(1.0, &AdamW { lr: 0.1, weight_decay: 0.0, ..AdamW::default() })?;
//!     f.full_params()
//! })?;
//! assert!(out[0].as_ref().unwrap().iter().all(|&p| (p - 0.9).abs() < 1e-6));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! None. [`Fsdp`] works over any [`weft_collectives::Communicator`] that
//! can [`split`](weft_collectives::Communicator::split) (it splits off its
//! own parameter and gradient groups, so the reducer thread is the only
//! one issuing on its group); on backends that cannot progress in the
//! background (no `detach`) prefetched gathers complete at issue.
#![deny(missing_docs)]

mod config;
mod error;
mod lowp;
mod memory;
mod reducer;
mod sharded;
mod spans;
mod units;
mod wire;

pub use config::{FsdpConfig, Precision, Strategy};
pub use error::{Error, Result};
pub use memory::{Category, MemoryReport};
pub use sharded::{Fsdp, MuonStep};
pub use spans::{Span, SpanLog, Track};
pub use units::{ShardBox, ShardPiece, Unit, UnitPlan, UnitSpec};
