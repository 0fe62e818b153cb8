//! Plain types shared by the trait, the algorithms and the backends.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use weft_numerics::{Dtype, Element};

/// The operations a communicator performs; used in errors, signatures and
/// traffic counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`all_reduce`](crate::CommunicatorExt::all_reduce).
    AllReduce,
    /// [`reduce_scatter`](crate::CommunicatorExt::reduce_scatter).
    ReduceScatter,
    /// [`all_gather`](crate::CommunicatorExt::all_gather).
    AllGather,
    /// [`broadcast`](crate::CommunicatorExt::broadcast).
    Broadcast,
    /// [`reduce`](crate::CommunicatorExt::reduce).
    Reduce,
    /// [`all_to_all`](crate::CommunicatorExt::all_to_all).
    AllToAll,
    /// [`all_to_all_v`](crate::CommunicatorExt::all_to_all_v).
    AllToAllV,
    /// Point-to-point [`send`](crate::CommunicatorExt::send) /
    /// [`recv`](crate::CommunicatorExt::recv).
    SendRecv,
    /// [`barrier`](crate::Communicator::barrier).
    Barrier,
    /// [`split`](crate::Communicator::split).
    Split,
}

impl OpKind {
    /// Every kind, in counter order.
    pub const ALL: [OpKind; 10] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllToAll,
        OpKind::AllToAllV,
        OpKind::SendRecv,
        OpKind::Barrier,
        OpKind::Split,
    ];

    /// Position in [`OpKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The snake-case name (`"all_reduce"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllV => "all_to_all_v",
            OpKind::SendRecv => "send_recv",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise sum divided by the group size (the division happens once,
    /// on the final sum).
    Avg,
    /// Elementwise maximum (NaN wins).
    Max,
    /// Elementwise minimum (NaN wins).
    Min,
}

impl ReduceOp {
    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// Which algorithm runs a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Let the policy pick by message size and topology (see
    /// [`Algorithm::resolve`]).
    #[default]
    Auto,
    /// Bandwidth-optimal ring: n−1 steps of S/n each per phase. For 3 to
    /// 16 ranks in one [`Topology`] domain each phase sends the same bytes
    /// in one direct step instead (rank k is sent chunk k by every peer,
    /// and reduces all of them in one pass): within a domain the link
    /// pattern does not matter, and one round trip replaces n − 1.
    Ring,
    /// Latency-optimal recursive doubling (all-reduce, all-gather) and
    /// recursive halving (reduce-scatter), log₂ n steps; binomial trees for
    /// broadcast and reduce. Non-power-of-two groups fold the extra ranks in
    /// first (all-reduce) or reduce through an all-reduce (reduce-scatter,
    /// all-gather), which costs more traffic.
    RecursiveDoubling,
    /// Two-level all-reduce over the [`Topology`]: intra-domain ring
    /// reduce-scatter, inter-domain ring all-reduce of the 1/k shard,
    /// intra-domain ring all-gather. Needs the same number of ranks of the
    /// group in every domain. Other collectives run as [`Algorithm::Ring`].
    Hierarchical,
}

/// Messages up to this many bytes use recursive doubling under
/// [`Algorithm::Auto`].
pub const SMALL_MESSAGE_BYTES: usize = 64 * 1024;

impl Algorithm {
    /// The default policy: `Auto` becomes [`RecursiveDoubling`](Self::RecursiveDoubling)
    /// up to [`SMALL_MESSAGE_BYTES`], else [`Hierarchical`](Self::Hierarchical)
    /// when the group spans two or more domains with at least two ranks in
    /// each and the same count everywhere (and the reduction is not
    /// reproducible: the exact hierarchical form sends twice the bytes
    /// between domains, so exact sums take the ring), else
    /// [`Ring`](Self::Ring). Other values are returned unchanged.
    pub fn resolve(self, bytes: usize, hierarchical_possible: bool) -> Algorithm {
        match self {
            Algorithm::Auto if bytes <= SMALL_MESSAGE_BYTES => Algorithm::RecursiveDoubling,
            Algorithm::Auto if hierarchical_possible => Algorithm::Hierarchical,
            Algorithm::Auto => Algorithm::Ring,
            a => a,
        }
    }

    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "rec_doubling",
            Algorithm::Hierarchical => "hierarchical",
        }
    }
}

