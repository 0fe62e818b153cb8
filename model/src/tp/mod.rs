//! Tensor parallelism, Megatron-LM style, as *sharding styles* of the one
//! GPT block's layers: with a [`TensorParallel`] group the blocks of
//! [`GptBlocks`](crate::GptBlocks) hold this rank's shard of every split
//! tensor (the layout's [`Placement`](weft_parallel::Placement)s say which)
//! and run the same sequence of ops, with the group's communication where
//! a style needs it. There is no second copy of the block.
//!
//! # The styles
//!
//! * **Column-parallel** linear (`attn.c_attn`, `mlp.c_fc`): `y = x·W + b`
//!   with `W [in, out]` split by output columns (and `b` with them): each
//!   rank computes its slice of `y` from the whole `x`. Forward: the
//!   identity `f` before it — or, with sequence parallelism, `ḡ`, the
//!   all-gather of the ranks' tokens ([`TensorParallel::enter_column`]).
//!   Backward: its input gradient is a per-rank partial sum, all-reduced
//!   (reduce-scattered under SP: [`TensorParallel::column_input_grad`]).
//! * **Row-parallel** linear (`attn.c_proj`, `mlp.c_proj`): `W` split by
//!   input rows; each rank's partial product is summed over the group (`g`:
//!   an all-reduce, or a reduce-scatter into each rank's tokens under SP),
//!   then the replicated bias is added once, after the sum
//!   ([`TensorParallel::row_forward`]); its backward needs the whole output
//!   gradient (all-gathered under SP: [`TensorParallel::row_output_grad`]).
//! * **Vocabulary-parallel** embedding and loss ([`VocabShard`]): each rank
//!   holds rows of `wte` (and of an untied `lm_head`); the embedding is the
//!   sum over the group of each rank's rows (one non-zero term per element:
//!   exact), the cross-entropy is computed from each rank's logit columns
//!   with three all-reduced floats per token — the logits are never
//!   gathered.
//! * **Sequence parallelism** ([`TpOptions::sequence_parallel`]): the
//!   regions between a row-parallel layer and the next column-parallel one
//!   — residual adds, layernorms — run on `B·T/tp` tokens per rank (a
//!   contiguous range of the flattened `(B·T)` rows). An all-reduce moves
//!   the bytes of a reduce-scatter plus an all-gather, so the traffic is the
//!   same while the residual stream and the block outputs are stored for
//!   `1/tp` of the tokens. The layernorms' gradients are then partial sums
//!   over the group ([`Placement::Partial`](weft_parallel::Placement::Partial)
//!   in the layout), which `weft_parallel::GradReducer` sums with the
//!   data-parallel reduction.
//!
//! # How a GPT-2 block is split
//!
//! Head `h` of `n_head` owns channels `h·HS..(h+1)·HS` of each of Q, K and
//! V (`HS = C / n_head`); rank `r` of `tp` holds heads
//! `r·n_head/tp..(r+1)·n_head/tp`, i.e. channels `r·C_l..(r+1)·C_l` with
//! `C_l = C/tp`. The fused `attn.c_attn.weight [C, 3C]` holds `Q|K|V` side
//! by side, so the rank's shard `[C, 3·C_l]` is the three column ranges
//! `r·C_l..`, `C + r·C_l..`, `2C + r·C_l..` concatenated — a strided shard
//! of 3 blocks — again `Q_l|K_l|V_l`, which is what the attention kernel
//! expects for `n_head/tp` heads. With grouped-query attention the
//! three blocks are unequal (`Q` is `n_head / n_kv_head` times as wide as
//! `K` or `V`: [`Placement::strided_lead`](weft_parallel::Placement::strided_lead)).
//! When `tp` divides `n_kv_head`, a rank's query heads are exactly the ones
//! that read its `n_kv_head/tp` key/value heads. When `tp` is a multiple
//! `g · n_kv_head` of them (and divides `n_head`), key/value heads are
//! *replicated*, as Megatron-LM and vLLM do: rank `r` holds query heads
//! `r·n_head/tp..` and a copy of the one key/value head `r / g` they read,
//! the `g` consecutive ranks of a replica group holding identical copies
//! of its `K` and `V` columns (and q/k/v biases)
//! ([`Placement::with_copies`](weft_parallel::Placement::with_copies)).
//! The forward needs nothing more: each copy computes the same keys and
//! values. In the backward each copy's gradient comes from its own query
//! heads only — a partial sum over the replica group, which
//! `weft_parallel::GradReducer` (or, under FSDP, a sum over the group
//! before FSDP's reduction) adds up so that the copies stay equal; the
//! input gradient of `attn.c_attn` needs no change (the group's partial key
//! and value gradients add up to the whole one in the all-reduce it already
//! has). A checkpoint writes each copy once and reads it into every
//! replica. Neither dividing the other is refused. `ln_1`, `ln_2`, `ln_f`, `wpe` and the
//! row-parallel biases are replicated. A mixture-of-experts feed-forward
//! block is replicated over `tp` (its experts may be sharded over `ep`
//! instead): every tensor-parallel rank runs it on the whole (gathered)
//! tokens and keeps its own rows of the output.
//!
//! # Numerics
//!
//! At `tp = 1` nothing is split and the block runs exactly the unsplit
//! kernel calls. At `tp > 1` the row-parallel layers sum partial dot
//! products over the group and the cross-entropy sums exponentials per
//! vocabulary shard, so results agree with `tp = 1` to rounding (see
//! `tests/tp.rs` for the tolerances), not bitwise.
//! [`TpOptions::reproducible`] makes every reduction the correctly rounded
//! exact sum, so a run is bitwise independent of the collective algorithm
//! and of the rank order — but the partial sums themselves still depend on
//! the tp degree.

