//! The `mpi` backend: ranks are MPI processes (feature `mpi`).
//!
//! [`MpiComm`] implements the transport primitive
//! [`exchange`](Communicator::exchange) with non-blocking MPI point-to-point
//! messages, so every algorithm of this crate (ring, recursive doubling,
//! hierarchical, reproducible) runs unchanged over MPI. Each message carries
//! a 64-byte header (sequence number, tag, the caller's [`Signature`],
//! payload length) in front of the payload, so mismatched calls are
//! reported as [`Error::Mismatch`] as on the local backend.
//!
//! Under [`Algorithm::Auto`], an `f32`/`f64` sum or average all-reduce of
//! less than [`NATIVE_ALL_REDUCE_BELOW`] bytes
//! ([`NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES`] when the group spans nodes) is handed to the MPI
//! library's own `MPI_Iallreduce` (every size to the blocking
//! `MPI_Allreduce` with [`MpiCommBuilder::blocking_native`]), after an
//! exchange of signatures that catches mismatched calls; larger ones run
//! this crate's algorithms over point-to-point messages, which measured
//! faster (see the constant), as its reduce-scatter does.
//!
//! # Threads and progress
//! MPI is initialised with `MPI_THREAD_MULTIPLE` requested; every MPI call
//! of this backend is made under one process-wide lock, so
//! `MPI_THREAD_SERIALIZED` suffices. Waits never block inside MPI: they poll
//! (`MPI_Test`, `MPI_Improbe`) until done or until the watchdog's timeout,
//! so non-blocking operations ([`CommunicatorExt::all_reduce_async`](crate::CommunicatorExt::all_reduce_async))
//! progress on their own threads.
//!
//! # Failures
//! A timed-out wait returns [`Error::Timeout`] naming the ranks whose
//! messages did not arrive (`missing` lists the same ranks: MPI cannot tell
//! which peers entered the operation). A process that dies normally makes
//! `mpirun` end the job; MPI has no portable way to report a lost peer.
//!
//! # Traffic
//! Messages of `exchange` and point-to-point are counted exactly (payload
//! bytes, not headers). A native all-reduce is counted at the
//! bandwidth-optimal volume 2(n−1)/n·S per rank over the link to the next
//! rank: what the MPI library moves at best, not a measurement.

use std::ffi::{c_int, c_void};

/// Bytes from which an [`Algorithm::Auto`] all-reduce runs this crate's
/// algorithm (the ring on one node) over point-to-point messages instead
/// of polling the library's `MPI_Iallreduce`: 2 MiB. Measured with
/// `benches/mpi_vs_local.rs` (Open MPI 4.1.4, one node, AMD EPYC with 2
/// cores): under `mpirun -np 2` the ring took 0.30–0.94× the library's
/// non-blocking time from 1 to 64 MiB (0.59–0.72× at 1 MiB, 0.30–0.34× at 64 MiB, two runs),
/// under `-np 4` 1.06× at 1 MiB and 0.73–0.81× from 4 to 64 MiB, while
/// below 1 MiB on 4 ranks the library's call was faster (0.3–0.7× the
/// ring's time: fewer steps). [`MpiComm::library_all_reduce`] calls the
/// library at any size.
pub const NATIVE_ALL_REDUCE_BELOW: usize = 2 << 20;

/// [`NATIVE_ALL_REDUCE_BELOW`] for a group whose ranks span more than one
/// node (topology domain): 64 KiB. Measured with `benches/across_nodes.rs`
/// on a namespace cluster (1 Gbit/s links, messages up to 1 MiB sent
/// eagerly, AMD EPYC with 2 cores): one rank a node, the ring took
/// 0.33-0.56x the library's non-blocking time at 256 KiB-1 MiB on 2 and 4
/// nodes and 0.47-1.0x at 64 KiB; the library's algorithms pay the link's
/// latency more times than the ring's 2(n-1) steps of S/n.
pub const NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES: usize = 64 << 10;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::AsRaw;
use weft_numerics::{Dtype, Element};

use crate::algo;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::Scratch;
use crate::reduce::finish_avg;
use crate::types::{
    Algorithm, Buf, BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions, Signature,
    Topology, Traffic, TrafficCounters, shard_range,
};

/// Default per-operation timeout of [`MpiComm`].
pub const MPI_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const BACKEND: &str = "mpi";
const HEADER: usize = 64;
/// Algorithm tags are below 2^22; the low 8 bits of the sequence number go
/// above them so concurrent non-blocking operations never match each
/// other's messages (MPI tags are at least 2^31 − 1 on OpenMPI).
const TAG_BITS: u32 = 22;
const SEQ_TAG_BITS: u32 = 8;
/// Largest point-to-point tag (OpenMPI's `MPI_TAG_UB`).
pub const MPI_MAX_TAG: u64 = i32::MAX as u64;

/// The MPI library's state: the `Universe` (finalises MPI when dropped),
/// the lock that serialises MPI calls, and per-process settings.
struct Env {
    lock: Mutex<()>,
    universe: Mutex<Option<mpi::environment::Universe>>,
    world_rank: usize,
    topology: Topology,
    timeout: Duration,
    blocking_native: bool,
    traffic: TrafficCounters,
    /// `MPI_Get_library_version`.
    library: String,
    /// The value of the C macro `MPI_IN_PLACE` of the running library, which
    /// the bindings do not export: `(void*)1` in Open MPI, `(void*)-1` in
    /// MPICH and its derivatives (both ABI-stable); `None` for others.
    in_place: Option<usize>,
}

impl Env {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _g = self.lock();
        // Dropping the universe calls MPI_Finalize; every group's
        // communicators were freed before (groups hold an `Arc<Env>`).
        drop(
            self.universe
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
    }
}

/// An owned MPI communicator handle.
struct RawComm(ffi::MPI_Comm);

// SAFETY: an MPI communicator handle may be used from any thread once MPI
// runs at `MPI_THREAD_SERIALIZED` or above (checked at initialisation); this
// backend makes every MPI call under `Env::lock`, which serialises them.
unsafe impl Send for RawComm {}
// SAFETY: as for `Send`: all uses go through `Env::lock`.
unsafe impl Sync for RawComm {}

