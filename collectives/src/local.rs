//! The `local` backend: ranks are threads of one process, messages are
//! handed over through shared memory.
//!
//! A collective message is never copied into a channel: the sender posts a
//! pointer to its own buffer in the receiver's mailbox and waits; the
//! receiver reduces or copies straight out of the sender's memory into its
//! own, then signals completion. A ring all-reduce therefore touches each
//! byte the textbook number of times and allocates nothing. Point-to-point
//! [`send`](crate::CommunicatorExt::send) is buffered (one copy) so that
//! pipeline stages can send before the peer is ready to receive.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::error::{Error, LossCause, Result};
use crate::types::{
    Incoming, OpCtx, OpKind, Outgoing, Signature, Topology, Traffic, TrafficCounters,
};

/// Default per-operation timeout of [`LocalCluster`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const ALIVE: u8 = 0;
const EXITED: u8 = 1;
const PANICKED: u8 = 2;
const INJECTED: u8 = 3;

/// Sequence number that marks point-to-point messages.
const P2P: u64 = u64::MAX;

enum Payload {
    /// Points into the sender's buffer, valid until the sender's `done` flag
    /// for this message is set (the sender blocks until then).
    Borrowed(*const u8, usize),
    Owned(Vec<u8>),
}

struct Post {
    src: usize,
    group: u64,
    seq: u64,
    tag: u64,
    sig: Signature,
    data: Payload,
    /// Completion of borrowed messages: (the sender's flags, index).
    done: Option<(Arc<SendFlags>, usize)>,
}

// SAFETY: the raw pointer in `Payload::Borrowed` is only dereferenced by the
// receiving thread while the sending thread keeps the buffer alive and
// unmodified (it blocks until the receiver sets the completion flag, and on
// any early exit retracts or waits for the message first, see `SendGuard`).
unsafe impl Send for Post {}

struct SendFlags {
    done: Vec<AtomicBool>,
    remaining: AtomicUsize,
}

struct Mailbox {
    queue: Mutex<Vec<Post>>,
    cv: Condvar,
    /// Bumped (under `queue`'s lock) by every post to this mailbox and
    /// every completion of its owner's messages: what a spinning waiter
    /// watches before it sleeps on `cv`.
    version: AtomicU64,
}

impl Mailbox {
    fn new() -> Self {
        Self {
            queue: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            version: AtomicU64::new(0),
        }
    }

    /// Wakes the owner; call with `queue` locked.
    fn notify(&self) {
        self.version.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }
}

/// How long a waiting rank spins before it sleeps, when every rank has a
/// core of its own: waking a thread from a condition variable takes tens
/// of microseconds on a loaded machine, as long as a 1 MiB reduction, and
/// a ring waits once per step. With more ranks than cores a spinning rank
/// would hold the core its peer needs, so it yields the core between
/// checks instead: the peer runs at once, without the sleep and wake-up
/// (4 thread ranks on 2 cores: a barrier 20-29 -> 6 µs, a 1 MiB
/// all-reduce 130 -> 95 µs).
const SPIN: Duration = Duration::from_micros(50);