mod vocab;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use weft_collectives::{Algorithm, Communicator, CommunicatorExt, ReduceOp, ReduceOptions};
use weft_kernels::{LinearInput, Mode, Precision, matmul_forward};

pub use vocab::VocabShard;

use crate::config::GptConfig;
use crate::error::{Error, Result};

pub(crate) fn split_err(what: &'static str, reason: String) -> Error {
    Error::Split { what, reason }
}

/// How a tp group communicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Sequence parallelism (see the module docs).
    pub sequence_parallel: bool,
    /// The collectives' reproducible mode for every sum (the maximum of the
    /// cross-entropy is exact in any order and always uses the plain mode).
    pub reproducible: bool,
    /// The collective algorithm; [`Algorithm::Ring`] by default, for which
    /// [`traffic_per_step`] gives the exact bytes.
    pub algorithm: Algorithm,
}

impl Default for TpOptions {
    fn default() -> Self {
        TpOptions {
            sequence_parallel: false,
            reproducible: false,
            algorithm: Algorithm::Ring,
        }
    }
}

impl TpOptions {
    /// The options of every sum.
    pub fn sum(&self) -> ReduceOptions {
        ReduceOptions::new(ReduceOp::Sum)
            .algorithm(self.algorithm)
            .reproducible(self.reproducible)
    }

    /// The options of the cross-entropy's row maximum (never reproducible:
    /// a maximum is exact in any order).
    pub fn max(&self) -> ReduceOptions {
        ReduceOptions::new(ReduceOp::Max).algorithm(self.algorithm)
    }
}

/// Nanoseconds spent inside tp collectives, for the "fraction of step time
/// in communication" figure. On the thread backend this includes waiting
/// for the slowest peer.
#[derive(Debug, Default)]
struct CommClock(AtomicU64);

impl CommClock {
    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = f();
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(ns, Ordering::Relaxed);
        r
    }
}

