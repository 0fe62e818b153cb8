//! [`ExactPartial`]: exact accumulation of several contributions per
//! element, and its reproducible reduction across a group.

use weft_numerics::{Dtype, Element};

use super::fused::{Div, add_in_place, decode_div, encode_add, encode_with_offsets, round_range};
use super::{BLOCK, F_EMPTY, F_NEGZERO, merge, read_block};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, shard_range};

/// The exact elementwise sum of any number of contributions (slices of
/// f32, bf16, f16 or f64 of one length), held in the compact encoding of
/// [`crate::repro`]: about 8 bytes per element for typical f32 or bf16
/// gradients (more only for blocks whose values span a very wide range),
/// updated in place; a block that must widen rewrites the encoding from
/// that block on once, without keeping a second copy. A first contribution
/// of f32 values is kept as those values (4 bytes per element) and encoded
/// when a second arrives; reductions whose every rank holds one such
/// contribution reduce the values themselves.
///
/// This is what makes data-parallel training bitwise independent of how a
/// global batch is split: accumulate each rank's micro-batch gradients
/// with [`add`](Self::add), reduce the partials across the group with
/// [`all_reduce_exact`](crate::CommunicatorExt::all_reduce_exact) or
/// [`reduce_scatter_exact`](crate::CommunicatorExt::reduce_scatter_exact),
/// and the result is the exact sum of *all* contributions rounded once
/// (or, with [`ReduceOp::Avg`], the exact sum divided by the total number
/// of contributions, rounded once) — the same bits whether the M
/// contributions were added on one rank or spread over N ranks in any
/// proportion and order. On one rank, [`round_to`](Self::round_to) and
/// [`mean_to`](Self::mean_to) give the same bits as the collectives.
///
/// # Example
/// ```
/// use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, ReduceOp, repro::ExactPartial};
///
/// let grads: Vec<Vec<f32>> = (0..6)
///     .map(|m| (0..1000).map(|i| ((i * 7 + m * 13) as f32).sin() * 1e-3).collect())
///     .collect();
/// // one rank, six micro-batches
/// let mut p = ExactPartial::new(1000);
/// for g in &grads {
///     p.add(g)?;
/// }
/// let mut one = vec![0f32; 1000];
/// p.mean_to(&mut one)?;
/// // three ranks, micro-batches split 1 / 2 / 3
/// let split = [0..1, 1..3, 3..6];
/// let outs = LocalCluster::run(3, |comm| {
///     let mut p = ExactPartial::new(1000);
///     for g in &grads[split[comm.rank()].clone()] {
///         p.add(g)?;
///     }
///     let mut out = vec![0f32; 1000];
///     comm.all_reduce_exact(&p, &mut out, ReduceOp::Avg)?;
///     Ok::<_, weft_collectives::Error>(out)
/// })?;
/// for out in outs {
///     let out = out?;
///     assert!(out.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()));
/// }
/// # Ok::<(), weft_collectives::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ExactPartial {
    len: usize,
    count: u64,
    enc: Vec<u8>,
    /// Byte offset of every block of `enc`, then its length.
    offs: Vec<usize>,
    spill: Vec<u8>,
    /// The one contribution so far when it was f32 values
    /// ([`Held::Values`]): a value is its own exact sum, so the encoding is
    /// written only when a second contribution arrives, and a reduction
    /// whose every rank holds one such contribution reduces the values
    /// themselves (4 bytes per element, not about 8).
    native: Vec<f32>,
    held: Held,
}

/// What an [`ExactPartial`] holds its sum in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// No contribution: the sum is the empty one (its encoding, written
    /// only when needed, is [`zero_encoding`]'s).
    Empty,
    /// One contribution of f32 values, in `native`.
    Values,
    /// `enc` and `offs`.
    Encoded,
}

impl ExactPartial {
    /// An empty accumulator (every element zero, no contributions) for
    /// slices of `len` elements.
    pub fn new(len: usize) -> Self {
        let mut p = Self {
            len,
            count: 0,
            enc: Vec::new(),
            offs: Vec::new(),
            spill: Vec::new(),
            native: Vec::new(),
            held: Held::Empty,
        };
        p.clear();
        p
    }

    /// Elements per contribution.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` for zero-length contributions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Contributions added since creation or the last [`clear`](Self::clear).
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Bytes of the exact partial a reduction sends for all elements: the
    /// encoding, or 4 per element while it holds a single f32
    /// contribution (see [`add`](Self::add)).
    pub fn encoded_bytes(&self) -> usize {
        match self.held {
            // a header and a flag byte per element in every block
            Held::Empty => 8 * self.len.div_ceil(BLOCK) + self.len,
            Held::Values => 4 * self.len,
            Held::Encoded => self.enc.len(),
        }
    }

