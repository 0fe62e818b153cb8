//! Placements: how a tensor is laid out over the sharding axes of the
//! mesh, and the map between a rank's elements and the whole tensor's.

use std::fmt;
use std::ops::Range;

use weft_collectives::shard_range;

use crate::error::{Result, layout_err};

/// A mesh axis a tensor can be sharded over.
///
/// The other axes of the mesh never split a tensor: the data-parallel axes
/// replicate every parameter (their ranks see different data), and the
/// pipeline axis holds each tensor whole on the one stage that owns it
/// (a stage's [`ParamLayout`](crate::ParamLayout) lists only its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Tensor parallelism: a layer's matrices split over `tp` ranks.
    Tp,
    /// Expert parallelism: a mixture-of-experts layer's experts split over
    /// `ep` data-parallel ranks.
    Ep,
}

impl Axis {
    /// Both axes, in the order shards nest (`ep` outermost).
    pub const ALL: [Axis; 2] = [Axis::Ep, Axis::Tp];

    /// `tp` or `ep`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Ep => "ep",
        }
    }
}

/// How a tensor (or its gradient) sits on one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// Every rank of the axis holds the whole tensor, with the same values.
    #[default]
    Replicate,
    /// Dimension `dim` is cut into `blocks` blocks, and each block is
    /// split over the axis' ranks with [`shard_range`] (the first
    /// `len mod n` ranks hold one more); a rank holds its part of every
    /// block, concatenated in block order. `blocks = 1` is an ordinary
    /// shard; `blocks = 3` shards each of Q, K and V of a fused
    /// `[C, 3C]` projection by heads (a strided shard). The blocks are
    /// equal except the first, which is `lead` times as wide as each of the
    /// others: grouped-query attention's fused `[C, Cq + 2·Ckv]` is 3
    /// blocks with `lead = n_head / n_kv_head`.
    ///
    /// With `copies > 1` the blocks after the first are split over only
    /// `size / copies` parts, each held, identically, by `copies`
    /// consecutive ranks (rank `r` holds part `r / copies`): grouped-query
    /// attention with more tensor-parallel ranks than key/value heads,
    /// where each rank holds its query heads and a copy of the one
    /// key/value head they read (Megatron's and vLLM's replicated kv
    /// heads). As a *gradient* placement the copies are partial sums over
    /// their `copies` ranks (each replica's backward sees only its own
    /// query heads), which [`GradReducer`](crate::GradReducer) sums so that
    /// the copies stay equal; [`first_runs`] names the elements a rank
    /// holds first, which checkpoints write and the gradient norm counts.
    Shard {
        /// The dimension cut.
        dim: usize,
        /// Blocks of the dimension, each sharded.
        blocks: usize,
        /// The first block's width in units of each other block's (1:
        /// equal blocks).
        lead: usize,
        /// Ranks holding each part of the blocks after the first (1: no
        /// copies; must divide the axis' size).
        copies: usize,
    },
    /// Every rank holds a tensor of the whole shape whose sum over the
    /// axis is the value: a gradient that still needs a reduction over the
    /// axis (layernorm gradients under sequence parallelism). Parameters
    /// are never partial.
    Partial,
}

impl Placement {
    /// An ordinary shard of dimension `dim`.
    pub const fn shard(dim: usize) -> Self {
        Placement::Shard {
            dim,
            blocks: 1,
            lead: 1,
            copies: 1,
        }
    }

    /// A strided shard: `blocks` equal blocks of `dim`, each sharded.
    pub const fn strided(dim: usize, blocks: usize) -> Self {
        Placement::Shard {
            dim,
            blocks,
            lead: 1,
            copies: 1,
        }
    }

    /// A strided shard of `blocks` blocks of `dim` whose first is `lead`
    /// times as wide as each of the others, each block sharded: the fused
    /// `Q|K|V` projection of grouped-query attention, `Q` being
    /// `n_head / n_kv_head` times as wide as `K` or `V`.
    pub const fn strided_lead(dim: usize, blocks: usize, lead: usize) -> Self {
        Placement::Shard {
            dim,
            blocks,
            lead,
            copies: 1,
        }
    }

