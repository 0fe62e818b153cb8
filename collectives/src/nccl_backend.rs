//! The `nccl` backend: ranks are GPUs driven by NCCL (feature `nccl`).
//!
//! Built on cudarc's `nccl` module with dynamic loading, so the crate
//! compiles without the CUDA toolkit; the driver (`libcuda`) and NCCL
//! (`libnccl`) are loaded at run time. cudarc *panics* when they are
//! missing, so every constructor first calls [`nccl_available`], which
//! returns [`Error::BackendUnavailable`] naming what is missing.
//!
//! [`NcclComm`] implements [`Communicator`] for host buffers by staging
//! them through the GPU: all-reduce, reduce-scatter, all-gather, broadcast
//! and reduce run as the NCCL collectives; `exchange` (and so every other
//! algorithm of this crate, the reproducible mode included) runs over
//! grouped `ncclSend`/`ncclRecv`. The `*_device` methods run the NCCL
//! collectives on buffers already on the GPU, with no staging.
//!
//! Limits: messages carry no signatures (NCCL moves raw buffers), so a
//! mismatched call shows up as a timeout, not [`Error::Mismatch`];
//! [`split`](Communicator::split) needs the communicator the NCCL id was
//! broadcast over ([`NcclComm::over`]): the split runs there and each part
//! gets an NCCL communicator of its own (a communicator made from an id
//! alone refuses it); point-to-point `send` is not buffered
//! (it completes only with the matching `recv`). Every wait polls a CUDA
//! event until the communicator's timeout, so nothing hangs; after a
//! timeout the communicator is aborted and every later call fails.
//!
//! NCCL reduces `f16`/`bf16` with one rounding per addition (as this
//! crate's other backends do); `Avg` is a sum followed by one division on
//! the host, like the other backends; `Max`/`Min` follow NCCL's NaN handling.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};
use weft_numerics::{Dtype, Element, bf16, f16};

use crate::algo;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::{finish_avg, with_typed_mut};
use crate::types::{
    Algorithm, Buf, BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, ReduceOptions, Signature,
    Topology, Traffic, TrafficCounters, shard_range,
};

/// Default per-operation timeout of [`NcclComm`].
pub const NCCL_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const BACKEND: &str = "nccl";

/// Checks that the CUDA driver and NCCL can be loaded and that a GPU is
/// present; returns the number of GPUs. Never panics.
///
/// cudarc looks for `libnccl.so` (and `libnccl.so.<cuda major>`, not
/// `libnccl.so.2`): with NCCL from a wheel such as `nvidia-nccl-cu12`,
/// put a `libnccl.so` link to its `libnccl.so.2` on `LD_LIBRARY_PATH`.
///
/// # Errors
/// [`Error::BackendUnavailable`] naming the missing library or device.
pub fn nccl_available() -> Result<usize> {
    let unavailable = |reason: String| Error::BackendUnavailable {
        backend: BACKEND,
        reason,
    };
    // SAFETY: only tries to dlopen the library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver on this machine"
                .into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(unavailable(
            "the NCCL library (libnccl.so) cannot be loaded: install NCCL or put a libnccl.so link to libnccl.so.2 on LD_LIBRARY_PATH".into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| unavailable(format!("the CUDA driver reports no devices: {e}")))?;
    if n < 1 {
        return Err(unavailable("the CUDA driver sees no GPU".into()));
    }
    Ok(n as usize)
}

fn nccl_err(op: OpKind, what: &str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: format!("{what} failed: {:?}", e.0),
    }
}

fn cuda_err(op: OpKind, what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: format!("{what} failed: {e}"),
    }
}

/// An NCCL unique id: made by one rank, handed to every rank of the new
/// communicator (e.g. broadcast over another communicator, see
/// [`NcclComm::over`]).
#[derive(Clone, Copy, Debug)]
pub struct NcclId {
    bytes: [u8; 128],
}