/// Options of a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReduceOptions {
    /// The reduction.
    pub op: ReduceOp,
    /// The algorithm (default: the size/topology policy).
    pub algorithm: Algorithm,
    /// The dtype in which partial sums travel between ranks; `None` means the
    /// buffer's own dtype. Every addition is computed in f32 (f64 for f64
    /// data) and rounded once to this dtype, so with `Some(Dtype::F32)` a
    /// bf16 or f16 buffer is reduced entirely in f32 and rounded once at the
    /// end, at twice the traffic. Must be at least as wide as the buffer.
    pub wire: Option<Dtype>,
    /// Reproducible mode: results bitwise identical for any world size,
    /// algorithm and rank order of the same contributions (the correctly
    /// rounded exact sum). Only `Sum` and `Avg`; see [`crate::repro`].
    pub reproducible: bool,
}

impl ReduceOptions {
    /// Defaults for `op`: automatic algorithm, native wire dtype, not reproducible.
    pub const fn new(op: ReduceOp) -> Self {
        Self {
            op,
            algorithm: Algorithm::Auto,
            wire: None,
            reproducible: false,
        }
    }

    /// With this algorithm.
    pub const fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// With this wire dtype for partial sums.
    pub const fn wire(mut self, wire: Dtype) -> Self {
        self.wire = Some(wire);
        self
    }

    /// In reproducible mode.
    pub const fn reproducible(mut self, on: bool) -> Self {
        self.reproducible = on;
        self
    }
}

impl From<ReduceOp> for ReduceOptions {
    fn from(op: ReduceOp) -> Self {
        Self::new(op)
    }
}

/// Ranks per domain (node, NVLink island): links between ranks of one domain
/// are fast ("intra"), links between domains slow ("inter"). World rank `r`
/// is in domain `r / ranks_per_domain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    ranks_per_domain: usize,
}

impl Topology {
    /// One domain holding every rank.
    pub const fn flat() -> Self {
        Self {
            ranks_per_domain: usize::MAX,
        }
    }

    /// Domains of `ranks_per_domain` consecutive world ranks (0 is treated as 1).
    pub const fn new(ranks_per_domain: usize) -> Self {
        Self {
            ranks_per_domain: if ranks_per_domain == 0 {
                1
            } else {
                ranks_per_domain
            },
        }
    }

    /// Ranks per domain (`usize::MAX` for [`flat`](Self::flat)).
    pub const fn ranks_per_domain(&self) -> usize {
        self.ranks_per_domain
    }

    /// The domain of a world rank.
    pub const fn domain_of(&self, world_rank: usize) -> usize {
        world_rank / self.ranks_per_domain
    }

    /// The class of the link between two world ranks.
    pub const fn link(&self, a: usize, b: usize) -> LinkClass {
        if self.domain_of(a) == self.domain_of(b) {
            LinkClass::Intra
        } else {
            LinkClass::Inter
        }
    }
}

impl Default for Topology {
    fn default() -> Self {
        Self::flat()
    }
}

/// Link classes of the traffic counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkClass {
    /// Between ranks of one domain.
    Intra,
    /// Between domains.
    Inter,
}

impl LinkClass {
    /// Both classes.
    pub const ALL: [LinkClass; 2] = [LinkClass::Intra, LinkClass::Inter];
}

/// A snapshot of one rank's traffic: bytes sent and received, per operation
/// and link class. Counts payload bytes only (the elements or encoded exact
/// sums that an algorithm moves), not headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    sent: [[u64; 2]; 10],
    received: [[u64; 2]; 10],
}

impl Traffic {
    /// Bytes sent by `op` over `class` links.
    pub fn sent(&self, op: OpKind, class: LinkClass) -> u64 {
        self.sent[op.index()][class as usize]
    }

    /// Bytes received by `op` over `class` links.
    pub fn received(&self, op: OpKind, class: LinkClass) -> u64 {
        self.received[op.index()][class as usize]
    }

