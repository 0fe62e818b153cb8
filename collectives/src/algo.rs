//! The collective algorithms, written once over [`Communicator::exchange`].
//!
//! Every algorithm works on a list of `members` (group ranks, in ring or
//! butterfly order) and this rank's position `me` in it, so that the
//! hierarchical algorithm can run rings inside a domain and across domains
//! within one call. Buffers are dtype-erased bytes; chunk `i` of a buffer of
//! `len` elements over `m` members is [`shard_range`]`(len, m, i)`.

use std::ops::Range;

use weft_numerics::Dtype;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::{
    Scratch, convert, finish_avg, reduce_into, reduce_many, reduce_to, stream_copy, stream_fence,
};
use crate::repro;
use crate::types::{
    Algorithm, Buf, BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions, Signature,
    shard_range,
};

/// Tag spaces of the phases of one call.
const PHASE: u32 = 1 << 20;

fn byte_range(len: usize, m: usize, i: usize, es: usize) -> Range<usize> {
    let r = shard_range(len, m, i);
    r.start * es..r.end * es
}

/// A shared view of range `a` and a mutable view of range `b` of `buf`;
/// the ranges must not overlap.
pub(crate) fn split_two(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if a.end <= b.start {
        let (x, y) = buf.split_at_mut(b.start);
        (&x[a], &mut y[..b.end - b.start])
    } else {
        assert!(
            b.end <= a.start,
            "split_two: overlapping ranges {a:?} and {b:?}"
        );
        let (x, y) = buf.split_at_mut(a.start);
        (&y[..a.end - a.start], &mut x[b])
    }
}

/// One send of `data` to `to` and one receive of `len` bytes from `from`,
/// handed to `sink`.
#[allow(clippy::too_many_arguments)]
fn send_recv_with<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    to: usize,
    data: &[u8],
    from: usize,
    len: usize,
    mut sink: impl FnMut(&[u8]) + Send,
) -> Result<()> {
    let mut sink = |src: &[u8]| {
        sink(src);
        Ok(())
    };
    c.exchange(
        ctx,
        tag,
        &[Outgoing { to, data }],
        &mut [Incoming {
            from,
            len: Some(len),
            sink: &mut sink,
        }],
    )
}

/// One send and one receive whose bytes are reduced into `into`.
#[allow(clippy::too_many_arguments)]
fn send_recv_reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    to: usize,
    data: &[u8],
    from: usize,
    into: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
) -> Result<()> {
    let len = into.len();
    send_recv_with(c, ctx, tag, to, data, from, len, |src| {
        reduce_into(dtype, op, into, src);
    })
}

/// One send and one receive: `into = own ⊕ received`, with `own` left as
/// it is (so that it may be the buffer a peer is reading); `stream`: see
/// [`reduce_to`].
#[allow(clippy::too_many_arguments)]
fn send_recv_reduce_to<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    to: usize,
    data: &[u8],
    from: usize,
    own: &[u8],
    into: &mut [u8],
    (dtype, op, stream): (Dtype, ReduceOp, bool),
) -> Result<()> {
    let len = into.len();
    send_recv_with(c, ctx, tag, to, data, from, len, |src| {
        reduce_to(dtype, op, into, own, src, stream);
    })
}

/// `dst.copy_from_slice(src)`, streamed past the cache when large (see
/// [`STREAM_BYTES`](crate::reduce::STREAM_BYTES)).
fn copy_large(dst: &mut [u8], src: &[u8]) {
    if dst.len() >= crate::reduce::STREAM_BYTES {
        stream_copy(dst, src);
        stream_fence();
    } else {
        dst.copy_from_slice(src);
    }
}

/// One send and one receive whose bytes are copied into `into`.
fn send_recv_copy<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    send: Option<(usize, &[u8])>,
    recv: Option<(usize, &mut [u8])>,
) -> Result<()> {
    let sends: Vec<Outgoing<'_>> = send
        .map(|(to, data)| Outgoing { to, data })
        .into_iter()
        .collect();
    match recv {
        Some((from, into)) => {
            let len = into.len();
            let mut sink = |src: &[u8]| {
                copy_large(into, src);
                Ok(())
            };
            c.exchange(
                ctx,
                tag,
                &sends,
                &mut [Incoming {
                    from,
                    len: Some(len),
                    sink: &mut sink,
                }],
            )
        }
        None => c.exchange(ctx, tag, &sends, &mut []),
    }
}

/// The most members a direct exchange serves: each holds one message from
/// every peer at once.
pub(crate) const MAX_DIRECT: usize = 16;

/// Whether a phase over `members` runs as one direct exchange instead of
/// the ring's n − 1 steps: for 3 to [`MAX_DIRECT`] members all in one
/// [`Topology`](crate::Topology) domain. Each rank then sends chunk k
/// straight to member k — (n−1)/n of the buffer, exactly the bytes the
/// ring sends — in one round trip; within a domain (one machine's shared
/// memory, or one node's) the link pattern does not matter, across
/// domains the ring's neighbour-only pattern does. With two members the
/// ring is one step already.
pub(crate) fn direct<C: Communicator + ?Sized>(c: &C, members: &[usize]) -> bool {
    let topo = c.topology();
    let dom = |p: usize| topo.domain_of(c.world_rank_of(p));
    (3..=MAX_DIRECT).contains(&members.len()) && members.iter().all(|&p| dom(p) == dom(members[0]))
}

