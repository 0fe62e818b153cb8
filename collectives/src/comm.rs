//! The [`Communicator`] trait and its typed extension [`CommunicatorExt`].

use std::time::{Duration, Instant};

use weft_numerics::Element;

use crate::algo;
use crate::error::{Error, Result};
use crate::types::{
    Algorithm, Buf, BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions, Signature,
    Topology, Traffic,
};

/// A group of ranks that run collectives together.
///
/// See the [crate documentation](crate#the-communicator-design) for why the
/// trait is split into a few required primitives and many provided
/// collectives. Ranks passed to and returned by methods are ranks *in this
/// group* (`0..size()`), except in errors, which name world ranks.
///
/// The trait is object safe: other crates hold a `&dyn Communicator` or
/// `Box<dyn Communicator>` and call the typed methods of
/// [`CommunicatorExt`], which every communicator (and `dyn Communicator`)
/// implements.
pub trait Communicator: Send + Sync {
    // ---- required primitives -------------------------------------------

    /// This rank's position in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// The world rank of group rank `rank`.
    fn world_rank_of(&self, rank: usize) -> usize;

    /// The domains of the world ranks (for hierarchical algorithms and link classes).
    fn topology(&self) -> Topology;

    /// A human-readable name of the group with its world ranks, for errors.
    fn group_name(&self) -> String;

    /// The per-operation timeout of the watchdog.
    fn timeout(&self) -> Duration;

    /// Starts a collective call: checks this rank is healthy, takes the next
    /// sequence number of the group and records that this rank arrived.
    ///
    /// # Errors
    /// [`Error::InjectedFault`] if this rank was told to fail,
    /// [`Error::Aborted`] if the group was aborted.
    fn begin(&self, sig: Signature) -> Result<OpCtx>;

    /// The transport primitive every algorithm is built from: posts `sends`,
    /// hands every message of `recvs` to its sink as it arrives, and returns
    /// once all messages are consumed on both sides. Messages are matched by
    /// (`ctx.seq`, `tag`, source); the receiver compares the sender's
    /// signature with its own.
    ///
    /// # Errors
    /// [`Error::PeerLost`], [`Error::Timeout`], [`Error::Mismatch`],
    /// [`Error::Aborted`], or what a sink returned.
    fn exchange(
        &self,
        ctx: &OpCtx,
        tag: u32,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()>;

    /// Point-to-point send of raw bytes to group rank `peer` with a user
    /// `tag`. Returns once the message is buffered or delivered; messages
    /// with the same (peer, tag) arrive in order.
    ///
    /// # Errors
    /// [`Error::PeerLost`], [`Error::InvalidArgument`] for a bad peer.
    fn send_bytes(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()>;

    /// Receives the next message from `peer` with `tag` into `out`, whose
    /// length must equal the message's.
    ///
    /// # Errors
    /// [`Error::PeerLost`], [`Error::Timeout`], [`Error::Mismatch`] on a
    /// length mismatch, [`Error::InvalidArgument`] for a bad peer.
    fn recv_bytes(&self, peer: usize, tag: u64, out: &mut [u8]) -> Result<()>;

    /// Splits the group: ranks passing the same `color` form a new group,
    /// ordered by `key` (ties by rank). Collective over this group.
    ///
    /// # Errors
    /// As for any collective.
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>>;

    /// This rank's traffic counters (all groups of this rank together).
    fn traffic(&self) -> Traffic;

    /// This rank's traffic through this group alone (its handles and the
    /// handles detached from them; not the groups split from it): what
    /// one axis of a mesh sends, where [`traffic`](Self::traffic) is every
    /// axis together.
    fn group_traffic(&self) -> Traffic;

    /// A handle to the same group usable from another thread, for
    /// non-blocking operations; `None` if the backend cannot (then the
    /// non-blocking forms complete before returning).
    fn detach(&self) -> Option<Box<dyn Communicator>>;

    /// Marks the group broken after a collective failed part-way, so that
    /// peers still waiting in it, and every later call in the group, fail
    /// at once with [`Error::Aborted`] instead of
    /// waiting out the timeout. Called by algorithms whose failure can
    /// strand peers waiting for a message it withdrew (the nested
    /// exchanges of the reproducible mode's direct reductions). The
    /// default does nothing (the peers' timeouts still apply).
    fn abort_group(&self, reason: &str) {
        let _ = reason;
    }

    // ---- provided collectives (dtype-erased, object safe) -------------

    /// All-reduce of a dtype-erased buffer; see [`CommunicatorExt::all_reduce_with`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::all_reduce_with`].
    fn all_reduce_buf(&self, buf: BufMut<'_>, opts: &ReduceOptions) -> Result<()> {
        let ctx = self.begin(algo::reduce_signature(self, OpKind::AllReduce, &buf, opts)?)?;
        algo::all_reduce(self, &ctx, buf, opts)
    }

    /// Reduce-scatter of a dtype-erased buffer; see [`CommunicatorExt::reduce_scatter_with`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::reduce_scatter_with`].
    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        opts: &ReduceOptions,
    ) -> Result<()> {
        let ctx = self.begin(algo::reduce_scatter_signature(self, &input, &output, opts)?)?;
        algo::reduce_scatter(self, &ctx, input, output, opts)
    }

    /// All-gather of dtype-erased buffers; see [`CommunicatorExt::all_gather`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::all_gather`].
    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        algorithm: Algorithm,
    ) -> Result<()> {
        let ctx = self.begin(algo::all_gather_signature(
            self, &input, &output, algorithm,
        )?)?;
        algo::all_gather(self, &ctx, input, output)
    }