impl NcclId {
    /// A fresh id.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without NCCL; [`Error::Backend`] if
    /// NCCL fails.
    pub fn new() -> Result<Self> {
        nccl_available()?;
        let id = Id::new().map_err(|e| nccl_err(OpKind::Split, "ncclGetUniqueId", e))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal()) {
            *b = *c as u8;
        }
        Ok(Self { bytes })
    }

    /// The id's bytes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.bytes
    }

    /// An id from bytes made by [`to_bytes`](Self::to_bytes) on some rank.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        Self { bytes }
    }

    fn id(&self) -> Id {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(self.bytes) {
            *c = b as std::ffi::c_char;
        }
        Id::uninit(internal)
    }
}

/// A group of GPUs talking through NCCL; see the [module documentation](crate#crate-features).
pub struct NcclComm {
    comm: Mutex<CommCell>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    timeout: Duration,
    seq: AtomicU64,
    aborted: AtomicBool,
    traffic: TrafficCounters,
    /// The communicator the id was broadcast over ([`NcclComm::over`]):
    /// [`split`](Communicator::split) splits it and builds the new group's
    /// NCCL communicator over the part.
    bootstrap: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.stream.context().ordinal())
            .finish_non_exhaustive()
    }
}

/// cudarc's NCCL communicator, made `Send` for the mutex in [`NcclComm`].
struct CommCell(Comm);

// SAFETY: an NCCL communicator is not bound to the thread that created it;
// NCCL only forbids concurrent calls on one communicator, and `NcclComm`
// makes every call under its mutex. The stream it holds is an `Arc` of a
// thread-safe cudarc stream.
unsafe impl Send for CommCell {}

/// Element types NCCL reduces natively.
trait NcclElem: Element + NcclType + DeviceRepr + ValidAsZeroBits + Unpin {}
impl NcclElem for f32 {}
impl NcclElem for f64 {}
impl NcclElem for f16 {}
impl NcclElem for bf16 {}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

/// Runs `f` on `bytes` viewed as elements of `dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            Dtype::F32 => {
                type $T = f32;
                $body
            }
            Dtype::F64 => {
                type $T = f64;
                $body
            }
            Dtype::F16 => {
                type $T = f16;
                $body
            }
            Dtype::BF16 => {
                type $T = bf16;
                $body
            }
        }
    };
}

impl NcclComm {
    /// A communicator of one rank on GPU `device`.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without the driver, NCCL or the
    /// device; [`Error::Backend`] if CUDA or NCCL fail.
    pub fn single(device: usize) -> Result<Self> {
        let id = NcclId::new()?;
        Self::from_rank(device, 0, 1, id)
    }

    /// Joins rank `rank` of a communicator of `size` ranks identified by
    /// `id` (made by one rank with [`NcclId::new`] and given to all), on
    /// GPU `device`. Collective: every rank must call it.
    ///
    /// # Errors
    /// As [`single`](Self::single); [`Error::InvalidArgument`] for a rank
    /// outside `0..size` or a device that does not exist.
    pub fn from_rank(device: usize, rank: usize, size: usize, id: NcclId) -> Result<Self> {
        let op = OpKind::Split;
        let devices = nccl_available()?;
        if rank >= size {
            return Err(Error::InvalidArgument {
                op,
                arg: "rank",
                reason: format!("rank {rank} is outside 0..{size}"),
            });
        }
        if device >= devices {
            return Err(Error::InvalidArgument {
                op,
                arg: "device",
                reason: format!("GPU {device} does not exist ({devices} present)"),
            });
        }
        let ctx = CudaContext::new(device).map_err(|e| cuda_err(op, "cuCtxCreate", e))?;
        let stream = ctx.default_stream();
        let comm = Comm::from_rank(stream.clone(), rank, size, id.id())
            .map_err(|e| nccl_err(op, "ncclCommInitRank", e))?;
        Ok(Self {
            comm: Mutex::new(CommCell(comm)),
            stream,
            rank,
            size,
            timeout: NCCL_DEFAULT_TIMEOUT,
            seq: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            traffic: TrafficCounters::default(),
            bootstrap: None,
        })
    }