/// A tensor-parallel group and how it communicates: what a
/// [`GptBlocks`](crate::GptBlocks) of a tensor-parallel rank runs its
/// sharding styles over (see the module docs).
#[derive(Clone)]
pub struct TensorParallel {
    comm: Arc<dyn Communicator>,
    /// The ranks holding copies of this rank's key/value heads (more ranks
    /// than key/value heads), if they are more than this one.
    kv: Option<Arc<dyn Communicator>>,
    opts: TpOptions,
    clock: Arc<CommClock>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl TensorParallel {
    /// The group `comm` (its size is `tp`, its rank this rank's place).
    pub fn new(comm: Arc<dyn Communicator>, opts: TpOptions) -> Self {
        TensorParallel {
            comm,
            kv: None,
            opts,
            clock: Arc::default(),
        }
    }

    /// This group with `kv`, the ranks holding copies of this rank's
    /// key/value heads when `tp` is a multiple of `n_kv_head`
    /// ([`ParallelMesh::copies_group_arc`](weft_parallel::ParallelMesh::copies_group_arc)
    /// of `tp / n_kv_head`): an FSDP-sharded model sums their partial
    /// gradients over it before reducing over the data-parallel group.
    #[must_use]
    pub fn with_kv_copies(mut self, kv: Arc<dyn Communicator>) -> Self {
        self.kv = (kv.size() > 1).then_some(kv);
        self
    }

    /// Sums `x` over the ranks holding copies of this rank's key/value
    /// heads (nothing without copies).
    pub(crate) fn kv_all_reduce(&self, x: &mut [f32]) -> Result<()> {
        if let Some(kv) = &self.kv {
            self.clock
                .time(|| kv.all_reduce_with(x, &self.opts.sum()))?;
        }
        Ok(())
    }

    /// The tp degree.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The options.
    pub fn options(&self) -> &TpOptions {
        &self.opts
    }

    /// Whether sequence parallelism is on.
    pub fn sequence_parallel(&self) -> bool {
        self.opts.sequence_parallel
    }

    /// The group.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// Nanoseconds this rank has spent in tp collectives (on the thread
    /// backend including waits for the slowest peer).
    pub fn comm_nanos(&self) -> u64 {
        self.clock.0.load(Ordering::Relaxed)
    }

    /// The rows of `n` a rank's residual stream holds: `n / tp` under
    /// sequence parallelism, else `n`.
    pub(crate) fn rows(&self, n: usize) -> usize {
        if self.opts.sequence_parallel {
            n / self.size()
        } else {
            n
        }
    }

    /// This rank's first row under sequence parallelism (0 otherwise).
    pub(crate) fn first_row(&self, n: usize) -> usize {
        if self.opts.sequence_parallel {
            self.rank() * (n / self.size())
        } else {
            0
        }
    }

    pub(crate) fn all_reduce(&self, x: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.all_reduce_with(x, &self.opts.sum()))?;
        Ok(())
    }

    pub(crate) fn all_reduce_max(&self, x: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.all_reduce_with(x, &self.opts.max()))?;
        Ok(())
    }

    /// Checks that `full` is `tp` shards of `shard`'s length.
    fn check_split(&self, what: &'static str, shard: usize, full: usize) -> Result<()> {
        if full == shard * self.size() {
            return Ok(());
        }
        Err(split_err(
            what,
            format!(
                "{shard} floats of a shard times tp = {} is not the {full} of the whole",
                self.size()
            ),
        ))
    }

    pub(crate) fn all_gather(&self, shard: &[f32], full: &mut [f32]) -> Result<()> {
        self.check_split("sequence all-gather", shard.len(), full.len())?;
        self.clock
            .time(|| self.comm.all_gather_with(shard, full, self.opts.algorithm))?;
        Ok(())
    }

    pub(crate) fn reduce_scatter(&self, full: &[f32], shard: &mut [f32]) -> Result<()> {
        self.check_split("sequence reduce-scatter", shard.len(), full.len())?;
        self.clock
            .time(|| self.comm.reduce_scatter_with(full, shard, &self.opts.sum()))?;
        Ok(())
    }

    /// The input of a column-parallel layer from this rank's tokens `x`:
    /// `x` itself (`f`, the identity), or under sequence parallelism all
    /// ranks' tokens gathered into `full` (`ḡ`).
    ///
    /// # Errors
    /// [`Error::Comm`] or [`Error::Split`] for shapes that do not split.
    pub fn enter_column<'a>(&self, x: &'a [f32], full: &'a mut [f32]) -> Result<&'a [f32]> {
        if self.opts.sequence_parallel {
            self.all_gather(x, full)?;
            Ok(full)
        } else {
            Ok(x)
        }
    }

    /// The backward of [`enter_column`](Self::enter_column): a
    /// column-parallel layer's input gradient `partial (N, C)` is a per-rank
    /// partial sum; it is all-reduced in place, or reduce-scattered into
    /// this rank's tokens `rows` under sequence parallelism. Returns this
    /// rank's rows of the sum.
    ///
    /// # Errors
    /// As [`enter_column`](Self::enter_column).
    pub fn column_input_grad<'a>(
        &self,
        partial: &'a mut [f32],
        rows: &'a mut [f32],
    ) -> Result<&'a [f32]> {
        if self.opts.sequence_parallel {
            self.reduce_scatter(partial, rows)?;
            Ok(rows)
        } else {
            self.all_reduce(partial)?;
            Ok(partial)
        }
    }

    /// The gradient a row-parallel layer's backward needs: the whole output
    /// gradient — `dy` itself, or all ranks' tokens gathered into `full`
    /// under sequence parallelism.
    ///
    /// # Errors
    /// As [`enter_column`](Self::enter_column).
    pub fn row_output_grad<'a>(&self, dy: &'a [f32], full: &'a mut [f32]) -> Result<&'a [f32]> {
        self.enter_column(dy, full)
    }

    /// A row-parallel layer `out = Σ_ranks inp_r (N, k) · w_r + bias`
    /// (`w_r (k, C)`) into this rank's tokens (its products in
    /// `precision`): the partial product (into `out`, or into
    /// `partial (N, C)` under sequence parallelism), summed over the group
    /// (`g`: all-reduce, or reduce-scatter into `out`), then the replicated
    /// bias, if any, added once.
    ///
    /// # Errors
    /// A kernel error on a wrong length; as [`enter_column`](Self::enter_column).
    #[allow(clippy::too_many_arguments)]
    pub fn row_forward(
        &self,
        out: &mut [f32],
        partial: &mut [f32],
        inp: LinearInput<'_, f32>,
        w: &[f32],
        bias: Option<&[f32]>,
        (b, t): (usize, usize),
        (k, c): (usize, usize),
        mode: Mode,
        precision: Precision,
    ) -> Result<()> {
        if self.opts.sequence_parallel {
            matmul_forward(partial, inp, w, None, b, t, k, c, mode, precision)?;
            self.reduce_scatter(partial, out)?;
        } else {
            matmul_forward(out, inp, w, None, b, t, k, c, mode, precision)?;
            self.all_reduce(out)?;
        }
        if let Some(bias) = bias {
            for row in out.chunks_exact_mut(c) {
                for (o, &x) in row.iter_mut().zip(bias) {
                    *o += x;
                }
            }
        }
        Ok(())
    }
}