    /// Forgets every contribution, keeping the memory (nothing is
    /// written: the empty sum's encoding is made when it is needed).
    pub fn clear(&mut self) {
        self.count = 0;
        self.held = Held::Empty;
    }

    /// Brings `enc` and `offs` up to date: the state [`add`](Self::add)
    /// would have left them in.
    fn materialize(&mut self) {
        match self.held {
            Held::Empty => zero_encoding(self.len, &mut self.enc, &mut self.offs),
            Held::Values => encode_with_offsets(&self.native, &mut self.enc, &mut self.offs),
            Held::Encoded => {}
        }
        self.held = Held::Encoded;
    }

    /// This partial with its encoding up to date: itself, or (while it
    /// holds no contribution or one as values) an encoded copy.
    fn encoded(&self) -> std::borrow::Cow<'_, ExactPartial> {
        if self.held == Held::Encoded {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut p = ExactPartial {
            len: self.len,
            count: self.count,
            enc: Vec::new(),
            offs: Vec::new(),
            spill: Vec::new(),
            native: Vec::new(),
            held: self.held,
        };
        if self.held == Held::Values {
            encode_with_offsets(&self.native, &mut p.enc, &mut p.offs);
            p.held = Held::Encoded;
        } else {
            p.materialize();
        }
        std::borrow::Cow::Owned(p)
    }

    /// Adds one contribution exactly: the encoding is updated in place, in
    /// SIMD lanes for blocks of 64 finite values spanning at most 27
    /// binades beside the running sum (typical gradients), exactly by the
    /// general path otherwise. Values of every dtype may be mixed. A first
    /// contribution of f32 values is kept as it is (a copy) and encoded
    /// when a second one arrives: with one micro-batch per rank, the
    /// reductions then move and read 4 bytes per element instead of about
    /// 8.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `xs.len()` differs from [`len`](Self::len);
    /// [`Error::Decode`] only if the accumulator was corrupted (it cannot be
    /// through this API).
    pub fn add<T: Element>(&mut self, xs: &[T]) -> Result<()> {
        self.add_many(&[xs])
    }

    /// Adds several contributions exactly, the same as
    /// [`add`](Self::add) for each in turn, in one pass over the
    /// encoding: each block of the sum takes every contribution's block
    /// while it is in the cache (the owner of a shard adding every rank's
    /// chunk, as [`reduce_scatter_add_exact`](crate::CommunicatorExt::reduce_scatter_add_exact)
    /// does).
    ///
    /// # Errors
    /// As [`add`](Self::add), if any slice has the wrong length (then
    /// nothing is added).
    pub fn add_many<T: Element>(&mut self, xs: &[&[T]]) -> Result<()> {
        for x in xs {
            self.check_len(OpKind::AllReduce, "xs", x.len())?;
        }
        let Some((first, rest)) = xs.split_first() else {
            return Ok(());
        };
        if self.held == Held::Empty && rest.is_empty() && T::DTYPE == Dtype::F32 {
            self.native.clear();
            self.native.extend(first.iter().map(|x| x.to_f32()));
            self.held = Held::Values;
        } else if self.held == Held::Empty {
            encode_with_offsets(first, &mut self.enc, &mut self.offs);
            self.held = Held::Encoded;
            if !rest.is_empty() {
                add_in_place(&mut self.enc, rest, &mut self.spill, &mut self.offs)?;
            }
        } else if self.held == Held::Values {
            // the values encoded and the new contributions added block by
            // block (until it returns, the partial still holds its values)
            encode_add(&self.native, xs, &mut self.enc, &mut self.offs)?;
            self.held = Held::Encoded;
        } else {
            self.materialize();
            add_in_place(&mut self.enc, xs, &mut self.spill, &mut self.offs)?;
        }
        self.count += xs.len() as u64;
        Ok(())
    }

    /// Merges another accumulator of the same length into this one
    /// (contributions and counts add up).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a length mismatch.
    pub fn merge_from(&mut self, other: &ExactPartial) -> Result<()> {
        self.check_len(OpKind::AllReduce, "other", other.len)?;
        self.materialize();
        let other = other.encoded();
        merge(&self.enc, &other.enc, self.len, &mut self.spill)?;
        std::mem::swap(&mut self.enc, &mut self.spill);
        self.spill = Vec::new();
        self.count += other.count;
        self.offs = block_offsets(&self.enc, self.len)?;
        Ok(())
    }

