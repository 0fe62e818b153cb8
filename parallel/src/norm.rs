//! The global gradient norm, exactly, whatever the layout.

use std::ops::Range;

use weft_collectives::Communicator;
use weft_numerics::ExactSum;

use crate::error::{Error, Result};
use crate::layout::{ParamLayout, ParamSpec};
use crate::mesh::{DimSet, ParallelMesh};
use crate::placement::{Coords, Placements};

/// Adds every `g²` of `grads` (exact in f64) to `sum`.
pub fn add_squares(sum: &mut ExactSum, grads: &[f32]) {
    let mut buf = Vec::with_capacity(4096);
    for c in grads.chunks(4096) {
        buf.clear();
        buf.extend(c.iter().map(|&x| f64::from(x) * f64::from(x)));
        sum.add_slice(&buf);
    }
}

/// The exact sum of every rank's `local` over `comm`, the same on every
/// rank: each rank sends its state to every other and merges all of them
/// (merging is exact, so the order does not matter).
///
/// # Errors
/// A collective error; [`Error::Corrupt`] if a peer's state does not decode.
pub fn merge_exact(comm: &dyn Communicator, local: &ExactSum) -> Result<ExactSum> {
    const TAG: u64 = 0x5746_4e53; // "WFNS"
    let me = comm.rank();
    if comm.size() == 1 {
        return Ok(local.clone());
    }
    // point to point, so that the collectives' byte counters of the
    // reductions stay what the reductions move
    let mine = local.to_bytes();
    for peer in (0..comm.size()).filter(|&p| p != me) {
        comm.send_bytes(peer, TAG, &(mine.len() as u64).to_le_bytes())?;
        comm.send_bytes(peer, TAG + 1, &mine)?;
    }
    let mut total = local.clone();
    for peer in (0..comm.size()).filter(|&p| p != me) {
        let mut n = [0u8; 8];
        comm.recv_bytes(peer, TAG, &mut n)?;
        let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(usize::MAX);
        if len > 1 << 20 {
            return Err(Error::Corrupt {
                rank: peer,
                reason: format!("a gradient-norm state of {len} bytes"),
            });
        }
        let mut buf = vec![0u8; len];
        comm.recv_bytes(peer, TAG + 1, &mut buf)?;
        let other = ExactSum::from_bytes(&buf).map_err(|e| Error::Corrupt {
            rank: peer,
            reason: format!("gradient-norm state: {e}"),
        })?;
        total.merge(&other);
    }
    Ok(total)
}

/// The index of a placement's class: bit 0 if `tp` shards it, bit 1 if
/// `ep` does.
fn class(p: &Placements) -> usize {
    usize::from(p.tp.is_shard()) | (usize::from(p.ep.is_shard()) << 1)
}

/// Accumulates the squared gradient norm of a rank's tensors, classed by
/// placement.
///
/// Squares of f32 values are exact in f64; [`ExactSum`] adds them without
/// rounding, and exact sums merge exactly. So each rank sums the squares of
/// the gradient elements it holds, per *class* — the set of sharding axes
/// over which ranks hold different elements of a tensor — and each class is
/// merged over the group of ranks holding its distinct parts (the pipeline
/// stages, and the `tp` / `ep` ranks where the class is sharded there).
/// Ranks that replicate elements hold identical sums and are counted once;
/// copies of a key/value head inside a `tp`-sharded tensor
/// ([`Placement::with_copies`](crate::Placement::with_copies)) are added
/// by the first rank holding them only ([`add_spec`](Self::add_spec)).
/// The total, rounded once, is the bits one rank holding the whole model
/// would compute, for every layout.
///
/// ```
/// use weft_parallel::{GradNorm, Placements};
///
/// let mut n = GradNorm::new();
/// n.add(&Placements::REPLICATED, &[3.0, 4.0]);
/// assert_eq!(n.finish(None)?, 5.0);
/// # Ok::<(), weft_parallel::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct GradNorm {
    classes: [ExactSum; 4],
}

impl GradNorm {
    /// Nothing added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the squares of `grads`, elements of tensors placed
    /// `placements`.
    pub fn add(&mut self, placements: &Placements, grads: &[f32]) {
        add_squares(&mut self.classes[class(placements)], grads);
    }

