//! From the flat runs a rank holds to the boxes a checkpoint stores.
//!
//! A rank of a sharded model holds each tensor as runs of its elements in
//! flat (row-major) order: FSDP cuts the flat buffer anywhere, tensor
//! parallelism holds whole rows or strided rows. A checkpoint stores
//! rectangular [`Region`]s of each tensor, so that any layout can read
//! any other's. [`flat_boxes`] tiles one run by boxes; [`boxes_of_runs`]
//! does it for every run a rank holds and merges the boxes that stack
//! (a strided shard's rows become one box per block).

use std::collections::BTreeMap;

use crate::region::Region;

/// The boxes of a row-major tensor of shape `shape` that elements
/// `start .. start + len` (in flat order) make up, each with the offset of
/// its first element in the run: a flat run covers a partial row, whole
/// rows, then a partial row, recursively in every dimension.
///
/// ```
/// use weft_checkpoint::flat_boxes;
///
/// // elements 3..8 of a 3 × 4 tensor: the end of row 0, then row 1 whole
/// let boxes = flat_boxes(&[3, 4], 3, 5);
/// assert_eq!(boxes.len(), 2);
/// assert_eq!((boxes[0].0.offsets.clone(), boxes[0].0.shape.clone(), boxes[0].1), (vec![0, 3], vec![1, 1], 0));
/// assert_eq!((boxes[1].0.offsets.clone(), boxes[1].0.shape.clone(), boxes[1].1), (vec![1, 0], vec![1, 4], 1));
/// ```
#[must_use]
pub fn flat_boxes(shape: &[usize], start: usize, len: usize) -> Vec<(Region, usize)> {
    let mut out = Vec::new();
    tile(shape, start, start + len, 0, &mut out);
    out.into_iter()
        .map(|(o, s, at)| (Region::new(o, s), at))
        .collect()
}

/// Boxes (offsets, shape, position in the run) tiling `a..b` of `shape`.
fn tile(
    shape: &[usize],
    a: usize,
    b: usize,
    at: usize,
    out: &mut Vec<(Vec<u64>, Vec<u64>, usize)>,
) {
    if a >= b {
        return;
    }
    let Some((_, rest)) = shape.split_first() else {
        return;
    };
    if rest.is_empty() {
        out.push((vec![a as u64], vec![(b - a) as u64], at));
        return;
    }
    let inner: usize = rest.iter().product();
    let (r0, c0, r1, c1) = (a / inner, a % inner, b / inner, b % inner);
    let prefix = |out: &mut Vec<(Vec<u64>, Vec<u64>, usize)>, r: usize, from: usize| {
        for (o, s, _) in &mut out[from..] {
            o.insert(0, r as u64);
            s.insert(0, 1);
        }
    };
    if r0 == r1 {
        let from = out.len();
        tile(rest, c0, c1, at, out);
        prefix(out, r0, from);
        return;
    }
    let mut at = at;
    let mut first_full = r0;
    if c0 != 0 {
        let from = out.len();
        tile(rest, c0, inner, at, out);
        prefix(out, r0, from);
        at += inner - c0;
        first_full = r0 + 1;
    }
    if r1 > first_full {
        let mut o = vec![first_full as u64];
        let mut s = vec![(r1 - first_full) as u64];
        o.extend(rest.iter().map(|_| 0u64));
        s.extend(rest.iter().map(|&d| d as u64));
        out.push((o, s, at));
        at += (r1 - first_full) * inner;
    }
    if c1 != 0 {
        let from = out.len();
        tile(rest, 0, c1, at, out);
        prefix(out, r1, from);
    }
}

/// A run of a tensor's elements in flat order, with aligned value arrays
/// (a parameter and its optimizer moments, say: each array holds the same
/// elements).
#[derive(Clone, Debug)]
pub struct FlatRun<'a> {
    /// The tensor.
    pub name: &'a str,
    /// The whole tensor's shape.
    pub global_shape: &'a [usize],
    /// The run's first element, in the whole tensor's flat order.
    pub start: usize,
    /// The run's values, one array per kind (all the same length).
    pub values: Vec<&'a [f32]>,
}

/// A box of a tensor and each value array's elements in it, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatBox {
    /// The tensor.
    pub name: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<u64>,
    /// Where the box sits in it.
    pub region: Region,
    /// Its elements, one array per kind of the runs.
    pub values: Vec<Vec<f32>>,
}