    /// Writes the exact sum, rounded once to nearest-even, to `out`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out.len()` differs from [`len`](Self::len).
    pub fn round_to<T: Element>(&self, out: &mut [T]) -> Result<()> {
        self.check_len(OpKind::AllReduce, "out", out.len())?;
        if self.count == 0 {
            out.fill(T::ZERO);
            return Ok(());
        }
        if self.held == Held::Values {
            // one value is its own exact sum: rounded once
            for (o, x) in out.iter_mut().zip(&self.native) {
                *o = T::from_f32(*x);
            }
            return Ok(());
        }
        decode_div(&self.enc, out, Div(1))
    }

    /// Writes the exact sum divided by [`count`](Self::count), rounded once
    /// to nearest-even, to `out` (zeros if nothing was added).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out.len()` differs from [`len`](Self::len)
    /// or the count exceeds 2^32 − 1.
    pub fn mean_to<T: Element>(&self, out: &mut [T]) -> Result<()> {
        self.check_len(OpKind::AllReduce, "out", out.len())?;
        if self.count == 0 {
            out.fill(T::ZERO);
            return Ok(());
        }
        if self.held == Held::Values {
            // divided by a count of one
            return self.round_to(out);
        }
        let d = divisor(OpKind::AllReduce, self.count)?;
        decode_div(&self.enc, out, d)
    }

    /// Writes the exact sum divided by `divisor`, rounded once to
    /// nearest-even, to `out` (zeros if nothing was added): what
    /// [`mean_to`](Self::mean_to) writes when `divisor` equals the count,
    /// for callers whose mean is over contributions counted elsewhere (a
    /// gradient already summed over other ranks' tokens).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out.len()` differs from [`len`](Self::len)
    /// or `divisor` exceeds 2^32 − 1.
    pub fn div_to<T: Element>(&self, out: &mut [T], by: u64) -> Result<()> {
        self.check_len(OpKind::AllReduce, "out", out.len())?;
        if self.count == 0 {
            out.fill(T::ZERO);
            return Ok(());
        }
        let d = divisor(OpKind::AllReduce, by)?;
        decode_div(&self.encoded().enc, out, d)
    }

    fn check_len(&self, op: OpKind, arg: &'static str, len: usize) -> Result<()> {
        if len != self.len {
            return Err(Error::InvalidArgument {
                op,
                arg,
                reason: format!("{len} elements, but the exact partial holds {}", self.len),
            });
        }
        Ok(())
    }
}

/// The encoding of the empty sum, the identity of merging: zero with the
/// "only −0.0 so far" flag on every element (so that a rank without
/// contributions leaves a −0.0 total of the others unchanged) and the "no
/// contribution yet" flag, which any contribution clears: the exact sum of
/// no contribution at all, on any number of ranks, rounds to +0.0.
fn zero_encoding(len: usize, out: &mut Vec<u8>, offs: &mut Vec<usize>) {
    out.clear();
    offs.clear();
    for start in (0..len).step_by(BLOCK) {
        offs.push(out.len());
        super::put_header(out, 0, 0, true, 0);
        out.extend(std::iter::repeat_n(
            F_NEGZERO | F_EMPTY,
            BLOCK.min(len - start),
        ));
    }
    offs.push(out.len());
}

/// Byte offsets of every block of an encoding of `len` elements, then its
/// length.
fn block_offsets(enc: &[u8], len: usize) -> Result<Vec<usize>> {
    let mut off = Vec::with_capacity(len.div_ceil(BLOCK) + 1);
    let mut pos = 0;
    for start in (0..len).step_by(BLOCK) {
        off.push(pos);
        read_block(enc, &mut pos, BLOCK.min(len - start))?;
    }
    off.push(pos);
    Ok(off)
}

/// Elements from which an exact reduction of f32 results gathers the
/// ranks' counts to learn whether every rank holds one contribution as
/// values (below, the exchange would cost more than it saves).
const NATIVE_FROM: usize = 16 << 10;

fn divisor(op: OpKind, count: u64) -> Result<Div> {
    u32::try_from(count.max(1))
        .map(Div)
        .map_err(|_| Error::InvalidArgument {
            op,
            arg: "partial",
            reason: format!("{count} contributions; the mean supports at most 2^32 - 1"),
        })
}

