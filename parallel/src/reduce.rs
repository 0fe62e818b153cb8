//! The data-parallel gradient reducer of every layout.

use std::collections::BTreeMap;
use std::ops::Range;

use rayon::prelude::*;
use weft_collectives::repro::ExactPartial;
use weft_collectives::{CommunicatorExt, ReduceOp};
use weft_numerics::{Dtype, bf16};

use crate::error::Result;
use crate::layout::ParamLayout;
use crate::mesh::{DimSet, ParallelMesh};
use crate::placement::{Placement, Placements};

/// Where a gradient element is summed: the ranks that saw different
/// tokens and hold the same element — the data-parallel group, or for an
/// expert shard the replicas of its expert group, each with the
/// context-parallel ranks (other tokens of the same sequences) — and, for
/// a gradient left partial over `tp` (a layernorm under sequence
/// parallelism), the tensor-parallel group too.
pub fn reduce_group(grad_placements: &Placements) -> DimSet {
    let data = if grad_placements.ep.is_shard() {
        DimSet::EDP.with(DimSet::CP)
    } else {
        DimSet::DP.with(DimSet::CP)
    };
    if grad_placements.tp == Placement::Partial {
        data.with(DimSet::TP)
    } else {
        data
    }
}

/// The elements reduced over one group.
#[derive(Debug)]
struct Part {
    group: DimSet,
    /// With `> 1`, the group also spans this rank's replica group of
    /// `copies` consecutive tp ranks ([`ParallelMesh::copies_group`]):
    /// copied key/value parts, whose gradients are partial there.
    copies: usize,
    /// Element ranges of the buffer, in order.
    ranges: Vec<Range<usize>>,
    /// Exact partial sums, one set per contribution range (the ranges the
    /// caller adds: a whole buffer, or the pieces a pipeline stage
    /// finishes per micro-batch), of this part's elements inside it: one
    /// partial per [`PIECE`] elements, added in parallel.
    partials: BTreeMap<(usize, usize), Vec<ExactPartial>>,
    buf: Vec<f32>,
    /// The bucket in bf16, for a bf16 wire in plain mode (allocated once).
    wire: Vec<bf16>,
}

/// The elements of `ranges` inside `window`, as ranges of the buffer.
fn within(ranges: &[Range<usize>], window: &Range<usize>) -> Vec<Range<usize>> {
    ranges
        .iter()
        .filter_map(|r| {
            let (a, b) = (r.start.max(window.start), r.end.min(window.end));
            (a < b).then_some(a..b)
        })
        .collect()
}

/// Elements per exact partial: a contribution is added piece by piece over
/// the thread pool (an exact addition costs about as much as the
/// micro-batch's smallest products), and the pieces are reduced one
/// collective each. A constant, so that every rank of a group cuts the
/// same pieces whatever its pool; the pieces change no bit (the sums are
/// exact per element).
const PIECE: usize = 1 << 18;

/// Empty partials for `n` elements, one per [`PIECE`].
fn pieces(n: usize) -> Vec<ExactPartial> {
    (0..n)
        .step_by(PIECE)
        .map(|a| ExactPartial::new(PIECE.min(n - a)))
        .collect()
}

fn gather(ranges: &[Range<usize>], grads: &[f32], buf: &mut Vec<f32>) {
    buf.clear();
    for r in ranges {
        buf.extend_from_slice(&grads[r.clone()]);
    }
}