    /// Bytes sent by `op` over every link.
    pub fn sent_by(&self, op: OpKind) -> u64 {
        self.sent[op.index()].iter().sum()
    }

    /// Bytes received by `op` over every link.
    pub fn received_by(&self, op: OpKind) -> u64 {
        self.received[op.index()].iter().sum()
    }

    /// Bytes sent over `class` links by every operation.
    pub fn sent_over(&self, class: LinkClass) -> u64 {
        self.sent.iter().map(|r| r[class as usize]).sum()
    }

    /// All bytes sent.
    pub fn total_sent(&self) -> u64 {
        self.sent.iter().flatten().sum()
    }

    /// All bytes received.
    pub fn total_received(&self) -> u64 {
        self.received.iter().flatten().sum()
    }

    /// `self − earlier`, counter by counter (for measuring one operation).
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        let mut t = self.clone();
        for i in 0..10 {
            for c in 0..2 {
                t.sent[i][c] -= earlier.sent[i][c].min(t.sent[i][c]);
                t.received[i][c] -= earlier.received[i][c].min(t.received[i][c]);
            }
        }
        t
    }
}

impl std::ops::AddAssign<&Traffic> for Traffic {
    /// Adds `other`'s counters (e.g. several groups' traffic together).
    fn add_assign(&mut self, other: &Traffic) {
        for i in 0..10 {
            for c in 0..2 {
                self.sent[i][c] += other.sent[i][c];
                self.received[i][c] += other.received[i][c];
            }
        }
    }
}

/// Live counters for one rank; backends add to them, [`snapshot`](Self::snapshot)
/// reads them.
#[derive(Debug, Default)]
pub struct TrafficCounters {
    sent: [[AtomicU64; 2]; 10],
    received: [[AtomicU64; 2]; 10],
}

impl TrafficCounters {
    /// Counts `bytes` sent by `op` over a `class` link.
    pub fn add_sent(&self, op: OpKind, class: LinkClass, bytes: usize) {
        self.sent[op.index()][class as usize].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts `bytes` received by `op` over a `class` link.
    pub fn add_received(&self, op: OpKind, class: LinkClass, bytes: usize) {
        self.received[op.index()][class as usize].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> Traffic {
        let mut t = Traffic::default();
        for i in 0..10 {
            for c in 0..2 {
                t.sent[i][c] = self.sent[i][c].load(Ordering::Relaxed);
                t.received[i][c] = self.received[i][c].load(Ordering::Relaxed);
            }
        }
        t
    }
}

/// What a rank called: every rank of a group must call the same thing. Sent
/// with every message and compared by the receiver, so that mismatched calls
/// become [`Error::Mismatch`](crate::Error::Mismatch) instead of corruption.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    /// The operation.
    pub op: OpKind,
    /// The element dtype (`None` for byte payloads and barriers).
    pub dtype: Option<Dtype>,
    /// Total elements of the operation's buffer as every rank sees it
    /// (all-to-all-v: 0, the counts are checked per message).
    pub len: u64,
    /// Root rank, for broadcast and reduce.
    pub root: Option<usize>,
    /// The reduction, if any.
    pub reduce: Option<ReduceOp>,
    /// The resolved algorithm, if any.
    pub algorithm: Option<Algorithm>,
    /// The wire dtype of partial sums, if different from `dtype`.
    pub wire: Option<Dtype>,
    /// Reproducible mode.
    pub reproducible: bool,
}

impl Signature {
    /// A signature with only the operation set.
    pub const fn new(op: OpKind) -> Self {
        Self {
            op,
            dtype: None,
            len: 0,
            root: None,
            reduce: None,
            algorithm: None,
            wire: None,
            reproducible: false,
        }
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.op)?;
        if let Some(d) = self.dtype {
            write!(f, "{d} x {}", self.len)?;
        } else {
            write!(f, "len {}", self.len)?;
        }
        if let Some(r) = self.reduce {
            write!(f, ", {}", r.name())?;
        }
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        if let Some(a) = self.algorithm {
            write!(f, ", {}", a.name())?;
        }
        if let Some(w) = self.wire {
            write!(f, ", wire {w}")?;
        }
        if self.reproducible {
            f.write_str(", reproducible")?;
        }
        f.write_str(")")
    }
}

