//! The linear layers' products on the GPU: cuBLAS (`cublasGemmEx`) in
//! [`Mode::Throughput`], the fixed-order kernel of `matmul.cu` in
//! [`Mode::BatchInvariant`], for both weight layouts and every backward
//! product.
//!
//! Precision as on the CPU ([`Precision`]): buffers stay f32; in bf16 and
//! fp16 the operands are rounded (for cuBLAS into the device's operand
//! buffer, [`Gpu::reserve_operands`], allocated once; by the invariant
//! kernel as it loads them) and the products accumulated in f32. With [`Precision::F32`] cuBLAS computes in f32
//! (`CUBLAS_COMPUTE_32F`), or TF32 where [`Gpu::set_tf32`] asks for it.
//!
//! cuBLAS is column-major: a row-major `(r, c)` matrix is its column-major
//! transpose, so a row-major `C = A·B` is the column-major `Cᵀ = Bᵀ·Aᵀ`
//! and every call below passes the second operand first.

use std::ffi::c_void;

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::device::{Gpu, cuda_err};
use super::nvrtc::Source;
use super::ops::{add_bias, check_dev, column_sums, dim32, launch};
use crate::error::{Error, Result};
use crate::{Mode, Precision};

/// A row-major operand: its device pointer, and whether the product reads
/// it transposed.
#[derive(Clone, Copy)]
struct Operand {
    ptr: u64,
    /// Leading dimension in elements (row length of the stored matrix).
    ld: usize,
    trans: bool,
}

/// Strides of the invariant kernel: `A[m, k] = a[m·sam + k·sak]`,
/// `B[k, n] = b[k·sbk + n·sbn]`.
#[derive(Clone, Copy)]
struct Strides {
    sam: u64,
    sak: u64,
    sbk: u64,
    sbn: u64,
}

/// One product `C (M, N) [+]= A (M, K) · B (K, N) [+ bias]`, row-major.
struct Product<'a> {
    op: &'static str,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    strides: Strides,
    accumulate: bool,
    bias: Option<&'a CudaView<'a, f32>>,
}

fn round_code(p: Precision) -> i32 {
    match p {
        Precision::F32 => 0,
        Precision::Bf16 => 1,
        Precision::F16 => 2,
    }
}

/// Runs `p` into `c` (row-major, leading dimension N).
fn run(
    gpu: &Gpu,
    p: &Product<'_>,
    c: &mut impl DevicePtrMut<f32>,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    match mode {
        Mode::BatchInvariant => invariant(gpu, p, c, precision),
        Mode::Throughput => {
            cublas(gpu, p, c, precision)?;
            if let Some(bias) = p.bias {
                add_bias(gpu, p.op, c, bias, p.m, p.n)?;
            }
            Ok(())
        }
    }
}

