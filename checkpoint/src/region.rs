//! Boxes inside a tensor, and the byte runs that copy one box into another.

use serde::{Deserialize, Serialize};

/// A hyper-rectangle inside a tensor of some global shape: the slice
/// `[offsets[0]..offsets[0]+shape[0], offsets[1]..offsets[1]+shape[1], ...]`.
///
/// A row range of a matrix (FSDP, row-parallel) is `offsets = [r0, 0]`,
/// `shape = [rows, cols]`; a column range (column-parallel) is
/// `offsets = [0, c0]`, `shape = [rows, n]`; the whole tensor is
/// [`Region::full`]. A scalar is the region with empty vectors.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// First index along each dimension.
    pub offsets: Vec<u64>,
    /// Extent along each dimension.
    pub shape: Vec<u64>,
}

impl Region {
    /// The region `offsets .. offsets + shape`.
    pub fn new(offsets: Vec<u64>, shape: Vec<u64>) -> Self {
        Region { offsets, shape }
    }

    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        Region {
            offsets: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Part `index` of `parts` near-equal contiguous parts of `global` along
    /// `dim`: indices `index*n/parts .. (index+1)*n/parts` where `n =
    /// global[dim]`. Parts may be empty when `n < parts`.
    ///
    /// # Panics
    /// If `dim >= global.len()`, `parts == 0` or `index >= parts`.
    pub fn split(global: &[u64], dim: usize, parts: usize, index: usize) -> Self {
        assert!(
            dim < global.len(),
            "split dim {dim} of a {}-d tensor",
            global.len()
        );
        assert!(index < parts, "part {index} of {parts}");
        let n = u128::from(global[dim]);
        let (p, i) = (parts as u128, index as u128);
        // u128 avoids overflow of n * parts; results are <= n, so fit u64.
        let start = (n * i / p) as u64;
        let end = (n * (i + 1) / p) as u64;
        let mut r = Region::full(global);
        r.offsets[dim] = start;
        r.shape[dim] = end - start;
        r
    }

    /// Number of elements, or `None` on overflow.
    pub fn volume(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// Whether the region lies inside a tensor of shape `global`.
    pub fn within(&self, global: &[u64]) -> bool {
        self.offsets.len() == global.len()
            && self.shape.len() == global.len()
            && self
                .offsets
                .iter()
                .zip(&self.shape)
                .zip(global)
                .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|e| e <= g))
    }

    /// The common part of two regions of the same rank, if not empty.
    /// A scalar region intersects another scalar region.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut shape = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            shape.push(hi - lo);
        }
        Some(Region { offsets, shape })
    }
}

/// One contiguous copy: `len` elements from element `src` of the source box
/// to element `dst` of the destination box (both row-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The runs that copy `inter` (a region inside both `src` and `dst`) from a
/// row-major buffer holding `src` to one holding `dst`, in increasing
/// source order, merging trailing dimensions that are contiguous in both.
/// Calls `f` once per run.
pub(crate) fn for_each_run<E>(
    src: &Region,
    dst: &Region,
    inter: &Region,
    mut f: impl FnMut(Run) -> Result<(), E>,
) -> Result<(), E> {
    let n = inter.shape.len();
    if n == 0 {
        return f(Run {
            src: 0,
            dst: 0,
            len: 1,
        });
    }
    let ss = strides(&src.shape);
    let ds = strides(&dst.shape);
    // Merge trailing dims covered fully by src, dst and inter.
    let mut d = n - 1;
    let mut len = inter.shape[d];
    while d > 0 && inter.shape[d] == src.shape[d] && inter.shape[d] == dst.shape[d] {
        d -= 1;
        len *= inter.shape[d];
    }
    // Outer index over dims 0..d (exclusive), inner run covers d..n.
    let base_src: u64 = (0..n)
        .map(|k| (inter.offsets[k] - src.offsets[k]) * ss[k])
        .sum();
    let base_dst: u64 = (0..n)
        .map(|k| (inter.offsets[k] - dst.offsets[k]) * ds[k])
        .sum();
    let mut idx = vec![0u64; d];
    loop {
        let so: u64 = base_src + idx.iter().zip(&ss).map(|(i, s)| i * s).sum::<u64>();
        let dof: u64 = base_dst + idx.iter().zip(&ds).map(|(i, s)| i * s).sum::<u64>();
        f(Run {
            src: so,
            dst: dof,
            len,
        })?;
        // Increment the odometer over dims 0..d.
        let mut k = d;
        loop {
            if k == 0 {
                return Ok(());
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < inter.shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_tiles() {
        let g = [7u64, 3];
        let parts: Vec<Region> = (0..3).map(|i| Region::split(&g, 0, 3, i)).collect();
        assert_eq!(parts[0].offsets, vec![0, 0]);
        assert_eq!(parts.iter().map(|r| r.shape[0]).sum::<u64>(), 7);
        assert!(parts.iter().all(|r| r.within(&g)));
        let empty = Region::split(&[2], 0, 4, 0);
        assert_eq!(empty.shape, vec![0]);
    }

    #[test]
    fn runs_copy_columns() {
        // 4x6 source (whole), destination = columns 2..5, copy all of dst.
        let src = Region::full(&[4, 6]);
        let dst = Region::new(vec![0, 2], vec![4, 3]);
        let inter = src.intersect(&dst).unwrap();
        let mut runs = vec![];
        for_each_run::<()>(&src, &dst, &inter, |r| {
            runs.push(r);
            Ok(())
        })
        .unwrap();
        assert_eq!(runs.len(), 4);
        assert_eq!(
            runs[1],
            Run {
                src: 8,
                dst: 3,
                len: 3
            }
        );
        // Rows merge into one run.
        let dst = Region::new(vec![1, 0], vec![2, 6]);
        let inter = src.intersect(&dst).unwrap();
        let mut runs = vec![];
        for_each_run::<()>(&src, &dst, &inter, |r| {
            runs.push(r);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            runs,
            vec![Run {
                src: 6,
                dst: 0,
                len: 12
            }]
        );
    }
}
