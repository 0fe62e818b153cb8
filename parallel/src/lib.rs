//! Parallelism as placements: the device mesh of a job, where every
//! parameter sits on it, and the operations that follow from that —
//! gradient reduction, the clipping norm, gathering a whole model and
//! sharding one, and AdamW — each written once for every layout.
//!
//! This is the layer torchtitan gets from `ParallelDims` and DTensor: a
//! model is parallelized by *placing* its parameters (a tensor-parallel
//! linear layer's weight is [`Placement::Shard`] on `tp`, an expert's on
//! `ep`, a layernorm's [`Placement::Replicate`]), and everything that must
//! treat a sharded model as the whole model reads the placements instead of
//! knowing the model.
//!
//! # Overview
//! * [`ParallelLayout`]: how a job is split — the degrees, the FSDP
//!   [`Strategy`], the pipeline schedule, the reductions and the backend —
//!   the `[parallel]` table of a job file and the candidates `weft-plan`
//!   ranks; [`ParallelLayout::check`] is every rule a run on it needs,
//!   naming the setting at fault, and cuts the global batch
//!   ([`BatchSplit`]).
//! * [`ParallelDims`] (`pp`, `dp`, `ep` inside `dp`, `tp`) validates the
//!   degrees and [`builds`](ParallelDims::build) a [`ParallelMesh`]: a
//!   [`weft_collectives::Mesh`] over `pp × edp × ep × tp` (tensor parallel
//!   innermost, so a tp group is consecutive ranks — Megatron's order) with
//!   the communicator of every group of dimensions ([`DimSet`]) built once.
//! * [`Placement`] / [`Placements`]: replicated, sharded along a dimension
//!   (optionally strided: fused Q|K|V; with [copies](Placement::with_copies)
//!   of the key/value blocks on consecutive ranks when `tp` exceeds the
//!   key/value heads), or partial (a gradient still to be summed), per
//!   sharding [`Axis`]. [`runs`] maps a rank's elements to the whole
//!   tensor's, [`first_runs`] the ones it holds first (each element once
//!   over the ranks: what checkpoints write), [`copied_runs`] the copies
//!   (whose gradients are partial over their replica group,
//!   [`ParallelMesh::copies_group`]).
//! * [`ParamLayout`] / [`ParamSpec`] / [`LayoutBuilder`]: a rank's
//!   parameters in one flat buffer under their names, with local and whole
//!   shapes, decay and placements. Gradients, moments and checkpoints share
//!   it; [`ParamLayout::sub`] cuts a stage's or a unit's layout.
//! * [`GradReducer`]: micro-batch gradients to the global mean, over each
//!   tensor's [`reduce_group`] — exact (any split, same bits) or plain.
//! * [`GradNorm`]: the exact global gradient norm over any layout.
//! * [`extract`] / [`gather_whole`]: a rank's shard of a whole model, and
//!   the whole model from every rank's shards.
//! * [`AdamWState`] / [`adamw_runs`]: AdamW over a layout's (or a shard's)
//!   runs of tensors.
//! * [`MuonPlan`] / [`MuonMatrix`]: Muon over any layout's buffers — the
//!   element-wise steps on the pieces a rank holds, Newton–Schulz on each
//!   whole matrix at one owner rank (gathered and scattered back with two
//!   all-to-alls), the owners sharing the work.
//!
//! # Example
//! Two tensor-parallel ranks each hold half of a row-sharded embedding and
//! a replicated gain; the norm and the gathered model are the whole
//! model's.
//!
//! ```
//! use weft_collectives::LocalCluster;
//! use weft_parallel::{
//!     GradNorm, LayoutBuilder, ParallelDims, Placement, Placements, extract, gather_whole,
//! };
//!
//! let build = |c| -> weft_parallel::Result<_> {
//!     let mut b = LayoutBuilder::new(c);
//!     b.push("wte", &[4, 2], true, Placements::tp(Placement::shard(0)))?;
//!     b.push("gain", &[2], false, Placements::REPLICATED)?;
//!     b.finish()
//! };
//! let whole = build(Default::default())?;
//! let grads: Vec<f32> = vec![1., 1., 1., 1., 1., 1., 1., 1., 2., 2.];
//! let dims = ParallelDims { tp: 2, ..ParallelDims::SINGLE };
//! let out = LocalCluster::run(2, |comm| -> weft_parallel::Result<(f64, Vec<f32>)> {
//!     let mesh = dims.build(&comm)?;
//!     let local = build(mesh.coords().sharding())?;
//!     let mut mine = vec![0.0; local.len()];
//!     extract(&local, &whole, &grads, &mut mine)?;
//!     assert_eq!(mine.len(), 4 + 2);
//!     let mut norm = GradNorm::new();
//!     norm.add_layout(&local, &mine);
//!     let n = norm.finish(Some(&mesh))?;
//!     let mut back = vec![0.0; whole.len()];
//!     let root = mesh.world().rank() == 0;
//!     let mut outs = [&mut back[..]];
//!     gather_whole(mesh.world(), &mesh.coords(), &local, &whole, &[&mine],
//!                  root.then_some(&mut outs[..]))?;
//!     Ok((n, back))
//! })?;
//! let (n, back) = out.into_iter().next().unwrap()?;
//! assert_eq!(n, 4.0); // sqrt(8·1 + 2·4), the gain counted once
//! assert_eq!(back, grads);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! * `serde`: [`ParallelLayout`] (de)serializes key for key as the
//!   `[parallel]` table of a job file, its choices by name ([`Strategy`],
//!   or `"none"` for replicas; the schedule, backend and wire dtype by
//!   their crates' names).
#![deny(missing_docs)]

mod config;
mod context;
mod error;
mod gather;
mod layout;
mod mesh;
mod muon;
mod norm;
mod optim;
mod placement;
mod recompute;
mod reduce;

pub use config::{
    BatchSplit, DEFAULT_MICRO_TOKENS, MAX_DEGREE, MAX_MICRO_BATCHES, ModelShape, ParallelLayout,
    Strategy,
};
pub use context::ContextChunks;
pub use error::{Error, Result};
pub use gather::{extract, gather_whole};
pub use layout::{LayoutBuilder, ParamLayout, ParamSpec};
pub use mesh::{DimSet, MeshCoords, MeshTraffic, ParallelDims, ParallelMesh, TrafficAxis};
pub use muon::{MuonCost, MuonMatrix, MuonPlan, MuonTraffic};
pub use norm::{GradNorm, add_squares, merge_exact};
pub use optim::{AdamWState, adamw_runs};
pub use placement::{
    Axis, Coords, Placement, Placements, Run, copied_runs, first_runs, local_shape, runs,
};
pub use recompute::Recompute;
pub use reduce::{GradReducer, reduce_group};