    /// This placement with the parts of the blocks after the first each
    /// held by `copies` consecutive ranks (see [`Placement::Shard`]): the
    /// fused `Q|K|V` of grouped-query attention over `tp = copies ·
    /// n_kv_head` ranks. Other placements are returned unchanged.
    #[must_use]
    pub const fn with_copies(self, copies: usize) -> Self {
        match self {
            Placement::Shard {
                dim, blocks, lead, ..
            } => Placement::Shard {
                dim,
                blocks,
                lead,
                copies,
            },
            other => other,
        }
    }

    /// Ranks of the axis holding each copy of a replicated part: a
    /// shard's `copies` when it has blocks after the first, else 1.
    pub fn copies(self) -> usize {
        match self {
            Placement::Shard { blocks, copies, .. } if blocks > 1 => copies.max(1),
            _ => 1,
        }
    }

    /// Whether ranks of the axis hold different elements.
    pub fn is_shard(self) -> bool {
        matches!(self, Placement::Shard { .. })
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Shard {
                dim,
                blocks,
                lead,
                copies,
            } => {
                write!(f, "Shard({dim}")?;
                if blocks != 1 {
                    write!(f, ", {blocks} blocks")?;
                }
                if lead != 1 {
                    write!(f, ", the first {lead}x")?;
                }
                if copies != 1 {
                    write!(f, ", the others' parts on {copies} ranks each")?;
                }
                f.write_str(")")
            }
            Placement::Partial => f.write_str("Partial"),
        }
    }
}

/// A tensor's placement on every sharding axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Placements {
    /// On the tensor-parallel axis.
    pub tp: Placement,
    /// On the expert-parallel axis.
    pub ep: Placement,
}

impl Placements {
    /// Replicated on every axis.
    pub const REPLICATED: Placements = Placements {
        tp: Placement::Replicate,
        ep: Placement::Replicate,
    };

    /// Sharded (or replicated) on the tensor-parallel axis only.
    pub const fn tp(p: Placement) -> Self {
        Placements {
            tp: p,
            ep: Placement::Replicate,
        }
    }

    /// The placement on `axis`.
    pub fn get(&self, axis: Axis) -> Placement {
        match axis {
            Axis::Tp => self.tp,
            Axis::Ep => self.ep,
        }
    }

    /// Sets the placement on `axis`.
    pub fn set(&mut self, axis: Axis, p: Placement) {
        match axis {
            Axis::Tp => self.tp = p,
            Axis::Ep => self.ep = p,
        }
    }

    /// Ranks holding each copy of a replicated part on the
    /// tensor-parallel axis ([`Placement::copies`]; 1: none).
    pub fn tp_copies(&self) -> usize {
        self.tp.copies()
    }

    /// Whether no axis shards the tensor.
    pub fn is_replicated(&self) -> bool {
        !self.tp.is_shard() && !self.ep.is_shard()
    }
}

/// A rank's position on the sharding axes: `(index, size)` per axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Index and size of the tensor-parallel axis.
    pub tp: (usize, usize),
    /// Index and size of the expert-parallel axis.
    pub ep: (usize, usize),
}

impl Default for Coords {
    fn default() -> Self {
        Coords::SINGLE
    }
}

impl Coords {
    /// One rank: nothing is sharded.
    pub const SINGLE: Coords = Coords {
        tp: (0, 1),
        ep: (0, 1),
    };

    /// `(index, size)` on `axis`.
    pub fn get(&self, axis: Axis) -> (usize, usize) {
        match axis {
            Axis::Tp => self.tp,
            Axis::Ep => self.ep,
        }
    }
}

/// A contiguous stretch of elements: `len` elements from `local` in a
/// rank's tensor are elements `whole ..` of the whole tensor (both
/// row-major, offsets from the tensors' first elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// First element in the whole tensor.
    pub whole: usize,
    /// First element in the rank's tensor.
    pub local: usize,
    /// Elements.
    pub len: usize,
}

/// How a held range is copied: whether other ranks hold copies of it
/// (`shared`), and whether a lower rank holds it first (`later`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Mark {
    shared: bool,
    later: bool,
}

impl Mark {
    fn or(self, o: Mark) -> Mark {
        Mark {
            shared: self.shared || o.shared,
            later: self.later || o.later,
        }
    }
}

/// Of one dimension, the whole tensor's index ranges a rank holds, in the
/// order it stores them, each marked by how it is copied.
type Held = Vec<(Range<usize>, Mark)>;