fn invariant(
    gpu: &Gpu,
    p: &Product<'_>,
    c: &mut impl DevicePtrMut<f32>,
    precision: Precision,
) -> Result<()> {
    let st = gpu.stream();
    let (cp, _gc) = c.device_ptr_mut(st);
    let (bp, _gb) = match p.bias {
        Some(b) => {
            let (x, g) = b.device_ptr(st);
            (x, Some(g))
        }
        None => (0, None),
    };
    let (m32, n32, k32) = (
        dim32(p.op, "M", p.m)?,
        dim32(p.op, "N", p.n)?,
        dim32(p.op, "K", p.k)?,
    );
    let s = p.strides;
    let ldc = p.n as u64;
    let acc = i32::from(p.accumulate);
    let round = round_code(precision);
    let cfg = LaunchConfig {
        grid_dim: (n32.div_ceil(64), m32.div_ceil(64), 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        gpu,
        p.op,
        gpu.function(Source::Matmul, "matmul_invariant", 0)?,
        cfg,
        [
            &cp, &p.a.ptr, &p.b.ptr, &bp, &m32, &n32, &k32, &s.sam, &s.sak, &s.sbk, &s.sbn, &ldc,
            &acc, &round
        ]
    );
    Ok(())
}

fn cublas(
    gpu: &Gpu,
    p: &Product<'_>,
    c: &mut impl DevicePtrMut<f32>,
    precision: Precision,
) -> Result<()> {
    let st = gpu.stream();
    // Rounded copies of the operands for the 16-bit products, side by side
    // in the device's operand buffer (held, so no other product rounds
    // into it before this one is queued).
    let a_len = p.m * p.k;
    let b_len = p.k * p.n;
    let held;
    let (a_ptr, b_ptr, dtype) = match precision {
        Precision::F32 => (p.a.ptr, p.b.ptr, cudaDataType_t::CUDA_R_32F),
        Precision::Bf16 | Precision::F16 => {
            let kernel = if precision == Precision::Bf16 {
                "to_bf16"
            } else {
                "to_f16"
            };
            held = gpu.operands(a_len + b_len)?;
            let base = held.as_ref().map_or(0, |buf| buf.device_ptr(st).0);
            let (ap, bp) = (base, base + 2 * a_len as u64);
            round_raw(gpu, p.op, kernel, ap, p.a.ptr, a_len)?;
            round_raw(gpu, p.op, kernel, bp, p.b.ptr, b_len)?;
            let dtype = if precision == Precision::Bf16 {
                cudaDataType_t::CUDA_R_16BF
            } else {
                cudaDataType_t::CUDA_R_16F
            };
            (ap, bp, dtype)
        }
    };
    let compute = if precision == Precision::F32 && gpu.tf32() {
        cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| Error::InvalidArgument {
            op: p.op,
            reason: format!("{what} = {v} is over cuBLAS's 32-bit dimensions"),
        })
    };
    // Column-major Cᵀ (N×M) = op(B)ᵀ (N×K) · op(A)ᵀ (K×M).
    let (m, n, k) = (int("N", p.n)?, int("M", p.m)?, int("K", p.k)?);
    let (lda, ldb, ldc) = (int("ld", p.b.ld)?, int("ld", p.a.ld)?, int("N", p.n)?);
    let alpha = 1.0f32;
    let beta = if p.accumulate { 1.0f32 } else { 0.0f32 };
    let (cp, _gc) = c.device_ptr_mut(st);
    let blas = gpu.blas()?;
    // SAFETY: the pointers are live device buffers of at least the sizes
    // the dimensions and leading dimensions imply (checked by the public
    // wrappers); alpha and beta are host f32 values (host pointer mode);
    // the handle runs on the device's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(p.b.trans),
            op(p.a.trans),
            m,
            n,
            k,
            (&raw const alpha).cast::<c_void>(),
            b_ptr as *const c_void,
            dtype,
            lda,
            a_ptr as *const c_void,
            dtype,
            ldb,
            (&raw const beta).cast::<c_void>(),
            cp as *mut c_void,
            cudaDataType_t::CUDA_R_32F,
            ldc,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| cuda_err(p.op, e))?;
    // The next product's rounding, queued after this one on the stream,
    // overwrites the copies only once this product has read them.
    Ok(())
}