/// Every run's boxes, tensor by tensor (in name order), boxes that stack
/// along the first dimension (the same extent in every other dimension,
/// adjacent rows) merged into one: their row-major data simply
/// concatenates.
#[must_use]
pub fn boxes_of_runs(runs: &[FlatRun<'_>]) -> Vec<FlatBox> {
    let mut by_tensor: BTreeMap<&str, (Vec<u64>, Vec<FlatBox>)> = BTreeMap::new();
    for run in runs {
        let entry = by_tensor.entry(run.name).or_insert_with(|| {
            (
                run.global_shape.iter().map(|&d| d as u64).collect(),
                Vec::new(),
            )
        });
        let len = run.values.first().map_or(0, |v| v.len());
        for (region, at) in flat_boxes(run.global_shape, run.start, len) {
            let count = region
                .volume()
                .and_then(|v| usize::try_from(v).ok())
                .unwrap_or(0);
            let values = run
                .values
                .iter()
                // (an empty array stays empty: the tensor has none)
                .map(|v| v.get(at..at + count).map_or_else(Vec::new, <[f32]>::to_vec))
                .collect();
            entry.1.push(FlatBox {
                name: run.name.to_owned(),
                global_shape: entry.0.clone(),
                region,
                values,
            });
        }
    }
    by_tensor
        .into_values()
        .flat_map(|(_, boxes)| merge_stacked(boxes))
        .collect()
}

/// Merges boxes that stack along the first dimension.
fn merge_stacked(mut boxes: Vec<FlatBox>) -> Vec<FlatBox> {
    boxes.sort_by(|a, b| {
        (
            &a.region.offsets[1..],
            &a.region.shape[1..],
            a.region.offsets[0],
        )
            .cmp(&(
                &b.region.offsets[1..],
                &b.region.shape[1..],
                b.region.offsets[0],
            ))
    });
    let mut out: Vec<FlatBox> = Vec::with_capacity(boxes.len());
    for b in boxes {
        if let Some(last) = out.last_mut() {
            let (x, y) = (&last.region, &b.region);
            if x.offsets[1..] == y.offsets[1..]
                && x.shape[1..] == y.shape[1..]
                && x.offsets[0] + x.shape[0] == y.offsets[0]
            {
                last.region.shape[0] += y.shape[0];
                for (v, w) in last.values.iter_mut().zip(b.values) {
                    v.extend(w);
                }
                continue;
            }
        }
        out.push(b);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flat run of a 3-D tensor is tiled exactly by its boxes, each
    /// box's row-major elements being the run's, in order.
    #[test]
    fn flat_runs_are_tiled_by_their_boxes() {
        let shape = [3usize, 4, 5];
        let total: usize = shape.iter().product();
        let flat = |o: &[u64]| -> usize { usize::try_from((o[0] * 4 + o[1]) * 5 + o[2]).unwrap() };
        for start in 0..total {
            for len in 1..=total - start {
                let mut got = Vec::new();
                for (region, at) in flat_boxes(&shape, start, len) {
                    assert_eq!(at, got.len(), "boxes in run order");
                    let (o, s) = (region.offsets.clone(), region.shape.clone());
                    for i in 0..s[0] {
                        for j in 0..s[1] {
                            for k in 0..s[2] {
                                got.push(flat(&[o[0] + i, o[1] + j, o[2] + k]));
                            }
                        }
                    }
                }
                let want: Vec<usize> = (start..start + len).collect();
                assert_eq!(got, want, "start {start} len {len}");
            }
        }
        assert_eq!(flat_boxes(&[7], 2, 3).len(), 1);
    }

    /// Rows held as strided runs (a tensor-parallel rank's Q, K and V
    /// blocks) come out as one box per block, values in row-major order.
    #[test]
    fn stacked_rows_merge_into_one_box() {
        // a 4 × 6 tensor; this rank holds columns 2..4 of every row
        let whole: Vec<f32> = (0..24u8).map(f32::from).collect();
        let shape = [4usize, 6];
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|r| whole[r * 6 + 2..r * 6 + 4].to_vec())
            .collect();
        let runs: Vec<FlatRun<'_>> = (0..4)
            .map(|r| FlatRun {
                name: "w",
                global_shape: &shape,
                start: r * 6 + 2,
                values: vec![&rows[r]],
            })
            .collect();
        let boxes = boxes_of_runs(&runs);
        assert_eq!(boxes.len(), 1);
        assert_eq!(boxes[0].region, Region::new(vec![0, 2], vec![4, 2]));
        assert_eq!(boxes[0].values[0], [2., 3., 8., 9., 14., 15., 20., 21.]);
    }
}