/// Per dimension, the ranges a rank holds ([`Held`]).
fn held(global: &[usize], p: &Placements, c: &Coords) -> Result<Vec<Held>> {
    let mut idx: Vec<Held> = global
        .iter()
        .map(|&n| vec![(0..n, Mark::default())])
        .collect();
    for axis in Axis::ALL {
        let (rank, size) = c.get(axis);
        if rank >= size {
            return Err(layout_err(
                format!("{} coordinate", axis.name()),
                format!("rank {rank} of {size}"),
            ));
        }
        let Placement::Shard {
            dim,
            blocks,
            lead,
            copies,
        } = p.get(axis)
        else {
            continue;
        };
        let cur = idx.get(dim).ok_or_else(|| {
            layout_err(
                format!("{} placement", axis.name()),
                format!(
                    "shards dimension {dim} of a {}-dimensional tensor",
                    global.len()
                ),
            )
        })?;
        if copies == 0 || !size.is_multiple_of(copies) {
            return Err(layout_err(
                format!("{} placement", axis.name()),
                format!("parts held by {copies} ranks each do not divide {size} ranks"),
            ));
        }
        let total: usize = cur.iter().map(|(r, _)| r.len()).sum();
        // widths in units: the first block `lead`, every other one
        let units = if blocks == 0 || lead == 0 {
            0
        } else {
            blocks - 1 + lead
        };
        if units == 0 || !total.is_multiple_of(units) {
            let first = if lead > 1 {
                format!(" (the first {lead} times as wide)")
            } else {
                String::new()
            };
            return Err(layout_err(
                format!("{} placement", axis.name()),
                format!(
                    "{total} elements of dimension {dim} do not split into {blocks} blocks{first}"
                ),
            ));
        }
        let unit = total / units;
        let mut next = Vec::new();
        for b in 0..blocks {
            let (at, blen) = if b == 0 {
                (0, lead * unit)
            } else {
                ((lead + b - 1) * unit, unit)
            };
            // the blocks after the first: `size / copies` parts, each on
            // `copies` consecutive ranks, the first of which holds it first
            let (part, copy) = if b == 0 {
                (shard_range(blen, size, rank), Mark::default())
            } else {
                (
                    shard_range(blen, size / copies, rank / copies),
                    Mark {
                        shared: copies > 1,
                        later: !rank.is_multiple_of(copies),
                    },
                )
            };
            let (start, end) = (at + part.start, at + part.end);
            // positions start..end of the current local index space, mapped
            // back to the whole tensor's indices
            let mut at = 0;
            for (r, was) in cur {
                let (lo, hi) = (at, at + r.len());
                let (a, e) = (start.max(lo), end.min(hi));
                if a < e {
                    next.push((r.start + (a - lo)..r.start + (e - lo), was.or(copy)));
                }
                at = hi;
            }
        }
        idx[dim] = next;
    }
    Ok(idx)
}

/// The shape of a rank's part of a tensor of shape `global` placed by
/// `p`, at coordinates `c`.
///
/// # Errors
/// [`Error::Layout`](crate::Error::Layout) if a placement shards a
/// dimension the tensor does not have, a dimension does not divide into its
/// blocks, copies do not divide the axis, or a coordinate is out of range.
pub fn local_shape(global: &[usize], p: &Placements, c: &Coords) -> Result<Vec<usize>> {
    Ok(held(global, p, c)?
        .iter()
        .map(|rs| rs.iter().map(|(r, _)| r.len()).sum())
        .collect())
}

/// Where a rank's elements of a tensor of shape `global` placed by `p`
/// sit in the whole tensor, as maximal runs in the rank's storage order
/// (their `local` offsets tile the rank's part). A replicated tensor is
/// one run.
///
/// # Errors
/// As [`local_shape`].
pub fn runs(global: &[usize], p: &Placements, c: &Coords) -> Result<Vec<Run>> {
    runs_where(global, p, c, |_| true)
}

/// [`runs`] less the copies a lower rank of the axis holds too (the parts
/// of a [`Placement::Shard`] with `copies > 1` on every rank of a replica
/// group but its first): over all ranks of a sharded axis, every element
/// once. What a checkpoint writes and the gradient norm counts. The
/// `local` offsets are as in [`runs`] (they no longer tile the part when
/// copies are left out).
///
/// # Errors
/// As [`local_shape`].
pub fn first_runs(global: &[usize], p: &Placements, c: &Coords) -> Result<Vec<Run>> {
    runs_where(global, p, c, |m| !m.later)
}

