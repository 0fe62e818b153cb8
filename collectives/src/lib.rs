//! How the ranks of a weft run talk to each other.
//!
//! Every parallel strategy in weft (data, FSDP, pipeline, tensor and expert
//! parallelism) programs against one trait, [`Communicator`], and this crate
//! runs it over threads of one process ([`LocalCluster`], the default, so
//! everything can be tested on a laptop).
//!
//! # Overview
//! - [`Communicator`]: rank, size, the transport primitive
//!   [`exchange`](Communicator::exchange), point-to-point bytes,
//!   [`split`](Communicator::split), traffic counters; collectives as
//!   provided methods.
//! - [`CommunicatorExt`]: the typed collectives — [`all_reduce`](CommunicatorExt::all_reduce),
//!   [`reduce_scatter`](CommunicatorExt::reduce_scatter), [`all_gather`](CommunicatorExt::all_gather),
//!   [`broadcast`](CommunicatorExt::broadcast), [`reduce`](CommunicatorExt::reduce),
//!   [`all_to_all`](CommunicatorExt::all_to_all), [`all_to_all_v`](CommunicatorExt::all_to_all_v),
//!   [`send`](CommunicatorExt::send)/[`recv`](CommunicatorExt::recv), non-blocking
//!   [`all_reduce_async`](CommunicatorExt::all_reduce_async) and friends returning a [`Pending`].
//! - [`ReduceOp`] (sum, avg, max, min), [`ReduceOptions`] (algorithm, wire
//!   dtype, reproducible mode), [`Algorithm`] (ring, recursive doubling,
//!   hierarchical, and the size/topology policy).
//! - [`Topology`] (ranks per domain) and [`Traffic`] (bytes per operation
//!   and [`LinkClass`]).
//! - [`Mesh`]: named N-d device mesh, tp fastest.
//! - [`repro`]: the exact, compact encoding behind the reproducible mode,
//!   and [`repro::ExactPartial`], exact accumulation of micro-batch
//!   gradients reduced by [`all_reduce_exact`](CommunicatorExt::all_reduce_exact)
//!   / [`reduce_scatter_exact`](CommunicatorExt::reduce_scatter_exact).
//! - [`LocalCluster`] / [`LocalComm`]: the thread backend.
//! - `MpiComm` (feature `mpi`): MPI processes; `NcclComm` (feature `nccl`):
//!   NCCL on GPUs.
//!
//! # The Communicator design
//! The trait has a handful of *required* primitives and builds every
//! collective as a *provided* method on top of them, as grep-matcher's
//! `Matcher` does:
//!
//! - `exchange(ctx, tag, sends, recvs)` is the one transport primitive:
//!   post some messages, consume some messages, return when both sides are
//!   done. Incoming bytes are handed to a *sink* closure instead of being
//!   copied into a buffer the caller provides. On the local backend the sink
//!   reads straight from the sender's memory, so a ring step reduces the
//!   peer's chunk into its own with zero intermediate copies; a
//!   message-passing backend receives into scratch and calls the same sink.
//!   Every algorithm (ring, recursive doubling, hierarchical, reproducible)
//!   is written once over `exchange` and runs unchanged on every backend;
//!   a backend with native collectives (MPI, NCCL) overrides the provided
//!   methods instead.
//! - `begin(signature)` gives each collective call a sequence number and
//!   records that this rank arrived. Messages carry the signature (op,
//!   dtype, length, root, reduction, algorithm), so mismatched calls are
//!   reported as [`Error::Mismatch`], and a timed-out rank can name the
//!   ranks that never arrived.
//! - The object-safe methods take dtype-tagged byte views ([`Buf`],
//!   [`BufMut`]) so the trait can be used as `&dyn Communicator` by crates
//!   that do not want to be generic over the backend; the generic, typed
//!   API lives in [`CommunicatorExt`], implemented for every communicator
//!   including `dyn Communicator`.
//!
//! # Precision
//! Reductions accumulate in f32 or wider whatever the wire dtype: every
//! addition widens both operands to f32 (f64 for f64) and rounds once.
//! [`ReduceOptions::wire`] chooses the dtype in which *partial sums* travel
//! (e.g. f32 for a bf16 buffer, so only the final result is rounded to
//! bf16). [`ReduceOptions::reproducible`] makes all-reduce and
//! reduce-scatter return the correctly rounded exact sum, bitwise identical
//! for any world size, algorithm or order (see [`repro`]); `Avg` there is
//! the exact sum divided by the group size, rounded once.
//!
//! # Exact partials for data parallelism
//! Reproducible all-reduce makes the result independent of the *ranks*, but
//! a trainer also accumulates several micro-batches per rank; for the bits
//! to be independent of how a global batch of M micro-batches is split over
//! N ranks, that local accumulation must be exact too. A
//! [`repro::ExactPartial`] adds each micro-batch's gradient (f32, bf16, f16
//! or f64 slices) exactly, in place, at about 8 bytes per element for
//! typical gradients; [`all_reduce_exact`](CommunicatorExt::all_reduce_exact)
//! and [`reduce_scatter_exact`](CommunicatorExt::reduce_scatter_exact)
//! merge the ranks' partials exactly and round once: `Sum` gives the
//! correctly rounded sum of all M contributions, `Avg` the exact sum divided
//! by M (the total of the ranks' [`count`](repro::ExactPartial::count)s),
//! rounded once. On one rank, [`round_to`](repro::ExactPartial::round_to) /
//! [`mean_to`](repro::ExactPartial::mean_to) give the same bits.
//!
//! ```
//! use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, ReduceOp, repro::ExactPartial};
//!
//! // 4 micro-batch gradients of 300 elements; rank r of 2 takes r, r + 2
//! let g: Vec<Vec<f32>> = (0..4)
//!     .map(|m| (0..300).map(|i| ((i + 37 * m) as f32).cos() * 1e-4).collect())
//!     .collect();
//! let means = LocalCluster::run(2, |comm| {
//!     let mut acc = ExactPartial::new(300);
//!     for m in (comm.rank()..4).step_by(2) {
//!         acc.add(&g[m])?; // once per micro-batch
//!     }
//!     let mut mean = vec![0f32; 300];
//!     comm.all_reduce_exact(&acc, &mut mean, ReduceOp::Avg)?;
//!     Ok::<_, weft_collectives::Error>(mean)
//! })?;
//! let mut one = ExactPartial::new(300);
//! for x in &g {
//!     one.add(x)?;
//! }
//! let mut want = vec![0f32; 300];
//! one.mean_to(&mut want)?;
//! assert_eq!(means[0].as_ref().unwrap(), &want);
//! # Ok::<(), weft_collectives::Error>(())
//! ```
//!
//! # Cost of the reproducible mode
//! Measured with `WEFT_BENCH_OPS=repro-table cargo bench -p weft-collectives
//! --bench collectives -- RANKS 64` (ring, reproducible and exact
//! all-reduce alternate in one cluster, each keeping its best of 5
//! rounds), f32, thread ranks, on the shared 2-core development machine
//! while other builds ran (load average 3.6–4.9), so single figures are
//! noisy; the ratios of one run are the point. Two runs each; "ring
//! pattern" is the same table over one-rank domains
//! (`WEFT_BENCH_RANKS_PER_DOMAIN=1`), where both reproducible reductions
//! keep the ring's neighbour-only pattern (see [`repro`]):
//!
//! | bytes | 2 ranks repro / ring | 4 ranks repro / ring | 4 ranks exact / ring | 4 ranks, ring pattern: repro / ring |
//! |---|---|---|---|---|
//! | 64 KiB | 0.96, 0.97 | 1.09, 1.10 | 1.66, 1.64 | 1.29, 1.26 |
//! | 256 KiB | 1.04, 1.03 | 1.29, 1.29 | 2.33, 2.27 | 1.67 (once; 0.67 in a noisy run) |
//! | 1 MiB | 0.99, 1.00 | 1.17, 1.19 | 1.70, 1.67 | 1.50, 1.49 |
//! | 4 MiB | 1.00, 1.01 | 1.13, 1.11 | 1.59, 1.58 | 1.44, 1.42 |
//! | 16 MiB | 1.00, 1.00 | 1.04, 1.01 | 2.04, 2.07 | 1.70, 1.90 |
//! | 64 MiB | 0.83, 0.95 | 0.93, 0.89 | 1.59, 1.57 | 1.88, 1.77 |
//!
//! With two ranks the reproducible all-reduce costs what the plain ring
//! does (ratios below 1 are noise): the two-term sum computed in f64 and
//! rounded once is already the correctly rounded exact sum. With 3 to 16
//! ranks in one domain, the direct reduce-scatter sums all n contributions
//! of a block in registers in one pass, with no partial sums in memory,
//! so it costs about what the plain ring's n − 1 reduction steps do; total
//! CPU time per call (`perf stat` of `examples/repro_profile.rs ring|repro
//! LEN 4 REPS`, which counts work, not waiting) was 1.0–1.13× the plain
//! ring's from 1 MiB to 64 MiB. Over several domains the fixed-lane ring
//! moves partial sums as 8-byte lanes: 1.3–1.9×. Before this design
//! (per-block headers and realignment at every step) 4 ranks cost
//! 1.8–2.7×. "exact" is [`all_reduce_exact`](CommunicatorExt::all_reduce_exact)
//! of an `ExactPartial` (the data-parallel trainer's reduction), which
//! moves general encodings (8 bytes and a header per 64 elements): in one
//! domain the owner of each chunk sums all n encoded pieces at once (it
//! was 2.0–3.0× with the ring; over one-rank domains it still is 1.9–3.0×).
//! One [`ExactPartial::add`](repro::ExactPartial::add) of a micro-batch
//! costs about 0.6 ns per element when the partial fits in cache and is
//! bound by memory bandwidth beyond (20 bytes per element).
//!
//! # Failures
//! Nothing hangs: every wait has the communicator's timeout, and the
//! error names the operation, the group and the ranks that did not
//! arrive ([`Error::Timeout`]). A rank that returns, panics or is failed by
//! fault injection ([`LocalCluster::fail_rank_at`]) makes its peers' waits
//! fail with [`Error::PeerLost`] naming it. The reproducible mode's direct
//! reductions, which hold every peer's message at once, abort the group
//! when they fail ([`Communicator::abort_group`]), so that peers waiting
//! for a message the failing rank withdrew fail at once with
//! [`Error::Aborted`] rather than at their timeout.
//!
//! # Example
//! ```
//! use weft_collectives::{Algorithm, Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions, bf16};
//!
//! let out = LocalCluster::run(4, |comm| -> Result<Vec<bf16>, weft_collectives::Error> {
//!     let mut g = vec![bf16::from_f32(comm.rank() as f32); 1000];
//!     let opts = ReduceOptions::new(ReduceOp::Avg).algorithm(Algorithm::Ring);
//!     comm.all_reduce_with(&mut g, &opts)?;
//!     Ok(g)
//! })?;
//! for r in out {
//!     assert!(r?.iter().all(|x| x.to_f32() == 1.5));
//! }
//! # Ok::<(), weft_collectives::Error>(())
//! ```
//!
//! # Crate features
//! - *(default)*: the `local` thread backend only; no native dependencies.
//! - `mpi`: `MpiComm`, the backend over MPI processes (the `mpi` crate; needs
//!   an MPI library, `mpicc` and libclang to build — on Debian
//!   `libopenmpi-dev openmpi-bin libclang-dev`). Every algorithm of this
//!   crate runs over MPI point-to-point; `Auto` f32/f64 sums use the
//!   library's own all-reduce. `tests/mpi.rs` runs the suite under
//!   `mpirun -np 4`.
//! - `nccl`: `NcclComm`, the backend over NCCL on GPUs (cudarc, loaded at
//!   run time, so it builds without CUDA). Host buffers are staged through
//!   the GPU; `*_device` methods work on device buffers. Without the driver
//!   or NCCL, constructors return [`Error::BackendUnavailable`] (cudarc
//!   itself would panic). `tests/nccl.rs` checks it against a CPU
//!   reference on one GPU; `collectives/gpu-check.sh` runs that check.
#![deny(missing_docs)]

mod algo;
mod comm;
mod error;
mod local;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
mod nccl_backend;
mod reduce;
pub mod repro;
mod types;

pub use comm::{Communicator, CommunicatorExt, Pending};
pub use error::{Error, LossCause, Result};
pub use local::{DEFAULT_TIMEOUT, LocalCluster, LocalComm};
pub use mesh::Mesh;
#[cfg(feature = "mpi")]
pub use mpi_backend::{MPI_DEFAULT_TIMEOUT, MPI_MAX_TAG, MpiComm, MpiCommBuilder};
#[cfg(feature = "nccl")]
pub use nccl_backend::{NCCL_DEFAULT_TIMEOUT, NcclComm, NcclId, nccl_available};
pub use types::{
    Algorithm, Buf, BufMut, Incoming, LinkClass, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions,
    SMALL_MESSAGE_BYTES, Signature, Sink, Topology, Traffic, TrafficCounters, shard_range,
};
pub use weft_numerics::{Dtype, Element, bf16, f16};
