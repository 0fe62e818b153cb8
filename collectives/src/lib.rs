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
//!   [`reduce_scatter`](CommunicatorExt::reduce_scatter), [`all_gather`](CommunicatorExt::all_gather)
//!   (and [in place](CommunicatorExt::all_gather_in_place), the rank's shard already in the output),
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
//! - [`processes`]: a job of one process per rank under an MPI launcher —
//!   the launcher's environment, the world with every rank's host (ranks
//!   renumbered host by host), switching it to NCCL.
//! - [`agree`] (a set-up step's outcome agreed by every rank, so none is
//!   left waiting), [`gather_bytes`] and [`all_gather_bytes`].
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
//! typical gradients (a single f32 contribution is kept as its values, 4
//! bytes); [`all_reduce_exact`](CommunicatorExt::all_reduce_exact)
//! and [`reduce_scatter_exact`](CommunicatorExt::reduce_scatter_exact)
//! merge the ranks' partials exactly and round once: `Sum` gives the
//! correctly rounded sum of all M contributions, `Avg` the exact sum divided
//! by M (the total of the ranks' [`count`](repro::ExactPartial::count)s),
//! rounded once. On one rank, [`round_to`](repro::ExactPartial::round_to) /
//! [`mean_to`](repro::ExactPartial::mean_to) give the same bits. Where
//! gradients are sharded (FSDP), each micro-batch's gradient can instead
//! travel as values:
//! [`reduce_scatter_add_exact`](CommunicatorExt::reduce_scatter_add_exact)
//! adds every rank's chunk exactly into the accumulator of the chunk's
//! owner, which rounds once after the last micro-batch.
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
//! # What the collectives cost
//! `cargo bench -p weft-collectives --bench collectives -- RANKS MAX_MIB`
//! prints two tables for thread ranks: each collective from 4 KiB up
//! (nccl-tests' algbw and busbw, beside the machine's memcpy), and the
//! collectives a training step calls, side by side in alternating rounds,
//! with their ratios (`WEFT_BENCH_OPS=side` for that table alone). Figures
//! go stale with the code and differ by machine, so they live in the
//! bench, not here; what the design guarantees:
//!
//! - **No allocation per call in steady state.** Scratch buffers come from
//!   a per-thread pool (each thread rank keeps its own few), so repeated
//!   calls allocate only small bookkeeping, whatever the size
//!   (`tests/alloc.rs` counts it under a counting allocator).
//! - **Reduce-scatter reads its input in place.** The ring starts from the
//!   caller's buffer and ends in the output; only two chunk-sized partial
//!   sums exist at a time. (It used to convert the whole input into a
//!   zeroed copy first; measured figures in the repository's
//!   `benchmarks/2026-12-02-ring-reduce-scatter-in-place-epyc.md`.)
//! - **Large results bypass the cache.** Outputs and copies of 8 MiB or
//!   more are written with non-temporal stores (no read of the lines about
//!   to be overwritten, no eviction of the inputs still to be read).
//! - **One round trip inside a domain.** For 3 to 16 ranks in one
//!   [`Topology`] domain, the ring's phases run as one direct exchange:
//!   every rank sends chunk k straight to rank k (the ring's bytes), and
//!   the reduce-scatter's owner sums all n chunks in one pass, tile by
//!   tile in L1, writing no partial sum to memory (the ring writes n − 2
//!   of them); the all-gather copies each peer's chunk as it comes, both
//!   faster than the ring with 4 thread ranks on 2 cores.
//! - **Waits spin briefly before they sleep**, since a
//!   condition-variable wake-up costs as much as a 1 MiB reduction; with
//!   more ranks than cores they yield the core between checks, so that a
//!   peer waiting for it runs at once.
//!
//! Measured figures, with 2 and 4 thread ranks and over MPI, are in the
//! repository's `benchmarks/` records, one per measurement:
//! `2026-12-05-collectives-thread-ranks-epyc.md`,
//! `2026-12-05-collectives-exact-prefetch-xeon.md`,
//! `2026-12-05-mpi-reduce-scatter-epyc.md` and
//! `2026-12-05-mpi-reduce-scatter-xeon.md`. What shapes the costs:
//!
//! - A reduce-scatter reads and writes 3 bytes of memory per bus byte
//!   where the all-reduce, whose second half only copies, moves 2.5; the
//!   out-of-place all-gather copies its own shard as well as the peers'.
//! - The reproducible all-reduce and reduce-scatter cost about the plain
//!   ones with 2 ranks (the one step adds the two inputs straight into
//!   the output), and with 3–16 ranks in one domain sum each block of all
//!   ranks' chunks in registers in one pass (see [`repro`]). With 4 ranks
//!   on 2 cores at 1–4 MiB the exact sum, which scans each block's
//!   exponents and converts every value, is compute the ranks share,
//!   where the plain direct reduce-scatter costs a few additions per
//!   element (for f32 with up to 4 ranks and a power-of-two divisor,
//!   AVX-512 lanes scan all contributions of a block and reduce once,
//!   then sum them in f64).
//! - The exact reductions of [`repro::ExactPartial`]s with one f32
//!   contribution per rank (one micro-batch: the partial keeps the
//!   values) take the same route. With more contributions the partials
//!   are encoded, 8 bytes per element for gradients, so the
//!   reduce-scatter phase moves twice f32's bytes (the all-reduce's volume
//!   1.5× the plain one), and large exact reductions take about what that
//!   volume allows; each block of two partials is read in place and
//!   summed and rounded in one pass of i64 lanes (a divisor that is not a
//!   power of two costs one f64 division per element), with the lanes of
//!   both pieces prefetched a few blocks ahead. With 3 to 16 ranks in one
//!   domain each owner sums the pieces of every peer eight i64 lanes at a
//!   time in AVX-512 registers and rounds once, the next blocks of every
//!   piece prefetched.
//! - bf16 buffers (f32 accumulation) reduce-scatter and all-gather in less
//!   time than f32 ones (their sums are rounded 32 at a time by
//!   `vcvtne2ps2bf16` where the CPU has AVX512-BF16).
//! - [`reduce_scatter_add_exact`](CommunicatorExt::reduce_scatter_add_exact)
//!   (FSDP's exact accumulation of a micro-batch's gradient shards) sends
//!   the plain reduce-scatter's bytes and adds every rank's chunk in one
//!   pass over the owner's encoded accumulator, taking a few times the
//!   plain reduce-scatter's time (the additions, not the bytes); FSDP's
//!   reducer thread runs it behind the backward, so the reproducible
//!   ZeRO-3 step with two micro-batches per rank takes about the plain
//!   one's time (`benches/fsdp_step.rs` in weft-model, `--micro 2`).
//! - Over MPI (`benches/mpi_vs_local.rs`), this crate's ring
//!   reduce-scatter beats the library's blocking `MPI_Reduce_scatter` on
//!   both machines measured, from a few hundred KiB with 2 processes and
//!   from a megabyte or a few with 4; the all-gather is the library's own
//!   (`MPI_Iallgatherv`, polled), as fast as its blocking form in some
//!   runs and slower in others, like this crate's ring over
//!   point-to-point, whose messages are copied into and out of their
//!   headers' buffers.
//!
//! # Failures
//! Nothing hangs: every wait has the communicator's timeout, and the
//! error names the operation, the group and the ranks that did not
//! arrive ([`Error::Timeout`]). A rank that returns, panics or is failed by
//! fault injection ([`LocalCluster::fail_rank_at`]) makes its peers' waits
//! fail with [`Error::PeerLost`] naming it. The direct exchanges (see
//! above) of reductions, which hold every peer's message at once, abort the group
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
//!   crate runs over MPI point-to-point; `Auto` f32/f64 all-reduces
//!   below 2 MiB (`NATIVE_ALL_REDUCE_BELOW`; 64 KiB when a group spans
//!   nodes, `NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES`) and `Auto` all-gathers use the
//!   library's own (`MPI_Iallreduce`, `MPI_Iallgatherv`, polled so the
//!   timeout still holds), larger all-reduces and every reduce-scatter this
//!   crate's ring, measured faster than the library's non-blocking calls
//!   on one node (`benches/mpi_vs_local.rs` compares them with the
//!   library's blocking and non-blocking calls and the thread backend;
//!   `MpiComm::library_all_reduce` and `library_reduce_scatter` call the
//!   library at any size). `tests/mpi.rs` runs the suite under
//!   `mpirun -np 4`.
//! - `nccl`: `NcclComm`, the backend over NCCL on GPUs (cudarc, loaded at
//!   run time, so it builds without CUDA). Host buffers are staged through
//!   the GPU; `*_device` methods work on device buffers. Without the driver
//!   or NCCL, constructors return [`Error::BackendUnavailable`] (cudarc
//!   itself would panic). `tests/nccl.rs` checks it against a CPU
//!   reference on one GPU; `collectives/gpu-check.sh` runs that check.
//! - `serde`: [`Backend`] (de)serializes as the name a job file uses
//!   (`"auto"`, `"threads"`, `"mpi"`, `"nccl"`).
#![deny(missing_docs)]