/// One collective call in progress: its sequence number in the group and its
/// signature. Made by [`Communicator::begin`](crate::Communicator::begin).
#[derive(Clone, Copy, Debug)]
pub struct OpCtx {
    /// Position of the call among the group's collective calls (0, 1, ...).
    pub seq: u64,
    /// What was called.
    pub sig: Signature,
}

/// One outgoing message of an [`exchange`](crate::Communicator::exchange).
#[derive(Clone, Copy, Debug)]
pub struct Outgoing<'a> {
    /// Destination rank in the group.
    pub to: usize,
    /// Payload.
    pub data: &'a [u8],
}

/// The function an incoming message's bytes are handed to.
pub type Sink<'a> = &'a mut (dyn FnMut(&[u8]) -> crate::Result<()> + Send);

/// One incoming message of an [`exchange`](crate::Communicator::exchange):
/// its bytes are handed to `sink` (on the local backend straight from the
/// sender's memory, so a reduction reads the peer's buffer with no copy).
pub struct Incoming<'a> {
    /// Source rank in the group.
    pub from: usize,
    /// Expected payload length, if known; a different length is a mismatch.
    pub len: Option<usize>,
    /// Consumes the payload.
    pub sink: Sink<'a>,
}

impl fmt::Debug for Incoming<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("from", &self.from)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A dtype-tagged mutable byte view of an element buffer: how typed slices
/// cross the object-safe [`Communicator`](crate::Communicator) methods.
#[derive(Debug)]
pub struct BufMut<'a> {
    dtype: Dtype,
    bytes: &'a mut [u8],
}

impl<'a> BufMut<'a> {
    /// Views a typed slice.
    pub fn new<T: Element>(xs: &'a mut [T]) -> Self {
        let len = size_of_val(xs);
        // SAFETY: every `Element` (f64, f32, f16, bf16; the trait is sealed)
        // is plain old data with no padding and no invalid bit patterns, so
        // its memory may be viewed and written as bytes; the view borrows
        // `xs` mutably for 'a.
        let bytes = unsafe { std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast::<u8>(), len) };
        Self {
            dtype: T::DTYPE,
            bytes,
        }
    }

    /// The element dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }

    /// `true` when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes.
    pub fn bytes(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// The bytes, consuming the view.
    pub fn into_bytes(self) -> &'a mut [u8] {
        self.bytes
    }
}

/// A dtype-tagged shared byte view of an element buffer.
#[derive(Clone, Copy, Debug)]
pub struct Buf<'a> {
    dtype: Dtype,
    bytes: &'a [u8],
}

impl<'a> Buf<'a> {
    /// Views a typed slice.
    pub fn new<T: Element>(xs: &'a [T]) -> Self {
        let len = size_of_val(xs);
        // SAFETY: as in `BufMut::new`; shared view of plain old data.
        let bytes = unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), len) };
        Self {
            dtype: T::DTYPE,
            bytes,
        }
    }

    /// Views the bytes of `dtype` elements (a whole number of them,
    /// aligned for `dtype`).
    pub(crate) fn from_bytes(dtype: Dtype, bytes: &'a [u8]) -> Self {
        debug_assert!(bytes.len().is_multiple_of(dtype.size_bytes()));
        debug_assert!((bytes.as_ptr() as usize).is_multiple_of(dtype.size_bytes()));
        Self { dtype, bytes }
    }

    /// The element dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }

    /// `true` when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// The element range of shard `i` when `len` elements are split over `n`
/// ranks: the first `len % n` shards get one element more. Reduce-scatter
/// leaves shard `rank` on each rank; all-gather expects it.
///
/// # Panics
/// If `n == 0` or `i >= n`.
pub fn shard_range(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    assert!(n > 0 && i < n, "shard_range: shard {i} of {n}");
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    let size = base + usize::from(i < extra);
    start..start + size
}