/// The whole blocks covering element range `r` (empty for an empty range).
fn blocks_of(r: &std::ops::Range<usize>) -> std::ops::Range<usize> {
    if r.is_empty() {
        0..0
    } else {
        r.start / BLOCK..r.end.div_ceil(BLOCK)
    }
}

/// [`CommunicatorExt::reduce_scatter_add_exact`](crate::CommunicatorExt::reduce_scatter_add_exact):
/// every rank sends chunk `k` of `input` to rank `k`; each rank receives
/// its chunk of every peer's input by nested exchanges, so that all of them
/// are readable at once (on the thread backend in the senders' own
/// memory, no copy), and adds them with its own in one pass over its
/// accumulator.
pub(crate) fn reduce_scatter_add_exact<T: Element, C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    input: &[T],
    acc: &mut ExactPartial,
) -> Result<()> {
    let (n, me, len) = (c.size(), c.rank(), input.len());
    let own = &input[shard_range(len, n, me)];
    if n == 1 {
        return acc.add(own);
    }
    let bytes = crate::types::Buf::new(input).bytes();
    let es = size_of::<T>();
    let sends: Vec<Outgoing<'_>> = (0..n)
        .filter(|&k| k != me)
        .map(|k| {
            let r = shard_range(len, n, k);
            Outgoing {
                to: k,
                data: &bytes[r.start * es..r.end * es],
            }
        })
        .collect();
    let want = size_of_val(own);
    let from: Vec<(usize, Option<usize>)> = (1..n).map(|s| ((me + s) % n, Some(want))).collect();
    let mut f = |views: &[&[u8]]| -> Result<()> {
        let peers: Vec<std::borrow::Cow<'_, [T]>> =
            views.iter().map(|v| crate::reduce::typed::<T>(v)).collect();
        let mut all: Vec<&[T]> = Vec::with_capacity(n);
        all.push(own);
        all.extend(peers.iter().map(|p| &p[..]));
        acc.add_many(&all)
    };
    crate::algo::gather_nested(c, ctx, 0, &sends, &from, &[], &mut f)
        .map_err(|e| crate::algo::abort_on(c, e))
}