    /// In-place all-gather of a dtype-erased buffer; see
    /// [`CommunicatorExt::all_gather_in_place`]. This default copies the
    /// rank's shard out and runs [`all_gather_buf`](Self::all_gather_buf)
    /// (right for any backend); the thread backend gathers with no copy
    /// of its own shard.
    ///
    /// # Errors
    /// As [`CommunicatorExt::all_gather_in_place`].
    fn all_gather_in_place_buf(&self, mut buf: BufMut<'_>, algorithm: Algorithm) -> Result<()> {
        let es = buf.dtype().size_bytes();
        let shard = crate::shard_range(buf.len(), self.size(), self.rank());
        let bytes = &buf.bytes()[shard.start * es..shard.end * es];
        // a copy aligned for any element type (u64 words)
        let mut own = vec![0u64; bytes.len().div_ceil(8)];
        let own: &mut [u8] = &mut bytemuck_bytes(&mut own)[..bytes.len()];
        own.copy_from_slice(bytes);
        self.all_gather_buf(Buf::from_bytes(buf.dtype(), own), buf, algorithm)
    }

    /// Broadcast of a dtype-erased buffer; see [`CommunicatorExt::broadcast`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::broadcast`].
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize, algorithm: Algorithm) -> Result<()> {
        let ctx = self.begin(algo::rooted_signature(
            self,
            OpKind::Broadcast,
            &buf,
            root,
            None,
            algorithm,
        )?)?;
        algo::broadcast(self, &ctx, buf, root)
    }

    /// Reduce to a root of a dtype-erased buffer; see [`CommunicatorExt::reduce`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::reduce`].
    fn reduce_buf(
        &self,
        buf: BufMut<'_>,
        root: usize,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<()> {
        let ctx = self.begin(algo::rooted_signature(
            self,
            OpKind::Reduce,
            &buf,
            root,
            Some(op),
            algorithm,
        )?)?;
        algo::reduce(self, &ctx, buf, root, op)
    }

    /// All-to-all with per-peer element counts; see [`CommunicatorExt::all_to_all_v`].
    ///
    /// # Errors
    /// As [`CommunicatorExt::all_to_all_v`].
    fn all_to_all_v_buf(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let sig = algo::all_to_all_v_signature(self, &send, send_counts, &recv, recv_counts)?;
        let ctx = self.begin(sig)?;
        algo::all_to_all_v(self, &ctx, send, send_counts, recv, recv_counts)
    }

    /// Blocks until every rank of the group has called `barrier`.
    ///
    /// # Errors
    /// [`Error::PeerLost`], [`Error::Timeout`], [`Error::Mismatch`].
    fn barrier(&self) -> Result<()> {
        let ctx = self.begin(Signature::new(OpKind::Barrier))?;
        algo::barrier(self, &ctx)
    }
}