/// Receives one message from each `(member, bytes if known)` of `from` by
/// nested exchanges (the first also posting `sends`), so that all of them
/// stay readable at once — on the thread backend in the senders' own
/// memory, no copy — and hands them to `f` in the order of `from`.
pub(crate) fn gather_nested<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    sends: &[Outgoing<'_>],
    from: &[(usize, Option<usize>)],
    views: &[&[u8]],
    f: &mut (dyn FnMut(&[&[u8]]) -> Result<()> + Send),
) -> Result<()> {
    let Some((&(p, want), rest)) = from.split_first() else {
        if !sends.is_empty() {
            c.exchange(ctx, tag, sends, &mut [])?;
        }
        return f(views);
    };
    let mut sink = |src: &[u8]| -> Result<()> {
        let mut v = Vec::with_capacity(views.len() + 1);
        v.extend_from_slice(views);
        v.push(src);
        // every message was sent with the first exchange's tag
        gather_nested(c, ctx, tag, &[], rest, &v, &mut *f)
    };
    c.exchange(
        ctx,
        tag,
        sends,
        &mut [Incoming {
            from: p,
            len: want,
            sink: &mut sink,
        }],
    )
}

/// Aborts the group after a failed direct exchange (whose withdrawn
/// messages would strand peers until their timeout) and returns `e`.
pub(crate) fn abort_on<C: Communicator + ?Sized>(c: &C, e: Error) -> Error {
    c.abort_group(&format!(
        "rank {} could not finish a direct exchange: {e}",
        c.rank()
    ));
    e
}

/// Direct reduce-scatter over `members` (see [`direct`]): member k is sent
/// chunk k of every other member's input in one exchange and sums all n
/// contributions in member order in one pass ([`reduce_many`]), no partial
/// sum written to memory. `chunks[k]` is this rank's chunk k (`None` for
/// its own when `out` holds it on entry: the in-place form).
#[allow(clippy::too_many_arguments)]
fn direct_reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag: u32,
    members: &[usize],
    me: usize,
    chunks: &[Option<&[u8]>],
    out: &mut [u8],
    (dtype, op, stream): (Dtype, ReduceOp, bool),
) -> Result<()> {
    let m = members.len();
    let sends: Vec<Outgoing<'_>> = (0..m)
        .filter(|&k| k != me)
        .map(|k| Outgoing {
            to: members[k],
            data: chunks[k].unwrap_or_default(),
        })
        .collect();
    let from: Vec<(usize, Option<usize>)> = (1..m)
        .map(|s| (members[(me + s) % m], Some(out.len())))
        .collect();
    let own = chunks[me];
    let mut f = |views: &[&[u8]]| -> Result<()> {
        // views[s − 1] came from member me + s
        let terms: Vec<Option<&[u8]>> = (0..m)
            .map(|k| {
                if k == me {
                    own
                } else {
                    Some(views[(k + m - me) % m - 1])
                }
            })
            .collect();
        reduce_many(dtype, op, out, &terms, stream);
        Ok(())
    };
    gather_nested(c, ctx, tag, &sends, &from, &[], &mut f).map_err(|e| abort_on(c, e))
}

/// `buf`'s chunks over `m` members, each writable.
fn chunks_mut(buf: &mut [u8], m: usize, es: usize) -> Vec<&mut [u8]> {
    let len = buf.len() / es;
    let mut rest = buf;
    (0..m)
        .map(|k| {
            let (c, r) = std::mem::take(&mut rest).split_at_mut(byte_range(len, m, k, es).len());
            rest = r;
            c
        })
        .collect()
}

/// This rank's chunks of `buf` over `m` members, shared, with chunk `me`
/// left out (`None`) and returned writable.
fn chunks_but_mine(
    buf: &mut [u8],
    m: usize,
    me: usize,
    es: usize,
) -> (Vec<Option<&[u8]>>, &mut [u8]) {
    let mut parts = chunks_mut(buf, m, es);
    let mine = std::mem::take(&mut parts[me]);
    let chunks = parts
        .into_iter()
        .enumerate()
        .map(|(k, p)| (k != me).then_some(&*p))
        .collect();
    (chunks, mine)
}

/// In-place reduce-scatter: afterwards member `me` holds the reduced chunk
/// `me` of `buf`. A ring, or one direct exchange (see [`direct`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter_chunks<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
) -> Result<()> {
    if direct(c, members) {
        let m = members.len();
        let (chunks, mine) = chunks_but_mine(buf, m, me, dtype.size_bytes());
        return direct_reduce_scatter(c, ctx, tag0, members, me, &chunks, mine, (dtype, op, false));
    }
    ring_reduce_scatter(c, ctx, tag0, members, me, buf, dtype, op)
}

/// Ring reduce-scatter: afterwards member `me` holds the reduced chunk `me`.
#[allow(clippy::too_many_arguments)]
fn ring_reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
) -> Result<()> {
    let m = members.len();
    if m <= 1 {
        return Ok(());
    }
    let es = dtype.size_bytes();
    let len = buf.len() / es;
    let right = members[(me + 1) % m];
    let left = members[(me + m - 1) % m];
    for s in 0..m - 1 {
        let send_c = (me + 2 * m - s - 1) % m;
        let recv_c = (me + 2 * m - s - 2) % m;
        let (sb, rb) = split_two(
            buf,
            byte_range(len, m, send_c, es),
            byte_range(len, m, recv_c, es),
        );
        send_recv_reduce(c, ctx, tag0 + s as u32, right, sb, left, rb, dtype, op)?;
    }
    Ok(())
}