/// Spins (up to `limit`, yielding the core between checks when
/// `yielding`) until `done()` holds; whether it did.
fn spin_until((limit, yielding): (Duration, bool), done: impl Fn() -> bool) -> bool {
    if limit.is_zero() {
        return false;
    }
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if yielding {
            std::thread::yield_now();
        } else {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
        if start.elapsed() >= limit {
            return done();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct Group {
    id: u64,
    /// World ranks of the members, by group rank.
    members: Vec<usize>,
    /// Highest sequence number each member has begun, plus one (0: none).
    arrived: Vec<AtomicU64>,
    name: String,
    /// Traffic through this group, by group rank.
    traffic: Vec<TrafficCounters>,
}

struct World {
    timeout: Duration,
    /// How long waits spin before they sleep ([`SPIN`]), and whether they
    /// yield the core while they do (more ranks than cores).
    spin: (Duration, bool),
    topology: Topology,
    boxes: Vec<Mailbox>,
    status: Vec<AtomicU8>,
    traffic: Vec<TrafficCounters>,
    /// Per world rank: the number of collective calls begun (for faults).
    begun: Vec<AtomicU64>,
    /// Per world rank: fail when beginning this call (0-based).
    fail_at: Vec<Option<u64>>,
    groups: Mutex<HashMap<(u64, u64, u32), Arc<Group>>>,
    next_group: AtomicU64,
    aborted: Mutex<HashMap<u64, String>>,
    any_aborted: AtomicBool,
}

impl World {
    fn wake_all(&self) {
        for b in &self.boxes {
            let _g = lock(&b.queue);
            b.notify();
        }
    }

    fn loss(&self, rank: usize) -> Option<LossCause> {
        match self.status[rank].load(Ordering::Acquire) {
            ALIVE => None,
            EXITED => Some(LossCause::Exited),
            PANICKED => Some(LossCause::Panicked),
            _ => Some(LossCause::Injected),
        }
    }

    fn abort_reason(&self, group: u64) -> Option<String> {
        if !self.any_aborted.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.aborted).get(&group).cloned()
    }

    fn abort(&self, group: u64, reason: String) {
        lock(&self.aborted).entry(group).or_insert(reason);
        self.any_aborted.store(true, Ordering::Release);
        self.wake_all();
    }

    /// Marks one borrowed message consumed and wakes its sender.
    fn complete(&self, src: usize, flags: &SendFlags, idx: usize) {
        let b = &self.boxes[src];
        let _g = lock(&b.queue);
        if !flags.done[idx].swap(true, Ordering::AcqRel) {
            flags.remaining.fetch_sub(1, Ordering::AcqRel);
        }
        b.notify();
    }
}

/// Builds and runs a group of thread ranks.
///
/// # Example
/// ```
/// use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, ReduceOp};
///
/// let sums = LocalCluster::run(4, |comm| {
///     let mut x = vec![comm.rank() as f32; 3];
///     comm.all_reduce(&mut x, ReduceOp::Sum)?;
///     Ok::<_, weft_collectives::Error>(x)
/// })?;
/// assert!(sums.iter().all(|r| r.as_ref().unwrap() == &vec![6.0; 3]));
/// # Ok::<(), weft_collectives::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LocalCluster {
    n: usize,
    timeout: Duration,
    topology: Topology,
    faults: Vec<(usize, u64)>,
}

impl LocalCluster {
    /// A cluster of `n` ranks (at least 1) with the default timeout and a flat topology.
    pub fn builder(n: usize) -> Self {
        Self {
            n: n.max(1),
            timeout: DEFAULT_TIMEOUT,
            topology: Topology::flat(),
            faults: Vec::new(),
        }
    }

    /// Runs `f` on `n` thread ranks with default settings; see [`run_each`](Self::run_each).
    ///
    /// # Errors
    /// [`Error::RankPanicked`] naming the first rank whose closure panicked.
    pub fn run<R, F>(n: usize, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(LocalComm) -> R + Sync,
    {
        Self::builder(n).run_each(f).into_iter().collect()
    }

    /// Sets the per-operation timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the topology (ranks per domain) used by hierarchical algorithms
    /// and traffic link classes.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// Fault injection: world rank `rank` fails when it begins its
    /// `call`-th collective call (0-based): that call returns
    /// [`Error::InjectedFault`] and its peers see [`Error::PeerLost`].
    pub fn fail_rank_at(mut self, rank: usize, call: u64) -> Self {
        self.faults.push((rank, call));
        self
    }

    /// A world of one rank on the calling thread, with the default
    /// settings: collectives over it return their input, so code written
    /// for many ranks runs unchanged on one, without a thread of its own.
    ///
    /// ```
    /// use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, ReduceOp};
    /// let comm = LocalCluster::single();
    /// let mut x = [1.0f32, 2.0];
    /// comm.all_reduce(&mut x, ReduceOp::Sum)?;
    /// assert_eq!((comm.rank(), comm.size(), x), (0, 1, [1.0, 2.0]));
    /// # Ok::<(), weft_collectives::Error>(())
    /// ```
    pub fn single() -> LocalComm {
        let (world, group) = Self::builder(1).world();
        LocalComm {
            world,
            group,
            rank: 0,
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The shared state of this cluster's ranks and their world group.
    fn world(&self) -> (Arc<World>, Arc<Group>) {
        let n = self.n;
        let mut fail_at = vec![None; n];
        for &(r, c) in &self.faults {
            if r < n {
                fail_at[r] = Some(c);
            }
        }
        let members: Vec<usize> = (0..n).collect();
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let world = Arc::new(World {
            timeout: self.timeout,
            spin: (SPIN, n > cores),
            topology: self.topology,
            boxes: (0..n).map(|_| Mailbox::new()).collect(),
            status: (0..n).map(|_| AtomicU8::new(ALIVE)).collect(),
            traffic: (0..n).map(|_| TrafficCounters::default()).collect(),
            begun: (0..n).map(|_| AtomicU64::new(0)).collect(),
            fail_at,
            groups: Mutex::new(HashMap::new()),
            next_group: AtomicU64::new(1),
            aborted: Mutex::new(HashMap::new()),
            any_aborted: AtomicBool::new(false),
        });
        let group = Arc::new(Group {
            id: 0,
            name: format!("world{members:?}"),
            arrived: (0..n).map(|_| AtomicU64::new(0)).collect(),
            traffic: (0..n).map(|_| TrafficCounters::default()).collect(),
            members,
        });
        (world, group)
    }

    /// Runs `f` once per rank, each on its own thread, and returns each
    /// rank's result, or [`Error::RankPanicked`] for a rank that panicked.
    /// A rank whose closure returns (or panics) is marked lost, so peers
    /// that still wait for it get [`Error::PeerLost`].
    pub fn run_each<R, F>(&self, f: F) -> Vec<Result<R>>
    where
        R: Send,
        F: Fn(LocalComm) -> R + Sync,
    {
        let n = self.n;
        let (world, group) = self.world();
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let comm = LocalComm {
                        world: world.clone(),
                        group: group.clone(),
                        rank: r,
                        seq: Arc::new(AtomicU64::new(0)),
                    };
                    let world = world.clone();
                    std::thread::Builder::new()
                        .name(format!("weft-rank-{r}"))
                        .spawn_scoped(s, move || {
                            let out =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                            let code = if out.is_ok() { EXITED } else { PANICKED };
                            let _ = world.status[r].compare_exchange(
                                ALIVE,
                                code,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            );
                            world.wake_all();
                            out.map_err(|p| Error::RankPanicked {
                                rank: r,
                                message: panic_message(&*p),
                            })
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        Err(Error::RankPanicked {
                            rank: r,
                            message: panic_message(&*p),
                        })
                    }),
                    Err(e) => Err(Error::Backend {
                        backend: "local",
                        op: OpKind::Barrier,
                        message: format!("cannot spawn rank {r}: {e}"),
                    }),
                })
                .collect()
        })
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// One rank's handle on a group of the local backend.
pub struct LocalComm {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    /// Next sequence number; shared with detached handles.
    seq: Arc<AtomicU64>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm")
            .field("group", &self.group.name)
            .field("rank", &self.rank)
            .finish()
    }
}

/// Retracts or awaits this rank's borrowed messages on every exit path
/// (success, error or panic), so no receiver ever reads a freed buffer.
struct SendGuard<'a> {
    world: &'a World,
    flags: Arc<SendFlags>,
    dests: Vec<usize>,
    me: usize,
}