/// A non-blocking operation in flight; [`wait`](Self::wait) for its result.
#[derive(Debug)]
pub struct Pending<T> {
    state: PendingState<T>,
}

#[derive(Debug)]
enum PendingState<T> {
    Ready(Result<T>, Instant),
    Running(std::thread::JoinHandle<(Result<T>, Instant)>),
}

impl<T> Pending<T> {
    /// `true` once the operation has finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        match &self.state {
            PendingState::Ready(..) => true,
            PendingState::Running(h) => h.is_finished(),
        }
    }

    /// Waits for the operation and returns its buffer.
    ///
    /// # Errors
    /// The operation's error; [`Error::RankPanicked`] if its worker panicked.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().0
    }

    /// Waits for the operation; returns its result and when it finished
    /// (stamped by the thread that ran it, so a late `wait` still sees
    /// when the data arrived: what a trace of overlap needs).
    pub fn wait_timed(self) -> (Result<T>, Instant) {
        match self.state {
            PendingState::Ready(r, at) => (r, at),
            PendingState::Running(h) => h.join().unwrap_or_else(|p| {
                (
                    Err(Error::RankPanicked {
                        rank: usize::MAX,
                        message: crate::local::panic_message(&*p),
                    }),
                    Instant::now(),
                )
            }),
        }
    }
}

fn start<C, S, T, F, G>(comm: &C, sig: Signature, state: S, run: F, finish: G) -> Result<Pending<T>>
where
    C: Communicator + ?Sized,
    S: Send + 'static,
    T: Send + 'static,
    F: FnOnce(&dyn Communicator, &OpCtx, &mut S) -> Result<()> + Send + 'static,
    G: FnOnce(S) -> T + Send + 'static,
{
    let ctx = comm.begin(sig)?;
    let mut state = state;
    match comm.detach() {
        Some(detached) => {
            let handle = std::thread::Builder::new()
                .name(format!("weft-{}-{}", sig.op, ctx.seq))
                .spawn(move || {
                    let r = run(&*detached, &ctx, &mut state).map(|()| finish(state));
                    (r, Instant::now())
                })
                .map_err(|e| Error::Backend {
                    backend: "local",
                    op: sig.op,
                    message: format!("cannot spawn a progress thread: {e}"),
                })?;
            Ok(Pending {
                state: PendingState::Running(handle),
            })
        }
        None => {
            // Not detachable: the backend cannot progress in the background,
            // so run to completion now.
            let inner: &dyn Communicator = &DynRef(comm);
            let r = run(inner, &ctx, &mut state).map(|()| finish(state));
            Ok(Pending {
                state: PendingState::Ready(r, Instant::now()),
            })
        }
    }
}

/// Adapts `&C` (possibly unsized) to `&dyn Communicator`.
struct DynRef<'a, C: ?Sized>(&'a C);

impl<C: Communicator + ?Sized> Communicator for DynRef<'_, C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn world_rank_of(&self, rank: usize) -> usize {
        self.0.world_rank_of(rank)
    }
    fn topology(&self) -> Topology {
        self.0.topology()
    }
    fn group_name(&self) -> String {
        self.0.group_name()
    }
    fn timeout(&self) -> Duration {
        self.0.timeout()
    }
    fn begin(&self, sig: Signature) -> Result<OpCtx> {
        self.0.begin(sig)
    }
    fn exchange(
        &self,
        ctx: &OpCtx,
        tag: u32,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        self.0.exchange(ctx, tag, sends, recvs)
    }
    fn send_bytes(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.0.send_bytes(peer, tag, data)
    }
    fn recv_bytes(&self, peer: usize, tag: u64, out: &mut [u8]) -> Result<()> {
        self.0.recv_bytes(peer, tag, out)
    }
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        self.0.split(color, key)
    }
    fn traffic(&self) -> Traffic {
        self.0.traffic()
    }
    fn group_traffic(&self) -> Traffic {
        self.0.group_traffic()
    }
    fn detach(&self) -> Option<Box<dyn Communicator>> {
        self.0.detach()
    }
    fn abort_group(&self, reason: &str) {
        self.0.abort_group(reason);
    }
}