fn scatter(ranges: &[Range<usize>], buf: &[f32], grads: &mut [f32]) {
    let mut at = 0;
    for r in ranges {
        grads[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
        at += r.len();
    }
}

/// Turns micro-batch gradients into the gradient of the global batch's
/// mean loss, on every layout: summed over the ranks of each tensor's
/// [`reduce_group`], divided by the global number of micro-batches. The
/// copied parts of a tensor placed with copies on `tp` (grouped-query
/// attention's key/value heads when `tp > n_kv_head`:
/// [`Placement::Shard`]'s `copies`) are partial over their replica group
/// and summed over it as well, in the same reduction, so every copy ends
/// with the same bits.
///
/// Exact (the reproducible mode): every micro-batch's gradient is folded
/// into an exact partial sum ([`ExactPartial`]) and the group's partials
/// are reduced and divided exactly, rounded once
/// ([`all_reduce_exact_div`](CommunicatorExt::all_reduce_exact_div)), so
/// any split of the global batch over ranks and micro-batches gives the
/// same bits. Plain: gradients accumulate in place in f32, are all-reduced
/// with the ring and scaled by `1/M`.
///
/// ```
/// use weft_parallel::{GradReducer, LayoutBuilder, Coords, Placements};
///
/// let mut b = LayoutBuilder::new(Coords::SINGLE);
/// b.push("w", &[3], true, Placements::REPLICATED)?;
/// let layout = b.finish()?;
/// let mut r = GradReducer::new(&layout, true);
/// let mut g = vec![1.0f32, 2.0, 3.0];
/// r.add_all(&mut g)?; // micro-batch 1 (folded, then zeroed)
/// g.copy_from_slice(&[3.0, 2.0, 1.0]);
/// r.add_all(&mut g)?; // micro-batch 2
/// r.finish(&mut g, None, 2)?;
/// assert_eq!(g, [2.0, 2.0, 2.0]);
/// # Ok::<(), weft_parallel::Error>(())
/// ```
#[derive(Debug)]
pub struct GradReducer {
    parts: Vec<Part>,
    exact: bool,
    len: usize,
    wire: Dtype,
}

impl GradReducer {
    /// A reducer for gradient buffers laid out by `layout`; `exact`
    /// selects the reproducible sums.
    ///
    /// # Panics
    /// Never for a layout [`ParamLayout::new`] accepted (it checks every
    /// placement at the layout's coordinates).
    pub fn new(layout: &ParamLayout, exact: bool) -> Self {
        let mut by_group: BTreeMap<(DimSet, usize), Vec<Range<usize>>> = BTreeMap::new();
        let mut add = |key: (DimSet, usize), r: Range<usize>| {
            let rs = by_group.entry(key).or_default();
            match rs.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => rs.push(r),
            }
        };
        let coords = layout.coords();
        for s in layout.specs() {
            let group = reduce_group(&s.grad_placements);
            let copies = s.grad_placements.tp_copies();
            if copies == 1 {
                add((group, 1), s.range());
                continue;
            }
            // the copied parts summed over their replica group too, the
            // rest as the tensor's placement says
            let copied = s
                .copied_runs(&coords)
                .expect("ParamLayout::new checked the placements at these coordinates");
            let mut at = s.offset;
            for r in copied {
                let (a, b) = (s.offset + r.local, s.offset + r.local + r.len);
                if at < a {
                    add((group, 1), at..a);
                }
                add((group, copies), a..b);
                at = b;
            }
            if at < s.range().end {
                add((group, 1), at..s.range().end);
            }
        }
        // each part's bucket, allocated once: every gradient passes
        // through it at the step's end
        let parts = by_group
            .into_iter()
            .map(|((group, copies), ranges)| Part {
                buf: Vec::with_capacity(ranges.iter().map(Range::len).sum()),
                group,
                copies,
                ranges,
                partials: BTreeMap::new(),
                wire: Vec::new(),
            })
            .collect();
        GradReducer {
            parts,
            exact,
            len: layout.len(),
            wire: Dtype::F32,
        }
    }

    /// This reducer with gradients shipped as `wire` between ranks: `F32`
    /// (the default) or `BF16`, half the bytes — in plain mode the
    /// buckets are rounded to bf16 and all-reduced as bf16 (each addition
    /// in f32, rounded once: the collectives' rule), in the reproducible
    /// mode the exact mean is rounded to bf16 once (so any layout still
    /// gives the same bits, and FSDP's bf16 reduction's). The plain mode's
    /// bf16 buckets are allocated here (2 bytes per gradient, counted by
    /// [`buffer_bytes`](Self::buffer_bytes)).
    ///
    /// # Errors
    /// [`Error::Layout`](crate::Error::Layout) for another dtype.
    pub fn with_wire(mut self, wire: Dtype) -> Result<Self> {
        if !matches!(wire, Dtype::F32 | Dtype::BF16) {
            return Err(crate::error::layout_err(
                "gradients on the wire",
                format!("must be f32 or bf16, not {wire:?}"),
            ));
        }
        self.wire = wire;
        if wire == Dtype::BF16 {
            for p in &mut self.parts {
                p.wire = Vec::with_capacity(p.buf.capacity());
            }
        }
        Ok(self)
    }

    /// The dtype of gradients between ranks (see [`with_wire`](Self::with_wire)).
    pub fn wire(&self) -> Dtype {
        self.wire
    }

    /// Bytes of the buckets the gradients pass through to be summed (one
    /// float per gradient; the reproducible mode's exact partial sums come
    /// on top, sized by the values).
    pub fn buffer_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| 4 * p.buf.capacity() + 2 * p.wire.capacity())
            .sum()
    }

    /// Whether the sums are exact.
    pub fn exact(&self) -> bool {
        self.exact
    }

    /// Call once per micro-batch when its gradients in `range` of `grads`
    /// are final. Exact: folds them into the partial sums of `range` and
    /// zeroes them for the next micro-batch. Plain: leaves them to
    /// accumulate in place. A caller adds the same ranges every
    /// micro-batch (the whole buffer, or a pipeline stage's pieces).
    ///
    /// # Errors
    /// A length error if `range` lies outside the buffer.
    pub fn add(&mut self, range: Range<usize>, grads: &mut [f32]) -> Result<()> {
        if !self.exact {
            return Ok(());
        }
        if range.end > grads.len() {
            return Err(crate::error::layout_err(
                "gradient contribution",
                format!("range {range:?} outside a buffer of {}", grads.len()),
            ));
        }
        let mut zeroed = 0;
        for part in &mut self.parts {
            let inside = within(&part.ranges, &range);
            let n: usize = inside.iter().map(Range::len).sum();
            if n == 0 {
                continue;
            }
            let ps = part
                .partials
                .entry((range.start, range.end))
                .or_insert_with(|| pieces(n));
            if let [one] = &inside[..] {
                // one contiguous run: added where it lies, each piece
                // zeroed while it is in the cache
                ps.par_iter_mut()
                    .zip(grads[one.clone()].par_chunks_mut(PIECE))
                    .try_for_each(|(p, x)| {
                        p.add(x)?;
                        x.fill(0.0);
                        Ok::<_, weft_collectives::Error>(())
                    })?;
            } else {
                gather(&inside, grads, &mut part.buf);
                ps.par_iter_mut()
                    .zip(part.buf.par_chunks(PIECE))
                    .try_for_each(|(p, x)| p.add(x))?;
                for r in inside {
                    weft_kernels::zero(&mut grads[r]);
                }
            }
            zeroed += n;
        }
        if zeroed < range.len() {
            // (every element lies in a part: kept for safety)
            weft_kernels::zero(&mut grads[range]);
        }
        Ok(())
    }

    /// [`add`](Self::add) of the whole buffer.
    ///
    /// # Errors
    /// As [`add`](Self::add).
    pub fn add_all(&mut self, grads: &mut [f32]) -> Result<()> {
        let n = grads.len().min(self.len);
        self.add(0..n, grads)
    }

    /// Writes the gradient of the global batch's mean loss over its
    /// `micro_batches` into `grads` and resets the partial sums.
    /// Collective over each part's group on `mesh` (every rank of the
    /// data-parallel group calls it, with the same layout); `None` for a
    /// single rank.
    ///
    /// # Errors
    /// A collective error, or [`Error::Comm`](crate::Error::Comm) for a
    /// divisor beyond 2^32 − 1; [`Error::Dims`](crate::Error::Dims) if
    /// `mesh` has no group for a tensor's copies.
    pub fn finish(
        &mut self,
        grads: &mut [f32],
        mesh: Option<&ParallelMesh>,
        micro_batches: usize,
    ) -> Result<()> {
        let m = micro_batches.max(1);
        #[allow(clippy::cast_precision_loss)]
        let inv = 1.0 / m as f32;
        for part in &mut self.parts {
            let comm = match mesh {
                Some(ms) => Some(ms.copies_group(part.group, part.copies)?),
                None => None,
            }
            .filter(|c| c.size() > 1);
            if self.exact {
                for (&(a, b), partials) in &mut part.partials {
                    let inside = within(&part.ranges, &(a..b));
                    let n: usize = partials.iter().map(ExactPartial::len).sum();
                    part.buf.resize(n, 0.0);
                    if self.wire == Dtype::BF16 {
                        // the exact mean rounded straight to bf16, once
                        part.wire.resize(n, bf16::ZERO);
                        for (p, w) in partials.iter().zip(part.wire.chunks_mut(PIECE)) {
                            match comm {
                                Some(c) => c.all_reduce_exact_div(p, w, m as u64)?,
                                None => p.div_to(w, m as u64)?,
                            }
                        }
                        for (g, w) in part.buf.iter_mut().zip(&part.wire) {
                            *g = w.to_f32();
                        }
                    } else {
                        for (p, o) in partials.iter().zip(part.buf.chunks_mut(PIECE)) {
                            match comm {
                                Some(c) => c.all_reduce_exact_div(p, o, m as u64)?,
                                None => p.div_to(o, m as u64)?,
                            }
                        }
                    }
                    scatter(&inside, &part.buf, grads);
                    partials.iter_mut().for_each(ExactPartial::clear);
                }
            } else {
                gather(&part.ranges, grads, &mut part.buf);
                if self.wire == Dtype::BF16 {
                    part.wire.clear();
                    part.wire
                        .extend(part.buf.iter().map(|&g| bf16::from_f32(g)));
                    if let Some(c) = comm {
                        c.all_reduce(&mut part.wire, ReduceOp::Sum)?;
                    }
                    for (g, w) in part.buf.iter_mut().zip(&part.wire) {
                        *g = w.to_f32();
                    }
                } else if let Some(c) = comm {
                    c.all_reduce(&mut part.buf, ReduceOp::Sum)?;
                }
                if m > 1 {
                    part.buf.iter_mut().for_each(|g| *g *= inv);
                }
                scatter(&part.ranges, &part.buf, grads);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Coords, LayoutBuilder, ParallelDims};
    use weft_collectives::{Communicator, LocalCluster};

    /// Contributions longer than a piece are cut into several exact
    /// partials, added over the pool and reduced one by one: the bits of
    /// one exact partial of the whole, on one rank and on two, whole or
    /// handed over in ranges that cut across pieces.
    #[test]
    fn pieces_change_no_bit() {
        let len = 2 * PIECE + 877;
        let mut b = LayoutBuilder::new(Coords::SINGLE);
        b.push("a", &[len - 100], true, Placements::REPLICATED)
            .unwrap();
        b.push("b", &[100], false, Placements::REPLICATED).unwrap();
        let layout = b.finish().unwrap();
        let m = 3;
        let mut whole = ExactPartial::new(len);
        for k in 0..m {
            whole.add(&grads(k, len)).unwrap();
        }
        let mut want = vec![0.0f32; len];
        whole.mean_to(&mut want).unwrap();
        let mut one = GradReducer::new(&layout, true);
        let mut g = vec![0.0; len];
        for k in 0..m {
            g.copy_from_slice(&grads(k, len));
            one.add_all(&mut g).unwrap();
        }
        one.finish(&mut g, None, m).unwrap();
        assert!(g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        same_on_two_ranks(&layout, len, m, PIECE + PIECE / 2, &want);
    }

    fn grads(seed: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) * 1e-3 * (1 + i % 5) as f32)
            .collect()
    }

    /// A bf16 wire: exact sums rounded to bf16 once, the same bits on any
    /// number of ranks; plain sums all-reduced in bf16, within bf16's
    /// rounding of the f32 wire and not equal to it.
    #[test]
    fn a_bf16_wire_rounds_exact_sums_once_and_halves_the_plain_buckets() {
        let mut b = LayoutBuilder::new(Coords::SINGLE);
        b.push("a", &[300], true, Placements::REPLICATED).unwrap();
        let layout = b.finish().unwrap();
        let m = 4;
        let run = |ranks: usize, exact: bool, wire: Dtype| -> Vec<f32> {
            let dims = ParallelDims {
                dp: ranks,
                ..ParallelDims::SINGLE
            };
            let out = LocalCluster::run(ranks, |comm| {
                let mesh = dims.build(&comm)?;
                let mut r = GradReducer::new(&layout, exact).with_wire(wire)?;
                let plain_bytes = 4 * 300 + if wire == Dtype::F32 { 0 } else { 2 * 300 };
                assert_eq!(r.buffer_bytes(), plain_bytes);
                let mut g = vec![0.0; 300];
                for k in (comm.rank()..m).step_by(ranks) {
                    let x = grads(k, 300);
                    if exact {
                        g.copy_from_slice(&x);
                        r.add_all(&mut g)?;
                    } else {
                        g.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
                    }
                }
                r.finish(&mut g, Some(&mesh), m)?;
                Ok::<_, crate::Error>(g)
            })
            .unwrap();
            out.into_iter().next().unwrap().unwrap()
        };
        let exact32 = run(1, true, Dtype::F32);
        let want = run(1, true, Dtype::BF16);
        assert_eq!(run(2, true, Dtype::BF16), want);
        assert_eq!(run(4, true, Dtype::BF16), want);
        for (a, b) in exact32.iter().zip(&want) {
            assert_eq!(*b, bf16::from_f32(*a).to_f32(), "one rounding ({a})");
        }
        let (p32, p16) = (run(2, false, Dtype::F32), run(2, false, Dtype::BF16));
        assert_ne!(p32, p16);
        // each rank's sum and the total rounded to bf16 (2⁻⁹ relative each,
        // against the largest gradient: sums cancel)
        let scale = p32.iter().fold(0f32, |s, g| s.max(g.abs()));
        for (a, b) in p32.iter().zip(&p16) {
            assert!((a - b).abs() <= 4.0 * 2f32.powi(-9) * scale, "{a} vs {b}");
        }
        assert!(
            GradReducer::new(&layout, true)
                .with_wire(Dtype::F16)
                .is_err()
        );
    }

    #[test]
    fn any_split_over_ranks_and_ranges_gives_the_bits_of_one_rank() {
        let mut b = LayoutBuilder::new(Coords::SINGLE);
        b.push("a", &[40], true, Placements::REPLICATED).unwrap();
        b.push("b", &[25], false, Placements::REPLICATED).unwrap();
        let layout = b.finish().unwrap();
        let m = 4;
        let mut one = GradReducer::new(&layout, true);
        let mut g = vec![0.0; 65];
        for k in 0..m {
            g.copy_from_slice(&grads(k, 65));
            one.add_all(&mut g).unwrap();
        }
        one.finish(&mut g, None, m).unwrap();
        let want = g.clone();
        same_on_two_ranks(&layout, 65, m, 50, &want);
    }

    /// Micro-batches `0..m` split over two data-parallel ranks, each
    /// gradient handed over in two ranges cut at `cut` (as a pipeline stage
    /// hands them over): every rank ends with the bits of `want`.
    fn same_on_two_ranks(layout: &ParamLayout, len: usize, m: usize, cut: usize, want: &[f32]) {
        let dims = ParallelDims {
            dp: 2,
            ..ParallelDims::SINGLE
        };
        let out = LocalCluster::run(2, |comm| {
            let mesh = dims.build(&comm)?;
            let mut r = GradReducer::new(layout, true);
            let mut g = vec![0.0; len];
            for k in (comm.rank()..m).step_by(2) {
                g.copy_from_slice(&grads(k, len));
                r.add(cut..len, &mut g)?;
                r.add(0..cut, &mut g)?;
            }
            r.finish(&mut g, Some(&mesh), m)?;
            Ok::<_, crate::Error>(g)
        })
        .unwrap();
        for o in out {
            let o = o.unwrap();
            assert!(o.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