/// Out-of-place ring reduce-scatter: `input` (every chunk, dtype `from`)
/// is only read; afterwards `out` (chunk `me`, dtype `wire`) holds the
/// reduced chunk. The same steps and the same additions, bit for bit, as
/// [`ring_reduce_scatter`] on a copy of `input` converted to `wire`, but
/// without that copy: step 0 sends this rank's own chunk straight from
/// `input`, every step writes `own ⊕ received` into a chunk-sized buffer
/// (the next step's message), and the last step writes into `out`. Memory
/// traffic is the ring's own, and the scratch (two chunks, pooled) is
/// 2/m of the input.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_reduce_scatter_to<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    input: &[u8],
    from: Dtype,
    wire: Dtype,
    op: ReduceOp,
    out: &mut [u8],
) -> Result<()> {
    let m = members.len();
    let (ef, ew) = (from.size_bytes(), wire.size_bytes());
    let len = input.len() / ef;
    if m <= 1 {
        convert(from, input, wire, out);
        return Ok(());
    }
    let right = members[(me + 1) % m];
    let left = members[(me + m - 1) % m];
    // chunk 0 is the largest; with two members the one step reads the
    // input and writes the output, no partial sum in between
    let cap = shard_range(len, m, 0).len() * ew;
    let between = if m > 2 { cap } else { 0 };
    let mut trav = Scratch::take(between);
    let mut next = Scratch::take(between);
    // with a wider wire, this rank's chunks converted: the one sent at step
    // 0 and the one added at each step
    let mut conv = Scratch::take(if from == wire { 0 } else { 2 * cap });
    let mut sent = 0;
    for s in 0..m - 1 {
        let send_c = (me + 2 * m - s - 1) % m;
        let recv_c = (me + 2 * m - s - 2) % m;
        let rr = byte_range(len, m, recv_c, ef);
        let n = rr.len() / ef * ew;
        let (sconv, oconv) = conv
            .bytes_mut()
            .split_at_mut(if from == wire { 0 } else { cap });
        let data: &[u8] = if s == 0 {
            let sr = byte_range(len, m, send_c, ef);
            if from == wire {
                &input[sr]
            } else {
                let k = sr.len() / ef * ew;
                convert(from, &input[sr], wire, &mut sconv[..k]);
                &sconv[..k]
            }
        } else {
            &trav.bytes()[..sent]
        };
        let own: &[u8] = if from == wire {
            &input[rr]
        } else {
            convert(from, &input[rr], wire, &mut oconv[..n]);
            &oconv[..n]
        };
        let into: &mut [u8] = if s == m - 2 {
            &mut *out
        } else {
            &mut next.bytes_mut()[..n]
        };
        send_recv_reduce_to(
            c,
            ctx,
            tag0 + s as u32,
            right,
            data,
            left,
            own,
            into,
            // the last step's result is the caller's; the others are sent on
            (wire, op, s == m - 2),
        )?;
        std::mem::swap(&mut trav, &mut next);
        sent = n;
    }
    Ok(())
}

/// All-gather of `buf`'s chunks: member `me` starts with chunk `me`, ends
/// with all. A ring, or one direct exchange (see [`direct`]) in which each
/// member sends its chunk to every other and copies theirs as they come.
pub(crate) fn all_gather_chunks<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    es: usize,
) -> Result<()> {
    if !direct(c, members) {
        return ring_all_gather(c, ctx, tag0, members, me, buf, es);
    }
    let m = members.len();
    let mut parts = chunks_mut(buf, m, es);
    let mine = &*std::mem::take(&mut parts[me]);
    let sends: Vec<Outgoing<'_>> = (0..m)
        .filter(|&k| k != me)
        .map(|k| Outgoing {
            to: members[k],
            data: mine,
        })
        .collect();
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    let mut sinks: Vec<_> = parts
        .into_iter()
        .map(|dst| {
            move |src: &[u8]| -> Result<()> {
                copy_large(dst, src);
                Ok(())
            }
        })
        .collect();
    let mut recvs: Vec<Incoming<'_>> = sinks
        .iter_mut()
        .enumerate()
        .filter(|(k, _)| *k != me)
        .map(|(k, sink)| Incoming {
            from: members[k],
            len: Some(lens[k]),
            sink,
        })
        .collect();
    c.exchange(ctx, tag0, &sends, &mut recvs)
}

/// Ring all-gather: member `me` starts with chunk `me`, ends with all.
fn ring_all_gather<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    es: usize,
) -> Result<()> {
    let m = members.len();
    if m <= 1 {
        return Ok(());
    }
    let len = buf.len() / es;
    let right = members[(me + 1) % m];
    let left = members[(me + m - 1) % m];
    for s in 0..m - 1 {
        let send_c = (me + m - s) % m;
        let recv_c = (me + 2 * m - s - 1) % m;
        let (sb, rb) = split_two(
            buf,
            byte_range(len, m, send_c, es),
            byte_range(len, m, recv_c, es),
        );
        send_recv_copy(c, ctx, tag0 + s as u32, Some((right, sb)), Some((left, rb)))?;
    }
    Ok(())
}

