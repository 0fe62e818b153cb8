//! Tensor parallelism, Megatron-LM style: every layer's matrices split over
//! a tp group of ranks (a [`Communicator`]), one all-reduce per sub-block
//! in the forward and one in the backward.
//!
//! # The pieces
//!
//! * [`ColumnParallelLinear`] / [`RowParallelLinear`]: `y = x·W + b` with
//!   `W` in the Hugging Face `Conv1D` `[in, out]` layout, split by output
//!   columns (each rank computes a slice of `y`; its bias slice is sharded
//!   with the columns) or by input rows (each rank computes a partial `y`
//!   from its slice of `x`; the partials are summed by the all-reduce, then
//!   the bias, which is replicated, is added once — after the reduction, so
//!   it is not counted `tp` times).
//! * The conjugate operators ([`f_backward`], [`g_forward`]): `f` is the
//!   identity in the forward and an all-reduce in the backward (it sits in
//!   front of a column-parallel layer, whose input is replicated but whose
//!   input gradient is a per-rank partial), `g` is an all-reduce in the
//!   forward and the identity in the backward (after a row-parallel layer).
//!   With sequence parallelism they become [`seq_gather`] (all-gather
//!   forward, reduce-scatter backward) and [`seq_scatter`] (reduce-scatter
//!   forward, all-gather backward).
//! * [`VocabShard`]: the vocabulary-parallel embedding (each rank holds
//!   rows `range()` of `wte`; ids outside contribute zero rows; the sum
//!   over the group is the embedding) and the vocabulary-parallel
//!   cross-entropy that never gathers the logits: each rank's logits
//!   `(B·T, V/tp)` give a row maximum and a sum of exponentials, the
//!   maximum is all-reduced with `Max`, the sums and the target logit
//!   (non-zero only on the rank that owns the target) with `Sum`, and
//!   `loss = ln Σexp − (x_target − max)`.
//! * [`TpLayout`]: which part of each Hugging Face tensor a rank holds
//!   ([`Split`]), sharding a full parameter buffer and placing a shard back
//!   (export, checkpoint regions).
//! * [`TpGpt`]: the whole GPT-2 on one rank of the group — loss, and the
//!   gradient of this rank's parameter shard.
//!
//! # How a GPT-2 block is split
//!
//! Head `h` of `n_head` owns channels `h·HS..(h+1)·HS` of each of Q, K and
//! V (`HS = C / n_head`); rank `r` of `tp` holds heads
//! `r·n_head/tp..(r+1)·n_head/tp`, i.e. channels `r·C_l..(r+1)·C_l` with
//! `C_l = C/tp`. The fused `attn.c_attn.weight [C, 3C]` holds `Q|K|V` side
//! by side, so the rank's shard `[C, 3·C_l]` is the three column ranges
//! `r·C_l..`, `C + r·C_l..`, `2C + r·C_l..` (each `C_l` wide) concatenated
//! — again `Q_l|K_l|V_l`, which is what the attention kernel expects for
//! `n_head/tp` heads; `attn.c_attn.bias [3C]` likewise. `attn.c_proj
//! .weight [C, C]` is row-parallel: rows `r·C_l..(r+1)·C_l` (the input
//! channels of the rank's heads). `mlp.c_fc [C, 4C]` is column-parallel
//! (columns `r·4C/tp..`, its bias too), `mlp.c_proj [4C, C]` row-parallel.
//! `ln_1`, `ln_2`, `ln_f`, `wpe` and the row-parallel biases are
//! replicated; `wte` (and an untied `lm_head`) are split by vocabulary
//! rows ([`crate::ParamLayout`] names throughout).
//!
//! Forward of a block on rank `r` (`x` replicated): `ln_1(x)` → f →
//! column-parallel QKV → attention over the local heads → row-parallel
//! `c_proj` → g (all-reduce) + bias → residual; the MLP the same way. One
//! all-reduce of `B·T·C` floats per sub-block forward and one per sub-block
//! backward (the f of each sub-block) — four per block per micro-batch.
//!
//! # Replicated parameters and their gradients
//!
//! Without sequence parallelism every rank computes the layernorms, the
//! position embedding and the row-parallel bias additions on the whole
//! (replicated) activations, from gradients that are already all-reduced:
//! their gradients are complete and bitwise identical on every rank, and
//! must *not* be summed over the group. With sequence parallelism the
//! layernorms run on a rank's share of the tokens only, so their gradients
//! are partial sums and [`TpGpt::backward`] all-reduces them (one
//! all-reduce of `2C·(2L+1)` floats per micro-batch). The row-parallel
//! biases and `wpe` get their gradients from the gathered (whole) output
//! gradient in both modes, so they need no sum.
//!
//! # Sequence parallelism
//!
//! With [`TpOptions::sequence_parallel`], the regions between a row-parallel
//! layer and the next column-parallel one — residual adds, layernorms (and
//! dropout, where a model has it) — run on `B·T/tp` tokens per rank (a
//! contiguous range of the flattened `(B·T)` rows; `B·T` must be divisible
//! by `tp`). The all-reduce after a row-parallel layer becomes a
//! reduce-scatter (each rank keeps its tokens), and the column-parallel
//! layer's input is all-gathered first; in the backward the roles swap. An
//! all-reduce moves the bytes of a reduce-scatter plus an all-gather, so the
//! traffic is the same, while the residual stream, layernorm statistics
//! and block outputs are stored for `1/tp` of the tokens. (The gathered
//! layernorm outputs are kept for the weight gradients rather than
//! gathered again in the backward.)
//!
//! # Numerics
//!
//! At `tp = 1` [`TpGpt`] runs the same kernel calls as [`crate::Gpt`]
//! (row-parallel biases fused into the GEMM, the fused classifier), so its
//! loss and gradients are bitwise `Gpt`'s. At `tp > 1` the row-parallel
//! layers sum partial dot products over the group and the cross-entropy
//! sums exponentials per vocabulary shard, so results agree with `tp = 1`
//! to rounding (see `tests/tp.rs` for the tolerances), not bitwise.
//! [`TpOptions::reproducible`] makes every reduction the correctly rounded
//! exact sum, so a run is bitwise independent of the collective algorithm
//! and of the rank order — but the partial sums themselves still depend on
//! the tp degree, so different tp degrees are still not bitwise equal.
//! In that mode sequence parallelism is bitwise the plain split except for
//! the layernorm parameters' gradients (sums over tokens that SP splits).
//!
//! # Example
//!
//! Two thread ranks, each holding half of every split tensor, give the
//! whole model's loss; each has the gradient of its own shard.
//!
//! ```
//! use weft_collectives::{Communicator, LocalCluster};
//! use weft_model::tp::{TpGpt, TpOptions};
//! use weft_model::{Gpt, GptConfig};
//!
//! let cfg = GptConfig { n_layer: 1, n_head: 4, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5 };
//! let mut full = Gpt::new(cfg)?;
//! full.init_gpt2(1);
//! let tokens: Vec<u32> = (0..8).collect();
//! let targets: Vec<u32> = (1..9).collect();
//! let mut acts = full.activations(1, 8)?;
//! let want = full.forward(&mut acts, &tokens, Some(&targets))?.unwrap();
//! let out = LocalCluster::run(2, |comm| -> weft_model::tp::Result<(f64, usize)> {
//!     let mut m = TpGpt::from_full(&full, 2, comm.rank(), TpOptions::default())?;
//!     let mut acts = m.activations(1, 8)?;
//!     let loss = m.forward(&comm, &mut acts, &tokens, Some(&targets))?.unwrap();
//!     m.zero_grad();
//!     m.backward(&comm, &mut acts)?;
//!     Ok((loss, m.grads.len()))
//! })?;
//! for r in out {
//!     let (loss, shard) = r?;
//!     assert!((loss - want).abs() < 1e-6 * want);
//!     assert!(shard < full.grads.len() * 3 / 5);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod block;
mod linear;
mod model;
mod shard;
mod vocab;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use weft_collectives::{Algorithm, Communicator, CommunicatorExt, ReduceOp, ReduceOptions};

pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use model::{TpActivations, TpGpt, TpMemory, TpTraffic, param_split};
pub use shard::{Piece, Split, TpLayout, TpTensor};
pub use vocab::VocabShard;

/// What went wrong in a tensor-parallel layer or model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model crate's error (configuration, batch shape, weights).
    #[error(transparent)]
    Model(#[from] crate::Error),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] weft_kernels::Error),
    /// A collective over the tp group failed (timeout, lost peer, mismatch).
    #[error("tensor-parallel collective: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// A shape, degree or buffer does not fit the split.
    #[error("tensor parallelism: {what}: {reason}")]
    Shape {
        /// What was checked, e.g. `n_head` or `column-parallel weight`.
        what: &'static str,
        /// What is wrong, with the numbers.
        reason: String,
    },
}

/// `Result` with the tensor-parallel [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn shape_err(what: &'static str, reason: String) -> Error {
    Error::Shape { what, reason }
}

pub(crate) fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(shape_err(
            what,
            format!("holds {got} floats, expected {want}"),
        ))
    }
}

/// How a tp group communicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Sequence parallelism (see the module docs): reduce-scatter /
    /// all-gather instead of all-reduce, layernorm regions on `B·T/tp`
    /// tokens per rank.
    pub sequence_parallel: bool,
    /// The collectives' reproducible mode for every sum (the maximum of the
    /// cross-entropy is exact in any order and always uses the plain mode).
    pub reproducible: bool,
    /// The collective algorithm; [`Algorithm::Ring`] by default, for which
    /// [`TpGpt::traffic_per_step`] gives the exact bytes.
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
pub(crate) struct CommClock(AtomicU64);

