//! Column- and row-parallel linear layers.

use std::ops::Range;

use weft_collectives::Communicator;
use weft_kernels::{Mode, matmul_backward, matmul_forward};

use super::{Result, TpOptions, check_len, f_backward, g_forward, seq_scatter, shape_err};

fn check_degree(what: &'static str, features: usize, tp: usize, rank: usize) -> Result<()> {
    if tp == 0 || rank >= tp {
        return Err(shape_err(what, format!("rank {rank} of tp = {tp}")));
    }
    if features == 0 || !features.is_multiple_of(tp) {
        return Err(shape_err(
            what,
            format!("{features} features do not split evenly over tp = {tp}"),
        ));
    }
    Ok(())
}

fn check_comm(comm: &dyn Communicator, tp: usize, rank: usize) -> Result<()> {
    if comm.size() != tp || comm.rank() != rank {
        return Err(shape_err(
            "communicator",
            format!(
                "layer built for rank {rank} of tp = {tp}, called with rank {} of {}",
                comm.rank(),
                comm.size()
            ),
        ));
    }
    Ok(())
}

/// `y (N, out) = x (N, in) · W + b` with `W [in, out]` split by output
/// columns: rank `r` holds columns [`columns`](Self::columns) of `W` (a
/// `[in, out/tp]` matrix) and the same slice of `b`, and computes that
/// slice of `y` from the whole (replicated) `x`. The forward needs no
/// communication (the `f` operator is the identity); the backward's input
/// gradient is a partial sum per rank and is all-reduced ([`f_backward`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnParallelLinear {
    in_features: usize,
    out_features: usize,
    tp: usize,
    rank: usize,
}

impl ColumnParallelLinear {
    /// Rank `rank` of `tp` of a `[in, out]` layer.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `out` is not a positive
    /// multiple of `tp`, `in` is 0, or `rank >= tp`.
    pub fn new(in_features: usize, out_features: usize, tp: usize, rank: usize) -> Result<Self> {
        check_degree("column-parallel output features", out_features, tp, rank)?;
        if in_features == 0 {
            return Err(shape_err("column-parallel input features", "0".into()));
        }
        Ok(Self {
            in_features,
            out_features,
            tp,
            rank,
        })
    }

    /// Output columns on this rank, `out/tp`.
    pub fn local_out(&self) -> usize {
        self.out_features / self.tp
    }

    /// The global output columns this rank holds.
    pub fn columns(&self) -> Range<usize> {
        let k = self.local_out();
        self.rank * k..(self.rank + 1) * k
    }

    /// This rank's `[in, out/tp]` slice of a full `[in, out]` weight.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) on a wrong length.
    pub fn shard_weight(&self, full: &[f32]) -> Result<Vec<f32>> {
        check_len(
            "column-parallel weight",
            full.len(),
            self.in_features * self.out_features,
        )?;
        let cols = self.columns();
        Ok(full
            .chunks_exact(self.out_features)
            .flat_map(|row| row[cols.clone()].iter().copied())
            .collect())
    }

    /// This rank's slice of a full `[out]` bias.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) on a wrong length.
    pub fn shard_bias(&self, full: &[f32]) -> Result<Vec<f32>> {
        check_len("column-parallel bias", full.len(), self.out_features)?;
        Ok(full[self.columns()].to_vec())
    }

    /// `out (N, out/tp) = inp (N, in) · w + b` for this rank's columns.
    ///
    /// # Errors
    /// A kernel error on a wrong buffer length.
    pub fn forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
    ) -> Result<()> {
        let (c, oc) = (self.in_features, self.local_out());
        matmul_forward(out, inp, w, b, 1, n, c, oc, Mode::Throughput)?;
        Ok(())
    }

    /// Backward: accumulates `dw`, `db` (this rank's slices) and
    /// *overwrites* `dinp (N, in)` with the whole input gradient — the
    /// rank's partial `dout · wᵀ`, all-reduced over the group.
    ///
    /// # Errors
    /// A kernel error on a wrong buffer length; [`Error::Shape`](super::Error::Shape)
    /// if `comm` is not this layer's group; [`Error::Comm`](super::Error::Comm).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        comm: &dyn Communicator,
        opts: &TpOptions,
        dinp: &mut [f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
    ) -> Result<()> {
        check_comm(comm, self.tp, self.rank)?;
        let (c, oc) = (self.in_features, self.local_out());
        weft_kernels::zero(dinp);
        matmul_backward(dinp, dw, db, dout, inp, w, 1, n, c, oc, Mode::Throughput)?;
        f_backward(comm, opts, dinp)
    }
}