/// Reproducible reduction of exact partials: afterwards `out` (the
/// elements `shard_range(len, n, rank)`) holds the exact sum over every
/// rank's partial (divided by the total count for `Avg`), rounded once.
/// For `Avg` without `divide_by` the ranks first all-gather their counts
/// (16 bytes each); a sum, or a quotient by a given divisor, needs no
/// count: a group without any contribution rounds its empty encodings to
/// +0.0.
///
/// A ring reduce-scatter whose chunks are the whole encoded blocks covering
/// each rank's shard, sent straight from the partial's memory: neighbouring
/// chunks share at most one boundary block, which both carry. The last
/// merge rounds block by block into `out`.
pub(crate) fn reduce_scatter_exact<T: Element, C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    p: &ExactPartial,
    out: &mut [T],
    op: ReduceOp,
    divide_by: Option<u64>,
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let len = p.len;
    let opk = ctx.sig.op;
    if matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(Error::InvalidArgument {
            op: opk,
            arg: "op",
            reason: format!("exact reductions are sum or avg, not {}", op.name()),
        });
    }
    // Every rank holding its one contribution as f32 values, and an f32
    // result: the reproducible reduce-scatter of those values (what the
    // encoding would give, from half the bytes). Whether every rank does is
    // learnt with the counts `Avg` gathers anyway, or by gathering them
    // (16 bytes per rank) when the buffer is large enough for the saving to
    // outweigh that exchange; the conditions are the same on every rank.
    let avg_counts = divide_by.is_none() && op == ReduceOp::Avg;
    let may_native = n > 1 && T::DTYPE == Dtype::F32;
    let pairs = if avg_counts || (may_native && len >= NATIVE_FROM) {
        Some(crate::algo::gather_u64_pairs(
            c,
            ctx,
            [p.count, u64::from(p.held == Held::Values)],
        )?)
    } else {
        None
    };
    let native = may_native && pairs.as_ref().is_some_and(|v| v.iter().all(|x| x[1] == 1));
    let d = match (divide_by, op) {
        (Some(k), _) => divisor(opk, k)?,
        (None, ReduceOp::Avg) => {
            // the global number of contributions (0: an empty sum, +0.0)
            let total: u64 = pairs.iter().flatten().map(|x| x[0]).sum();
            if total == 0 {
                out.fill(T::ZERO);
                return Ok(());
            }
            divisor(opk, total)?
        }
        (None, _) => Div(1),
    };
    let mine = shard_range(len, n, me);
    if native {
        let own = super::Own {
            head: &p.native[..],
            tail: &[],
            tail_start: len,
            // two ranks, and the direct route, sum all inputs straight
            // into `out`; the ring starts from the own chunk there
            covers_io: n == 2 || super::direct_route(c, Dtype::F32),
        };
        let mut res = Ok(());
        crate::reduce::with_typed_mut::<f32>(BufMut::new(out).into_bytes(), |o| {
            if !own.covers_io {
                o.copy_from_slice(&p.native[mine.clone()]);
            }
            res = super::ring_rs_raw(c, ctx, tag0, &own, len, o, d);
        });
        return res;
    }
    // (a rank holding its contribution as values encodes it here: only
    // when the group's contributions differ in kind or count)
    let p = &*p.encoded();
    // (kept equal to the encoding's block offsets by every update: tested
    // below, not re-derived per call)
    let off = &p.offs;
    let piece = |ch: usize| {
        let br = blocks_of(&shard_range(len, n, ch));
        let elems = (br.start * BLOCK)..(br.end * BLOCK).min(len).max(br.start * BLOCK);
        (&p.enc[off[br.start]..off[br.end]], elems)
    };
    if n == 1 {
        let (bytes, el) = piece(me);
        return round_range(bytes, el.len(), mine.start - el.start, out, d);
    }
    // Direct in one domain (as the reproducible ring, see `crate::repro`):
    // every rank sends the blocks covering chunk k straight to rank k, the
    // owner holds all n pieces at once and sums them block by block.
    let all: Vec<usize> = (0..n).collect();
    if crate::algo::direct(c, &all) {
        let sends: Vec<Outgoing<'_>> = (0..n)
            .filter(|&k| k != me)
            .map(|k| Outgoing {
                to: k,
                data: piece(k).0,
            })
            .collect();
        let (own, el) = piece(me);
        let from: Vec<(usize, Option<usize>)> = (1..n).map(|s| ((me + s) % n, None)).collect();
        let mut f = |views: &[&[u8]]| -> Result<()> {
            let mut all = Vec::with_capacity(n);
            all.push(own);
            all.extend_from_slice(views);
            super::fixed::merge_all_round_range(&all, el.len(), mine.start - el.start, out, d)
        };
        return crate::algo::gather_nested(c, ctx, tag0, &sends, &from, &[], &mut f)
            .map_err(|e| crate::algo::abort_on(c, e));
    }
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let mut trav = super::take_buf(0);
    let mut next = super::take_buf(0);
    let mut result = Ok(());
    for s in 0..n - 1 {
        let send_c = (me + 2 * n - s - 1) % n;
        let recv_c = (me + 2 * n - s - 2) % n;
        let last = s == n - 2;
        let (own, el) = piece(recv_c);
        let data: &[u8] = if s == 0 { piece(send_c).0 } else { &trav };
        let mut sink = |src: &[u8]| {
            if last {
                super::fixed::merge_all_round_range(
                    &[src, own],
                    el.len(),
                    mine.start - el.start,
                    out,
                    d,
                )
            } else {
                merge(src, own, el.len(), &mut next)
            }
        };
        result = c.exchange(
            ctx,
            tag0 + s as u32,
            &[Outgoing { to: right, data }],
            &mut [Incoming {
                from: left,
                len: None,
                sink: &mut sink,
            }],
        );
        if result.is_err() {
            break;
        }
        std::mem::swap(&mut trav, &mut next);
    }
    super::give_back(trav);
    super::give_back(next);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block offsets that reductions slice the encoding by stay those
    /// of the encoding through every kind of update: fast blocks, blocks
    /// that widen or spill to the general encoding, merges, clears.
    #[test]
    fn block_offsets_track_the_encoding_through_every_update() {
        let len = 1000;
        let mut p = ExactPartial::new(len);
        // (through the encoded view reductions read: the partial itself
        // once encoded, else the encoding of its values or of nothing)
        let check = |p: &ExactPartial| {
            let e = p.encoded();
            assert_eq!(e.offs, block_offsets(&e.enc, e.len).unwrap());
        };
        check(&p);
        let small: Vec<f32> = (0..len).map(|i| (i as f32 * 0.01).sin() * 1e-3).collect();
        p.add(&small).unwrap();
        assert_eq!(p.held, Held::Values);
        check(&p);
        // values 60 binades apart in some blocks: the general encoding
        let wide: Vec<f32> = (0..len)
            .map(|i| {
                if i % 7 == 0 {
                    1e9
                } else {
                    (i as f32).cos() * 1e-9
                }
            })
            .collect();
        p.add(&wide).unwrap();
        assert_eq!(p.held, Held::Encoded);
        check(&p);
        let special: Vec<f64> = (0..len)
            .map(|i| match i % 97 {
                0 => f64::INFINITY,
                1 => -0.0,
                _ => i as f64 * 1e-300,
            })
            .collect();
        p.add(&special).unwrap();
        check(&p);
        let mut q = ExactPartial::new(len);
        q.add(&small).unwrap();
        p.merge_from(&q).unwrap();
        check(&p);
        p.clear();
        assert_eq!(p.held, Held::Empty);
        assert_eq!(p.encoded_bytes(), p.encoded().enc.len());
        check(&p);
        p.add(&special).unwrap();
        assert_eq!(p.held, Held::Encoded);
        check(&p);
        p.add(&wide).unwrap();
        check(&p);
    }

    /// Adding several contributions at once leaves the bytes (and the
    /// count) that adding them one after another does: narrow blocks
    /// through the lanes, blocks that widen or fall to the general encoding
    /// mid-way (the rest spilled), specials, from every starting state.
    #[test]
    fn adding_many_at_once_is_adding_each_in_turn() {
        let len = 64 * 9 + 13;
        let narrow = |k: u32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f32 + k as f32 * 0.37) * 0.01).sin() * 1e-3)
                .collect()
        };
        // one source that widens a middle block (60 binades apart) and one
        // with an infinity and a −0.0 in later blocks
        let wide: Vec<f32> = (0..len)
            .map(|i| {
                if i == 64 * 4 + 5 {
                    1e9
                } else {
                    (i as f32).cos() * 1e-9
                }
            })
            .collect();
        let special: Vec<f32> = (0..len)
            .map(|i| match i {
                i if i == 64 * 6 => f32::INFINITY,
                i if i == 64 * 7 + 1 => -0.0,
                _ => (i as f32 * 0.3).sin() * 1e-4,
            })
            .collect();
        let sources: Vec<Vec<f32>> =
            vec![narrow(1), narrow(2), wide, narrow(3), special, narrow(4)];
        for start in 0..3 {
            for (from, to) in [(0, 1), (0, 3), (1, 2), (0, 6), (2, 6), (3, 5)] {
                let fresh = || {
                    let mut p = ExactPartial::new(len);
                    if start >= 1 {
                        p.add(&narrow(9)).unwrap(); // held as values
                    }
                    if start >= 2 {
                        p.add(&narrow(8)).unwrap(); // encoded
                    }
                    p
                };
                let mut one = fresh();
                for x in &sources[from..to] {
                    one.add(x).unwrap();
                }
                let mut many = fresh();
                let xs: Vec<&[f32]> = sources[from..to].iter().map(|x| &x[..]).collect();
                many.add_many(&xs).unwrap();
                let (a, b) = (one.encoded(), many.encoded());
                assert_eq!(a.enc, b.enc, "start {start}, sources {from}..{to}");
                assert_eq!(a.offs, b.offs, "start {start}, sources {from}..{to}");
                assert_eq!(one.count(), many.count());
            }
        }
        // a partial holding values takes further contributions through
        // encode_add (the values encoded and added to block by block):
        // the bytes of encoding them first and adding in place after
        let native = narrow(9);
        for (from, to) in [(0, 1), (2, 3), (4, 5), (0, 6), (1, 5)] {
            let ys: Vec<&[f32]> = sources[from..to].iter().map(|x| &x[..]).collect();
            let (mut enc, mut offs, mut spill) = (Vec::new(), Vec::new(), Vec::new());
            encode_with_offsets(&native, &mut enc, &mut offs);
            add_in_place(&mut enc, &ys, &mut spill, &mut offs).unwrap();
            let (mut fused, mut foffs) = (Vec::new(), Vec::new());
            encode_add(&native, &ys, &mut fused, &mut foffs).unwrap();
            assert_eq!(enc, fused, "sources {from}..{to}");
            assert_eq!(offs, foffs, "sources {from}..{to}");
        }
        // a wrong length anywhere adds nothing
        let mut p = ExactPartial::new(len);
        assert!(p.add_many(&[&narrow(1)[..], &narrow(2)[..3]]).is_err());
        assert_eq!(p.count(), 0);
    }
}