/// Typed collectives over any [`Communicator`] (including `dyn Communicator`).
///
/// Buffers are slices of `f32`, `f16`, `bf16` or `f64` (any
/// [`weft_numerics::Element`]). Every rank of the group must make the same
/// calls in the same order with the same lengths, dtypes, roots and options;
/// a mismatch is reported as [`Error::Mismatch`].
pub trait CommunicatorExt: Communicator {
    /// Replaces `buf` on every rank by the elementwise reduction of all
    /// ranks' `buf`s, with the default options for `op`.
    ///
    /// # Errors
    /// [`Error::PeerLost`], [`Error::Timeout`], [`Error::Mismatch`],
    /// [`Error::InvalidArgument`].
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_buf(BufMut::new(buf), &ReduceOptions::new(op))
    }

    /// [`all_reduce`](Self::all_reduce) with explicit options (algorithm,
    /// wire dtype, reproducible mode).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); [`Error::InvalidArgument`] for a
    /// wire dtype narrower than the buffer, a hierarchical algorithm on a
    /// group whose domains hold different numbers of ranks, or a
    /// reproducible `Max`/`Min`.
    fn all_reduce_with<T: Element>(&self, buf: &mut [T], opts: &ReduceOptions) -> Result<()> {
        self.all_reduce_buf(BufMut::new(buf), opts)
    }

    /// Reduces `input` (the same length on every rank) and leaves shard
    /// [`shard_range`](crate::shard_range)`(input.len(), size, rank)` of the
    /// result in `output`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); [`Error::InvalidArgument`] if
    /// `output` has the wrong length.
    fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_buf(
            Buf::new(input),
            BufMut::new(output),
            &ReduceOptions::new(op),
        )
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with explicit options.
    ///
    /// # Errors
    /// As [`reduce_scatter`](Self::reduce_scatter).
    fn reduce_scatter_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        opts: &ReduceOptions,
    ) -> Result<()> {
        self.reduce_scatter_buf(Buf::new(input), BufMut::new(output), opts)
    }

    /// Reduces every rank's [`ExactPartial`](crate::repro::ExactPartial)
    /// into `out` on every rank: the exact sum of all contributions of all
    /// ranks, rounded once to `T` (`Sum`), or that sum divided by the total
    /// number of contributions ([`ExactPartial::count`](crate::repro::ExactPartial::count)
    /// summed over the group), rounded once (`Avg`). The bits depend only
    /// on the multiset of contributions, not on how they were split over
    /// ranks or ordered; on one rank this equals
    /// [`ExactPartial::round_to`](crate::repro::ExactPartial::round_to) /
    /// [`mean_to`](crate::repro::ExactPartial::mean_to).
    ///
    /// A ring reduce-scatter of the encoded partials (sent straight from
    /// the partial's memory, about 2× the native bytes for f32 gradients)
    /// rounding into the output, then a ring all-gather of native values.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out.len()` differs from the partial's
    /// length or `op` is `Max`/`Min`; [`Error::Mismatch`] if ranks' lengths
    /// differ; and as for any collective.
    fn all_reduce_exact<T: Element>(
        &self,
        partial: &crate::repro::ExactPartial,
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        exact_all_reduce(self, partial, out, op, None)
    }

    /// Like [`all_reduce_exact`](Self::all_reduce_exact) but leaves only
    /// shard [`shard_range`](crate::shard_range)`(partial.len(), size, rank)`
    /// of the result in `out_shard` (no all-gather).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out_shard` has the wrong length or
    /// `op` is `Max`/`Min`; and as for any collective.
    fn reduce_scatter_exact<T: Element>(
        &self,
        partial: &crate::repro::ExactPartial,
        out_shard: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let want = crate::shard_range(partial.len(), self.size(), self.rank()).len();
        exact_check(OpKind::ReduceScatter, want, out_shard.len(), op)?;
        let ctx = self.begin(exact_signature::<T>(
            OpKind::ReduceScatter,
            partial.len(),
            op,
        ))?;
        crate::repro::reduce_scatter_exact(self, &ctx, 1 << 20, partial, out_shard, op, None)
    }

    /// Like [`reduce_scatter_exact`](Self::reduce_scatter_exact) with
    /// `Avg`, but the exact sum is divided by `divisor` (the same on every
    /// rank) and rounded once, as
    /// [`all_reduce_exact_div`](Self::all_reduce_exact_div) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out_shard` has the wrong length or
    /// `divisor` is 0 or exceeds 2^32 − 1; and as for any collective.
    fn reduce_scatter_exact_div<T: Element>(
        &self,
        partial: &crate::repro::ExactPartial,
        out_shard: &mut [T],
        divisor: u64,
    ) -> Result<()> {
        if divisor == 0 {
            return Err(Error::InvalidArgument {
                op: OpKind::ReduceScatter,
                arg: "divisor",
                reason: "must be at least 1".into(),
            });
        }
        let want = crate::shard_range(partial.len(), self.size(), self.rank()).len();
        exact_check(OpKind::ReduceScatter, want, out_shard.len(), ReduceOp::Avg)?;
        let ctx = self.begin(exact_signature::<T>(
            OpKind::ReduceScatter,
            partial.len(),
            ReduceOp::Avg,
        ))?;
        crate::repro::reduce_scatter_exact(
            self,
            &ctx,
            1 << 20,
            partial,
            out_shard,
            ReduceOp::Avg,
            Some(divisor),
        )
    }

    /// Adds every rank's chunk of `input` exactly into the accumulator of
    /// the rank that owns it: chunk `r` of each rank's `input`
    /// ([`shard_range`](crate::shard_range)`(input.len(), size, r)`) goes to
    /// rank `r` as values and is added to its `acc` as one contribution, so
    /// a call adds `size` contributions to every rank's accumulator.
    ///
    /// The reduce-scatter of sharded gradient accumulation in reproducible
    /// mode (what weft-fsdp runs per micro-batch): the plain
    /// reduce-scatter's bytes on the wire, not an exact encoding of about
    /// twice as many, and each shard's owner keeps the exact sum of every
    /// rank's micro-batches, to be rounded once at the end
    /// ([`ExactPartial::div_to`](crate::repro::ExactPartial::div_to), or
    /// [`all_reduce_exact_div`](Self::all_reduce_exact_div) across
    /// replicas). Bitwise the same for any number of ranks and any split
    /// of the micro-batches over them.
    ///
    /// ```
    /// use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, repro::ExactPartial};
    ///
    /// let sums = LocalCluster::run(2, |comm| {
    ///     let mut acc = ExactPartial::new(2); // this rank's half of 4
    ///     for micro in 0..3 {
    ///         let g = vec![0.1f32 * (comm.rank() + micro) as f32; 4];
    ///         comm.reduce_scatter_add_exact(&g, &mut acc)?;
    ///     }
    ///     let mut mean = vec![0f32; 2];
    ///     acc.mean_to(&mut mean)?; // the exact sum of 6 contributions / 6, rounded once
    ///     Ok::<_, weft_collectives::Error>((acc.count(), mean))
    /// })?;
    /// assert_eq!(sums[0].as_ref().unwrap().0, 6);
    /// # Ok::<(), weft_collectives::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `acc` is not as long as this rank's
    /// chunk; and as for any collective.
    fn reduce_scatter_add_exact<T: Element>(
        &self,
        input: &[T],
        acc: &mut crate::repro::ExactPartial,
    ) -> Result<()> {
        let want = crate::shard_range(input.len(), self.size(), self.rank()).len();
        if acc.len() != want {
            return Err(Error::InvalidArgument {
                op: OpKind::ReduceScatter,
                arg: "acc",
                reason: format!(
                    "{} elements, expected this rank's chunk of {want}",
                    acc.len()
                ),
            });
        }
        // no algorithm: a different protocol from `reduce_scatter_exact`'s,
        // so the two mixed up are a mismatch, not a hang
        let sig = Signature {
            algorithm: None,
            ..exact_signature::<T>(OpKind::ReduceScatter, input.len(), ReduceOp::Sum)
        };
        let ctx = self.begin(sig)?;
        crate::repro::reduce_scatter_add_exact(self, &ctx, input, acc)
    }

    /// Like [`all_reduce_exact`](Self::all_reduce_exact) with `Avg`, but
    /// the exact sum of every rank's contributions is divided by `divisor`
    /// (the same on every rank) instead of by the number of contributions,
    /// and rounded once: the mean over a count the caller knows and the
    /// partials do not (gradients already summed over other ranks' tokens,
    /// as an expert shard's are, or partial sums over a tensor-parallel
    /// group). On one rank this equals
    /// [`ExactPartial::div_to`](crate::repro::ExactPartial::div_to).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `out.len()` differs from the partial's
    /// length or `divisor` is 0 or exceeds 2^32 − 1; and as for any
    /// collective.
    fn all_reduce_exact_div<T: Element>(
        &self,
        partial: &crate::repro::ExactPartial,
        out: &mut [T],
        divisor: u64,
    ) -> Result<()> {
        if divisor == 0 {
            return Err(Error::InvalidArgument {
                op: OpKind::AllReduce,
                arg: "divisor",
                reason: "must be at least 1".into(),
            });
        }
        exact_all_reduce(self, partial, out, ReduceOp::Avg, Some(divisor))
    }

    /// Concatenates every rank's `input` in rank order into `output`; rank
    /// `r`'s input must have length `shard_range(output.len(), size, r).len()`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a wrong input length, and as for any
    /// collective.
    fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_buf(Buf::new(input), BufMut::new(output), Algorithm::Auto)
    }

    /// [`all_gather`](Self::all_gather) with an explicit algorithm.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    fn all_gather_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.all_gather_buf(Buf::new(input), BufMut::new(output), algorithm)
    }

    /// All-gather in place: on entry each rank's shard of `buf`
    /// ([`shard_range`](crate::shard_range)`(buf.len(), size, rank)`) holds its contribution;
    /// on return every rank's `buf` holds every shard — the result of
    /// [`all_gather`](Self::all_gather) without the copy of the rank's own
    /// shard into the output (NCCL's in-place form, `sendbuff ==
    /// recvbuff + rank·count`): on the thread backend it moves only the
    /// peers' shards, half the memory traffic of the out-of-place form at
    /// two ranks.
    ///
    /// # Errors
    /// As for any collective.
    fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.all_gather_in_place_buf(BufMut::new(buf), Algorithm::Auto)
    }

    /// [`all_gather_in_place`](Self::all_gather_in_place) with an explicit
    /// algorithm.
    ///
    /// # Errors
    /// As for any collective.
    fn all_gather_in_place_with<T: Element>(
        &self,
        buf: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.all_gather_in_place_buf(BufMut::new(buf), algorithm)
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a root outside the group, and as for
    /// any collective.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_buf(BufMut::new(buf), root, Algorithm::Auto)
    }

    /// Reduces every rank's `buf` into `root`'s `buf`. The contents of the
    /// other ranks' buffers are unspecified afterwards (they hold partial
    /// results).
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.reduce_buf(BufMut::new(buf), root, op, Algorithm::Auto)
    }

    /// Equal-split all-to-all: `send` and `recv` hold `size` blocks of equal
    /// length; block `j` of `send` goes to rank `j` and arrives as block
    /// `rank` of its `recv`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the lengths differ or are not multiples
    /// of the group size, and as for any collective.
    fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.size();
        if send.len() != recv.len() || !send.len().is_multiple_of(n) {
            return Err(Error::InvalidArgument {
                op: OpKind::AllToAll,
                arg: "send/recv",
                reason: format!(
                    "lengths {} and {} must be equal multiples of the group size {n}",
                    send.len(),
                    recv.len()
                ),
            });
        }
        let counts = vec![send.len() / n; n];
        self.all_to_all_v_buf(Buf::new(send), &counts, BufMut::new(recv), &counts)
    }

    /// All-to-all with per-peer counts (MoE dispatch/combine): `send` is the
    /// concatenation of `send_counts[j]` elements for each rank `j`, `recv`
    /// receives `recv_counts[j]` elements from each rank `j`, in rank order.
    /// `recv_counts[j]` on this rank must equal `send_counts[rank]` on `j`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if counts do not sum to the buffer lengths,
    /// [`Error::Mismatch`] if a peer sends a different count than expected,
    /// and as for any collective.
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_buf(Buf::new(send), send_counts, BufMut::new(recv), recv_counts)
    }

    /// Sends `data` to group rank `peer` (buffered: returns without waiting
    /// for the receiver).
    ///
    /// # Errors
    /// As [`Communicator::send_bytes`].
    fn send<T: Element>(&self, peer: usize, tag: u64, data: &[T]) -> Result<()> {
        self.send_bytes(peer, tag, Buf::new(data).bytes())
    }

    /// Receives the next message with `tag` from `peer` into `out`.
    ///
    /// # Errors
    /// As [`Communicator::recv_bytes`].
    fn recv<T: Element>(&self, peer: usize, tag: u64, out: &mut [T]) -> Result<()> {
        self.recv_bytes(peer, tag, BufMut::new(out).into_bytes())
    }

    /// Starts an all-reduce that progresses in the background (on the local
    /// backend, on its own thread) while the caller computes. The operation
    /// takes its place in the group's call order now; later calls may run
    /// before it completes.
    ///
    /// # Errors
    /// Errors detectable at the start ([`Error::InjectedFault`],
    /// [`Error::InvalidArgument`]); the rest come from [`Pending::wait`].
    fn all_reduce_async<T: Element>(
        &self,
        buf: Vec<T>,
        opts: ReduceOptions,
    ) -> Result<Pending<Vec<T>>> {
        let mut b = buf;
        let sig = algo::reduce_signature(self, OpKind::AllReduce, &BufMut::new(&mut b), &opts)?;
        start(
            self,
            sig,
            b,
            move |c, ctx, b: &mut Vec<T>| algo::all_reduce(c, ctx, BufMut::new(b), &opts),
            |b| b,
        )
    }

    /// Starts a reduce-scatter in the background; the result is the shard
    /// (see [`reduce_scatter`](Self::reduce_scatter)).
    ///
    /// # Errors
    /// As [`all_reduce_async`](Self::all_reduce_async).
    fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        opts: ReduceOptions,
    ) -> Result<Pending<Vec<T>>> {
        let r = crate::shard_range(input.len(), self.size(), self.rank());
        let mut out = vec![T::ZERO; r.len()];
        let sig =
            algo::reduce_scatter_signature(self, &Buf::new(&input), &BufMut::new(&mut out), &opts)?;
        start(
            self,
            sig,
            (input, out),
            move |c, ctx, (i, o): &mut (Vec<T>, Vec<T>)| {
                algo::reduce_scatter(c, ctx, Buf::new(i), BufMut::new(o), &opts)
            },
            |(_, o)| o,
        )
    }

    /// Starts an in-place all-gather in the background (see
    /// [`all_gather_in_place`](Self::all_gather_in_place)): `buf` holds
    /// this rank's shard at its place on entry and is the result, so that
    /// only the peers' shards are copied and nothing is allocated — the
    /// form to prefer over [`all_gather_async`](Self::all_gather_async),
    /// which copies the input and its own shard once more.
    ///
    /// # Errors
    /// As [`all_reduce_async`](Self::all_reduce_async).
    fn all_gather_in_place_async<T: Element>(&self, buf: Vec<T>) -> Result<Pending<Vec<T>>> {
        self.all_gather_in_place_async_then(buf, |b| b)
    }

    /// [`all_gather_in_place_async`](Self::all_gather_in_place_async),
    /// then `then` applied to the gathered buffer where the operation runs
    /// (its progress thread), so that work on the result — widening it,
    /// unpacking it — is hidden behind the caller's computation too.
    ///
    /// # Errors
    /// As [`all_reduce_async`](Self::all_reduce_async).
    fn all_gather_in_place_async_then<T, U, F>(&self, buf: Vec<T>, then: F) -> Result<Pending<U>>
    where
        T: Element,
        U: Send + 'static,
        F: FnOnce(Vec<T>) -> U + Send + 'static,
    {
        let mut b = buf;
        let sig = algo::all_gather_in_place_signature(self, &BufMut::new(&mut b), Algorithm::Auto);
        start(
            self,
            sig,
            b,
            move |c, ctx, b: &mut Vec<T>| algo::all_gather_in_place(c, ctx, BufMut::new(b)),
            then,
        )
    }

    /// Starts an all-gather in the background; the result is the gathered
    /// buffer of `total` elements (see [`all_gather`](Self::all_gather)).
    ///
    /// # Errors
    /// As [`all_reduce_async`](Self::all_reduce_async).
    fn all_gather_async<T: Element>(&self, input: Vec<T>, total: usize) -> Result<Pending<Vec<T>>> {
        let mut out = vec![T::ZERO; total];
        let sig = algo::all_gather_signature(
            self,
            &Buf::new(&input),
            &BufMut::new(&mut out),
            Algorithm::Auto,
        )?;
        start(
            self,
            sig,
            (input, out),
            move |c, ctx, (i, o): &mut (Vec<T>, Vec<T>)| {
                algo::all_gather(c, ctx, Buf::new(i), BufMut::new(o))
            },
            |(_, o)| o,
        )
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// The exact all-reduce: an exact reduce-scatter rounding into this
/// rank's shard of `out` (`divide_by` overriding `Avg`'s divisor), then a
/// ring all-gather of the rounded shards.
fn exact_all_reduce<C: Communicator + ?Sized, T: Element>(
    c: &C,
    partial: &crate::repro::ExactPartial,
    out: &mut [T],
    op: ReduceOp,
    divide_by: Option<u64>,
) -> Result<()> {
    exact_check(OpKind::AllReduce, partial.len(), out.len(), op)?;
    let ctx = c.begin(exact_signature::<T>(OpKind::AllReduce, partial.len(), op))?;
    let n = c.size();
    let me = c.rank();
    let r = crate::shard_range(out.len(), n, me);
    crate::repro::reduce_scatter_exact(c, &ctx, 1 << 20, partial, &mut out[r], op, divide_by)?;
    let all: Vec<usize> = (0..n).collect();
    let es = T::DTYPE.size_bytes();
    algo::all_gather_chunks(
        c,
        &ctx,
        2 << 20,
        &all,
        me,
        BufMut::new(out).into_bytes(),
        es,
    )
}

fn exact_check(op: OpKind, want: usize, got: usize, reduce: ReduceOp) -> Result<()> {
    if want != got {
        return Err(Error::InvalidArgument {
            op,
            arg: "out",
            reason: format!("{got} elements, expected {want}"),
        });
    }
    if matches!(reduce, ReduceOp::Max | ReduceOp::Min) {
        return Err(Error::InvalidArgument {
            op,
            arg: "op",
            reason: format!("exact reductions are sum or avg, not {}", reduce.name()),
        });
    }
    Ok(())
}

fn exact_signature<T: Element>(op: OpKind, len: usize, reduce: ReduceOp) -> Signature {
    Signature {
        op,
        dtype: Some(T::DTYPE),
        len: len as u64,
        root: None,
        reduce: Some(reduce),
        algorithm: Some(Algorithm::Ring),
        wire: None,
        reproducible: true,
    }
}

/// The bytes of a word buffer.
fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and every byte pattern is valid for u8;
    // the view borrows `words` mutably.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) }
}