    /// Builds an NCCL communicator over the ranks of `comm` (any backend,
    /// e.g. an `MpiComm` or a sub-group of one), with this rank on GPU
    /// `device`: rank 0 makes the id and broadcasts it over `comm`. The
    /// result keeps a handle to `comm` (when its backend can give one, as
    /// MPI's can), so it can [`split`](Communicator::split): the split runs
    /// over `comm` and each part gets an NCCL communicator of its own.
    ///
    /// # Errors
    /// As [`from_rank`](Self::from_rank), and as `comm`'s broadcast. Every
    /// rank must call it; a rank without NCCL fails before the broadcast.
    pub fn over(comm: &dyn Communicator, device: usize) -> Result<Self> {
        let mut words = [0f64; 16];
        if comm.rank() == 0 {
            let id = NcclId::new()?;
            for (w, ch) in words.iter_mut().zip(id.to_bytes().chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(ch);
                *w = f64::from_bits(u64::from_le_bytes(b));
            }
        } else {
            nccl_available()?;
        }
        comm.broadcast_buf(BufMut::new(&mut words), 0, Algorithm::Auto)?;
        let mut bytes = [0u8; 128];
        for (ch, w) in bytes.chunks_exact_mut(8).zip(words) {
            ch.copy_from_slice(&w.to_bits().to_le_bytes());
        }
        let mut nccl =
            Self::from_rank(device, comm.rank(), comm.size(), NcclId::from_bytes(bytes))?;
        nccl.bootstrap = comm.detach();
        Ok(nccl)
    }