/// The part of [`runs`] that other ranks hold copies of (the parts of a
/// [`Placement::Shard`] with `copies > 1`): the elements whose gradients
/// are partial over their replica group. Empty without copies.
///
/// # Errors
/// As [`local_shape`].
pub fn copied_runs(global: &[usize], p: &Placements, c: &Coords) -> Result<Vec<Run>> {
    runs_where(global, p, c, |m| m.shared)
}

fn runs_where(
    global: &[usize],
    p: &Placements,
    c: &Coords,
    keep: impl Fn(Mark) -> bool,
) -> Result<Vec<Run>> {
    let idx = held(global, p, c)?;
    let d = global.len();
    let mut out: Vec<Run> = Vec::new();
    let mut push = |whole: usize, local: usize, len: usize| {
        if len == 0 {
            return;
        }
        if let Some(last) = out.last_mut()
            && last.whole + last.len == whole
            && last.local + last.len == local
        {
            last.len += len;
            return;
        }
        out.push(Run { whole, local, len });
    };
    if d == 0 {
        push(0, 0, 1);
        return Ok(out);
    }
    let mut stride = vec![1usize; d];
    for i in (0..d - 1).rev() {
        stride[i] = stride[i + 1] * global[i + 1];
    }
    // the outer dimensions' held indices, expanded, with their copy marks
    let outer: Vec<Vec<(usize, Mark)>> = idx[..d - 1]
        .iter()
        .map(|rs| {
            rs.iter()
                .flat_map(|(r, copy)| r.clone().map(move |i| (i, *copy)))
                .collect()
        })
        .collect();
    let mut pos = vec![0usize; d - 1];
    let mut local = 0;
    if outer.iter().any(Vec::is_empty) {
        return Ok(out);
    }
    loop {
        let mut base = 0;
        let mut mark = Mark::default();
        for (i, &p) in pos.iter().enumerate() {
            let (at, m) = outer[i][p];
            base += at * stride[i];
            mark = mark.or(m);
        }
        for (r, m) in &idx[d - 1] {
            if keep(mark.or(*m)) {
                push(base + r.start, local, r.len());
            }
            local += r.len();
        }
        // next outer index, row-major
        let mut i = d - 1;
        loop {
            if i == 0 {
                return Ok(out);
            }
            i -= 1;
            pos[i] += 1;
            if pos[i] < outer[i].len() {
                break;
            }
            pos[i] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32).collect()
    }

    /// The rank's part, cut from a whole tensor by its runs.
    fn cut(global: &[usize], p: &Placements, c: &Coords) -> Vec<f32> {
        let w = whole(global.iter().product());
        let n: usize = local_shape(global, p, c).unwrap().iter().product();
        let mut out = vec![f32::NAN; n];
        for r in runs(global, p, c).unwrap() {
            out[r.local..r.local + r.len].copy_from_slice(&w[r.whole..r.whole + r.len]);
        }
        out
    }

    #[test]
    fn a_replicated_tensor_is_one_run() {
        let r = runs(&[4, 6], &Placements::REPLICATED, &Coords::SINGLE).unwrap();
        assert_eq!(
            r,
            [Run {
                whole: 0,
                local: 0,
                len: 24
            }]
        );
    }

    #[test]
    fn row_and_column_shards_cut_what_megatron_cuts() {
        let rows = Placements::tp(Placement::shard(0));
        let c = Coords {
            tp: (1, 2),
            ..Coords::SINGLE
        };
        assert_eq!(local_shape(&[4, 3], &rows, &c).unwrap(), [2, 3]);
        assert_eq!(cut(&[4, 3], &rows, &c), [6., 7., 8., 9., 10., 11.]);
        let cols = Placements::tp(Placement::shard(1));
        assert_eq!(cut(&[2, 4], &cols, &c), [2., 3., 6., 7.]);
        // Q|K|V of [1, 6] split by heads over 2 ranks: q1 k1 v1 on rank 1
        let qkv = Placements::tp(Placement::strided(1, 3));
        assert_eq!(cut(&[1, 6], &qkv, &c), [1., 3., 5.]);
        // a 1-d bias of the fused projection, strided likewise
        assert_eq!(
            cut(&[6], &Placements::tp(Placement::strided(0, 3)), &c),
            [1., 3., 5.]
        );
        // grouped-query Q|K|V of [1, 8] (heads of width 1): four query
        // heads, two key and two value heads (lead 2): Q = 0..4, K = 4..6,
        // V = 6..8; rank 1 of 2 holds Q 2..4, K 5 and V 7
        let gqa = Placements::tp(Placement::strided_lead(1, 3, 2));
        assert_eq!(cut(&[1, 8], &gqa, &c), [2., 3., 5., 7.]);
        assert_eq!(
            Placement::strided_lead(1, 3, 2).to_string(),
            "Shard(1, 3 blocks, the first 2x)"
        );
        assert_eq!(Placement::strided_lead(1, 3, 1), Placement::strided(1, 3));
        // uneven rows: 5 over 2 ranks is 3 + 2
        let c0 = Coords {
            tp: (0, 2),
            ..Coords::SINGLE
        };
        assert_eq!(local_shape(&[5, 2], &rows, &c0).unwrap(), [3, 2]);
        assert_eq!(local_shape(&[5, 2], &rows, &c).unwrap(), [2, 2]);
    }

    #[test]
    fn expert_and_tensor_shards_nest() {
        // (E=4, C=2, H=4): experts over ep=2, hidden columns over tp=2
        let p = Placements {
            ep: Placement::shard(0),
            tp: Placement::shard(2),
        };
        let c = Coords {
            ep: (1, 2),
            tp: (0, 2),
        };
        assert_eq!(local_shape(&[4, 2, 4], &p, &c).unwrap(), [2, 2, 2]);
        // experts 2 and 3, hidden columns 0 and 1
        assert_eq!(
            cut(&[4, 2, 4], &p, &c),
            [16., 17., 20., 21., 24., 25., 28., 29.]
        );
    }

    #[test]
    fn every_element_is_held_once_over_the_shards() {
        let cases: [(&[usize], Placements); 5] = [
            (&[7, 6], Placements::tp(Placement::shard(0))),
            (&[4, 12], Placements::tp(Placement::strided(1, 3))),
            (&[12], Placements::tp(Placement::strided(0, 3))),
            (&[2, 24], Placements::tp(Placement::strided_lead(1, 3, 4))),
            (
                &[4, 3, 6],
                Placements {
                    ep: Placement::shard(0),
                    tp: Placement::shard(2),
                },
            ),
        ];
        for (g, p) in cases {
            let total: usize = g.iter().product();
            for (tp, ep) in [(2, 1), (3, 1), (2, 2), (1, 4)] {
                if !p.ep.is_shard() && ep > 1 {
                    continue;
                }
                let mut seen = vec![0u8; total];
                for t in 0..tp {
                    for e in 0..ep {
                        let c = Coords {
                            tp: (t, tp),
                            ep: (e, ep),
                        };
                        let Ok(rs) = runs(g, &p, &c) else { continue };
                        let mut local = 0;
                        for r in rs {
                            assert_eq!(r.local, local);
                            local += r.len;
                            seen[r.whole..r.whole + r.len]
                                .iter_mut()
                                .for_each(|s| *s += 1);
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "{g:?} {p:?} tp={tp} ep={ep}");
            }
        }
    }

    /// Grouped-query `Q|K|V` of `[1, 16]` (heads of width 2: 4 query heads
    /// reading 2 key/value heads, Q = 0..8, K = 8..12, V = 12..16, lead 2)
    /// over tp = 4: each rank holds
    /// its query head and a copy of the key/value head it reads, ranks 0
    /// and 1 sharing head 0, ranks 2 and 3 head 1.
    #[test]
    fn replicated_key_value_parts_are_held_by_consecutive_ranks() {
        let p = Placements::tp(Placement::strided_lead(1, 3, 2).with_copies(2));
        assert_eq!(p.tp_copies(), 2);
        assert_eq!(
            p.tp.to_string(),
            "Shard(1, 3 blocks, the first 2x, the others' parts on 2 ranks each)"
        );
        let at = |r| Coords {
            tp: (r, 4),
            ..Coords::SINGLE
        };
        let want: [&[f32]; 4] = [
            &[0., 1., 8., 9., 12., 13.],
            &[2., 3., 8., 9., 12., 13.],
            &[4., 5., 10., 11., 14., 15.],
            &[6., 7., 10., 11., 14., 15.],
        ];
        for (r, w) in want.iter().enumerate() {
            assert_eq!(local_shape(&[1, 16], &p, &at(r)).unwrap(), [1, 6]);
            assert_eq!(cut(&[1, 16], &p, &at(r)), *w, "rank {r}");
        }
        // the second of a pair holds its query columns first, the key and
        // value columns as copies
        let first = first_runs(&[1, 16], &p, &at(1)).unwrap();
        assert_eq!(
            first,
            [Run {
                whole: 2,
                local: 0,
                len: 2
            }]
        );
        let first = first_runs(&[1, 16], &p, &at(2)).unwrap();
        let whole: Vec<_> = first.iter().map(|r| (r.whole, r.local, r.len)).collect();
        assert_eq!(whole, [(4, 0, 2), (10, 2, 2), (14, 4, 2)]);
        // the copied runs, on every rank of a pair: the key and value ones
        for r in [2, 3] {
            let c = copied_runs(&[1, 16], &p, &at(r)).unwrap();
            let whole: Vec<_> = c.iter().map(|r| (r.whole, r.local, r.len)).collect();
            assert_eq!(whole, [(10, 2, 2), (14, 4, 2)]);
        }
        let plain = Placements::tp(Placement::strided_lead(1, 3, 2));
        assert!(copied_runs(&[1, 16], &plain, &at(2)).unwrap().is_empty());
        // a bias and a two-row weight: the first runs of every rank cover
        // each element once, the runs every copy
        for g in [&[16][..], &[3, 16]] {
            let p = if g.len() == 1 {
                Placements::tp(Placement::strided_lead(0, 3, 2).with_copies(2))
            } else {
                p
            };
            let total: usize = g.iter().product();
            let (mut once, mut all) = (vec![0u8; total], vec![0u8; total]);
            for r in 0..4 {
                let rs = runs(g, &p, &at(r)).unwrap();
                assert_eq!(rs.iter().map(|r| r.len).sum::<usize>(), 6 * total / 16);
                for x in rs {
                    all[x.whole..x.whole + x.len]
                        .iter_mut()
                        .for_each(|s| *s += 1);
                }
                for x in first_runs(g, &p, &at(r)).unwrap() {
                    once[x.whole..x.whole + x.len]
                        .iter_mut()
                        .for_each(|s| *s += 1);
                }
            }
            assert!(once.iter().all(|&s| s == 1), "{g:?} {once:?}");
            // query columns once, key and value columns twice
            for (i, &n) in all.iter().enumerate() {
                assert_eq!(n, if i % 16 < 8 { 1 } else { 2 }, "{g:?} element {i}");
            }
        }
        // multi-query: one key/value head copied on every rank
        let mqa = Placements::tp(Placement::strided_lead(1, 3, 4).with_copies(4));
        assert_eq!(cut(&[1, 6 * 2], &mqa, &at(3)), [6., 7., 8., 9., 10., 11.]);
        // copies that do not divide the axis
        let bad = Placements::tp(Placement::strided_lead(1, 3, 2).with_copies(3));
        let e = local_shape(&[1, 16], &bad, &at(0)).unwrap_err();
        assert!(e.to_string().contains("3 ranks each"), "{e}");
    }

    #[test]
    fn bad_placements_are_errors() {
        let c = Coords {
            tp: (0, 2),
            ..Coords::SINGLE
        };
        let e = local_shape(&[4], &Placements::tp(Placement::shard(1)), &c).unwrap_err();
        assert!(e.to_string().contains("dimension 1"), "{e}");
        let e = local_shape(&[4], &Placements::tp(Placement::strided(0, 3)), &c).unwrap_err();
        assert!(e.to_string().contains("3 blocks"), "{e}");
        let lead = Placements::tp(Placement::strided_lead(0, 3, 2));
        let e = local_shape(&[5], &lead, &c).unwrap_err();
        assert!(e.to_string().contains("the first 2 times as wide"), "{e}");
        let bad = Coords {
            tp: (2, 2),
            ..Coords::SINGLE
        };
        assert!(local_shape(&[4], &Placements::REPLICATED, &bad).is_err());
    }
}