/// Recursive-doubling all-reduce over any number of members: the first
/// `2·(m − p)` members fold pairwise into `p` (a power of two), those run
/// log₂ p exchange-and-reduce rounds, and the folded-out members get the
/// result back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rd_all_reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
) -> Result<()> {
    let m = members.len();
    if m <= 1 {
        return Ok(());
    }
    let p = 1usize << (usize::BITS - 1 - m.leading_zeros());
    let rem = m - p;
    let v = if me < 2 * rem {
        if me.is_multiple_of(2) {
            send_recv_copy(c, ctx, tag0, Some((members[me + 1], &*buf)), None)?;
            None
        } else {
            let left = members[me - 1];
            let len = buf.len();
            let mut sink = |src: &[u8]| {
                reduce_into(dtype, op, buf, src);
                Ok(())
            };
            c.exchange(
                ctx,
                tag0,
                &[],
                &mut [Incoming {
                    from: left,
                    len: Some(len),
                    sink: &mut sink,
                }],
            )?;
            Some(me / 2)
        }
    } else {
        Some(me - rem)
    };
    if let Some(v) = v {
        // The partner reads this rank's buffer while this rank reduces, so
        // each round writes `mine ⊕ theirs` into the other of two buffers
        // (`buf` and a pooled scratch) instead of into the one being read.
        let mut tmp = Scratch::take(buf.len());
        let mut in_buf = true;
        let mut mask = 1;
        let mut step = 1;
        while mask < p {
            let pv = v ^ mask;
            let partner = members[if pv < rem { pv * 2 + 1 } else { pv + rem }];
            let (cur, into): (&[u8], &mut [u8]) = if in_buf {
                (&*buf, tmp.bytes_mut())
            } else {
                (tmp.bytes(), &mut *buf)
            };
            send_recv_reduce_to(
                c,
                ctx,
                tag0 + step,
                partner,
                cur,
                partner,
                cur,
                into,
                (dtype, op, false),
            )?;
            in_buf = !in_buf;
            mask <<= 1;
            step += 1;
        }
        if !in_buf {
            buf.copy_from_slice(tmp.bytes());
        }
    }
    if me < 2 * rem {
        let tag = tag0 + 64;
        if me.is_multiple_of(2) {
            send_recv_copy(c, ctx, tag, None, Some((members[me + 1], buf)))?;
        } else {
            send_recv_copy(c, ctx, tag, Some((members[me - 1], &*buf)), None)?;
        }
    }
    Ok(())
}

/// Recursive-halving reduce-scatter for a power-of-two number of members.
#[allow(clippy::too_many_arguments)]
fn rh_reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
) -> Result<()> {
    let m = members.len();
    debug_assert!(m.is_power_of_two());
    let es = dtype.size_bytes();
    let len = buf.len() / es;
    let bytes_of =
        |lo: usize, hi: usize| byte_range(len, m, lo, es).start..byte_range(len, m, hi - 1, es).end;
    let (mut lo, mut hi) = (0, m);
    let mut mask = m / 2;
    let mut step = 0;
    while mask >= 1 {
        let partner = members[me ^ mask];
        let mid = lo + (hi - lo) / 2;
        let (keep, send) = if me < mid {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        let (sb, rb) = split_two(buf, bytes_of(send.0, send.1), bytes_of(keep.0, keep.1));
        send_recv_reduce(c, ctx, tag0 + step, partner, sb, partner, rb, dtype, op)?;
        (lo, hi) = keep;
        mask /= 2;
        step += 1;
    }
    Ok(())
}

/// Recursive-doubling all-gather for a power-of-two number of members.
fn rd_all_gather<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    buf: &mut [u8],
    es: usize,
) -> Result<()> {
    let m = members.len();
    debug_assert!(m.is_power_of_two());
    let len = buf.len() / es;
    let bytes_of =
        |lo: usize, hi: usize| byte_range(len, m, lo, es).start..byte_range(len, m, hi - 1, es).end;
    let mut mask = 1;
    let mut step = 0;
    while mask < m {
        let partner = me ^ mask;
        let mine = me & !(mask - 1);
        let theirs = partner & !(mask - 1);
        let (sb, rb) = split_two(
            buf,
            bytes_of(mine, mine + mask),
            bytes_of(theirs, theirs + mask),
        );
        send_recv_copy(
            c,
            ctx,
            tag0 + step,
            Some((members[partner], sb)),
            Some((members[partner], rb)),
        )?;
        mask <<= 1;
        step += 1;
    }
    Ok(())
}

/// The two-level layout of a group: this rank's domain members, its index
/// among them, and the members with the same local index in every domain.
pub(crate) struct HierLayout {
    pub(crate) local: Vec<usize>,
    pub(crate) local_index: usize,
    pub(crate) cross: Vec<usize>,
    pub(crate) cross_index: usize,
}

/// `Some` when the group spans ≥ 2 domains with the same number (≥ 1) of
/// its ranks in each.
pub(crate) fn hier_layout<C: Communicator + ?Sized>(c: &C) -> Option<HierLayout> {
    let n = c.size();
    let topo = c.topology();
    let mut domains: Vec<(usize, Vec<usize>)> = Vec::new();
    for r in 0..n {
        let d = topo.domain_of(c.world_rank_of(r));
        match domains.iter_mut().find(|(dd, _)| *dd == d) {
            Some((_, v)) => v.push(r),
            None => domains.push((d, vec![r])),
        }
    }
    if domains.len() < 2 {
        return None;
    }
    let k = domains[0].1.len();
    if domains.iter().any(|(_, v)| v.len() != k) {
        return None;
    }
    domains.sort_by_key(|(d, _)| *d);
    let me = c.rank();
    let (di, local) = domains
        .iter()
        .enumerate()
        .find_map(|(i, (_, v))| v.contains(&me).then(|| (i, v.clone())))?;
    let local_index = local.iter().position(|&r| r == me)?;
    let cross = domains.iter().map(|(_, v)| v[local_index]).collect();
    Some(HierLayout {
        local,
        local_index,
        cross,
        cross_index: di,
    })
}

fn invalid(op: OpKind, arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, arg, reason }
}