/// Where `receive` looks for messages and what their headers must say.
#[derive(Clone, Copy)]
struct Route {
    comm: ffi::MPI_Comm,
    mpi_tag: c_int,
    seq: u64,
    tag: u64,
}

/// A point-to-point send still in flight, with the buffer it reads (from
/// the thread's scratch pool, so that repeated collectives of one size
/// allocate and page-fault nothing).
struct InFlight {
    req: ffi::MPI_Request,
    _data: Scratch,
}

// SAFETY: the request handle is only touched under `Env::lock`; the buffer
// is owned and never moved (its heap allocation stays put).
unsafe impl Send for InFlight {}

struct Group {
    env: Arc<Env>,
    /// Collective traffic (exchange, native collectives).
    coll: RawComm,
    /// Point-to-point traffic (`send_bytes` / `recv_bytes`).
    p2p: RawComm,
    /// World rank of each group rank.
    members: Vec<usize>,
    name: String,
    /// Buffered point-to-point sends not yet known to be complete.
    sends: Mutex<Vec<InFlight>>,
    /// Traffic through this group.
    traffic: TrafficCounters,
}

impl Drop for Group {
    fn drop(&mut self) {
        let deadline = Instant::now() + self.env.timeout;
        let mut sends = std::mem::take(
            &mut *self
                .sends
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let _g = self.env.lock();
        // Buffered sends must complete before their buffers go; give them the
        // watchdog's time, then leak what is left rather than free memory MPI
        // may still read.
        while !sends.is_empty() && Instant::now() < deadline {
            sends.retain_mut(|s| !test(&mut s.req));
        }
        for s in sends {
            std::mem::forget(s);
        }
        for c in [&mut self.coll, &mut self.p2p] {
            // SAFETY: the handle is a communicator this group created and
            // nothing else uses it after the group is dropped.
            unsafe {
                ffi::MPI_Comm_free(&mut c.0);
            }
        }
    }
}

/// Settings for [`MpiComm::init`]-style construction.
#[derive(Clone, Debug)]
pub struct MpiCommBuilder {
    timeout: Duration,
    topology: Option<Topology>,
    blocking_native: bool,
}

impl MpiCommBuilder {
    /// Sets the per-operation timeout of the watchdog.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the topology (ranks per domain). Default: the ranks of one host
    /// form a domain when every host runs the same number of ranks
    /// (detected with `MPI_Comm_split_type`), else one flat domain.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    /// Native all-reduces call the blocking `MPI_Allreduce` (the MPI
    /// library's tuned algorithms) instead of polling `MPI_Iallreduce`:
    /// faster on some libraries, but the watchdog cannot interrupt them.
    pub fn blocking_native(mut self, on: bool) -> Self {
        self.blocking_native = on;
        self
    }

    /// Initialises MPI and returns the world communicator.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if MPI was already initialised in this
    /// process or offers less than `MPI_THREAD_SERIALIZED`.
    pub fn init(self) -> Result<MpiComm> {
        use mpi::environment::Threading;
        let (universe, provided) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
                Error::BackendUnavailable {
                backend: BACKEND,
                reason:
                    "MPI is already initialised in this process (create one MpiComm and split it)"
                        .into(),
            }
            })?;
        if provided < Threading::Serialized {
            return Err(Error::BackendUnavailable {
                backend: BACKEND,
                reason: format!(
                    "the MPI library offers only {provided:?} threading; MPI_THREAD_SERIALIZED is needed"
                ),
            });
        }
        let world = universe.world();
        let raw_world = world.as_raw();
        let (world_rank, size) = (rank_of(raw_world), size_of(raw_world));
        let topology = match self.topology {
            Some(t) => t,
            None => detect_topology(raw_world, world_rank, size),
        };
        let library = library_version();
        let in_place = if library.contains("Open MPI") {
            Some(1)
        } else if library.contains("MPICH") {
            Some(usize::MAX)
        } else {
            None
        };
        let env = Arc::new(Env {
            lock: Mutex::new(()),
            universe: Mutex::new(Some(universe)),
            world_rank,
            topology,
            timeout: self.timeout,
            blocking_native: self.blocking_native,
            traffic: TrafficCounters::default(),
            library,
            in_place,
        });
        let members: Vec<usize> = (0..size).collect();
        Ok(MpiComm::from_parent(&env, raw_world, members, world_rank))
    }
}

/// A group of MPI processes: the `mpi` backend (feature `mpi`).
///
/// # Example
/// ```no_run
/// use weft_collectives::{Communicator, CommunicatorExt, MpiComm, ReduceOp};
///
/// // run with `mpirun -np 4 ./prog`
/// let comm = MpiComm::init()?;
/// let mut x = vec![comm.rank() as f32; 1000];
/// comm.all_reduce(&mut x, ReduceOp::Sum)?;
/// # Ok::<(), weft_collectives::Error>(())
/// ```
pub struct MpiComm {
    group: Arc<Group>,
    rank: usize,
    seq: Arc<AtomicU64>,
    timeout: Duration,
    blocking_native: bool,
}

impl Clone for MpiComm {
    /// Another handle to the same group (same call sequence), with the same
    /// settings.
    fn clone(&self) -> Self {
        MpiComm {
            group: self.group.clone(),
            rank: self.rank,
            seq: self.seq.clone(),
            timeout: self.timeout,
            blocking_native: self.blocking_native,
        }
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("group", &self.group.name)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

fn check(op: OpKind, what: &str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Backend {
            backend: BACKEND,
            op,
            message: format!("{what} returned MPI error code {code}"),
        })
    }
}

fn library_version() -> String {
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING;
    // MPI writes at most that many bytes and their length.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate((len.max(0) as usize).min(buf.len()));
    String::from_utf8_lossy(&buf)
        .trim_end_matches(['\0', '\n'])
        .to_string()
}

fn rank_of(c: ffi::MPI_Comm) -> usize {
    let mut r: c_int = 0;
    // SAFETY: `c` is a valid communicator; `r` is a valid out pointer.
    unsafe { ffi::MPI_Comm_rank(c, &mut r) };
    r as usize
}