impl SendGuard<'_> {
    fn settle(&mut self) {
        if self.flags.remaining.load(Ordering::Acquire) == 0 {
            return;
        }
        // Remove messages nobody has taken yet.
        for (i, &d) in self.dests.iter().enumerate() {
            if self.flags.done[i].load(Ordering::Acquire) {
                continue;
            }
            let mut q = lock(&self.world.boxes[d].queue);
            let before = q.len();
            q.retain(
                |p| !matches!(&p.done, Some((f, j)) if Arc::ptr_eq(f, &self.flags) && *j == i),
            );
            if q.len() != before && !self.flags.done[i].swap(true, Ordering::AcqRel) {
                self.flags.remaining.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // The rest are being read right now: wait (bounded: the reader is
        // copying or reducing, it never blocks).
        let b = &self.world.boxes[self.me];
        let mut q = lock(&b.queue);
        while self.flags.remaining.load(Ordering::Acquire) > 0 {
            q =
                b.cv.wait_timeout(q, Duration::from_millis(10))
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
        }
    }
}

impl Drop for SendGuard<'_> {
    fn drop(&mut self) {
        self.settle();
    }
}

/// Marks a taken message complete even if its sink panics.
struct CompleteOnDrop<'a> {
    world: &'a World,
    src: usize,
    done: Option<(Arc<SendFlags>, usize)>,
}