mod algo;
mod backend;
mod bytes;
mod comm;
mod error;
mod local;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
mod nccl_backend;
pub mod processes;
mod reduce;
pub mod repro;
mod types;

pub use backend::Backend;
pub use bytes::{AGREE_TAG, Disagreement, MAX_GATHERED, agree, all_gather_bytes, gather_bytes};
pub use comm::{Communicator, CommunicatorExt, Pending};
pub use error::{Error, LossCause, Result};
pub use local::{DEFAULT_TIMEOUT, LocalCluster, LocalComm};
pub use mesh::Mesh;
#[cfg(feature = "mpi")]
pub use mpi_backend::{
    MPI_DEFAULT_TIMEOUT, MPI_MAX_TAG, MpiComm, MpiCommBuilder, NATIVE_ALL_REDUCE_BELOW,
    NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES,
};
#[cfg(feature = "nccl")]
pub use nccl_backend::{NCCL_DEFAULT_TIMEOUT, NcclComm, NcclId, nccl_available};
pub use reduce::round_to_bf16;
pub use types::{
    Algorithm, Buf, BufMut, Incoming, LinkClass, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions,
    SMALL_MESSAGE_BYTES, Signature, Sink, Topology, Traffic, TrafficCounters, shard_range,
};
pub use weft_numerics::{Dtype, Element, bf16, f16};