fn size_of(c: ffi::MPI_Comm) -> usize {
    let mut r: c_int = 0;
    // SAFETY: `c` is a valid communicator; `r` is a valid out pointer.
    unsafe { ffi::MPI_Comm_size(c, &mut r) };
    r as usize
}

/// `MPI_Test` on `req`; `true` once complete (the request is then freed).
fn test(req: &mut ffi::MPI_Request) -> bool {
    let mut flag: c_int = 0;
    // SAFETY: `req` is an active or null request owned by the caller; the
    // status is ignored. Called under `Env::lock`.
    unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    flag != 0
}

/// Ranks per host when every host runs the same number of ranks in
/// consecutive world ranks, else flat.
fn detect_topology(world: ffi::MPI_Comm, world_rank: usize, size: usize) -> Topology {
    let mut node = MaybeUninit::<ffi::MPI_Comm>::uninit();
    // SAFETY: collective over the world communicator, called by every rank
    // during initialisation; `node` receives a new communicator.
    let node = unsafe {
        ffi::MPI_Comm_split_type(
            world,
            ffi::RSMPI_COMM_TYPE_SHARED,
            world_rank as c_int,
            ffi::RSMPI_INFO_NULL,
            node.as_mut_ptr(),
        );
        node.assume_init()
    };
    let (local_rank, local_size) = (rank_of(node), size_of(node));
    let mut node = node;
    // SAFETY: `node` was created above and is not used afterwards.
    unsafe { ffi::MPI_Comm_free(&mut node) };
    // Hosts hold aligned blocks of consecutive world ranks, all of one size?
    let aligned = local_rank <= world_rank
        && (world_rank - local_rank).is_multiple_of(local_size.max(1))
        && size.is_multiple_of(local_size.max(1));
    let mine = [local_size as i64, -(local_size as i64), i64::from(aligned)];
    let mut min = [0i64; 3];
    // SAFETY: collective over the world, called by every rank during
    // initialisation; both buffers hold 3 i64.
    unsafe {
        ffi::MPI_Allreduce(
            mine.as_ptr().cast(),
            min.as_mut_ptr().cast(),
            3,
            ffi::RSMPI_INT64_T,
            ffi::RSMPI_MIN,
            world,
        );
    }
    let uniform = min[0] == -min[1] && min[2] == 1;
    if uniform && local_size < size {
        Topology::new(local_size)
    } else {
        Topology::flat()
    }
}

// ---- signatures on the wire ------------------------------------------------

fn dtype_code(d: Option<Dtype>) -> u8 {
    d.map_or(0, |d| {
        1 + Dtype::ALL.iter().position(|x| *x == d).unwrap_or(0) as u8
    })
}

fn dtype_of(c: u8) -> Option<Dtype> {
    (c as usize)
        .checked_sub(1)
        .and_then(|i| Dtype::ALL.get(i).copied())
}

const REDUCE_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::Auto,
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Hierarchical,
];

fn encode_sig(s: &Signature) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0] = s.op.index() as u8;
    b[1] = dtype_code(s.dtype);
    b[2] = u8::from(s.root.is_some());
    b[3] = s.reduce.map_or(0, |r| {
        1 + REDUCE_OPS.iter().position(|x| *x == r).unwrap_or(0) as u8
    });
    b[4] = s.algorithm.map_or(0, |a| {
        1 + ALGORITHMS.iter().position(|x| *x == a).unwrap_or(0) as u8
    });
    b[5] = dtype_code(s.wire);
    b[6] = u8::from(s.reproducible);
    b[8..16].copy_from_slice(&s.len.to_le_bytes());
    b[16..24].copy_from_slice(&(s.root.unwrap_or(0) as u64).to_le_bytes());
    b
}

fn decode_sig(b: &[u8]) -> Option<Signature> {
    let op = *OpKind::ALL.get(b[0] as usize)?;
    let mut s = Signature::new(op);
    s.dtype = dtype_of(b[1]);
    s.len = u64::from_le_bytes(b[8..16].try_into().ok()?);
    s.root = (b[2] != 0).then(|| u64::from_le_bytes(b[16..24].try_into().expect("8")) as usize);
    s.reduce = (b[3] as usize)
        .checked_sub(1)
        .and_then(|i| REDUCE_OPS.get(i).copied());
    s.algorithm = (b[4] as usize)
        .checked_sub(1)
        .and_then(|i| ALGORITHMS.get(i).copied());
    s.wire = dtype_of(b[5]);
    s.reproducible = b[6] != 0;
    Some(s)
}

/// A message: `header` then `data`, in a pooled buffer.
fn packed(header: &[u8; HEADER], data: &[u8]) -> Scratch {
    let mut msg = Scratch::take(HEADER + data.len());
    let (h, d) = msg.bytes_mut().split_at_mut(HEADER);
    h.copy_from_slice(header);
    d.copy_from_slice(data);
    msg
}

fn header(seq: u64, tag: u64, sig: &Signature, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..8].copy_from_slice(&seq.to_le_bytes());
    h[8..16].copy_from_slice(&tag.to_le_bytes());
    h[16..24].copy_from_slice(&(len as u64).to_le_bytes());
    h[24..56].copy_from_slice(&encode_sig(sig));
    h
}

/// `elems` as an MPI count, or an error naming the limit.
fn mpi_count(op: OpKind, elems: usize) -> Result<c_int> {
    c_int::try_from(elems).map_err(|_| Error::InvalidArgument {
        op,
        arg: "buffer",
        reason: format!("{elems} elements exceed MPI's int count"),
    })
}

/// What the library's own reductions take: f32 or f64 sums (or averages);
/// else an error naming `op`'s argument `arg`.
fn library_sum(op: OpKind, arg: &'static str, dtype: Dtype, reduce: ReduceOp) -> Result<()> {
    if matches!(dtype, Dtype::F32 | Dtype::F64) && matches!(reduce, ReduceOp::Sum | ReduceOp::Avg) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        arg,
        reason: format!(
            "the library's {} takes f32 or f64 sums, not {dtype} {}",
            op.name(),
            reduce.name()
        ),
    })
}