/// Bytes *sent*, summed over all ranks of the group, by the tp collectives
/// of one forward + backward of a micro-batch, per collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpTraffic {
    /// All-reduce bytes.
    pub all_reduce: u64,
    /// Reduce-scatter bytes.
    pub reduce_scatter: u64,
    /// All-gather bytes.
    pub all_gather: u64,
}

impl TpTraffic {
    /// All bytes.
    pub fn total(&self) -> u64 {
        self.all_reduce + self.reduce_scatter + self.all_gather
    }
}

/// The bytes a tp group of `tp` ranks sends (summed over its ranks) for one
/// forward + backward of a `b×t` micro-batch of a dense GPT-2 with
/// configuration `cfg`, with the ring algorithm and the plain sum, as
/// counted by the collectives' traffic counters. With `k = tp`, `N = b·t`,
/// `C`, `L` layers and 4-byte floats, a ring all-reduce of `x` floats
/// sends `2(k−1)·4x` bytes in all, a reduce-scatter or all-gather
/// `(k−1)·4x`:
///
/// * without sequence parallelism: all-reduces of `N·C` floats — the
///   embedding (1), four per block (two forward, two backward), the head's
///   input gradient (1) — plus the cross-entropy's `N` maxima and `2N`
///   sums: `2(k−1)·4·((4L+2)·N·C + 3N)`;
/// * with sequence parallelism each `N·C` all-reduce becomes a
///   reduce-scatter plus an all-gather of the same total bytes: `(4L+2)`
///   of each, `(k−1)·4·(4L+2)·N·C` bytes each, plus the cross-entropy's
///   `3N` all-reduced floats (the layernorms' partial gradients are summed
///   by the data-parallel reducer, once per step).
///
/// (The reproducible mode sends encoded exact sums instead, about twice
/// the bytes.)
pub fn traffic_per_step(
    cfg: &GptConfig,
    tp: usize,
    sequence_parallel: bool,
    b: usize,
    t: usize,
) -> TpTraffic {
    let k = tp as u64 - 1;
    let (n, c, l) = ((b * t) as u64, cfg.n_embd as u64, cfg.n_layer as u64);
    let big = (4 * l + 2) * n * c;
    let ce = 3 * n;
    if sequence_parallel {
        TpTraffic {
            all_reduce: 2 * k * 4 * ce,
            reduce_scatter: k * 4 * big,
            all_gather: k * 4 * big,
        }
    } else {
        TpTraffic {
            all_reduce: 2 * k * 4 * (big + ce),
            reduce_scatter: 0,
            all_gather: 0,
        }
    }
}
