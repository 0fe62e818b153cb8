//! Context parallelism: every sequence of a micro-batch cut into `2·cp`
//! chunks over the `cp` ranks of a group, attention as a ring.
//!
//! Rank `r` holds chunks `r` and `2·cp − 1 − r` of every sequence (its
//! `t = T/cp` rows: the first half chunk `r`, the second half the other),
//! so that under the causal mask every rank does the same attention work.
//! Everything but attention is per token and runs on the rank's rows as
//! it would on any rows; the embedding, rotary positions, windows and
//! document starts use the rows' positions in the whole sequence
//! ([`ContextParallel::position`]); the loss is each rank's mean over its
//! rows, and the ranks' gradients are summed with the data-parallel
//! ones, each rank one contribution (`weft_parallel::reduce_group`).
//!
//! Attention runs over `cp` steps: at step `s` a rank computes its query
//! chunks' partial results ([`weft_kernels::attention_partial`]) against
//! the keys and values of rank `r − s`, while a helper thread passes them
//! on to rank `r + 1` and receives those of rank `r − s − 1` (overlapped,
//! on any backend that can [`detach`](Communicator::detach)). Only the
//! key/value heads travel (grouped-query attention sends `2·Ckv` floats a
//! row, not `C + 2·Ckv`), and only the chunks a later rank of the ring
//! still needs: a chunk after every query chunk of those ranks (the causal
//! mask) or entirely before their windows is not sent. The partials are
//! merged in the fixed tree of the one-rank kernel
//! ([`weft_kernels::attention_merge`]), so a rank's attention outputs are
//! bit for bit those of the whole sequence on one rank.
//!
//! The backward passes the keys and values around the ring again; each
//! rank computes its query gradients and the key/value gradients of the
//! chunk it holds ([`weft_kernels::attention_backward_partial`]), sends
//! the latter to the chunk's owner during the next step's exchange (the
//! last step's while it computes the diagonal of its later chunk, kept
//! for last), and each owner merges what it gets in the tree order
//! ([`weft_kernels::attention_grad_merge`]): bit for bit the one-rank
//! backward too. What keeps a whole cp run from being
//! bitwise the one-rank run is outside attention: each parameter's
//! gradient sums its tokens in one product per rank, and the ranks'
//! products are added after rounding (see `docs/parallel.md`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::{
    Heads, Span, attention_backward_partial, attention_grad_merge, attention_merge,
    attention_partial, attention_partial_len,
};

use weft_parallel::ContextChunks;
use weft_trace::TraceEvent;

use crate::error::{Error, Result};

/// Tags of the ring's messages (one per purpose; messages of a (peer,
/// tag) pair arrive in order).
const TAG_KV: u64 = 0x5746_4350; // "WFCP"
const TAG_DKV: u64 = 0x5746_4351;

/// A context-parallel group: what a [`GptBlocks`](crate::GptBlocks) of a
/// context-parallel rank runs its attention over (see the module docs).
#[derive(Clone)]
pub struct ContextParallel {
    comm: Arc<dyn Communicator>,
    clock: Arc<RingClock>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .finish_non_exhaustive()
    }
}

/// The ring's spans since the last [`ContextParallel::take_spans`]: its
/// exchanges (on their helper threads) and the attention's waits for
/// them.
#[derive(Debug, Default)]
struct RingClock {
    spans: Mutex<Vec<RingSpan>>,
}

/// The most spans kept between two [`ContextParallel::take_spans`] (a
/// caller that never takes them keeps a bounded log).
const MAX_SPANS: usize = 1 << 16;

impl RingClock {
    fn record(&self, wait: bool, start: Instant, end: Instant) {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        if spans.len() < MAX_SPANS {
            spans.push(RingSpan { wait, start, end });
        }
    }
}

/// One timed piece of the ring, for a run's trace: an exchange in flight
/// (on its helper thread), or the attention waiting for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSpan {
    /// The attention waiting (the exposed part), else an exchange.
    pub wait: bool,
    /// When it started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

/// Messages `(peer, data)` to send.
type Mail = Vec<(usize, Vec<f32>)>;

/// What the ring does with each holder's chunks ([`ContextParallel::ring`]).
type Visit<'a> = dyn FnMut(usize, [Option<&[f32]>; 2]) -> Result<Mail> + 'a;