/// MPI's datatype for f32 or f64.
fn float_type(dtype: Dtype) -> ffi::MPI_Datatype {
    // SAFETY: reading the extern statics of the MPI library's predefined
    // handles, valid after initialisation.
    unsafe {
        if dtype == Dtype::F64 {
            ffi::RSMPI_DOUBLE
        } else {
            ffi::RSMPI_FLOAT
        }
    }
}

/// How long [`poll_until`] yields between polls before it sleeps.
const SPIN: Duration = Duration::from_micros(500);
/// How long it sleeps between polls after [`SPIN`].
const NAP: Duration = Duration::from_micros(50);

/// Polls `f` (under the MPI lock) until it returns `true` or `deadline`;
/// yields between polls for the first [`SPIN`] (what a message between
/// ranks of one node takes), then sleeps [`NAP`] between polls: a wait on
/// a slow link must not spin on cores that ranks share with their
/// compute (on nodes that share one machine's cores, a spinning wait
/// took a rank's core from the others' products).
fn poll_until(env: &Env, deadline: Instant, mut f: impl FnMut() -> Result<bool>) -> Result<bool> {
    let start = Instant::now();
    loop {
        let done = {
            let _g = env.lock();
            f()?
        };
        if done {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        if now - start > SPIN {
            std::thread::sleep(NAP);
        } else {
            std::thread::yield_now();
        }
    }
}

impl MpiComm {
    /// Initialises MPI with the default settings and returns the world
    /// communicator; see [`MpiComm::builder`].
    ///
    /// # Errors
    /// As [`MpiCommBuilder::init`].
    pub fn init() -> Result<Self> {
        Self::builder().init()
    }

    /// Settings for initialisation: timeout, topology, blocking native collectives.
    pub fn builder() -> MpiCommBuilder {
        MpiCommBuilder {
            timeout: MPI_DEFAULT_TIMEOUT,
            topology: None,
            blocking_native: false,
        }
    }

    /// Creates a group over a duplicate of `parent` (two duplicates: one
    /// for collectives, one for point-to-point).
    fn from_parent(
        env: &Arc<Env>,
        parent: ffi::MPI_Comm,
        members: Vec<usize>,
        rank: usize,
    ) -> Self {
        let dup = |c: ffi::MPI_Comm| {
            let mut out = MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY: collective over `c`, called by every member in the same
            // order; `out` receives a new communicator.
            unsafe {
                ffi::MPI_Comm_dup(c, out.as_mut_ptr());
                out.assume_init()
            }
        };
        let (coll, p2p) = {
            let _g = env.lock();
            (dup(parent), dup(parent))
        };
        let name = format!("mpi{members:?}");
        MpiComm {
            group: Arc::new(Group {
                env: env.clone(),
                coll: RawComm(coll),
                p2p: RawComm(p2p),
                members,
                name,
                sends: Mutex::new(Vec::new()),
                traffic: TrafficCounters::default(),
            }),
            rank,
            seq: Arc::new(AtomicU64::new(0)),
            timeout: env.timeout,
            blocking_native: env.blocking_native,
        }
    }

    /// The same group with another per-operation timeout (the watchdog of
    /// this handle and of groups split from it).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same group, with native all-reduces blocking or not (see
    /// [`MpiCommBuilder::blocking_native`]).
    pub fn with_blocking_native(mut self, on: bool) -> Self {
        self.blocking_native = on;
        self
    }

    /// The MPI library's version string (`MPI_Get_library_version`).
    pub fn library_version(&self) -> String {
        self.group.env.library.clone()
    }

    /// This process's world rank.
    pub fn world_rank(&self) -> usize {
        self.group.env.world_rank
    }

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

    fn timeout_error(&self, op: OpKind, waiting_for: Vec<usize>) -> Error {
        Error::Timeout {
            op,
            group: self.group.name.clone(),
            rank: self.me(),
            missing: waiting_for.clone(),
            waiting_for,
            after: self.timeout,
        }
    }

    fn mismatch(&self, peer: usize, ours: String, theirs: String) -> Error {
        Error::Mismatch {
            group: self.group.name.clone(),
            rank: self.me(),
            ours,
            peer,
            theirs,
        }
    }

    /// Reaps completed buffered point-to-point sends.
    fn reap_sends(&self) {
        let mut sends = self
            .group
            .sends
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if sends.is_empty() {
            return;
        }
        let _g = self.group.env.lock();
        sends.retain_mut(|s| !test(&mut s.req));
    }

    /// Receives the messages of `recvs` (matching source and MPI tag) on
    /// `comm`, checking each header against (`seq`, `tag`, `sig`).
    fn receive(
        &self,
        route: Route,
        sig: &Signature,
        recvs: &mut [Incoming<'_>],
        deadline: Instant,
    ) -> Result<()> {
        let Route {
            comm,
            mpi_tag,
            seq,
            tag,
        } = route;
        let op = sig.op;
        let env = &*self.group.env;
        let mut pending: Vec<usize> = (0..recvs.len()).collect();
        while !pending.is_empty() {
            let mut scratch = Scratch::take(0);
            let mut got: Option<usize> = None;
            let found = poll_until(env, deadline, || {
                for (pi, &i) in pending.iter().enumerate() {
                    let mut flag: c_int = 0;
                    let mut msg = MaybeUninit::<ffi::MPI_Message>::uninit();
                    let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
                    // SAFETY: valid communicator; out pointers are valid for
                    // writes. Called under `Env::lock`.
                    let rc = unsafe {
                        ffi::MPI_Improbe(
                            recvs[i].from as c_int,
                            mpi_tag,
                            comm,
                            &mut flag,
                            msg.as_mut_ptr(),
                            status.as_mut_ptr(),
                        )
                    };
                    check(op, "MPI_Improbe", rc)?;
                    if flag == 0 {
                        continue;
                    }
                    let mut count: c_int = 0;
                    // SAFETY: `flag != 0`, so `status` and `msg` were written.
                    let (mut msg, status) = unsafe { (msg.assume_init(), status.assume_init()) };
                    // SAFETY: `status` describes the matched message.
                    unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
                    // a pooled buffer: no allocation (nor its page faults)
                    // when the sizes repeat
                    scratch = Scratch::take(count.max(0) as usize);
                    // SAFETY: `scratch` holds `count` bytes; `msg` is the
                    // matched message, received exactly once here.
                    let rc = unsafe {
                        ffi::MPI_Mrecv(
                            scratch.bytes_mut().as_mut_ptr().cast::<c_void>(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            &mut msg,
                            ffi::RSMPI_STATUS_IGNORE,
                        )
                    };
                    check(op, "MPI_Mrecv", rc)?;
                    got = Some(pi);
                    return Ok(true);
                }
                Ok(false)
            })?;
            if !found {
                let waiting = pending
                    .iter()
                    .map(|&i| self.group.members[recvs[i].from])
                    .collect();
                return Err(self.timeout_error(op, waiting));
            }
            let pi = got.expect("set when found");
            let idx = pending.swap_remove(pi);
            let src = self.group.members[recvs[idx].from];
            let corrupt = |what: &str| Error::Backend {
                backend: BACKEND,
                op,
                message: format!("message from rank {src}: {what}"),
            };
            let scratch = scratch.bytes();
            if scratch.len() < HEADER {
                return Err(corrupt("shorter than its header"));
            }
            let (h, payload) = scratch.split_at(HEADER);
            let their_seq = u64::from_le_bytes(h[0..8].try_into().expect("8"));
            let their_tag = u64::from_le_bytes(h[8..16].try_into().expect("8"));
            let their_len = u64::from_le_bytes(h[16..24].try_into().expect("8"));
            if their_len != payload.len() as u64 {
                return Err(corrupt("payload length differs from its header"));
            }
            let their_sig =
                decode_sig(&h[24..56]).ok_or_else(|| corrupt("undecodable signature"))?;
            let rin = &mut recvs[idx];
            if their_sig != *sig || their_seq != seq || their_tag != tag {
                return Err(self.mismatch(
                    src,
                    format!("{sig} (call {seq}, tag {tag})"),
                    format!("{their_sig} (call {their_seq}, tag {their_tag})"),
                ));
            }
            if rin.len.is_some_and(|l| l != payload.len()) {
                return Err(self.mismatch(
                    src,
                    format!("{sig} expecting {} bytes", rin.len.unwrap_or(0)),
                    format!("{their_sig} sending {} bytes", payload.len()),
                ));
            }
            let class = env.topology.link(src, self.me());
            env.traffic.add_received(op, class, payload.len());
            self.group.traffic.add_received(op, class, payload.len());
            (rin.sink)(payload)?;
        }
        Ok(())
    }

    /// Posts a packed message; returns the request and the buffer it reads.
    fn post(
        &self,
        comm: ffi::MPI_Comm,
        to: usize,
        mpi_tag: c_int,
        op: OpKind,
        msg: Scratch,
    ) -> Result<InFlight> {
        let count = c_int::try_from(msg.bytes().len()).map_err(|_| Error::InvalidArgument {
            op,
            arg: "buffer",
            reason: format!(
                "{} bytes exceed one MPI message (2 GiB); split the buffer",
                msg.bytes().len()
            ),
        })?;
        let mut req = MaybeUninit::<ffi::MPI_Request>::uninit();
        let _g = self.group.env.lock();
        // SAFETY: `msg` stays alive and unmoved in the returned `InFlight`
        // until the request completes (or is leaked); out pointer valid.
        let rc = unsafe {
            ffi::MPI_Isend(
                msg.bytes().as_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                to as c_int,
                mpi_tag,
                comm,
                req.as_mut_ptr(),
            )
        };
        check(op, "MPI_Isend", rc)?;
        Ok(InFlight {
            // SAFETY: MPI_Isend succeeded and wrote the request.
            req: unsafe { req.assume_init() },
            _data: msg,
        })
    }

    /// Exchanges this rank's 32-byte signature with every rank of the group
    /// before a native collective; a difference is a mismatch.
    fn agree(&self, sig: &Signature, deadline: Instant) -> Result<()> {
        let n = self.group.members.len();
        let mine = encode_sig(sig);
        let mut all = vec![0u8; 32 * n];
        let env = &*self.group.env;
        let mut req = MaybeUninit::<ffi::MPI_Request>::uninit();
        {
            let _g = env.lock();
            // SAFETY: collective over the group's communicator; `mine` has 32
            // bytes and `all` 32·n; both outlive the request (we wait below,
            // and leak `all` if the wait times out).
            let rc = unsafe {
                ffi::MPI_Iallgather(
                    mine.as_ptr().cast(),
                    32,
                    ffi::RSMPI_UINT8_T,
                    all.as_mut_ptr().cast(),
                    32,
                    ffi::RSMPI_UINT8_T,
                    self.group.coll.0,
                    req.as_mut_ptr(),
                )
            };
            check(sig.op, "MPI_Iallgather", rc)?;
        }
        // SAFETY: MPI_Iallgather succeeded and wrote the request.
        let mut req = unsafe { req.assume_init() };
        if !poll_until(env, deadline, || Ok(test(&mut req)))? {
            std::mem::forget(all);
            return Err(self.timeout_error(sig.op, self.group.members.clone()));
        }
        for (r, theirs) in all.chunks_exact(32).enumerate() {
            if theirs != mine {
                let t =
                    decode_sig(theirs).map_or_else(|| "(undecodable)".into(), |s| s.to_string());
                return Err(self.mismatch(self.group.members[r], sig.to_string(), t));
            }
        }
        Ok(())
    }

    /// The MPI library's own all-reduce (sum) of `buf` (f32 or f64).
    fn native_all_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: Dtype) -> Result<()> {
        let op = ctx.sig.op;
        let env = &*self.group.env;
        let n = self.group.members.len();
        let count = mpi_count(op, buf.len() / dtype.size_bytes())?;
        let datatype = float_type(dtype);
        // In place where the library's MPI_IN_PLACE is known, else from a copy.
        let copy: Vec<u8> = if env.in_place.is_some() {
            Vec::new()
        } else {
            buf.to_vec()
        };
        let send_ptr: *const c_void = match env.in_place {
            Some(p) => p as *const c_void,
            None => copy.as_ptr().cast(),
        };
        let recv_ptr: *mut c_void = buf.as_mut_ptr().cast();
        let coll = self.group.coll.0;
        self.native(
            ctx,
            "MPI_Allreduce",
            // SAFETY: collective over the group's communicator, every rank
            // calls it (signatures agreed); the buffers hold `count`
            // elements and outlive the call or request (`native` waits, and
            // on a timeout leaks `copy`; `buf` is the caller's and MPI may
            // still write it then, which is documented).
            || unsafe {
                ffi::MPI_Allreduce(send_ptr, recv_ptr, count, datatype, ffi::RSMPI_SUM, coll)
            },
            // SAFETY: as above.
            |req| unsafe {
                ffi::MPI_Iallreduce(
                    send_ptr,
                    recv_ptr,
                    count,
                    datatype,
                    ffi::RSMPI_SUM,
                    coll,
                    req,
                )
            },
            copy,
            2 * (n - 1) * buf.len() / n,
        )
    }

    /// Bytes below which an [`Algorithm::Auto`] all-reduce calls the MPI
    /// library: [`NATIVE_ALL_REDUCE_BELOW`] when the group's ranks share a
    /// node, [`NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES`] when they span
    /// several.
    fn native_all_reduce_below(&self) -> usize {
        let t = self.group.env.topology;
        let m = &self.group.members;
        if m.iter().any(|&r| t.domain_of(r) != t.domain_of(m[0])) {
            NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES
        } else {
            NATIVE_ALL_REDUCE_BELOW
        }
    }

    /// The MPI library's own all-reduce (sum or average) of `buf` (f32 or
    /// f64) at any size: `MPI_Iallreduce` (`MPI_Allreduce` with
    /// [`with_blocking_native`](Self::with_blocking_native)).
    /// [`all_reduce`](crate::CommunicatorExt::all_reduce) calls it only
    /// below [`NATIVE_ALL_REDUCE_BELOW`] bytes
    /// ([`NATIVE_ALL_REDUCE_BELOW_ACROSS_NODES`] across nodes; always when blocking);
    /// on a network where the library's tuned algorithms win at every
    /// size, call this instead.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another dtype or op (`Sum` and `Avg`
    /// only) or more elements than MPI's `int` counts; and as for any
    /// collective.
    pub fn library_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut buf = BufMut::new(buf);
        let opts = ReduceOptions::new(op);
        let sig = algo::reduce_signature(self, OpKind::AllReduce, &buf, &opts)?;
        let dtype = buf.dtype();
        library_sum(OpKind::AllReduce, "buf", dtype, op)?;
        let ctx = self.begin(sig)?;
        if self.size() == 1 {
            return Ok(());
        }
        self.native_all_reduce(&ctx, buf.bytes(), dtype)?;
        if op == ReduceOp::Avg {
            finish_avg(dtype, buf.bytes(), self.size());
        }
        Ok(())
    }

    /// The MPI library's own reduce-scatter (sum) of `input` (f32 or f64,
    /// every rank the same length) into `output`, this rank's
    /// [`shard_range`] of the sum: `MPI_Ireduce_scatter` with this crate's
    /// shard sizes (`MPI_Reduce_scatter` with
    /// [`with_blocking_native`](Self::with_blocking_native)).
    ///
    /// [`reduce_scatter`](crate::CommunicatorExt::reduce_scatter) does not
    /// use it: on one node's shared memory this crate's ring over MPI
    /// point-to-point measured 1.4–1.6× faster than the library's blocking
    /// call, and more than its non-blocking one, at 4–16 MiB under
    /// `mpirun -np 2` and `-np 4`, about equal at 1 MiB and mixed at 64 MiB
    /// (Open MPI 4.1, `benches/mpi_vs_local.rs`). On a network where the
    /// library's tuned algorithms win, call this instead.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another dtype or op (`Sum` and `Avg`
    /// only), a wrong output length or more elements than MPI's `int`
    /// counts; and as for any collective.
    pub fn library_reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (input, mut output) = (Buf::new(input), BufMut::new(output));
        let opts = ReduceOptions::new(op);
        let sig = algo::reduce_scatter_signature(self, &input, &output, &opts)?;
        let dtype = input.dtype();
        library_sum(OpKind::ReduceScatter, "input", dtype, op)?;
        let ctx = self.begin(sig)?;
        if self.size() == 1 {
            output.bytes().copy_from_slice(input.bytes());
            return Ok(());
        }
        let n = self.group.members.len();
        let len = input.len();
        mpi_count(OpKind::ReduceScatter, len)?;
        let counts: Vec<c_int> = (0..n)
            .map(|r| shard_range(len, n, r).len() as c_int)
            .collect();
        let datatype = float_type(dtype);
        let send = input.bytes().as_ptr().cast::<c_void>();
        let recv = output.bytes().as_mut_ptr().cast::<c_void>();
        let (cp, coll) = (counts.as_ptr(), self.group.coll.0);
        let bytes = (n - 1) * input.bytes().len() / n;
        self.native(
            &ctx,
            "MPI_Reduce_scatter",
            // SAFETY: collective over the group's communicator, every rank
            // calls it (signatures agreed); `input` holds the sum of
            // `counts`, `output` this rank's count; `counts` lives until
            // `native` returns (leaked with it on a timeout).
            || unsafe { ffi::MPI_Reduce_scatter(send, recv, cp, datatype, ffi::RSMPI_SUM, coll) },
            // SAFETY: as above.
            |req| unsafe {
                ffi::MPI_Ireduce_scatter(send, recv, cp, datatype, ffi::RSMPI_SUM, coll, req)
            },
            counts,
            bytes,
        )?;
        if op == ReduceOp::Avg {
            finish_avg(dtype, output.bytes(), n);
        }
        Ok(())
    }

    /// The MPI library's own all-gather (`MPI_Iallgatherv` with this crate's
    /// shard sizes) of `input` into `output`, any dtype (as bytes).
    fn native_all_gather(
        &self,
        ctx: &OpCtx,
        input: &[u8],
        output: &mut [u8],
        es: usize,
    ) -> Result<()> {
        let op = ctx.sig.op;
        let n = self.group.members.len();
        let len = output.len() / es;
        mpi_count(op, len * es)?;
        // counts, then displacements, in bytes (MPI_BYTE)
        let mut cd: Vec<c_int> = (0..n)
            .map(|r| (shard_range(len, n, r).len() * es) as c_int)
            .collect();
        cd.extend((0..n).map(|r| (shard_range(len, n, r).start * es) as c_int));
        let (send, recv) = (input.as_ptr().cast::<c_void>(), output.as_mut_ptr().cast());
        let sc = mpi_count(op, input.len())?;
        let (cp, dp, coll) = (cd.as_ptr(), cd[n..].as_ptr(), self.group.coll.0);
        // SAFETY: reading a predefined handle, valid after initialisation.
        let byte = unsafe { ffi::RSMPI_UINT8_T };
        self.native(
            ctx,
            "MPI_Allgatherv",
            // SAFETY: collective over the group's communicator, every rank
            // calls it (signatures agreed); `input` holds `sc` bytes,
            // `output` the sum of the counts at their displacements; `cd`
            // lives until `native` returns (leaked with it on a timeout).
            || unsafe { ffi::MPI_Allgatherv(send, sc, byte, recv, cp, dp, byte, coll) },
            // SAFETY: as above.
            |req| unsafe { ffi::MPI_Iallgatherv(send, sc, byte, recv, cp, dp, byte, coll, req) },
            cd,
            (n - 1) * output.len() / n,
        )
    }

    /// Runs a native collective after agreeing on its signature: `blocking`
    /// under the library lock when asked, else `start` (a non-blocking
    /// call writing its request) polled until done or the deadline, which
    /// is a timeout error (`keep`, what the request still reads, is then
    /// leaked rather than freed under it). Counts `bytes` sent and received
    /// on the ring's links, as the ring would move them.
    fn native<K>(
        &self,
        ctx: &OpCtx,
        name: &str,
        blocking: impl FnOnce() -> c_int,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
        keep: K,
        bytes: usize,
    ) -> Result<()> {
        let op = ctx.sig.op;
        let env = &*self.group.env;
        let deadline = Instant::now() + self.timeout;
        self.agree(&ctx.sig, deadline)?;
        let n = self.group.members.len();
        if self.blocking_native {
            let _g = env.lock();
            check(op, name, blocking())?;
        } else {
            let mut req = MaybeUninit::<ffi::MPI_Request>::uninit();
            {
                let _g = env.lock();
                check(op, name, start(req.as_mut_ptr()))?;
            }
            // SAFETY: the call succeeded and wrote the request.
            let mut req = unsafe { req.assume_init() };
            if !poll_until(env, deadline, || Ok(test(&mut req)))? {
                std::mem::forget(keep);
                return Err(self.timeout_error(op, self.group.members.clone()));
            }
        }
        drop(keep);
        if n > 1 {
            let right = self.group.members[(self.rank + 1) % n];
            let left = self.group.members[(self.rank + n - 1) % n];
            let (out, inc) = (
                env.topology.link(self.me(), right),
                env.topology.link(left, self.me()),
            );
            env.traffic.add_sent(op, out, bytes);
            env.traffic.add_received(op, inc, bytes);
            self.group.traffic.add_sent(op, out, bytes);
            self.group.traffic.add_received(op, inc, bytes);
        }
        Ok(())
    }

    fn mpi_tag(seq: u64, tag: u32, op: OpKind) -> Result<c_int> {
        if tag >= 1 << TAG_BITS {
            return Err(Error::InvalidArgument {
                op,
                arg: "tag",
                reason: format!("algorithm tag {tag} exceeds the MPI backend's 2^{TAG_BITS}"),
            });
        }
        let s = (seq & ((1 << SEQ_TAG_BITS) - 1)) as u32;
        Ok(((s << TAG_BITS) | tag) as c_int)
    }

    /// Splits like [`Communicator::split`] but returns the concrete type.
    ///
    /// # Errors
    /// As any collective.
    pub fn split_mpi(&self, color: u32, key: u32) -> Result<MpiComm> {
        let ctx = self.begin(Signature::new(OpKind::Split))?;
        let all = algo::gather_u64_pairs(self, &ctx, [u64::from(color), u64::from(key)])?;
        let mut mine: Vec<(u64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, ck)| ck[0] == u64::from(color))
            .map(|(r, ck)| (ck[1], r))
            .collect();
        mine.sort_unstable();
        let members: Vec<usize> = mine.iter().map(|&(_, r)| self.group.members[r]).collect();
        let rank = mine
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| Error::Backend {
                backend: BACKEND,
                op: OpKind::Split,
                message: "the gathered colors lack this rank's own".into(),
            })?;
        let env = &self.group.env;
        let mut out = MaybeUninit::<ffi::MPI_Comm>::uninit();
        let split = {
            let _g = env.lock();
            // SAFETY: collective over the group's communicator; every rank
            // passed the gather above, so all call it. MPI orders the new
            // group by key, ties by old rank — as computed above. Colors
            // are masked to MPI's non-negative int range.
            let rc = unsafe {
                ffi::MPI_Comm_split(
                    self.group.coll.0,
                    (color & 0x7FFF_FFFF) as c_int,
                    (key & 0x7FFF_FFFF) as c_int,
                    out.as_mut_ptr(),
                )
            };
            check(OpKind::Split, "MPI_Comm_split", rc)?;
            // SAFETY: MPI_Comm_split succeeded and wrote the communicator.
            unsafe { out.assume_init() }
        };
        let comm = MpiComm::from_parent(env, split, members, rank)
            .with_timeout(self.timeout)
            .with_blocking_native(self.blocking_native);
        let mut split = split;
        let _g = env.lock();
        // SAFETY: `split` was duplicated above and is not used afterwards.
        unsafe { ffi::MPI_Comm_free(&mut split) };
        Ok(comm)
    }
}