/// Validates a reduction's options and resolves its algorithm.
pub(crate) fn reduce_signature<C: Communicator + ?Sized>(
    c: &C,
    op: OpKind,
    buf: &BufMut<'_>,
    opts: &ReduceOptions,
) -> Result<Signature> {
    let dtype = buf.dtype();
    let wire = opts.wire.unwrap_or(dtype);
    if wire.precision() < dtype.precision() || wire.size_bytes() < dtype.size_bytes() {
        return Err(invalid(
            op,
            "wire",
            format!("wire dtype {wire} is narrower than the buffer's {dtype}"),
        ));
    }
    if opts.reproducible && matches!(opts.op, ReduceOp::Max | ReduceOp::Min) {
        return Err(invalid(
            op,
            "reproducible",
            format!(
                "reproducible mode applies to sum and avg; {} is already order-independent",
                opts.op.name()
            ),
        ));
    }
    // an exact all-reduce's hierarchical form sends exact partials (two
    // words an element) between domains, twice the flat ring's f32 bytes
    // per element there: over a slow link between nodes the flat exact
    // ring is faster (measured 1.9-2.2x the plain hierarchical sum against
    // the flat ring's 1.3x, two nodes of two ranks), and the bits are the
    // same whichever runs
    let layout = hier_layout(c).filter(|l| l.local.len() >= 2 && !opts.reproducible);
    let bytes = buf.len() * wire.size_bytes();
    let algorithm = match opts.algorithm.resolve(bytes, layout.is_some()) {
        Algorithm::Hierarchical if hier_layout(c).is_none() => {
            return Err(invalid(
                op,
                "algorithm",
                format!(
                    "hierarchical needs the group {} to span two or more domains of {:?} with the same number of ranks in each",
                    c.group_name(),
                    c.topology()
                ),
            ));
        }
        a => a,
    };
    Ok(Signature {
        op,
        dtype: Some(dtype),
        len: buf.len() as u64,
        root: None,
        reduce: Some(opts.op),
        algorithm: Some(algorithm),
        wire: opts.wire.filter(|w| *w != dtype),
        reproducible: opts.reproducible,
    })
}

/// Runs an all-reduce whose call has begun.
pub(crate) fn all_reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mut buf: BufMut<'_>,
    opts: &ReduceOptions,
) -> Result<()> {
    let dtype = buf.dtype();
    let n = c.size();
    if opts.reproducible {
        return repro::all_reduce(c, ctx, buf, opts.op);
    }
    let wire = ctx.sig.wire.unwrap_or(dtype);
    let algorithm = ctx.sig.algorithm.unwrap_or(Algorithm::Ring);
    if wire == dtype {
        all_reduce_native(c, ctx, buf.bytes(), dtype, opts.op, algorithm)?;
        if opts.op == ReduceOp::Avg {
            finish_avg(dtype, buf.bytes(), n);
        }
    } else {
        let mut tmp = Scratch::take(buf.len() * wire.size_bytes());
        convert(dtype, buf.bytes(), wire, tmp.bytes_mut());
        all_reduce_native(c, ctx, tmp.bytes_mut(), wire, opts.op, algorithm)?;
        if opts.op == ReduceOp::Avg {
            finish_avg(wire, tmp.bytes_mut(), n);
        }
        convert(wire, tmp.bytes(), dtype, buf.bytes());
    }
    Ok(())
}

fn all_reduce_native<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    buf: &mut [u8],
    dtype: Dtype,
    op: ReduceOp,
    algorithm: Algorithm,
) -> Result<()> {
    let n = c.size();
    let all: Vec<usize> = (0..n).collect();
    let me = c.rank();
    match algorithm {
        Algorithm::RecursiveDoubling => rd_all_reduce(c, ctx, 0, &all, me, buf, dtype, op),
        Algorithm::Hierarchical => {
            let l = hier_layout(c)
                .ok_or_else(|| invalid(ctx.sig.op, "algorithm", "no hierarchical layout".into()))?;
            let es = dtype.size_bytes();
            let len = buf.len() / es;
            let k = l.local.len();
            reduce_scatter_chunks(c, ctx, 0, &l.local, l.local_index, buf, dtype, op)?;
            let shard = byte_range(len, k, l.local_index, es);
            reduce_scatter_chunks(
                c,
                ctx,
                PHASE,
                &l.cross,
                l.cross_index,
                &mut buf[shard.clone()],
                dtype,
                op,
            )?;
            all_gather_chunks(
                c,
                ctx,
                2 * PHASE,
                &l.cross,
                l.cross_index,
                &mut buf[shard],
                es,
            )?;
            all_gather_chunks(c, ctx, 3 * PHASE, &l.local, l.local_index, buf, es)
        }
        Algorithm::Ring | Algorithm::Auto => {
            reduce_scatter_chunks(c, ctx, 0, &all, me, buf, dtype, op)?;
            all_gather_chunks(c, ctx, PHASE, &all, me, buf, dtype.size_bytes())
        }
    }
}

/// Validates a reduce-scatter call.
pub(crate) fn reduce_scatter_signature<C: Communicator + ?Sized>(
    c: &C,
    input: &Buf<'_>,
    output: &BufMut<'_>,
    opts: &ReduceOptions,
) -> Result<Signature> {
    let op = OpKind::ReduceScatter;
    let want = shard_range(input.len(), c.size(), c.rank()).len();
    if output.dtype() != input.dtype() {
        return Err(invalid(
            op,
            "output",
            format!(
                "dtype {} differs from the input's {}",
                output.dtype(),
                input.dtype()
            ),
        ));
    }
    if output.len() != want {
        return Err(invalid(
            op,
            "output",
            format!(
                "{} elements, expected {want} (shard {} of {} input elements over {} ranks)",
                output.len(),
                c.rank(),
                input.len(),
                c.size()
            ),
        ));
    }
    let dtype = input.dtype();
    let wire = opts.wire.unwrap_or(dtype);
    if wire.precision() < dtype.precision() || wire.size_bytes() < dtype.size_bytes() {
        return Err(invalid(
            op,
            "wire",
            format!("wire dtype {wire} is narrower than the buffer's {dtype}"),
        ));
    }
    if opts.reproducible && matches!(opts.op, ReduceOp::Max | ReduceOp::Min) {
        return Err(invalid(
            op,
            "reproducible",
            "reproducible mode applies to sum and avg".into(),
        ));
    }
    let bytes = input.len() * wire.size_bytes();
    let algorithm = match opts.algorithm {
        Algorithm::Auto if bytes <= crate::SMALL_MESSAGE_BYTES && c.size().is_power_of_two() => {
            Algorithm::RecursiveDoubling
        }
        Algorithm::Auto | Algorithm::Hierarchical => Algorithm::Ring,
        a => a,
    };
    Ok(Signature {
        op,
        dtype: Some(dtype),
        len: input.len() as u64,
        root: None,
        reduce: Some(opts.op),
        algorithm: Some(algorithm),
        wire: opts.wire.filter(|w| *w != dtype),
        reproducible: opts.reproducible,
    })
}