impl CommClock {
    pub(crate) fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = f();
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(ns, Ordering::Relaxed);
        r
    }
    pub(crate) fn nanos(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    pub(crate) fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// The `f` operator's backward: sums the per-rank partial input gradients
/// of a column-parallel layer over the group (its forward is the identity).
///
/// # Errors
/// [`Error::Comm`] if the all-reduce fails.
pub fn f_backward(comm: &dyn Communicator, opts: &TpOptions, dx: &mut [f32]) -> Result<()> {
    comm.all_reduce_with(dx, &opts.sum())?;
    Ok(())
}

/// The `g` operator's forward: sums the per-rank partial outputs of a
/// row-parallel layer over the group (its backward is the identity).
///
/// # Errors
/// [`Error::Comm`] if the all-reduce fails.
pub fn g_forward(comm: &dyn Communicator, opts: &TpOptions, y: &mut [f32]) -> Result<()> {
    comm.all_reduce_with(y, &opts.sum())?;
    Ok(())
}

fn seq_rows(what: &'static str, comm: &dyn Communicator, full: usize, shard: usize) -> Result<()> {
    let tp = comm.size();
    if full != shard * tp {
        return Err(shape_err(
            what,
            format!(
                "sequence shard of {shard} floats times tp = {tp} is not the {full} floats of the whole"
            ),
        ));
    }
    Ok(())
}

/// Sequence parallelism's `ḡ` forward: all-gathers every rank's token
/// shard `(B·T/tp, C)` into the whole `(B·T, C)`, in rank order (the input
/// of a column-parallel layer). Its backward is [`seq_scatter`].
///
/// # Errors
/// [`Error::Shape`] if `full` is not `tp` shards; [`Error::Comm`].
pub fn seq_gather(
    comm: &dyn Communicator,
    opts: &TpOptions,
    shard: &[f32],
    full: &mut [f32],
) -> Result<()> {
    seq_rows("sequence all-gather", comm, full.len(), shard.len())?;
    comm.all_gather_with(shard, full, opts.algorithm)?;
    Ok(())
}

/// Sequence parallelism's reduce-scatter (the forward after a row-parallel
/// layer, and the backward of [`seq_gather`]): sums `partial (B·T, C)` over
/// the group and keeps this rank's tokens in `shard`.
///
/// # Errors
/// [`Error::Shape`] if `partial` is not `tp` shards; [`Error::Comm`].
pub fn seq_scatter(
    comm: &dyn Communicator,
    opts: &TpOptions,
    partial: &[f32],
    shard: &mut [f32],
) -> Result<()> {
    seq_rows("sequence reduce-scatter", comm, partial.len(), shard.len())?;
    comm.reduce_scatter_with(partial, shard, &opts.sum())?;
    Ok(())
}