    /// Adds an exact sum of squares of elements placed `placements` (an
    /// FSDP shard's, already merged over its shard group).
    pub fn add_exact(&mut self, placements: &Placements, sum: &ExactSum) {
        self.classes[class(placements)].merge(sum);
    }

    /// Adds another accumulator's sums, class by class.
    pub fn merge(&mut self, other: &GradNorm) {
        for (a, b) in self.classes.iter_mut().zip(&other.classes) {
            a.merge(b);
        }
    }

    /// Merges every class over `comm`, whose ranks hold disjoint elements
    /// (an FSDP shard group): afterwards every rank holds the group's sums.
    /// Collective over `comm`.
    ///
    /// # Errors
    /// As [`merge_exact`].
    pub fn merge_over(&mut self, comm: &dyn Communicator) -> Result<()> {
        for sum in &mut self.classes {
            *sum = merge_exact(comm, sum)?;
        }
        Ok(())
    }

    /// Adds every tensor of a gradient buffer laid out by `layout`.
    pub fn add_layout(&mut self, layout: &ParamLayout, grads: &[f32]) {
        for s in layout.specs() {
            self.add_spec(s, &layout.coords(), 0..grads.len(), grads);
        }
    }

    /// Adds the squares of `grads`, elements `held` of a rank's buffer (at
    /// coordinates `c`), of the parts of tensor `spec` inside `held`. The
    /// copies a lower tensor-parallel rank holds too (grouped-query
    /// attention's replicated key/value heads) are left to that rank
    /// ([`ParamSpec::first_runs`]), so every element counts once.
    pub fn add_spec(&mut self, spec: &ParamSpec, c: &Coords, held: Range<usize>, grads: &[f32]) {
        let r = spec.range();
        let (a, b) = (r.start.max(held.start), r.end.min(held.end));
        if a >= b {
            return;
        }
        let at = |x: usize| x - held.start;
        if spec.placements.tp_copies() == 1 {
            if let Some(g) = grads.get(at(a)..at(b)) {
                self.add(&spec.placements, g);
            }
            return;
        }
        // (a layout checked its placements at its coordinates: no error)
        for run in spec.first_runs(c).unwrap_or_default() {
            let l = spec.offset + run.local;
            let (x, y) = (l.max(a), (l + run.len).min(b));
            if let Some(g) = grads.get(at(x)..at(y.max(x))) {
                self.add(&spec.placements, g);
            }
        }
    }

    /// The global L2 norm: each class merged over the ranks holding its
    /// distinct parts (pipeline stages, and `tp`/`ep` where sharded), the
    /// classes added, rounded once, square-rooted. Collective over the mesh
    /// (every rank calls it); `None` for one rank holding everything.
    ///
    /// # Errors
    /// As [`merge_exact`].
    pub fn finish(&self, mesh: Option<&ParallelMesh>) -> Result<f64> {
        let mut total = ExactSum::new();
        for (k, sum) in self.classes.iter().enumerate() {
            match mesh {
                None => total.merge(sum),
                Some(m) => {
                    let mut g = DimSet::PP;
                    if k & 1 != 0 {
                        g = g.with(DimSet::TP);
                    }
                    if k & 2 != 0 {
                        g = g.with(DimSet::EP);
                    }
                    total.merge(&merge_exact(m.group(g), sum)?);
                }
            }
        }
        Ok(total.to_f64().sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_collectives::LocalCluster;

    #[test]
    fn merged_sums_are_exact_in_any_order() {
        let vals: Vec<f32> = (0..999)
            .map(|i| ((i * 37) as f32).sin() * 10f32.powi(i % 9 - 4))
            .collect();
        let mut one = ExactSum::new();
        add_squares(&mut one, &vals);
        let out = LocalCluster::run(3, |c| {
            let mut s = ExactSum::new();
            let part: Vec<f32> = vals.iter().skip(c.rank()).step_by(3).copied().collect();
            add_squares(&mut s, &part);
            merge_exact(&c, &s).map(|t| t.to_f64())
        })
        .unwrap();
        for o in out {
            assert_eq!(o.unwrap().to_bits(), one.to_f64().to_bits());
        }
    }
}