    /// With another per-operation timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The GPU's ordinal.
    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The CUDA stream NCCL runs on (for buffers of the `*_device` methods).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NCCL communicator, locked for one call.
    fn nccl(&self) -> NcclGuard<'_> {
        NcclGuard(
            self.comm
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn check_live(&self, op: OpKind) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::Aborted {
                op,
                group: self.group_name(),
                reason: "an earlier NCCL operation timed out; the communicator was aborted".into(),
            });
        }
        Ok(())
    }

    /// Waits for the stream's work, polling until the timeout.
    fn wait(&self, op: OpKind) -> Result<()> {
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_err(op, "cuEventRecord", e))?;
        let deadline = Instant::now() + self.timeout;
        let start = Instant::now();
        loop {
            if ev
                .try_is_complete()
                .map_err(|e| cuda_err(op, "cuEventQuery", e))?
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.aborted.store(true, Ordering::Release);
                return Err(Error::Timeout {
                    op,
                    group: self.group_name(),
                    rank: self.rank,
                    missing: Vec::new(),
                    waiting_for: (0..self.size).filter(|&r| r != self.rank).collect(),
                    after: self.timeout,
                });
            }
            if start.elapsed() > Duration::from_millis(5) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn count_ring(&self, op: OpKind, bytes: usize, factor: usize) {
        if self.size > 1 {
            let b = factor * (self.size - 1) * bytes / self.size;
            self.traffic.add_sent(op, crate::LinkClass::Intra, b);
            self.traffic.add_received(op, crate::LinkClass::Intra, b);
        }
    }

    fn upload<T: DeviceRepr + ValidAsZeroBits + Unpin>(
        &self,
        op: OpKind,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self
                .stream
                .alloc_zeros::<T>(1)
                .map_err(|e| cuda_err(op, "cuMemAlloc", e));
        }
        self.stream
            .clone_htod(host)
            .map_err(|e| cuda_err(op, "cuMemcpyHtoD", e))
    }

    fn download<T: DeviceRepr + Unpin>(
        &self,
        op: OpKind,
        dev: &CudaSlice<T>,
        host: &mut [T],
    ) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| cuda_err(op, "cuMemcpyDtoH", e))?;
        self.wait(op)
    }

    // ---- collectives on device buffers --------------------------------

    /// All-reduce of a device buffer in place (sum, max or min; `Avg` sums
    /// and divides once afterwards only on the host paths, so it is
    /// refused here).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `Avg`; [`Error::Backend`],
    /// [`Error::Timeout`], [`Error::Aborted`].
    pub fn all_reduce_device<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let k = OpKind::AllReduce;
        self.check_live(k)?;
        if op == ReduceOp::Avg {
            return Err(Error::InvalidArgument {
                op: k,
                arg: "op",
                reason: "avg on device buffers: sum, then scale on the device".into(),
            });
        }
        self.nccl()
            .all_reduce_in_place(buf, &nccl_op(op))
            .map_err(|e| nccl_err(k, "ncclAllReduce", e))?;
        self.count_ring(k, buf.len() * size_of::<T>(), 2);
        self.wait(k)
    }

    /// All-gather of equal shards on the device: `output.len()` must be
    /// `size × input.len()`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on wrong lengths, and as
    /// [`all_reduce_device`](Self::all_reduce_device).
    pub fn all_gather_device<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        let k = OpKind::AllGather;
        self.check_live(k)?;
        if output.len() != input.len() * self.size {
            return Err(Error::InvalidArgument {
                op: k,
                arg: "output",
                reason: format!(
                    "length {} is not {} ranks × {}",
                    output.len(),
                    self.size,
                    input.len()
                ),
            });
        }
        self.nccl()
            .all_gather(input, output)
            .map_err(|e| nccl_err(k, "ncclAllGather", e))?;
        self.count_ring(k, output.len() * size_of::<T>(), 1);
        self.wait(k)
    }

    /// Reduce-scatter of equal shards on the device: `input.len()` must be
    /// `size × output.len()`; rank `r` gets shard `r`.
    ///
    /// # Errors
    /// As [`all_gather_device`](Self::all_gather_device); `Avg` is refused.
    pub fn reduce_scatter_device<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let k = OpKind::ReduceScatter;
        self.check_live(k)?;
        if input.len() != output.len() * self.size || op == ReduceOp::Avg {
            return Err(Error::InvalidArgument {
                op: k,
                arg: "input/op",
                reason: format!(
                    "input length {} must be {} ranks × {} and op not avg (got {op:?})",
                    input.len(),
                    self.size,
                    output.len()
                ),
            });
        }
        self.nccl()
            .reduce_scatter(input, output, &nccl_op(op))
            .map_err(|e| nccl_err(k, "ncclReduceScatter", e))?;
        self.count_ring(k, input.len() * size_of::<T>(), 1);
        self.wait(k)
    }

    /// Broadcast of a device buffer in place from `root`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a root outside the group, and as
    /// [`all_reduce_device`](Self::all_reduce_device).
    pub fn broadcast_device<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        let k = OpKind::Broadcast;
        self.check_live(k)?;
        self.check_root(k, root)?;
        self.nccl()
            .broadcast_in_place(buf, root as i32)
            .map_err(|e| nccl_err(k, "ncclBroadcast", e))?;
        self.wait(k)
    }

    fn check_root(&self, op: OpKind, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(Error::InvalidArgument {
                op,
                arg: "root",
                reason: format!("root {root} is outside the group of {}", self.size),
            });
        }
        Ok(())
    }

    // ---- host-staged collectives ---------------------------------------

    fn host_all_reduce<T: NcclElem>(&self, host: &mut [T], op: ReduceOp) -> Result<()> {
        let k = OpKind::AllReduce;
        let mut d = self.upload(k, host)?;
        if !host.is_empty() {
            self.nccl()
                .all_reduce_in_place(&mut d, &nccl_op(op))
                .map_err(|e| nccl_err(k, "ncclAllReduce", e))?;
        }
        self.count_ring(k, size_of_val(host), 2);
        self.download(k, &d, host)
    }

    /// Reduce-scatter with this crate's uneven shards: NCCL's equal shards
    /// of the input padded to a multiple of the group size.
    fn host_reduce_scatter<T: NcclElem>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let k = OpKind::ReduceScatter;
        let n = self.size;
        let len = input.len();
        let chunk = len.div_ceil(n).max(1);
        // lay shard r of the input at r·chunk, zero padded
        let mut padded = vec![T::ZERO; chunk * n];
        for r in 0..n {
            let s = shard_range(len, n, r);
            padded[r * chunk..r * chunk + s.len()].copy_from_slice(&input[s]);
        }
        let d_in = self.upload(k, &padded)?;
        let mut d_out = self
            .stream
            .alloc_zeros::<T>(chunk)
            .map_err(|e| cuda_err(k, "cuMemAlloc", e))?;
        self.nccl()
            .reduce_scatter(&d_in, &mut d_out, &nccl_op(op))
            .map_err(|e| nccl_err(k, "ncclReduceScatter", e))?;
        self.count_ring(k, size_of_val(input), 1);
        let mut out = vec![T::ZERO; chunk];
        self.download(k, &d_out, &mut out)?;
        output.copy_from_slice(&out[..output.len()]);
        Ok(())
    }

    fn host_all_gather<T: NcclElem>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let k = OpKind::AllGather;
        let n = self.size;
        let len = output.len();
        let chunk = len.div_ceil(n).max(1);
        let mut mine = vec![T::ZERO; chunk];
        mine[..input.len()].copy_from_slice(input);
        let d_in = self.upload(k, &mine)?;
        let mut d_out = self
            .stream
            .alloc_zeros::<T>(chunk * n)
            .map_err(|e| cuda_err(k, "cuMemAlloc", e))?;
        self.nccl()
            .all_gather(&d_in, &mut d_out)
            .map_err(|e| nccl_err(k, "ncclAllGather", e))?;
        self.count_ring(k, size_of_val(output), 1);
        let mut all = vec![T::ZERO; chunk * n];
        self.download(k, &d_out, &mut all)?;
        for r in 0..n {
            let s = shard_range(len, n, r);
            let l = s.len();
            output[s].copy_from_slice(&all[r * chunk..r * chunk + l]);
        }
        Ok(())
    }

    fn host_broadcast<T: NcclElem>(&self, host: &mut [T], root: usize) -> Result<()> {
        let k = OpKind::Broadcast;
        let mut d = self.upload(k, host)?;
        if !host.is_empty() {
            self.nccl()
                .broadcast_in_place(&mut d, root as i32)
                .map_err(|e| nccl_err(k, "ncclBroadcast", e))?;
        }
        self.download(k, &d, host)
    }

    fn host_reduce<T: NcclElem>(&self, host: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        let k = OpKind::Reduce;
        let mut d = self.upload(k, host)?;
        if !host.is_empty() {
            self.nccl()
                .reduce_in_place(&mut d, &nccl_op(op), root as i32)
                .map_err(|e| nccl_err(k, "ncclReduce", e))?;
        }
        self.download(k, &d, host)
    }

    /// Native NCCL collectives apply when no reproducible mode or wider
    /// wire dtype is asked for.
    fn native(opts: &ReduceOptions, sig: &Signature) -> bool {
        !opts.reproducible && sig.wire.is_none()
    }
}