/// The trace threads of the ring: its exchanges in flight, and the
/// attention's waits for them.
const RING_TIDS: (u64, u64) = (90, 91);

/// The ring's spans of training step `step` as trace lanes of process 0
/// (the caller sets the rank): `cp ring` (`exchange kv`: an exchange in
/// flight, on its helper thread) and `cp wait` (`wait kv`: the attention
/// blocked on one, the exposed part), on a clock that started at
/// `origin`; nothing without spans.
pub fn ring_lanes(spans: &[RingSpan], origin: Instant, step: u64) -> Vec<TraceEvent> {
    if spans.is_empty() {
        return Vec::new();
    }
    let us = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e6;
    let mut out = vec![
        TraceEvent::thread_name(0, RING_TIDS.0, "cp ring"),
        TraceEvent::thread_name(0, RING_TIDS.1, "cp wait"),
    ];
    for s in spans {
        let (name, tid) = if s.wait {
            ("wait kv", RING_TIDS.1)
        } else {
            ("exchange kv", RING_TIDS.0)
        };
        out.push(
            TraceEvent::complete(name, us(s.start), us(s.end) - us(s.start), 0, tid)
                .with_cat("cp.comm")
                .with_arg("step", i64::try_from(step).unwrap_or(i64::MAX)),
        );
    }
    out
}

/// One rank's attention inputs for the ring, in its local layout.
pub(crate) struct RingIn<'a> {
    /// `(B, t, C + 2·Ckv)` queries, keys and values of the rank's rows.
    pub qkv: &'a [f32],
    /// `(B, t)` each row's first visible key by position, under masking.
    pub starts: Option<&'a [u32]>,
    /// Sequences and the rank's rows per sequence.
    pub b: usize,
    /// Rows per sequence on this rank (`T / cp`).
    pub t: usize,
    /// Query channels (`C`, or the rank's under tensor parallelism).
    pub c: usize,
    /// Query and key/value heads.
    pub heads: Heads,
    /// The layer's sliding window, if any.
    pub window: Option<usize>,
}