/// `y (N, out) = x (N, in) · W + b` with `W [in, out]` split by input rows:
/// rank `r` holds rows [`rows`](Self::rows) of `W` (a `[in/tp, out]`
/// matrix) and the matching columns of `x` (what a column-parallel layer
/// before it produced), computes the partial product, and the `g` operator
/// sums the partials over the group. The bias `b [out]` is replicated and
/// added once, after the sum (at `tp = 1` it is fused into the GEMM, the
/// unsplit layer's exact arithmetic). The backward needs no communication:
/// `dout` is replicated, so every rank has its input-gradient slice and its
/// weight rows' gradient, and the bias gradient `Σ dout` is complete (and
/// identical) on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowParallelLinear {
    in_features: usize,
    out_features: usize,
    tp: usize,
    rank: usize,
}

impl RowParallelLinear {
    /// Rank `rank` of `tp` of a `[in, out]` layer.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `in` is not a positive
    /// multiple of `tp`, `out` is 0, or `rank >= tp`.
    pub fn new(in_features: usize, out_features: usize, tp: usize, rank: usize) -> Result<Self> {
        check_degree("row-parallel input features", in_features, tp, rank)?;
        if out_features == 0 {
            return Err(shape_err("row-parallel output features", "0".into()));
        }
        Ok(Self {
            in_features,
            out_features,
            tp,
            rank,
        })
    }

    /// Input rows on this rank, `in/tp`.
    pub fn local_in(&self) -> usize {
        self.in_features / self.tp
    }

    /// The global input rows (weight rows) this rank holds.
    pub fn rows(&self) -> Range<usize> {
        let k = self.local_in();
        self.rank * k..(self.rank + 1) * k
    }

    /// This rank's `[in/tp, out]` slice of a full `[in, out]` weight.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) on a wrong length.
    pub fn shard_weight(&self, full: &[f32]) -> Result<Vec<f32>> {
        check_len(
            "row-parallel weight",
            full.len(),
            self.in_features * self.out_features,
        )?;
        let r = self.rows();
        Ok(full[r.start * self.out_features..r.end * self.out_features].to_vec())
    }

    fn partial(
        &self,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
    ) -> Result<()> {
        let (c, oc) = (self.local_in(), self.out_features);
        let fused = if self.tp == 1 { b } else { None };
        matmul_forward(out, inp, w, fused, 1, n, c, oc, Mode::Throughput)?;
        Ok(())
    }

    fn add_bias(&self, out: &mut [f32], b: Option<&[f32]>) {
        if let (true, Some(b)) = (self.tp > 1, b) {
            for row in out.chunks_exact_mut(self.out_features) {
                for (o, &x) in row.iter_mut().zip(b) {
                    *o += x;
                }
            }
        }
    }

    /// `out (N, out) = Σ_ranks inp_r (N, in/tp) · w_r + b`: the partial
    /// product, all-reduced ([`g_forward`]), plus the bias.
    ///
    /// # Errors
    /// A kernel error on a wrong buffer length; [`Error::Shape`](super::Error::Shape)
    /// if `comm` is not this layer's group; [`Error::Comm`](super::Error::Comm).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        comm: &dyn Communicator,
        opts: &TpOptions,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
    ) -> Result<()> {
        check_comm(comm, self.tp, self.rank)?;
        self.partial(out, inp, w, b, n)?;
        g_forward(comm, opts, out)?;
        self.add_bias(out, b);
        Ok(())
    }

    /// The sequence-parallel forward: the partial product into `partial (N,
    /// out)`, reduce-scattered ([`seq_scatter`]) so that `out_shard (N/tp,
    /// out)` holds this rank's tokens of the sum, plus the bias.
    ///
    /// # Errors
    /// As [`forward`](Self::forward); [`Error::Shape`](super::Error::Shape)
    /// if `N` is not a multiple of `tp`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_scatter(
        &self,
        comm: &dyn Communicator,
        opts: &TpOptions,
        out_shard: &mut [f32],
        partial: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
    ) -> Result<()> {
        check_comm(comm, self.tp, self.rank)?;
        self.partial(partial, inp, w, b, n)?;
        seq_scatter(comm, opts, partial, out_shard)?;
        self.add_bias(out_shard, b);
        Ok(())
    }

    /// Backward (no communication): accumulates `dinp (N, in/tp)`, `dw`
    /// (this rank's rows) and `db` (the replicated bias's whole gradient)
    /// from the whole `dout (N, out)`.
    ///
    /// # Errors
    /// A kernel error on a wrong buffer length.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
    ) -> Result<()> {
        let (c, oc) = (self.local_in(), self.out_features);
        matmul_backward(dinp, dw, db, dout, inp, w, 1, n, c, oc, Mode::Throughput)?;
        Ok(())
    }
}