/// A locked NCCL communicator.
struct NcclGuard<'a>(MutexGuard<'a, CommCell>);

impl std::ops::Deref for NcclGuard<'_> {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.0.0
    }
}

/// Views `bytes` as `T`s and runs `f`, returning its result.
fn typed_mut<T: Element, R>(bytes: &mut [u8], f: impl FnOnce(&mut [T]) -> Result<R>) -> Result<R> {
    let mut out = None;
    with_typed_mut::<T>(bytes, |xs| out = Some(f(xs)));
    out.expect("with_typed_mut calls its closure once")
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn world_rank_of(&self, rank: usize) -> usize {
        rank
    }

    fn topology(&self) -> Topology {
        Topology::flat()
    }

    fn group_name(&self) -> String {
        format!("nccl[0..{}]", self.size)
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn begin(&self, sig: Signature) -> Result<OpCtx> {
        self.check_live(sig.op)?;
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        Ok(OpCtx { seq, sig })
    }

    fn exchange(
        &self,
        ctx: &OpCtx,
        _tag: u32,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<()> {
        let op = ctx.sig.op;
        self.check_live(op)?;
        let mut d_sends = Vec::with_capacity(sends.len());
        for s in sends {
            d_sends.push((s.to, self.upload::<u8>(op, s.data)?, s.data.len()));
            self.traffic
                .add_sent(op, crate::LinkClass::Intra, s.data.len());
        }
        let mut d_recvs = Vec::with_capacity(recvs.len());
        for r in recvs.iter() {
            let len = r.len.ok_or_else(|| Error::InvalidArgument {
                op,
                arg: "recvs",
                reason: "the nccl backend needs the length of every incoming message".into(),
            })?;
            let d = self
                .stream
                .alloc_zeros::<u8>(len.max(1))
                .map_err(|e| cuda_err(op, "cuMemAlloc", e))?;
            d_recvs.push((r.from, d, len));
        }
        let comm = self.nccl();
        cudarc::nccl::safe::group_start().map_err(|e| nccl_err(op, "ncclGroupStart", e))?;
        let mut res = Ok(());
        for (to, d, len) in &d_sends {
            if *len > 0 && res.is_ok() {
                res = comm
                    .send(&d.slice(..*len), *to as i32)
                    .map_err(|e| nccl_err(op, "ncclSend", e));
            }
        }
        for (from, d, len) in &mut d_recvs {
            if *len > 0 && res.is_ok() {
                res = comm
                    .recv(&mut d.slice_mut(..*len), *from as i32)
                    .map(|_| ())
                    .map_err(|e| nccl_err(op, "ncclRecv", e));
            }
        }
        cudarc::nccl::safe::group_end().map_err(|e| nccl_err(op, "ncclGroupEnd", e))?;
        drop(comm);
        res?;
        self.wait(op)?;
        for ((_, d, len), r) in d_recvs.iter().zip(recvs.iter_mut()) {
            let mut host = vec![0u8; *len];
            self.download(op, d, &mut host)?;
            self.traffic.add_received(op, crate::LinkClass::Intra, *len);
            (r.sink)(&host)?;
        }
        Ok(())
    }

    fn send_bytes(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_peer(op, peer)?;
        let ctx = OpCtx {
            seq: u64::MAX,
            sig: Signature::new(op),
        };
        self.exchange(&ctx, tag as u32, &[Outgoing { to: peer, data }], &mut [])
    }

    fn recv_bytes(&self, peer: usize, tag: u64, out: &mut [u8]) -> Result<()> {
        let op = OpKind::SendRecv;
        self.check_peer(op, peer)?;
        let ctx = OpCtx {
            seq: u64::MAX,
            sig: Signature::new(op),
        };
        let len = out.len();
        let mut sink = |src: &[u8]| {
            out.copy_from_slice(src);
            Ok(())
        };
        self.exchange(
            &ctx,
            tag as u32,
            &[],
            &mut [Incoming {
                from: peer,
                len: Some(len),
                sink: &mut sink,
            }],
        )
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let Some(bootstrap) = &self.bootstrap else {
            return Err(Error::Backend {
                backend: BACKEND,
                op: OpKind::Split,
                message: "this NCCL communicator was made from an id alone and cannot split: build it with NcclComm::over(comm) to split through comm, or one NcclComm per group".into(),
            });
        };
        let part = bootstrap.split(color, key)?;
        let device = self.device();
        Ok(Box::new(
            NcclComm::over(&*part, device)?.with_timeout(self.timeout),
        ))
    }

    fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }

    fn group_traffic(&self) -> Traffic {
        // One NCCL communicator per group: its counters are the group's.
        self.traffic.snapshot()
    }

    fn detach(&self) -> Option<Box<dyn Communicator>> {
        None
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>, opts: &ReduceOptions) -> Result<()> {
        let sig = algo::reduce_signature(self, OpKind::AllReduce, &buf, opts)?;
        let ctx = self.begin(sig)?;
        if !Self::native(opts, &sig) {
            return algo::all_reduce(self, &ctx, buf, opts);
        }
        let dtype = buf.dtype();
        with_dtype!(dtype, T => typed_mut::<T, ()>(buf.bytes(), |xs| self.host_all_reduce(xs, opts.op)))?;
        if opts.op == ReduceOp::Avg {
            finish_avg(dtype, buf.bytes(), self.size);
        }
        Ok(())
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        opts: &ReduceOptions,
    ) -> Result<()> {
        let sig = algo::reduce_scatter_signature(self, &input, &output, opts)?;
        let ctx = self.begin(sig)?;
        if !Self::native(opts, &sig) {
            return algo::reduce_scatter(self, &ctx, input, output, opts);
        }
        let dtype = input.dtype();
        with_dtype!(dtype, T => {
            let inp: Vec<T> = crate::reduce::typed::<T>(input.bytes()).into_owned();
            typed_mut::<T, ()>(output.bytes(), |out| self.host_reduce_scatter(&inp, out, opts.op))
        })?;
        if opts.op == ReduceOp::Avg {
            finish_avg(dtype, output.bytes(), self.size);
        }
        Ok(())
    }

    fn all_gather_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        algorithm: Algorithm,
    ) -> Result<()> {
        let sig = algo::all_gather_signature(self, &input, &output, algorithm)?;
        self.begin(sig)?;
        let dtype = input.dtype();
        with_dtype!(dtype, T => {
            let inp: Vec<T> = crate::reduce::typed::<T>(input.bytes()).into_owned();
            typed_mut::<T, ()>(output.bytes(), |out| self.host_all_gather(&inp, out))
        })
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize, algorithm: Algorithm) -> Result<()> {
        let sig = algo::rooted_signature(self, OpKind::Broadcast, &buf, root, None, algorithm)?;
        self.begin(sig)?;
        let dtype = buf.dtype();
        with_dtype!(dtype, T => typed_mut::<T, ()>(buf.bytes(), |xs| self.host_broadcast(xs, root)))
    }

    fn reduce_buf(
        &self,
        mut buf: BufMut<'_>,
        root: usize,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<()> {
        let sig = algo::rooted_signature(self, OpKind::Reduce, &buf, root, Some(op), algorithm)?;
        self.begin(sig)?;
        let dtype = buf.dtype();
        with_dtype!(dtype, T => typed_mut::<T, ()>(buf.bytes(), |xs| self.host_reduce(xs, root, op)))?;
        if op == ReduceOp::Avg && self.rank == root {
            finish_avg(dtype, buf.bytes(), self.size);
        }
        Ok(())
    }
}

impl NcclComm {
    fn check_peer(&self, op: OpKind, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::InvalidArgument {
                op,
                arg: "peer",
                reason: format!("rank {peer} is outside the group of {}", self.size),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_bytes() {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37) as u8;
        }
        assert_eq!(NcclId::from_bytes(b).id().internal().map(|c| c as u8), b);
    }

    #[test]
    fn without_the_libraries_constructors_return_a_typed_error() {
        // Never panics, with or without a GPU: either NCCL is usable or the
        // error says what is missing.
        match nccl_available() {
            Ok(n) => assert!(n >= 1),
            Err(Error::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "nccl");
                assert!(reason.contains("lib"), "{reason}");
                let e = NcclComm::single(0).expect_err("no NCCL, no communicator");
                assert!(matches!(e, Error::BackendUnavailable { .. }), "{e}");
                assert!(e.to_string().contains("nccl backend not available"), "{e}");
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}