/// Runs a reduce-scatter whose call has begun.
pub(crate) fn reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    input: Buf<'_>,
    mut output: BufMut<'_>,
    opts: &ReduceOptions,
) -> Result<()> {
    let dtype = input.dtype();
    let n = c.size();
    let me = c.rank();
    if opts.reproducible {
        return repro::reduce_scatter(c, ctx, input, output, opts.op);
    }
    let wire = ctx.sig.wire.unwrap_or(dtype);
    let es = wire.size_bytes();
    let all: Vec<usize> = (0..n).collect();
    let algorithm = ctx.sig.algorithm.unwrap_or(Algorithm::Ring);
    if algorithm != Algorithm::RecursiveDoubling {
        // the ring reads the input in place and ends in the output
        if wire == dtype && direct(c, &all) {
            let out = output.bytes();
            let input = input.bytes();
            let chunks: Vec<Option<&[u8]>> = (0..n)
                .map(|k| Some(&input[byte_range(input.len() / es, n, k, es)]))
                .collect();
            // the result is the caller's: streamed when large
            direct_reduce_scatter(c, ctx, 0, &all, me, &chunks, out, (dtype, opts.op, true))?;
            if opts.op == ReduceOp::Avg {
                finish_avg(wire, out, n);
            }
        } else if wire == dtype {
            let out = output.bytes();
            ring_reduce_scatter_to(
                c,
                ctx,
                0,
                &all,
                me,
                input.bytes(),
                dtype,
                wire,
                opts.op,
                out,
            )?;
            if opts.op == ReduceOp::Avg {
                finish_avg(wire, out, n);
            }
        } else {
            let mut part = Scratch::take(output.len() * es);
            let p = part.bytes_mut();
            ring_reduce_scatter_to(c, ctx, 0, &all, me, input.bytes(), dtype, wire, opts.op, p)?;
            if opts.op == ReduceOp::Avg {
                finish_avg(wire, p, n);
            }
            convert(wire, p, dtype, output.bytes());
        }
        return Ok(());
    }
    // recursive halving (small messages) works in a whole-buffer copy
    let mut work = Scratch::take(input.len() * es);
    convert(dtype, input.bytes(), wire, work.bytes_mut());
    let shard = byte_range(input.len(), n, me, es);
    if n.is_power_of_two() {
        rh_reduce_scatter(c, ctx, 0, &all, me, work.bytes_mut(), wire, opts.op)?;
    } else {
        rd_all_reduce(c, ctx, 0, &all, me, work.bytes_mut(), wire, opts.op)?;
    }
    let part = &mut work.bytes_mut()[shard];
    if opts.op == ReduceOp::Avg {
        finish_avg(wire, part, n);
    }
    convert(wire, part, dtype, output.bytes());
    Ok(())
}

/// Validates an all-gather call.
pub(crate) fn all_gather_signature<C: Communicator + ?Sized>(
    c: &C,
    input: &Buf<'_>,
    output: &BufMut<'_>,
    algorithm: Algorithm,
) -> Result<Signature> {
    let op = OpKind::AllGather;
    let want = shard_range(output.len(), c.size(), c.rank()).len();
    if output.dtype() != input.dtype() {
        return Err(invalid(
            op,
            "output",
            format!(
                "dtype {} differs from the input's {}",
                output.dtype(),
                input.dtype()
            ),
        ));
    }
    if input.len() != want {
        return Err(invalid(
            op,
            "input",
            format!(
                "{} elements, expected {want} (shard {} of {} output elements over {} ranks)",
                input.len(),
                c.rank(),
                output.len(),
                c.size()
            ),
        ));
    }
    Ok(gather_signature(c, output, algorithm))
}

/// The signature of an all-gather into `output` (the same in place and
/// out of place: the peers see the same messages).
fn gather_signature<C: Communicator + ?Sized>(
    c: &C,
    output: &BufMut<'_>,
    algorithm: Algorithm,
) -> Signature {
    let op = OpKind::AllGather;
    let bytes = output.len() * output.dtype().size_bytes();
    let algorithm = match algorithm {
        Algorithm::Auto if bytes <= crate::SMALL_MESSAGE_BYTES && c.size().is_power_of_two() => {
            Algorithm::RecursiveDoubling
        }
        Algorithm::Auto | Algorithm::Hierarchical => Algorithm::Ring,
        a => a,
    };
    Signature {
        op,
        dtype: Some(output.dtype()),
        len: output.len() as u64,
        root: None,
        reduce: None,
        algorithm: Some(algorithm),
        wire: None,
        reproducible: false,
    }
}

/// Validates an in-place all-gather call (`buf` holds the rank's shard).
pub(crate) fn all_gather_in_place_signature<C: Communicator + ?Sized>(
    c: &C,
    buf: &BufMut<'_>,
    algorithm: Algorithm,
) -> Signature {
    gather_signature(c, buf, algorithm)
}

/// Runs an all-gather whose call has begun.
pub(crate) fn all_gather<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    input: Buf<'_>,
    mut output: BufMut<'_>,
) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let es = input.dtype().size_bytes();
    let total = output.len();
    copy_large(
        &mut output.bytes()[byte_range(total, n, me, es)],
        input.bytes(),
    );
    all_gather_in_place(c, ctx, output)
}

