//! One CUDA device: presence checks, the context, the stream, the compiled
//! modules and the cuBLAS handle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::nvrtc::{self, Source, Target};
use crate::error::{Error, Result};

/// Which of the libraries the GPU path loads at run time can be loaded
/// here (each probed by trying to open it, never by calling into it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Libraries {
    /// The NVIDIA driver library, `libcuda.so.1`.
    pub driver: bool,
    /// The runtime compiler, `libnvrtc.so.13`.
    pub nvrtc: bool,
    /// cuBLAS, `libcublas.so.13`.
    pub cublas: bool,
}

/// Probes the driver, NVRTC and cuBLAS libraries. Never panics.
pub fn libraries() -> Libraries {
    // SAFETY: only tries to dlopen the library under its candidate names.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    // SAFETY: as above.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    // SAFETY: as above.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    Libraries {
        driver,
        nvrtc,
        cublas,
    }
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        what: "CUDA".into(),
        reason: reason.into(),
    }
}

pub(crate) fn cuda_err(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Cuda {
        op,
        message: e.to_string(),
    }
}

/// The driver's CUDA version as `major * 1000 + minor * 10`, once the
/// library is known to be present.
fn driver_version() -> Result<i32> {
    let mut v = 0i32;
    // SAFETY: the driver library is present; a valid out-pointer.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(v)
    } else {
        Err(unavailable(format!("cuDriverGetVersion failed: {r:?}")))
    }
}

/// Devices the driver sees.
pub(crate) fn device_count() -> Result<usize> {
    let libs = libraries();
    if !libs.driver {
        return Err(unavailable(
            "the NVIDIA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver on this machine",
        ));
    }
    let v = driver_version()?;
    if v < 13000 {
        return Err(unavailable(format!(
            "the NVIDIA driver supports CUDA {}.{}; weft's CUDA build needs 13.0 or newer (driver R580+)",
            v / 1000,
            v % 1000 / 10
        )));
    }
    let n = CudaContext::device_count()
        .map_err(|e| unavailable(format!("the CUDA driver reports no devices: {e}")))?;
    if n < 1 {
        return Err(unavailable("the CUDA driver sees no GPU"));
    }
    Ok(n.unsigned_abs() as usize)
}

/// Everything the ops need: driver, device, NVRTC, cuBLAS.
pub(crate) fn available() -> Result<usize> {
    let n = device_count()?;
    nvrtc::nvrtc_present()?;
    if !libraries().cublas {
        return Err(Error::Unavailable {
            what: "cuBLAS".into(),
            reason: "libcublas.so.13 cannot be loaded: install cuBLAS for CUDA 13 \
                     (`pip install nvidia-cublas`, then put its nvidia/cu13/lib on \
                     LD_LIBRARY_PATH) or a CUDA 13 toolkit"
                .into(),
        });
    }
    Ok(n)
}