impl Drop for CompleteOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((f, i)) = self.done.take() {
            self.world.complete(self.src, &f, i);
        }
    }
}

impl LocalComm {
    fn me(&self) -> usize {
        self.group.members[self.rank]
    }

    fn check_peer(&self, op: OpKind, peer: usize) -> Result<()> {
        if peer >= self.group.members.len() {
            return Err(Error::InvalidArgument {
                op,
                arg: "peer",
                reason: format!(
                    "rank {peer} is outside the group of {}",
                    self.group.members.len()
                ),
            });
        }
        Ok(())
    }

    fn lost(&self, op: OpKind, world_rank: usize, cause: LossCause) -> Error {
        Error::PeerLost {
            op,
            rank: world_rank,
            cause,
            noticed_by: self.me(),
            group: self.group.name.clone(),
        }
    }

    fn timeout_error(&self, op: OpKind, seq: u64, waiting_for: Vec<usize>) -> Error {
        let missing = if seq == P2P {
            Vec::new()
        } else {
            self.group
                .members
                .iter()
                .zip(&self.group.arrived)
                .filter(|(_, a)| a.load(Ordering::Acquire) <= seq)
                .map(|(&m, _)| m)
                .collect()
        };
        Error::Timeout {
            op,
            group: self.group.name.clone(),
            rank: self.me(),
            missing,
            waiting_for,
            after: self.world.timeout,
        }
    }