/// `dst (n u16) = src (n f32)` rounded by `kernel` (`to_bf16`, `to_f16`),
/// on raw device pointers whose lengths the caller checked.
fn round_raw(
    gpu: &Gpu,
    op: &'static str,
    kernel: &'static str,
    dst: u64,
    src: u64,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    launch!(
        gpu,
        op,
        gpu.function(Source::Pointwise, kernel, 0)?,
        super::device::grid_for(n),
        [&dst, &src, &n64]
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn checks(
    op: &'static str,
    out: (&'static str, usize, usize),
    x: (&'static str, usize, usize),
    w: (&'static str, usize, usize),
) -> Result<()> {
    for (name, got, want) in [out, x, w] {
        if got != want {
            return Err(Error::ShapeMismatch {
                op,
                buffer: name,
                expected: want,
                got,
            });
        }
    }
    Ok(())
}

fn bias_check(op: &'static str, bias: Option<&CudaView<'_, f32>>, oc: usize) -> Result<()> {
    if let Some(b) = bias {
        check_dev(op, "bias", b, oc)?;
    }
    Ok(())
}

/// `out (BT, OC) = inp (BT, C) · weight (C, OC) + bias (OC)` — a weight
/// stored `[in, out]`, as the CPU's [`matmul_forward`](crate::matmul_forward).
///
/// # Errors
/// [`Error::ShapeMismatch`]; [`Error::InvalidArgument`] for dimensions
/// over 32 bits; [`Error::Cuda`], [`Error::Compile`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bias: Option<&CudaView<'_, f32>>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_forward";
    checks(
        OP,
        ("out", out.len(), bt * oc),
        ("inp", inp.len(), bt * c),
        ("weight", weight.len(), c * oc),
    )?;
    bias_check(OP, bias, oc)?;
    let st = gpu.stream();
    let (x, _gx) = inp.device_ptr(st);
    let (w, _gw) = weight.device_ptr(st);
    let p = Product {
        op: OP,
        m: bt,
        n: oc,
        k: c,
        a: Operand {
            ptr: x,
            ld: c,
            trans: false,
        },
        b: Operand {
            ptr: w,
            ld: oc,
            trans: false,
        },
        strides: Strides {
            sam: c as u64,
            sak: 1,
            sbk: oc as u64,
            sbn: 1,
        },
        accumulate: false,
        bias,
    };
    run(gpu, &p, out, mode, precision)
}

/// `out (BT, OC) = inp (BT, C) · weightᵀ + bias` — a weight stored
/// `[out, in]` `(OC, C)` (a tied language-model head), as the CPU's
/// [`matmul_forward_wt`](crate::matmul_forward_wt).
///
/// # Errors
/// As [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_wt(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bias: Option<&CudaView<'_, f32>>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_forward_wt";
    checks(
        OP,
        ("out", out.len(), bt * oc),
        ("inp", inp.len(), bt * c),
        ("weight", weight.len(), c * oc),
    )?;
    bias_check(OP, bias, oc)?;
    let st = gpu.stream();
    let (x, _gx) = inp.device_ptr(st);
    let (w, _gw) = weight.device_ptr(st);
    let p = Product {
        op: OP,
        m: bt,
        n: oc,
        k: c,
        a: Operand {
            ptr: x,
            ld: c,
            trans: false,
        },
        b: Operand {
            ptr: w,
            ld: c,
            trans: true,
        },
        strides: Strides {
            sam: c as u64,
            sak: 1,
            sbk: 1,
            sbn: c as u64,
        },
        accumulate: false,
        bias,
    };
    run(gpu, &p, out, mode, precision)
}

/// `dinp (BT, C) += dout (BT, OC) · weightᵀ`, the input gradient of
/// [`matmul_forward`] (weight `(C, OC)`). In [`Mode::BatchInvariant`] each
/// row's bits depend on its own row alone.
///
/// # Errors
/// As [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_input(
    gpu: &Gpu,
    dinp: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_backward_input";
    checks(
        OP,
        ("dinp", dinp.len(), bt * c),
        ("dout", dout.len(), bt * oc),
        ("weight", weight.len(), c * oc),
    )?;
    let st = gpu.stream();
    let (g, _gg) = dout.device_ptr(st);
    let (w, _gw) = weight.device_ptr(st);
    let p = Product {
        op: OP,
        m: bt,
        n: c,
        k: oc,
        a: Operand {
            ptr: g,
            ld: oc,
            trans: false,
        },
        b: Operand {
            ptr: w,
            ld: oc,
            trans: true,
        },
        strides: Strides {
            sam: oc as u64,
            sak: 1,
            sbk: 1,
            sbn: oc as u64,
        },
        accumulate: true,
        bias: None,
    };
    run(gpu, &p, dinp, mode, precision)
}

/// `dinp (BT, C) += dout (BT, OC) · weight (OC, C)`, the input gradient of
/// [`matmul_forward_wt`].
///
/// # Errors
/// As [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_wt_input(
    gpu: &Gpu,
    dinp: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_backward_wt_input";
    checks(
        OP,
        ("dinp", dinp.len(), bt * c),
        ("dout", dout.len(), bt * oc),
        ("weight", weight.len(), c * oc),
    )?;
    let st = gpu.stream();
    let (g, _gg) = dout.device_ptr(st);
    let (w, _gw) = weight.device_ptr(st);
    let p = Product {
        op: OP,
        m: bt,
        n: c,
        k: oc,
        a: Operand {
            ptr: g,
            ld: oc,
            trans: false,
        },
        b: Operand {
            ptr: w,
            ld: c,
            trans: false,
        },
        strides: Strides {
            sam: oc as u64,
            sak: 1,
            sbk: c as u64,
            sbn: 1,
        },
        accumulate: true,
        bias: None,
    };
    run(gpu, &p, dinp, mode, precision)
}

/// `dweight (C, OC) += inpᵀ · dout` and `dbias (OC) += Σ_rows dout`, the
/// parameter gradients of [`matmul_forward`]. cuBLAS in both modes
/// except that [`Mode::BatchInvariant`] uses the fixed-order kernel (its
/// reduction runs over the batch, so no mode makes it batch invariant;
/// both are deterministic run to run). The bias sum is deterministic
/// (fixed chunks of rows).
///
/// # Errors
/// As [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_weight(
    gpu: &Gpu,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: Option<&mut CudaViewMut<'_, f32>>,
    dout: &impl DevicePtr<f32>,
    inp: &impl DevicePtr<f32>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_backward_weight";
    checks(
        OP,
        ("dweight", dweight.len(), c * oc),
        ("dout", dout.len(), bt * oc),
        ("inp", inp.len(), bt * c),
    )?;
    if let Some(db) = &dbias {
        check_dev(OP, "dbias", &**db, oc)?;
    }
    {
        let st = gpu.stream();
        let (g, _gg) = dout.device_ptr(st);
        let (x, _gx) = inp.device_ptr(st);
        let p = Product {
            op: OP,
            m: c,
            n: oc,
            k: bt,
            a: Operand {
                ptr: x,
                ld: c,
                trans: true,
            },
            b: Operand {
                ptr: g,
                ld: oc,
                trans: false,
            },
            strides: Strides {
                sam: 1,
                sak: c as u64,
                sbk: oc as u64,
                sbn: 1,
            },
            accumulate: true,
            bias: None,
        };
        run(gpu, &p, dweight, mode, precision)?;
    }
    if let Some(db) = dbias {
        column_sums(gpu, OP, db, dout, bt, oc)?;
    }
    Ok(())
}

