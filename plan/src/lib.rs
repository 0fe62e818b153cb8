//! The weft planner: choose the parallel layout for a model, a batch and a
//! cluster before spending the cluster, and see why it wins.
//!
//! A pretraining run spends its chips on arithmetic (6·N·D), runs out of
//! memory (16 bytes per parameter with mixed-precision AdamW, plus
//! activations), or waits — on collectives or on the pipeline's bubble.
//! This crate predicts all three for every layout weft can run and ranks
//! them, so the chain of problems and fixes (plain data parallelism stops
//! fitting → FSDP → the communication crossover → pipeline and tensor
//! parallelism) is computed for *this* model and cluster rather than
//! recited.
//!
//! # Overview
//! * [`ModelSpec`]: the model by its dimensions — GPT-2's block or the
//!   Llama family's (grouped-query attention, SwiGLU, QK-norm, sliding
//!   windows), dense or a mixture of experts (fine-grained, shared
//!   experts, leading dense layers); [`published::models`] are published
//!   configurations whose parameter counts it reproduces. [`Cluster`]: GPUs per node, memory, peak FLOP/s per dtype,
//!   intra- and inter-node links (α, β), from [presets](Cluster::preset)
//!   (`a100-80gb`, `a100-40gb`, `h100`, `h200`), a TOML file
//!   ([`Cluster::from_file`], errors naming file, line and key), or
//!   this machine, measured ([`machine::MachineProfile`]: the kernels'
//!   GEMM rates at the model's shapes, a triad's bandwidth, the thread
//!   backend's all-reduce α and β).
//!   [`Recipe`]: what the ranks hold and compute — weft's own run
//!   ([`Accounting::Weft`]) or mixed precision on GPUs
//!   ([`Accounting::Mixed`]).
//! * [`Layout`]: `weft train`'s `[parallel]` table itself
//!   ([`weft_parallel::ParallelLayout`]: dp, FSDP [`Strategy`] and hybrid
//!   shard, tp with sequence parallelism, pp with its
//!   [`weft_pipeline::ScheduleKind`] and chunks, ep, cp), the micro-batch size,
//!   and activation recomputation for other frameworks' runs. Its checks
//!   are the trainer's ([`weft_parallel::ParallelLayout::check`]).
//! * [`predict()`]: one layout → [`Prediction`]: [`Memory`] per GPU by
//!   category, [`StepTime`] by part (compute by a per-operation roofline;
//!   each collective by the α–β model over the node hierarchy; what
//!   overlaps and what does not; the bubble from `weft-pipeline`'s
//!   simulator for the schedule), tokens/s, TFLOP/s per GPU, MFU, and
//!   whether it fits. The [`time`] and [`memory`] modules say exactly how.
//! * [`search::search`]: every layout ([`search::enumerate`], or those
//!   [`search::Constraints`] pin), best first; [`search::reason`] says why
//!   each wins or loses (memory, communication, bubble).
//! * [`explain::explain`]: the chain for this model — where plain data
//!   parallelism stops fitting, FSDP against it, the GPU count where
//!   communication overtakes compute and how it moves with the batch and
//!   with sparsity, tensor parallelism inside against across nodes, and
//!   the batch floor: the longest sequence each context-parallel degree
//!   trains, and cp against tp past it.
//! * [`budget`]: a compute budget → the Chinchilla-optimal size and tokens
//!   (Hoffmann et al. 2022) and the days a layout takes. [`report`]: the
//!   table, the budget's paragraph and the JSON `weft plan` prints;
//!   [`svg`]: its plots (drawn with `weft-compare`'s charts).
//! * [`calibrate`]: the planner against this machine — layouts run by the
//!   caller ([`calibrate::Runner`]; the trainer runs `weft train`), the
//!   machine measured in rounds, the step's share of the measured rates
//!   found on one-rank references, predicted against measured; on a
//!   cluster of nodes ([`launch::Launched`]: MPI jobs under a launcher),
//!   with the links measured and the communication crossover of FSDP.
//! * [`published`]: Narayanan et al. 2021's Table 1 (Megatron-LM, 1.7B to
//!   1T parameters on up to 3072 A100s) predicted with one set of
//!   constants: every row within 9%, the worst +8.0% (`tests/plan.rs`).
//!
//! The memory of weft's own layouts is not estimated but counted: the
//! [`Accounting::Weft`] model mirrors every buffer `weft train` allocates,
//! and the trainer's tests check it byte for byte against the start-up
//! report layout by layout, for GPT-2, its mixture of experts and the
//! Llama family (grouped-query attention, SwiGLU, RMSNorm, QK-norm,
//! Qwen3-MoE's experts after dense first layers).
//!
//! # What it does not model
//! Stragglers and noisy neighbours, network contention between jobs and
//! the fat tree's oversubscription, NCCL's choice of algorithm (the α–β
//! ring model throughout), kernel fusion beyond the roofline's
//! element-wise traffic, memory fragmentation and the framework's own
//! allocations (a layout "fits" when its counted bytes are within the
//! GPU's memory), load imbalance between experts (routing is taken as
//! balanced), FP8, and weft's GPU kernels (weft
//! computes on CPUs today; GPU layouts are planned as Megatron-LM runs
//! them). Activation recomputation is modelled as weft runs it
//! (`train.recompute`: a recomputed block keeps its output and runs its
//! forward again before its backward, before each half of a split one);
//! the search tries none, selective and full unless pinned; so is the
//! loss in chunks (`train.loss_chunk`), which the search tries beside the
//! whole micro-batch under weft's accounting.
//!
//! # Example
//! ```
//! use weft_plan::search::{Constraints, reason, search};
//! use weft_plan::{Cluster, Layout, ModelSpec, Recipe, Request, Strategy, predict};
//!
//! // GPT-2 XL-sized: 48 layers, 1600 channels, 25 heads, on 16 H100s
//! let req = Request {
//!     model: ModelSpec::gpt(48, 1600, 25, 1024, 50257),
//!     batch: 512,
//!     cluster: Cluster::preset("h100", 16)?,
//!     recipe: Recipe::mixed(),
//! };
//! // one layout: FSDP over all 16 GPUs, 4 sequences per micro-batch
//! let mut fsdp = Layout { micro_batch_size: 4, ..Layout::degrees(16, 1, 1) };
//! fsdp.parallel.fsdp = Some(Strategy::Full);
//! let p = predict(&req, &fsdp)?;
//! assert!(p.fits && p.mfu > 0.2 && p.mfu < 0.75);
//! // every layout, best first, with why each wins or loses
//! let ranked = search(&req, &Constraints::default())?;
//! assert!(ranked[0].step_s <= p.step_s);
//! println!("{}: {}", ranked[0].layout, reason(&ranked[0], &ranked[0]));
//! # Ok::<(), weft_plan::Error>(())
//! ```
//!
//! # Crate features
//! None. The crate depends on `weft-pipeline` (its simulator and
//! partitioner), on `weft-parallel` for the layout type it shares with the
//! trainer, on `weft-kernels` (the precision it plans in; the products it
//! times) and `weft-collectives` (the all-reduce it times) to measure a
//! machine, and on `weft-compare` for its charts.

#![deny(missing_docs)]

pub mod budget;
pub mod calibrate;
pub mod cluster;
mod error;
pub mod explain;
pub mod launch;
pub mod layout;
pub mod machine;
pub mod memory;
pub mod model;
pub mod predict;
pub mod published;
pub mod report;
pub mod search;
pub mod svg;
pub mod time;

pub use cluster::{Cluster, Device, Efficiency, Link, Peak, Precision};
pub use error::{Error, Origin, Result};
pub use layout::Layout;
pub use memory::{Accounting, Memory, Recipe};
pub use model::ModelSpec;
pub use predict::{Prediction, Request, memory_per_stage, predict};
pub use time::StepTime;
pub use weft_parallel::{ParallelLayout, Strategy};
pub use weft_pipeline::ScheduleKind;