/// Runs an all-gather whose call has begun, in place: the rank's shard of
/// `buf` holds its contribution (nothing is copied but the peers' shards).
pub(crate) fn all_gather_in_place<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mut buf: BufMut<'_>,
) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let es = buf.dtype().size_bytes();
    let out = buf.bytes();
    let all: Vec<usize> = (0..n).collect();
    match ctx.sig.algorithm {
        Some(Algorithm::RecursiveDoubling) if n.is_power_of_two() => {
            rd_all_gather(c, ctx, 0, &all, me, out, es)
        }
        _ => all_gather_chunks(c, ctx, 0, &all, me, out, es),
    }
}

/// Validates a broadcast or reduce call.
pub(crate) fn rooted_signature<C: Communicator + ?Sized>(
    c: &C,
    op: OpKind,
    buf: &BufMut<'_>,
    root: usize,
    reduce: Option<ReduceOp>,
    algorithm: Algorithm,
) -> Result<Signature> {
    if root >= c.size() {
        return Err(invalid(
            op,
            "root",
            format!("root {root} is outside the group of {} ranks", c.size()),
        ));
    }
    let bytes = buf.len() * buf.dtype().size_bytes();
    let algorithm = match algorithm.resolve(bytes, false) {
        Algorithm::Hierarchical => Algorithm::Ring,
        a => a,
    };
    Ok(Signature {
        op,
        dtype: Some(buf.dtype()),
        len: buf.len() as u64,
        root: Some(root),
        reduce,
        algorithm: Some(algorithm),
        wire: None,
        reproducible: false,
    })
}

/// Runs a broadcast whose call has begun.
pub(crate) fn broadcast<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mut buf: BufMut<'_>,
    root: usize,
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let es = buf.dtype().size_bytes();
    let len = buf.len();
    let buf = buf.bytes();
    if n == 1 {
        return Ok(());
    }
    if ctx.sig.algorithm == Some(Algorithm::Ring) {
        // Scatter from the root, then a ring all-gather (van de Geijn).
        if me == root {
            let sends: Vec<Outgoing<'_>> = (0..n)
                .filter(|&r| r != root)
                .map(|r| Outgoing {
                    to: r,
                    data: &buf[byte_range(len, n, r, es)],
                })
                .collect();
            c.exchange(ctx, 0, &sends, &mut [])?;
        } else {
            let r = byte_range(len, n, me, es);
            send_recv_copy(c, ctx, 0, None, Some((root, &mut buf[r])))?;
        }
        let all: Vec<usize> = (0..n).collect();
        return all_gather_chunks(c, ctx, PHASE, &all, me, buf, es);
    }
    // Binomial tree rooted at `root`.
    let vr = (me + n - root) % n;
    let mut mask = 1;
    let mut round = 0;
    while mask < n {
        if vr < mask {
            let dst = vr + mask;
            if dst < n {
                send_recv_copy(c, ctx, round, Some(((dst + root) % n, &*buf)), None)?;
            }
        } else if vr < 2 * mask {
            send_recv_copy(
                c,
                ctx,
                round,
                None,
                Some(((vr - mask + root) % n, &mut *buf)),
            )?;
        }
        mask <<= 1;
        round += 1;
    }
    Ok(())
}

/// Runs a reduce whose call has begun.
pub(crate) fn reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mut buf: BufMut<'_>,
    root: usize,
    op: ReduceOp,
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let dtype = buf.dtype();
    let es = dtype.size_bytes();
    let len = buf.len();
    let buf = buf.bytes();
    if ctx.sig.algorithm == Some(Algorithm::Ring) && n > 1 {
        let all: Vec<usize> = (0..n).collect();
        reduce_scatter_chunks(c, ctx, 0, &all, me, buf, dtype, op)?;
        // Gather the reduced shards at the root.
        if me == root {
            let mut parts: Vec<(usize, &mut [u8])> = Vec::with_capacity(n);
            let mut rest: &mut [u8] = buf;
            let mut offset = 0;
            for r in 0..n {
                let br = byte_range(len, n, r, es);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(br.end - offset);
                offset = br.end;
                rest = tail;
                if r != root {
                    parts.push((r, head));
                }
            }
            let mut sinks: Vec<_> = parts
                .into_iter()
                .map(|(r, part)| {
                    let l = part.len();
                    (r, l, move |src: &[u8]| {
                        part.copy_from_slice(src);
                        Ok(())
                    })
                })
                .collect();
            let mut incoming: Vec<Incoming<'_>> = sinks
                .iter_mut()
                .map(|(r, l, s)| Incoming {
                    from: *r,
                    len: Some(*l),
                    sink: s,
                })
                .collect();
            c.exchange(ctx, PHASE, &[], &mut incoming)?;
        } else {
            send_recv_copy(
                c,
                ctx,
                PHASE,
                Some((root, &buf[byte_range(len, n, me, es)])),
                None,
            )?;
        }
    } else {
        let vr = (me + n - root) % n;
        let mut mask = 1;
        let mut round = 0;
        while mask < n {
            if vr & mask != 0 {
                send_recv_copy(c, ctx, round, Some((((vr - mask) + root) % n, &*buf)), None)?;
                break;
            } else if vr + mask < n {
                let from = (vr + mask + root) % n;
                let blen = buf.len();
                let mut sink = |src: &[u8]| {
                    reduce_into(dtype, op, buf, src);
                    Ok(())
                };
                c.exchange(
                    ctx,
                    round,
                    &[],
                    &mut [Incoming {
                        from,
                        len: Some(blen),
                        sink: &mut sink,
                    }],
                )?;
            }
            mask <<= 1;
            round += 1;
        }
    }
    if me == root && op == ReduceOp::Avg {
        finish_avg(dtype, buf, n);
    }
    Ok(())
}