/// One CUDA device with a stream, the kernels compiled for it, and a
/// cuBLAS handle. Every op runs on the one stream, in call order; reading
/// a result back ([`download`](Self::download)) waits for it.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    modules: Mutex<HashMap<(Source, usize), Arc<CudaModule>>>,
    target: Target,
    name: String,
    tf32: bool,
    /// The 16-bit cuBLAS products' rounded operands, both in one buffer:
    /// grown to the largest product's and kept (every op runs on the one
    /// stream, so a product's copies are read before the next product
    /// rounds into the same memory).
    operands: Mutex<Option<CudaSlice<u16>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal` (0-based), after checking that the driver,
    /// NVRTC and cuBLAS can be loaded.
    ///
    /// # Errors
    /// [`Error::Unavailable`] naming the missing library, an old driver, no
    /// device or an ordinal past the last one; [`Error::Cuda`] if the
    /// driver or cuBLAS fails to initialise.
    pub fn new(ordinal: usize) -> Result<Self> {
        let n = available()?;
        if ordinal >= n {
            return Err(unavailable(format!(
                "there is no CUDA device {ordinal}: the driver sees {n}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("CudaContext::new", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute_capability", e))?;
        let name = ctx.name().map_err(|e| cuda_err("device name", e))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cublasCreate", e))?;
        Ok(Self {
            ctx,
            stream,
            blas: Mutex::new(blas),
            modules: Mutex::new(HashMap::new()),
            target: Target::Cubin {
                major: major.unsigned_abs(),
                minor: minor.unsigned_abs(),
            },
            name,
            tf32: false,
            operands: Mutex::new(None),
        })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        match self.target {
            Target::Cubin { major, minor } | Target::Ptx { major, minor } => (major, minor),
        }
    }

    /// The stream every op of this device runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Lets f32 products ([`Precision::F32`](crate::Precision) through
    /// cuBLAS) use TF32 tensor cores: operands rounded to 10-bit
    /// significands, f32 accumulation. Off by default.
    pub fn set_tf32(&mut self, on: bool) {
        self.tf32 = on;
    }

    pub(crate) fn tf32(&self) -> bool {
        self.tf32
    }

    /// Device memory and the device's total, in bytes: `(free, total)`.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the driver fails.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| cuda_err("cuMemGetInfo", e))
    }

    /// A device copy of `host`.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation or the copy fails.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.stream.null().map_err(|e| cuda_err("upload", e));
        }
        self.stream
            .clone_htod(host)
            .map_err(|e| cuda_err("upload", e))
    }

    /// `len` zeros on the device.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation fails.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        if len == 0 {
            return self.stream.null().map_err(|e| cuda_err("alloc_zeros", e));
        }
        self.stream
            .alloc_zeros(len)
            .map_err(|e| cuda_err("alloc_zeros", e))
    }

    /// Makes the buffer of the 16-bit products' rounded operands (bf16 or
    /// fp16 copies of both operands of a cuBLAS product, see
    /// [`Precision`](crate::Precision)) hold at least `values` of them, so
    /// that no product allocates: a model reserves its largest product's
    /// `k · (m + n)` once. The buffer only grows.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation fails.
    pub fn reserve_operands(&self, values: usize) -> Result<()> {
        self.operands(values).map(drop)
    }

    /// Bytes held by the buffer of the 16-bit products' rounded operands
    /// ([`reserve_operands`](Self::reserve_operands)).
    pub fn operand_bytes(&self) -> usize {
        let held = self.operands.lock().unwrap_or_else(|e| e.into_inner());
        2 * held.as_ref().map_or(0, CudaSlice::len)
    }

    /// The rounded-operand buffer, grown to at least `values` (`None` while
    /// nothing was asked of it).
    pub(crate) fn operands(&self, values: usize) -> Result<MutexGuard<'_, Option<CudaSlice<u16>>>> {
        let mut held = self.operands.lock().unwrap_or_else(|e| e.into_inner());
        if values > held.as_ref().map_or(0, CudaSlice::len) {
            // the smaller one freed first (in stream order)
            *held = None;
            *held = Some(self.zeros::<u16>(values)?);
        }
        Ok(held)
    }

    /// A host copy of a device buffer (waits for the work queued before).
    ///
    /// # Errors
    /// [`Error::Cuda`] if the copy (or an earlier launch) fails.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &impl DevicePtr<T>,
    ) -> Result<Vec<T>> {
        if buf.len() == 0 {
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(buf)
            .map_err(|e| cuda_err("download", e))
    }

    /// Records a timing event on the stream (for benches:
    /// `start.elapsed_ms(&end)` after `end.synchronize()`). cudarc's own
    /// default events are created without timing.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the driver fails.
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("cuEventRecord", e))
    }

    /// Waits until every op queued on this device has finished.
    ///
    /// # Errors
    /// [`Error::Cuda`] if one of them failed.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
    }

    /// The cuBLAS handle, with this device's context made current on the
    /// calling thread (cuBLAS calls run in the current context).
    pub(crate) fn blas(&self) -> Result<MutexGuard<'_, CudaBlas>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        Ok(self.blas.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Kernel `name` of `source` (compiled and loaded on first use).
    pub(crate) fn function(
        &self,
        source: Source,
        name: &'static str,
        head_size: usize,
    ) -> Result<CudaFunction> {
        let hs = if source.per_head_size() { head_size } else { 0 };
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(&(source, hs)) {
                Some(m) => m.clone(),
                None => {
                    let image = nvrtc::compile(source, self.target, hs)?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(image.to_vec()))
                        .map_err(|e| cuda_err("cuModuleLoadData", e))?;
                    modules.insert((source, hs), m.clone());
                    m
                }
            }
        };
        module
            .load_function(name)
            .map_err(|e| cuda_err("cuModuleGetFunction", e))
    }
}

/// A launch over `n` elements with grid-stride loops: 256 threads, at
/// most 8192 blocks.
pub(crate) fn grid_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 8192);
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).unwrap_or(8192), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
