//! Context parallelism's chunks: which rank holds which part of a
//! sequence, which key/value chunks a query chunk reads, and what each
//! step of the ring sends — one definition for the model's ring attention
//! (`weft_model::cp`) and the planner's traffic.

/// A sequence cut into `2·cp` chunks of `len` positions over `cp` ranks:
/// rank `x` holds chunks `x` and `2·cp − 1 − x`, so that under the
/// causal mask every rank's queries read the same number of keys.
///
/// ```
/// use weft_parallel::ContextChunks;
///
/// let c = ContextChunks { cp: 2, len: 64, window: None };
/// assert_eq!(c.of_rank(0), [0, 3]);
/// // rank 1 (chunks 1 and 2) reads chunks 0, 1 and 2, not 3
/// assert!(c.reads(1, 0) && !c.reads(1, 3));
/// // rank 0's chunk 3 goes on at step 0 only if rank 1 reads it: it does not
/// assert_eq!(c.sent(0, 0), [true, false]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextChunks {
    /// Ranks of the group.
    pub cp: usize,
    /// Positions per chunk.
    pub len: usize,
    /// The layer's sliding window (keys a query sees, itself included).
    pub window: Option<usize>,
}

impl ContextChunks {
    /// The chunks of rank `x`: `[x, 2·cp − 1 − x]`.
    pub fn of_rank(&self, x: usize) -> [usize; 2] {
        [x, 2 * self.cp - 1 - x]
    }

    /// The rank holding chunk `j`.
    pub fn owner(&self, j: usize) -> usize {
        if j < self.cp { j } else { 2 * self.cp - 1 - j }
    }

    /// Whether query chunk `q` sees a key of chunk `j`: not after it
    /// (causal) and not wholly before the window of its first row.
    pub fn sees(&self, q: usize, j: usize) -> bool {
        j <= q
            && self
                .window
                .is_none_or(|w| (j + 1) * self.len + w >= q * self.len + 2)
    }

    /// Whether rank `x` reads key chunk `j` (some chunk of its sees it).
    pub fn reads(&self, x: usize, j: usize) -> bool {
        self.of_rank(x).into_iter().any(|q| self.sees(q, j))
    }

    /// Which of its chunks in hand rank `me` sends on at ring step
    /// `step` (it holds rank `me − step`'s, and passes them to `me + 1`):
    /// those a rank later on the ring reads before they come round.
    pub fn sent(&self, me: usize, step: usize) -> [bool; 2] {
        let n = self.cp;
        if step + 1 >= n {
            return [false; 2];
        }
        let hold = (me + n - step % n) % n;
        self.of_rank(hold)
            .map(|j| (1..n - step).any(|d| self.reads((me + d) % n, j)))
    }

    /// The key/value gradient parts rank `me` computes at ring step
    /// `step` for chunks another rank owns (sent to their owner): one per
    /// pair of its query chunk and the holder's chunk that it sees.
    pub fn grad_parts(&self, me: usize, step: usize) -> usize {
        let n = self.cp;
        if step == 0 || step >= n {
            return 0;
        }
        let hold = (me + n - step) % n;
        self.of_rank(hold)
            .into_iter()
            .filter(|&j| self.reads(me, j))
            .map(|j| {
                self.of_rank(me)
                    .into_iter()
                    .filter(|&q| self.sees(q, j))
                    .count()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk a rank reads reaches it: it is its own, or every rank
    /// between its owner and the reader on the ring sends it on.
    #[test]
    fn every_chunk_read_reaches_its_reader() {
        for cp in [2usize, 3, 4, 8] {
            for window in [None, Some(1), Some(64), Some(100), Some(300)] {
                let c = ContextChunks {
                    cp,
                    len: 64,
                    window,
                };
                for x in 0..cp {
                    for j in 0..2 * cp {
                        let owner = c.owner(j);
                        assert!(c.of_rank(owner).contains(&j));
                        if !c.reads(x, j) || owner == x {
                            continue;
                        }
                        // chunk j travels owner → owner+1 → … → x
                        let steps = (x + cp - owner) % cp;
                        for s in 0..steps {
                            let at = (owner + s) % cp;
                            let k = usize::from(c.of_rank(owner)[1] == j);
                            assert!(c.sent(at, s)[k], "cp {cp} {window:?}: chunk {j} to {x}");
                        }
                    }
                }
            }
        }
    }

    /// The causal mask alone: each rank reads `2·cp − 1 − x + 1` chunks
    /// and every rank the same number of query–key pairs.
    #[test]
    fn the_causal_work_is_balanced() {
        for cp in [2usize, 4, 8] {
            let c = ContextChunks {
                cp,
                len: 64,
                window: None,
            };
            let pairs = |x: usize| {
                c.of_rank(x)
                    .into_iter()
                    .map(|q| (0..2 * cp).filter(|&j| c.sees(q, j)).count())
                    .sum::<usize>()
            };
            for x in 0..cp {
                assert_eq!(pairs(x), 2 * cp + 1, "cp {cp} rank {x}");
            }
        }
    }
}