impl Communicator for MpiComm {
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
        self.group.env.topology
    }

    fn group_name(&self) -> String {
        self.group.name.clone()
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn begin(&self, sig: Signature) -> Result<OpCtx> {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
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
        let env = &*self.group.env;
        let comm = self.group.coll.0;
        let mpi_tag = Self::mpi_tag(ctx.seq, tag, op)?;
        let deadline = Instant::now() + self.timeout;
        let mut inflight = Vec::with_capacity(sends.len());
        for s in sends {
            let msg = packed(
                &header(ctx.seq, u64::from(tag), &ctx.sig, s.data.len()),
                s.data,
            );
            let dst = self.group.members[s.to];
            let class = env.topology.link(self.me(), dst);
            env.traffic.add_sent(op, class, s.data.len());
            self.group.traffic.add_sent(op, class, s.data.len());
            inflight.push((dst, self.post(comm, s.to, mpi_tag, op, msg)?));
        }
        let route = Route {
            comm,
            mpi_tag,
            seq: ctx.seq,
            tag: u64::from(tag),
        };
        let r = self.receive(route, &ctx.sig, recvs, deadline);
        if r.is_ok() {
            poll_until(env, deadline, || {
                inflight.retain_mut(|(_, f)| !test(&mut f.req));
                Ok(inflight.is_empty())
            })?;
        }
        if !inflight.is_empty() {
            let waiting = inflight.iter().map(|(d, _)| *d).collect();
            // MPI may still read the buffers: leak them.
            std::mem::forget(inflight);
            r?;
            return Err(self.timeout_error(op, waiting));
        }
        r
    }

    fn send_bytes(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_peer(op, peer)?;
        let mpi_tag = c_int::try_from(tag).map_err(|_| Error::InvalidArgument {
            op,
            arg: "tag",
            reason: format!("tag {tag} exceeds the MPI tag bound {MPI_MAX_TAG}"),
        })?;
        self.reap_sends();
        let mut sig = Signature::new(op);
        sig.len = data.len() as u64;
        let msg = packed(&header(u64::MAX, tag, &sig, data.len()), data);
        let env = &*self.group.env;
        let dst = self.group.members[peer];
        let class = env.topology.link(self.me(), dst);
        env.traffic.add_sent(op, class, data.len());
        self.group.traffic.add_sent(op, class, data.len());
        let f = self.post(self.group.p2p.0, peer, mpi_tag, op, msg)?;
        self.group
            .sends
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(f);
        Ok(())
    }

    fn recv_bytes(&self, peer: usize, tag: u64, out: &mut [u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_peer(op, peer)?;
        let mpi_tag = c_int::try_from(tag).map_err(|_| Error::InvalidArgument {
            op,
            arg: "tag",
            reason: format!("tag {tag} exceeds the MPI tag bound {MPI_MAX_TAG}"),
        })?;
        self.reap_sends();
        let mut sig = Signature::new(op);
        sig.len = out.len() as u64;
        let len = out.len();
        let mut sink = |src: &[u8]| {
            out.copy_from_slice(src);
            Ok(())
        };
        let deadline = Instant::now() + self.timeout;
        let route = Route {
            comm: self.group.p2p.0,
            mpi_tag,
            seq: u64::MAX,
            tag,
        };
        self.receive(
            route,
            &sig,
            &mut [Incoming {
                from: peer,
                len: Some(len),
                sink: &mut sink,
            }],
            deadline,
        )
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_mpi(color, key)?))
    }

    fn traffic(&self) -> Traffic {
        self.group.env.traffic.snapshot()
    }

    fn group_traffic(&self) -> Traffic {
        self.group.traffic.snapshot()
    }

    fn detach(&self) -> Option<Box<dyn Communicator>> {
        Some(Box::new(self.clone()))
    }

    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        algorithm: Algorithm,
    ) -> Result<()> {
        let sig = algo::all_gather_signature(self, &input, &output, algorithm)?;
        let ctx = self.begin(sig)?;
        // the library's all-gather measured 1.1–8× faster than the ring
        // over point-to-point (Open MPI 4.1, one node), so `Auto` takes it
        if algorithm != Algorithm::Auto || self.size() == 1 {
            return algo::all_gather(self, &ctx, input, output);
        }
        let es = input.dtype().size_bytes();
        self.native_all_gather(&ctx, input.bytes(), output.bytes(), es)
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>, opts: &ReduceOptions) -> Result<()> {
        let sig = algo::reduce_signature(self, OpKind::AllReduce, &buf, opts)?;
        let dtype = buf.dtype();
        let native = opts.algorithm == Algorithm::Auto
            && !opts.reproducible
            && sig.wire.is_none()
            && matches!(opts.op, ReduceOp::Sum | ReduceOp::Avg)
            && matches!(dtype, Dtype::F32 | Dtype::F64)
            && (self.blocking_native || buf.bytes().len() < self.native_all_reduce_below())
            && self.size() > 1;
        let ctx = self.begin(sig)?;
        if !native {
            return algo::all_reduce(self, &ctx, buf, opts);
        }
        self.native_all_reduce(&ctx, buf.bytes(), dtype)?;
        if opts.op == ReduceOp::Avg {
            finish_avg(dtype, buf.bytes(), self.size());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip_through_their_encoding() {
        let mut s = Signature::new(OpKind::Reduce);
        s.dtype = Some(Dtype::BF16);
        s.len = 123_456_789;
        s.root = Some(3);
        s.reduce = Some(ReduceOp::Avg);
        s.algorithm = Some(Algorithm::Hierarchical);
        s.wire = Some(Dtype::F32);
        s.reproducible = true;
        assert_eq!(decode_sig(&encode_sig(&s)), Some(s));
        let b = Signature::new(OpKind::Barrier);
        assert_eq!(decode_sig(&encode_sig(&b)), Some(b));
        assert_ne!(encode_sig(&s), encode_sig(&b));
    }

    #[test]
    fn tags_keep_sequence_numbers_apart() {
        let a = MpiComm::mpi_tag(1, 5, OpKind::AllReduce).unwrap();
        let b = MpiComm::mpi_tag(2, 5, OpKind::AllReduce).unwrap();
        assert_ne!(a, b);
        assert!(a >= 0 && b >= 0);
        assert!(MpiComm::mpi_tag(255, (1 << TAG_BITS) - 1, OpKind::AllReduce).unwrap() > 0);
        assert!(MpiComm::mpi_tag(0, 1 << TAG_BITS, OpKind::AllReduce).is_err());
    }
}