impl ContextParallel {
    /// The group `comm` (its size is `cp`, its rank this rank's place).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        ContextParallel {
            comm,
            clock: Arc::default(),
        }
    }

    /// The cp degree.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The ring's spans since the last call (exchanges and waits, in
    /// the order they ended), for a trace.
    pub fn take_spans(&self) -> Vec<RingSpan> {
        std::mem::take(
            &mut *self
                .clock
                .spans
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// The group's chunks of `h` positions, for a layer of `window`.
    fn chunks(&self, h: usize, window: Option<usize>) -> ContextChunks {
        ContextChunks {
            cp: self.size(),
            len: h,
            window,
        }
    }

    /// The position in the whole sequence of row `i` of this rank's `t`
    /// rows of it.
    pub fn position(&self, i: usize, t: usize) -> usize {
        let h = t / 2;
        let chunk = self.chunks(h, None).of_rank(self.rank())[usize::from(i >= h)];
        chunk * h + i % h.max(1)
    }

    /// This rank's rows `(B, t)` of a per-row buffer of whole sequences
    /// `(B, cp·t)` (tokens, targets, document starts).
    ///
    /// # Errors
    /// [`Error::Batch`] if `whole` is not `B·cp·t` long.
    pub fn local<T: Copy>(&self, whole: &[T], b: usize, t: usize) -> Result<Vec<T>> {
        let seq = t * self.size();
        if whole.len() != b * seq {
            return Err(Error::Batch {
                reason: format!(
                    "{} values for {b} sequences of {seq} (context-parallel rows of {t} a rank)",
                    whole.len()
                ),
            });
        }
        Ok((0..b * t)
            .map(|r| whole[(r / t) * seq + self.position(r % t, t)])
            .collect())
    }

    /// Runs `exchange` (a message to the next rank and one from the
    /// previous) beside `compute`, on a helper thread when the backend
    /// can, and records the time the computation waited.
    fn overlapped<R>(
        &self,
        exchange: impl FnOnce(&dyn Communicator) -> Result<()> + Send,
        compute: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let clock = &self.clock;
        let timed = |c: &dyn Communicator| {
            let t0 = Instant::now();
            let r = exchange(c);
            clock.record(false, t0, Instant::now());
            r
        };
        match self.comm.detach() {
            Some(d) => std::thread::scope(|s| {
                let h = s.spawn(move || timed(&*d));
                let out = compute();
                let t0 = Instant::now();
                let ex = h.join().unwrap_or_else(|_| {
                    Err(Error::Batch {
                        reason: "the context-parallel exchange thread panicked".into(),
                    })
                });
                clock.record(true, t0, Instant::now());
                ex?;
                out
            }),
            None => {
                let t0 = Instant::now();
                timed(&*self.comm)?;
                clock.record(true, t0, Instant::now());
                compute()
            }
        }
    }

    /// The keys and values `(B, h, 2·Ckv)` of each chunk of the rank.
    fn own_kv(x: &RingIn<'_>, ckv: usize) -> [Vec<f32>; 2] {
        let (w, h) = (x.c + 2 * ckv, x.t / 2);
        std::array::from_fn(|half| {
            let mut kv = Vec::with_capacity(x.b * h * 2 * ckv);
            for bb in 0..x.b {
                for i in 0..h {
                    let row = (bb * x.t + half * h + i) * w;
                    kv.extend_from_slice(&x.qkv[row + x.c..row + w]);
                }
            }
            kv
        })
    }

    /// The ring of keys and values: calls `visit(step, holder, kv)` for
    /// each holder's chunks this rank reads (`kv[k]`: chunk `k` of the
    /// holder, `None` when not sent), the next holder's chunks arriving
    /// meanwhile; `visit` returns messages `(peer, data)` to send during
    /// the next step's exchange (the backward's key/value gradients).
    fn ring(&self, x: &RingIn<'_>, ckv: usize, visit: &mut Visit<'_>) -> Result<Mail> {
        let (n, me, h) = (self.size(), self.rank(), x.t / 2);
        let chunks = self.chunks(h, x.window);
        let len = x.b * h * 2 * ckv;
        let mut cur: [Option<Vec<f32>>; 2] = Self::own_kv(x, ckv).map(Some);
        let mut outbox: Vec<(usize, Vec<f32>)> = Vec::new();
        let prev = (me + n - 1) % n;
        for step in 0..n {
            let hold = (me + n - step) % n;
            // what goes on to the next rank, and what comes from the previous
            let (send, recv) = (chunks.sent(me, step), chunks.sent(prev, step));
            let mut incoming: [Option<Vec<f32>>; 2] = recv.map(|r| r.then(|| vec![0.0f32; len]));
            let sending: Vec<&[f32]> = (0..2)
                .filter(|&k| send[k])
                .filter_map(|k| cur[k].as_deref())
                .collect();
            let mail = std::mem::take(&mut outbox);
            let inbox = &mut incoming;
            let next = (me + 1) % n;
            let reads = chunks.of_rank(hold).map(|j| chunks.reads(me, j));
            let view: [Option<&[f32]>; 2] =
                std::array::from_fn(|k| cur[k].as_deref().filter(|_| reads[k]));
            outbox = self.overlapped(
                move |c| {
                    for s in sending {
                        c.send(next, TAG_KV, s)?;
                    }
                    for (peer, data) in &mail {
                        c.send(*peer, TAG_DKV, data)?;
                    }
                    for buf in inbox.iter_mut().flatten() {
                        c.recv(prev, TAG_KV, buf)?;
                    }
                    Ok(())
                },
                || visit(hold, view),
            )?;
            cur = incoming;
        }
        Ok(outbox)
    }

    /// Ring attention's forward: `out (B, t, C)` and `lse (B, NH, t)` of
    /// the rank's rows, bit for bit the rows of the one-rank kernel over
    /// the whole sequences.
    pub(crate) fn forward(&self, out: &mut [f32], lse: &mut [f32], x: &RingIn<'_>) -> Result<()> {
        let (h, heads) = (x.t / 2, x.heads);
        let hs = x.c / heads.q.max(1);
        let ckv = hs * heads.kv;
        let w = x.c + 2 * ckv;
        let n = 2 * self.size();
        let chunks = self.chunks(h, x.window);
        let mine = chunks.of_rank(self.rank());
        let span = |k: usize| Span {
            first: k * h,
            len: h,
        };
        let q: [Vec<f32>; 2] = std::array::from_fn(|half| rows(x.qkv, x.b, x.t, w, half));
        let starts: [Option<Vec<u32>>; 2] =
            std::array::from_fn(|half| x.starts.map(|s| rows(s, x.b, x.t, 1, half)));
        let plen = attention_partial_len(x.b, h, x.c, heads);
        // parts[half][chunk]
        let mut parts: [Vec<Option<Vec<f32>>>; 2] = [vec![None; n], vec![None; n]];
        self.ring(x, ckv, &mut |hold, kv| {
            for (k, j) in chunks.of_rank(hold).into_iter().enumerate() {
                let Some(kv) = kv[k] else { continue };
                for half in 0..2 {
                    if !chunks.sees(mine[half], j) {
                        continue;
                    }
                    let mut p = vec![0.0f32; plen];
                    attention_partial(
                        &mut p,
                        (&q[half], w),
                        span(mine[half]),
                        (kv, 2 * ckv, 0),
                        span(j),
                        starts[half].as_deref(),
                        x.b,
                        x.c,
                        heads,
                    )?;
                    parts[half][j] = Some(p);
                }
            }
            Ok(Vec::new())
        })?;
        for half in 0..2 {
            let list: Vec<(Option<&[f32]>, Span)> = (0..=mine[half])
                .map(|j| (parts[half][j].as_deref(), span(j)))
                .collect();
            let (mut o, mut l) = (vec![0.0f32; x.b * h * x.c], vec![0.0f32; x.b * heads.q * h]);
            attention_merge(&mut o, &mut l, &list, (x.b, h), x.c, heads)?;
            put_rows(out, &o, x.b, x.t, x.c, half);
            put_rows(lse, &l, x.b * heads.q, x.t, 1, half);
        }
        Ok(())
    }

    /// Ring attention's backward: adds to `dqkv (B, t, C + 2·Ckv)` the
    /// gradients of the rank's rows from `dout (B, t, C)`, with the
    /// forward's `out` and `lse`; bit for bit the one-rank kernel's rows.
    pub(crate) fn backward(
        &self,
        dqkv: &mut [f32],
        (dout, out, lse): (&[f32], &[f32], &[f32]),
        x: &RingIn<'_>,
    ) -> Result<()> {
        let (h, heads) = (x.t / 2, x.heads);
        let hs = x.c / heads.q.max(1);
        let ckv = hs * heads.kv;
        let w = x.c + 2 * ckv;
        let (cp, me) = (self.size(), self.rank());
        let n = 2 * cp;
        let chunks = self.chunks(h, x.window);
        let mine = chunks.of_rank(me);
        let span = |k: usize| Span {
            first: k * h,
            len: h,
        };
        let q: [Vec<f32>; 2] = std::array::from_fn(|half| rows(x.qkv, x.b, x.t, w, half));
        let dq_in: [Vec<f32>; 2] = std::array::from_fn(|half| rows(dout, x.b, x.t, x.c, half));
        let o: [Vec<f32>; 2] = std::array::from_fn(|half| rows(out, x.b, x.t, x.c, half));
        let l: [Vec<f32>; 2] = std::array::from_fn(|half| rows(lse, x.b * heads.q, x.t, 1, half));
        let starts: [Option<Vec<u32>>; 2] =
            std::array::from_fn(|half| x.starts.map(|s| rows(s, x.b, x.t, 1, half)));
        let (dq_len, dkv_len) = (x.b * h * x.c, x.b * h * 2 * ckv);
        // dq[half][key chunk], dkv[own half][query chunk]
        let mut dq: [Vec<Option<Vec<f32>>>; 2] = [vec![None; n], vec![None; n]];
        let mut dkv: [Vec<Option<Vec<f32>>>; 2] = [vec![None; n], vec![None; n]];
        // query chunk `mine[half]` against key chunk `j`: (dq, [dK | dV])
        let pair = |half: usize, j: usize, kv: &[f32]| -> Result<(Vec<f32>, Vec<f32>)> {
            let (mut gq, mut gkv) = (vec![0.0f32; dq_len], vec![0.0f32; dkv_len]);
            attention_backward_partial(
                (&mut gq, &mut gkv),
                (&dq_in[half], &o[half], &l[half]),
                (&q[half], w),
                span(mine[half]),
                (kv, 2 * ckv, 0),
                span(j),
                starts[half].as_deref(),
                x.b,
                x.c,
                heads,
            )?;
            Ok((gq, gkv))
        };
        // the diagonal of the rank's later chunk waits until after the
        // ring, to hide the last step's gradient parts on their way
        let deferred = |hold: usize, k: usize, half: usize| hold == me && k == 1 && half == 1;
        let last = self.ring(x, ckv, &mut |hold, kv| {
            let mut mail = Vec::new();
            for (k, j) in chunks.of_rank(hold).into_iter().enumerate() {
                let Some(kv) = kv[k] else { continue };
                for half in 0..2 {
                    if !chunks.sees(mine[half], j) || deferred(hold, k, half) {
                        continue;
                    }
                    let (gq, gkv) = pair(half, j, kv)?;
                    dq[half][j] = Some(gq);
                    if hold == me {
                        dkv[k][mine[half]] = Some(gkv);
                    } else {
                        mail.push((chunks.owner(j), gkv));
                    }
                }
            }
            Ok(mail)
        })?;
        // the last step's parts go out and every other rank's parts of
        // this rank's chunks come in — in the order each computed them
        // (its ring step `s` held this rank's chunks: the first chunk's
        // parts then the second's, by its query chunks) — while the
        // deferred diagonal computes
        let mut got: Vec<(usize, usize, Vec<f32>)> = Vec::new();
        let inbox = &mut got;
        let own = Self::own_kv(x, ckv);
        let (gq, gkv) = self.overlapped(
            move |c| {
                for (peer, data) in &last {
                    c.send(*peer, TAG_DKV, data)?;
                }
                for s in 1..cp {
                    let from = (me + s) % cp;
                    for (k, j) in mine.into_iter().enumerate() {
                        for qc in chunks.of_rank(from) {
                            if chunks.sees(qc, j) {
                                let mut buf = vec![0.0f32; dkv_len];
                                c.recv(from, TAG_DKV, &mut buf)?;
                                inbox.push((k, qc, buf));
                            }
                        }
                    }
                }
                Ok(())
            },
            || pair(1, mine[1], &own[1]),
        )?;
        dq[1][mine[1]] = Some(gq);
        dkv[1][mine[1]] = Some(gkv);
        for (k, qc, buf) in got {
            dkv[k][qc] = Some(buf);
        }
        let mut gq = vec![0.0f32; dq_len];
        let mut gkv = vec![0.0f32; dkv_len];
        for half in 0..2 {
            let list: Vec<(Option<&[f32]>, Span)> = (0..=mine[half])
                .map(|j| (dq[half][j].as_deref(), span(j)))
                .collect();
            gq.fill(0.0);
            attention_grad_merge(&mut gq, &list)?;
            let list: Vec<(Option<&[f32]>, Span)> = (0..n)
                .map(|qc| (dkv[half][qc].as_deref(), span(qc)))
                .collect();
            gkv.fill(0.0);
            attention_grad_merge(&mut gkv, &list)?;
            add_rows(dqkv, &gq, x.b, x.t, (w, 0, x.c), half);
            add_rows(dqkv, &gkv, x.b, x.t, (w, x.c, 2 * ckv), half);
        }
        Ok(())
    }
}

/// Half `half` (0: the first `t/2` rows of each sequence, 1: the rest)
/// of a `(B, t, width)` buffer, as `(B, t/2, width)`.
fn rows<T: Copy>(x: &[T], b: usize, t: usize, width: usize, half: usize) -> Vec<T> {
    let h = t / 2;
    let mut v = Vec::with_capacity(b * h * width);
    for bb in 0..b {
        let at = (bb * t + half * h) * width;
        v.extend_from_slice(&x[at..at + h * width]);
    }
    v
}

/// Writes `(B, t/2, width)` into half `half` of `(B, t, width)`.
fn put_rows(x: &mut [f32], part: &[f32], b: usize, t: usize, width: usize, half: usize) {
    let h = t / 2;
    for bb in 0..b {
        let at = (bb * t + half * h) * width;
        x[at..at + h * width].copy_from_slice(&part[bb * h * width..(bb + 1) * h * width]);
    }
}

/// Adds `(B, t/2, cols)` into columns `col..col + cols` of half `half`
/// of `(B, t, width)`.
fn add_rows(
    x: &mut [f32],
    part: &[f32],
    b: usize,
    t: usize,
    (width, col, cols): (usize, usize, usize),
    half: usize,
) {
    let h = t / 2;
    for bb in 0..b {
        for i in 0..h {
            let dst = &mut x[(bb * t + half * h + i) * width + col..][..cols];
            let src = &part[(bb * h + i) * cols..][..cols];
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
    }
}