/// `dweight (OC, C) += doutᵀ · inp` and `dbias += Σ_rows dout`, the
/// parameter gradients of [`matmul_forward_wt`].
///
/// # Errors
/// As [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_wt_weight(
    gpu: &Gpu,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: Option<&mut CudaViewMut<'_, f32>>,
    dout: &impl DevicePtr<f32>,
    inp: &impl DevicePtr<f32>,
    bt: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "cuda::matmul_backward_wt_weight";
    checks(
        OP,
        ("dweight", dweight.len(), c * oc),
        ("dout", dout.len(), bt * oc),
        ("inp", inp.len(), bt * c),
    )?;
    if let Some(db) = &dbias {
        check_dev(OP, "dbias", &**db, oc)?;
    }
    {
        let st = gpu.stream();
        let (g, _gg) = dout.device_ptr(st);
        let (x, _gx) = inp.device_ptr(st);
        let p = Product {
            op: OP,
            m: oc,
            n: c,
            k: bt,
            a: Operand {
                ptr: g,
                ld: oc,
                trans: true,
            },
            b: Operand {
                ptr: x,
                ld: c,
                trans: false,
            },
            strides: Strides {
                sam: 1,
                sak: oc as u64,
                sbk: c as u64,
                sbn: 1,
            },
            accumulate: true,
            bias: None,
        };
        run(gpu, &p, dweight, mode, precision)?;
    }
    if let Some(db) = dbias {
        column_sums(gpu, OP, db, dout, bt, oc)?;
    }
    Ok(())
}
