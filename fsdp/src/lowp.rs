//! Buffers in the compute/communication dtype (f32 or bf16).

use weft_collectives::repro::ExactPartial;
use weft_collectives::{Communicator, CommunicatorExt, Dtype, ReduceOptions, bf16};

/// A vector of f32 or bf16 values.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum LowVec {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl LowVec {
    /// `xs` rounded (to nearest-even) to `dtype` (f32 or bf16).
    pub(crate) fn from_f32(xs: &[f32], dtype: Dtype) -> Self {
        if dtype == Dtype::BF16 {
            LowVec::Bf16(xs.iter().map(|&x| bf16::from_f32(x)).collect())
        } else {
            LowVec::F32(xs.to_vec())
        }
    }

    /// `len` zeros of `dtype` (bf16, else f32).
    pub(crate) fn zeros(dtype: Option<Dtype>, len: usize) -> Self {
        if dtype == Some(Dtype::BF16) {
            LowVec::Bf16(vec![bf16::ZERO; len])
        } else {
            LowVec::F32(vec![0.0; len])
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            LowVec::F32(v) => v.len(),
            LowVec::Bf16(v) => v.len(),
        }
    }

    /// Bytes of the allocation.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            LowVec::F32(v) => crate::memory::bytes_of(v),
            LowVec::Bf16(v) => crate::memory::bytes_of(v),
        }
    }

    /// Zeros of the same dtype.
    pub(crate) fn zeros_like(&self, len: usize) -> Self {
        match self {
            LowVec::F32(_) => LowVec::F32(vec![0.0; len]),
            LowVec::Bf16(_) => LowVec::Bf16(vec![bf16::ZERO; len]),
        }
    }

    /// Element `i` widened to f32.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            LowVec::F32(v) => v[i],
            LowVec::Bf16(v) => v[i].to_f32(),
        }
    }

    /// Writes the values widened to f32 into `out` (same length).
    pub(crate) fn widen_into(&self, out: &mut [f32]) {
        match self {
            LowVec::F32(v) => out.copy_from_slice(v),
            LowVec::Bf16(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
        }
    }

    /// Overwrites with `xs` rounded to this dtype.
    pub(crate) fn assign_f32(&mut self, xs: &[f32]) {
        match self {
            LowVec::F32(v) => v.copy_from_slice(xs),
            LowVec::Bf16(v) => v
                .iter_mut()
                .zip(xs)
                .for_each(|(o, &x)| *o = bf16::from_f32(x)),
        }
    }

    /// Overwrites elements `at..at + xs.len()` with `xs` rounded to this
    /// dtype.
    pub(crate) fn assign_f32_at(&mut self, at: usize, xs: &[f32]) {
        match self {
            LowVec::F32(v) => v[at..at + xs.len()].copy_from_slice(xs),
            LowVec::Bf16(v) => v[at..at + xs.len()]
                .iter_mut()
                .zip(xs)
                .for_each(|(o, &x)| *o = bf16::from_f32(x)),
        }
    }

    /// `self += other` elementwise, computed in f32 and rounded once.
    pub(crate) fn add_assign(&mut self, other: &LowVec) {
        match (self, other) {
            (LowVec::F32(a), LowVec::F32(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
            (LowVec::Bf16(a), LowVec::Bf16(b)) => a
                .iter_mut()
                .zip(b)
                .for_each(|(x, y)| *x = bf16::from_f32(x.to_f32() + y.to_f32())),
            (a, b) => {
                let mut wide = vec![0.0f32; a.len()];
                a.widen_into(&mut wide);
                for (i, w) in wide.iter_mut().enumerate() {
                    *w += b.get(i);
                }
                a.assign_f32(&wide);
            }
        }
    }

    pub(crate) fn reduce_scatter(
        &self,
        c: &dyn Communicator,
        out: &mut LowVec,
        opts: &ReduceOptions,
    ) -> weft_collectives::Result<()> {
        match (self, out) {
            (LowVec::F32(a), LowVec::F32(b)) => c.reduce_scatter_with(a, b, opts),
            (LowVec::Bf16(a), LowVec::Bf16(b)) => c.reduce_scatter_with(a, b, opts),
            _ => unreachable!("reduce_scatter between different dtypes"),
        }
    }

    pub(crate) fn all_reduce(
        &mut self,
        c: &dyn Communicator,
        opts: &ReduceOptions,
    ) -> weft_collectives::Result<()> {
        match self {
            LowVec::F32(a) => c.all_reduce_with(a, opts),
            LowVec::Bf16(a) => c.all_reduce_with(a, opts),
        }
    }

    /// This rank's shard of the exact mean of every rank's contributions
    /// (sum over the group divided by the total count), rounded once.
    /// The exact sum of every rank's partial divided by `divisor`,
    /// rounded once, into this rank's shard.
    pub(crate) fn reduce_scatter_exact_div(
        &mut self,
        c: &dyn Communicator,
        p: &ExactPartial,
        divisor: u64,
    ) -> weft_collectives::Result<()> {
        match self {
            LowVec::F32(a) => c.reduce_scatter_exact_div(p, a, divisor),
            LowVec::Bf16(a) => c.reduce_scatter_exact_div(p, a, divisor),
        }
    }

    /// The exact sum of every rank's partial over `c` divided by
    /// `divisor`, rounded once (every rank gets all of it).
    pub(crate) fn all_reduce_exact_div(
        &mut self,
        c: &dyn Communicator,
        p: &ExactPartial,
        divisor: u64,
    ) -> weft_collectives::Result<()> {
        match self {
            LowVec::F32(a) => c.all_reduce_exact_div(p, a, divisor),
            LowVec::Bf16(a) => c.all_reduce_exact_div(p, a, divisor),
        }
    }

    /// This rank's partial alone divided by `divisor`, rounded once: the
    /// bits [`Self::all_reduce_exact_div`] gives on one rank.
    pub(crate) fn div_to(
        &mut self,
        p: &ExactPartial,
        divisor: u64,
    ) -> weft_collectives::Result<()> {
        match self {
            LowVec::F32(a) => p.div_to(a, divisor),
            LowVec::Bf16(a) => p.div_to(a, divisor),
        }
    }

    /// Gathers every rank's shard around this rank's, which `self` holds
    /// at its place ([`weft_collectives::shard_range`] of `self.len()`).
    pub(crate) fn all_gather_in_place(
        &mut self,
        c: &dyn Communicator,
    ) -> weft_collectives::Result<()> {
        match self {
            LowVec::F32(a) => c.all_gather_in_place(a),
            LowVec::Bf16(a) => c.all_gather_in_place(a),
        }
    }
}