    fn check_abort(&self, op: OpKind) -> Result<()> {
        match self.world.abort_reason(self.group.id) {
            Some(reason) => Err(Error::Aborted {
                op,
                group: self.group.name.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    fn check_self(&self, op: OpKind) -> Result<()> {
        if self.world.status[self.me()].load(Ordering::Acquire) == INJECTED {
            return Err(Error::InjectedFault {
                rank: self.me(),
                op,
            });
        }
        Ok(())
    }

    fn post(&self, dst: usize, post: Post) {
        let b = &self.world.boxes[dst];
        let mut q = lock(&b.queue);
        q.push(post);
        b.notify();
    }

    /// Core of `exchange` and `recv_bytes`: waits for and consumes the
    /// matching messages of `recvs`.
    fn receive(
        &self,
        seq: u64,
        tag: u64,
        sig: &Signature,
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        let op = sig.op;
        let me = self.me();
        let world = &*self.world;
        let deadline = Instant::now() + world.timeout;
        let mut pending: Vec<usize> = (0..recvs.len()).collect();
        let b = &world.boxes[me];
        while !pending.is_empty() {
            let mut spun = false;
            let mut q = lock(&b.queue);
            let (pi, post) = loop {
                // A message of the same call with another signature is a
                // mismatch whatever its tag.
                let found = q.iter().position(|p| {
                    p.group == self.group.id
                        && p.seq == seq
                        && (p.tag == tag || (seq != P2P && p.sig != *sig))
                        && pending
                            .iter()
                            .any(|&i| self.group.members[recvs[i].from] == p.src)
                });
                if let Some(pos) = found {
                    let post = q.remove(pos);
                    let pi = pending
                        .iter()
                        .position(|&i| self.group.members[recvs[i].from] == post.src)
                        .expect("matched above");
                    break (pi, post);
                }
                self.check_abort(op)?;
                for &i in &pending {
                    let src = self.group.members[recvs[i].from];
                    if let Some(cause) = world.loss(src) {
                        return Err(self.lost(op, src, cause));
                    }
                }
                let now = Instant::now();
                if now >= deadline {
                    let waiting = pending
                        .iter()
                        .map(|&i| self.group.members[recvs[i].from])
                        .collect();
                    return Err(self.timeout_error(op, seq, waiting));
                }
                if !spun {
                    // spin (unlocked) until something is posted, then look again
                    spun = true;
                    let v = b.version.load(Ordering::Acquire);
                    drop(q);
                    spin_until(world.spin, || b.version.load(Ordering::Acquire) != v);
                    q = lock(&b.queue);
                    continue;
                }
                q =
                    b.cv.wait_timeout(q, deadline - now)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
            };
            drop(q);
            let idx = pending.swap_remove(pi);
            let _complete = CompleteOnDrop {
                world,
                src: post.src,
                done: post.done.clone(),
            };
            let bytes: &[u8] = match &post.data {
                // SAFETY: the sender keeps this buffer alive and unmodified
                // until `_complete` marks the message done (see `SendGuard`).
                Payload::Borrowed(p, l) => unsafe { std::slice::from_raw_parts(*p, *l) },
                Payload::Owned(v) => v,
            };
            let rin = &mut recvs[idx];
            if post.sig != *sig || rin.len.is_some_and(|l| l != bytes.len()) {
                let theirs = if post.sig == *sig {
                    format!("{} sending {} bytes", post.sig, bytes.len())
                } else {
                    post.sig.to_string()
                };
                let ours = if post.sig == *sig {
                    format!("{} expecting {} bytes", sig, rin.len.unwrap_or(0))
                } else {
                    sig.to_string()
                };
                let err = Error::Mismatch {
                    group: self.group.name.clone(),
                    rank: me,
                    ours: ours.clone(),
                    peer: post.src,
                    theirs: theirs.clone(),
                };
                if seq != P2P {
                    world.abort(
                        self.group.id,
                        format!(
                            "rank {me} called {ours} but rank {} called {theirs}",
                            post.src
                        ),
                    );
                }
                return Err(err);
            }
            let class = world.topology.link(post.src, me);
            world.traffic[me].add_received(op, class, bytes.len());
            self.group.traffic[self.rank].add_received(op, class, bytes.len());
            (rin.sink)(bytes)?;
        }
        Ok(())
    }

    fn new_group(&self, key: (u64, u64, u32), members: Vec<usize>) -> Arc<Group> {
        let mut groups = lock(&self.world.groups);
        groups
            .entry(key)
            .or_insert_with(|| {
                let id = self.world.next_group.fetch_add(1, Ordering::Relaxed);
                Arc::new(Group {
                    id,
                    name: format!("g{id}{members:?}"),
                    arrived: members.iter().map(|_| AtomicU64::new(0)).collect(),
                    traffic: members.iter().map(|_| TrafficCounters::default()).collect(),
                    members,
                })
            })
            .clone()
    }

    /// Splits like [`Communicator::split`] but returns the concrete type.
    ///
    /// # Errors
    /// As any collective.
    pub fn split_local(&self, color: u32, key: u32) -> Result<LocalComm> {
        let ctx = self.begin(Signature::new(OpKind::Split))?;
        let all = crate::algo::gather_u64_pairs(self, &ctx, [u64::from(color), u64::from(key)])?;
        let mut mine: Vec<(u64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, ck)| ck[0] == u64::from(color))
            .map(|(r, ck)| (ck[1], r))
            .collect();
        mine.sort_unstable();
        let new_rank = mine
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| Error::Backend {
                backend: "local",
                op: OpKind::Split,
                message: "this rank is missing from its own color".into(),
            })?;
        let members: Vec<usize> = mine.iter().map(|&(_, r)| self.group.members[r]).collect();
        let group = self.new_group((self.group.id, ctx.seq, color), members);
        // Drop the registry entry once every member has its handle? Groups
        // are small; they live as long as the world.
        Ok(LocalComm {
            world: self.world.clone(),
            group,
            rank: new_rank,
            seq: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Makes this rank fail now, as if it crashed: later calls on it return
    /// [`Error::InjectedFault`], its peers get [`Error::PeerLost`].
    pub fn inject_failure(&self) {
        self.world.status[self.me()].store(INJECTED, Ordering::Release);
        self.world.wake_all();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.members.len()
    }

    fn world_rank_of(&self, rank: usize) -> usize {
        self.group.members[rank]
    }

    fn topology(&self) -> Topology {
        self.world.topology
    }

    fn group_name(&self) -> String {
        self.group.name.clone()
    }

    fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn all_gather_in_place_buf(
        &self,
        buf: crate::BufMut<'_>,
        algorithm: crate::Algorithm,
    ) -> Result<()> {
        let ctx = self.begin(crate::algo::all_gather_in_place_signature(
            self, &buf, algorithm,
        ))?;
        crate::algo::all_gather_in_place(self, &ctx, buf)
    }

    fn begin(&self, sig: Signature) -> Result<OpCtx> {
        let me = self.me();
        self.check_self(sig.op)?;
        let count = self.world.begun[me].fetch_add(1, Ordering::AcqRel);
        if self.world.fail_at[me] == Some(count) {
            self.inject_failure();
            return Err(Error::InjectedFault {
                rank: me,
                op: sig.op,
            });
        }
        self.check_abort(sig.op)?;
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        self.group.arrived[self.rank].fetch_max(seq + 1, Ordering::AcqRel);
        Ok(OpCtx { seq, sig })
    }

    fn exchange(
        &self,
        ctx: &OpCtx,
        tag: u32,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        let op = ctx.sig.op;
        self.check_self(op)?;
        let me = self.me();
        let world = &*self.world;
        let flags = Arc::new(SendFlags {
            done: sends.iter().map(|_| AtomicBool::new(false)).collect(),
            remaining: AtomicUsize::new(sends.len()),
        });
        let mut guard = SendGuard {
            world,
            flags: flags.clone(),
            dests: sends.iter().map(|s| self.group.members[s.to]).collect(),
            me,
        };
        for (i, s) in sends.iter().enumerate() {
            let dst = self.group.members[s.to];
            let class = world.topology.link(me, dst);
            world.traffic[me].add_sent(op, class, s.data.len());
            self.group.traffic[self.rank].add_sent(op, class, s.data.len());
            self.post(
                dst,
                Post {
                    src: me,
                    group: self.group.id,
                    seq: ctx.seq,
                    tag: u64::from(tag),
                    sig: ctx.sig,
                    data: Payload::Borrowed(s.data.as_ptr(), s.data.len()),
                    done: Some((flags.clone(), i)),
                },
            );
        }
        self.receive(ctx.seq, u64::from(tag), &ctx.sig, recvs)?;
        // Wait until every receiver has consumed our messages.
        spin_until(world.spin, || flags.remaining.load(Ordering::Acquire) == 0);
        let deadline = Instant::now() + world.timeout;
        let b = &world.boxes[me];
        let mut q = lock(&b.queue);
        while flags.remaining.load(Ordering::Acquire) > 0 {
            self.check_abort(op)?;
            for (i, &d) in guard.dests.iter().enumerate() {
                if !flags.done[i].load(Ordering::Acquire)
                    && let Some(cause) = world.loss(d)
                {
                    drop(q);
                    guard.settle();
                    return Err(self.lost(op, d, cause));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                let waiting = guard
                    .dests
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !flags.done[*i].load(Ordering::Acquire))
                    .map(|(_, &d)| d)
                    .collect();
                drop(q);
                guard.settle();
                return Err(self.timeout_error(op, ctx.seq, waiting));
            }
            q =
                b.cv.wait_timeout(q, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
        }
        Ok(())
    }

    fn send_bytes(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_self(op)?;
        self.check_peer(op, peer)?;
        let me = self.me();
        let dst = self.group.members[peer];
        if let Some(cause) = self.world.loss(dst) {
            return Err(self.lost(op, dst, cause));
        }
        let mut sig = Signature::new(op);
        sig.len = data.len() as u64;
        let class = self.world.topology.link(me, dst);
        self.world.traffic[me].add_sent(op, class, data.len());
        self.group.traffic[self.rank].add_sent(op, class, data.len());
        self.post(
            dst,
            Post {
                src: me,
                group: self.group.id,
                seq: P2P,
                tag,
                sig,
                data: Payload::Owned(data.to_vec()),
                done: None,
            },
        );
        Ok(())
    }

    fn recv_bytes(&self, peer: usize, tag: u64, out: &mut [u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_self(op)?;
        self.check_peer(op, peer)?;
        let mut sig = Signature::new(op);
        sig.len = out.len() as u64;
        let len = out.len();
        let mut sink = |src: &[u8]| {
            out.copy_from_slice(src);
            Ok(())
        };
        self.receive(
            P2P,
            tag,
            &sig,
            &mut [Incoming {
                from: peer,
                len: Some(len),
                sink: &mut sink,
            }],
        )
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_local(color, key)?))
    }

    fn traffic(&self) -> Traffic {
        self.world.traffic[self.me()].snapshot()
    }

    fn group_traffic(&self) -> Traffic {
        self.group.traffic[self.rank].snapshot()
    }

    fn abort_group(&self, reason: &str) {
        self.world.abort(self.group.id, reason.to_string());
    }

    fn detach(&self) -> Option<Box<dyn Communicator>> {
        Some(Box::new(LocalComm {
            world: self.world.clone(),
            group: self.group.clone(),
            rank: self.rank,
            seq: self.seq.clone(),
        }))
    }
}