/// Validates an all-to-all-v call.
pub(crate) fn all_to_all_v_signature<C: Communicator + ?Sized>(
    c: &C,
    send: &Buf<'_>,
    send_counts: &[usize],
    recv: &BufMut<'_>,
    recv_counts: &[usize],
) -> Result<Signature> {
    let op = OpKind::AllToAllV;
    let n = c.size();
    for (name, counts, len) in [
        ("send_counts", send_counts, send.len()),
        ("recv_counts", recv_counts, recv.len()),
    ] {
        if counts.len() != n {
            return Err(invalid(
                op,
                name,
                format!("{} counts for a group of {n} ranks", counts.len()),
            ));
        }
        let total: usize = counts.iter().sum();
        if total != len {
            return Err(invalid(
                op,
                name,
                format!("counts sum to {total} but the buffer holds {len} elements"),
            ));
        }
    }
    if send.dtype() != recv.dtype() {
        return Err(invalid(
            op,
            "recv",
            format!(
                "dtype {} differs from send's {}",
                recv.dtype(),
                send.dtype()
            ),
        ));
    }
    if send_counts[c.rank()] != recv_counts[c.rank()] {
        return Err(invalid(
            op,
            "recv_counts",
            format!(
                "this rank sends itself {} elements but expects {}",
                send_counts[c.rank()],
                recv_counts[c.rank()]
            ),
        ));
    }
    let mut sig = Signature::new(op);
    sig.dtype = Some(send.dtype());
    Ok(sig)
}

/// Runs an all-to-all-v whose call has begun.
pub(crate) fn all_to_all_v<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    send: Buf<'_>,
    send_counts: &[usize],
    mut recv: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let es = send.dtype().size_bytes();
    let sb = send.bytes();
    let rb = recv.bytes();
    let mut sends = Vec::with_capacity(n);
    let mut off = 0;
    let mut own: &[u8] = &[];
    for (j, &cnt) in send_counts.iter().enumerate() {
        let part = &sb[off..off + cnt * es];
        off += cnt * es;
        if j == me {
            own = part;
        } else {
            sends.push(Outgoing { to: j, data: part });
        }
    }
    let mut parts: Vec<(usize, &mut [u8])> = Vec::with_capacity(n);
    let mut rest: &mut [u8] = rb;
    for (j, &cnt) in recv_counts.iter().enumerate() {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(cnt * es);
        rest = tail;
        if j == me {
            head.copy_from_slice(own);
        } else {
            parts.push((j, head));
        }
    }
    let mut sinks: Vec<_> = parts
        .into_iter()
        .map(|(j, part)| {
            let l = part.len();
            (j, l, move |src: &[u8]| {
                part.copy_from_slice(src);
                Ok(())
            })
        })
        .collect();
    let mut incoming: Vec<Incoming<'_>> = sinks
        .iter_mut()
        .map(|(j, l, s)| Incoming {
            from: *j,
            len: Some(*l),
            sink: s,
        })
        .collect();
    c.exchange(ctx, 0, &sends, &mut incoming)
}

/// Dissemination barrier: ⌈log₂ n⌉ rounds of empty messages.
pub(crate) fn barrier<C: Communicator + ?Sized>(c: &C, ctx: &OpCtx) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let mut dist = 1;
    let mut round = 0;
    while dist < n {
        send_recv_copy(
            c,
            ctx,
            round,
            Some(((me + dist) % n, &[])),
            Some(((me + n - dist) % n, &mut [])),
        )?;
        dist <<= 1;
        round += 1;
    }
    Ok(())
}

/// Gathers 16 bytes from every rank (`split`'s colours and keys, the
/// exact reductions' counts), in rank order: every rank sends its pair to
/// every other in one exchange (one round trip, not the ring's n − 1).
pub(crate) fn gather_u64_pairs<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mine: [u64; 2],
) -> Result<Vec<[u64; 2]>> {
    let (n, me) = (c.size(), c.rank());
    let mut own = [0u8; 16];
    own[..8].copy_from_slice(&mine[0].to_le_bytes());
    own[8..].copy_from_slice(&mine[1].to_le_bytes());
    let mut buf = vec![0u8; 16 * n];
    buf[16 * me..16 * me + 16].copy_from_slice(&own);
    if n > 1 {
        let sends: Vec<Outgoing<'_>> = (0..n)
            .filter(|&p| p != me)
            .map(|to| Outgoing { to, data: &own })
            .collect();
        let mut sinks: Vec<(usize, _)> = buf
            .chunks_exact_mut(16)
            .enumerate()
            .filter(|&(p, _)| p != me)
            .map(|(p, at)| {
                (p, move |src: &[u8]| {
                    at.copy_from_slice(src);
                    Ok(())
                })
            })
            .collect();
        let mut incoming: Vec<Incoming<'_>> = sinks
            .iter_mut()
            .map(|(from, sink)| Incoming {
                from: *from,
                len: Some(16),
                sink,
            })
            .collect();
        c.exchange(ctx, 0, &sends, &mut incoming)?;
    }
    Ok(buf
        .chunks_exact(16)
        .map(|ch| {
            [
                u64::from_le_bytes(ch[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(ch[8..].try_into().expect("8 bytes")),
            ]
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_two_gives_disjoint_views() {
        let mut b: Vec<u8> = (0..10).collect();
        let (a, m) = split_two(&mut b, 6..9, 1..3);
        assert_eq!(a, &[6, 7, 8]);
        m[0] = 100;
        let (a, m) = split_two(&mut b, 0..2, 5..5);
        assert_eq!(a, &[0, 100]);
        assert!(m.is_empty());
    }
}
