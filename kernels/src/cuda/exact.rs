//! The step's checks on the device: finiteness, and exact sums — the
//! device side of [`ExactSum`] (the gradient norm of every layout, the
//! reproducible mode's sum over ranks).
//!
//! The kernels (`reduce.cu`) accumulate integer significands into
//! fixed-point limbs with integer additions, so the result does not depend
//! on the grid, the order or the atomics; [`exact_sum`] and
//! [`exact_sum_squares`] hand the limbs to the host, which adds them (as
//! exact f64 pieces) into an [`ExactSum`] that rounds once — the same value
//! as the CPU's, bit for bit, mergeable with every other rank's.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use weft_numerics::ExactSum;

use super::device::Gpu;
use super::nvrtc::Source;
use super::ops::{check_dev, dim32, launch};
use crate::error::{Error, Result};

/// Limbs of `exact_sum` (signed, weight `2^(32k − 149)`) and of
/// `exact_sum_squares` (unsigned, `2^(32k − 298)`), as in reduce.cu.
const NL: usize = 10;
const NLQ: usize = 20;

fn reduce_grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            u32::try_from(n.div_ceil(256).clamp(1, 1024)).unwrap_or(1024),
            1,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The number of NaN or infinite values in `x`.
///
/// # Errors
/// [`Error::Cuda`] if the launch or the copy back fails.
pub fn count_nonfinite(gpu: &Gpu, x: &impl DevicePtr<f32>) -> Result<u64> {
    const OP: &str = "cuda::count_nonfinite";
    let n = x.len();
    if n == 0 {
        return Ok(0);
    }
    let out = gpu.zeros::<u64>(1)?;
    {
        let st = gpu.stream();
        let (o, _go) = out.device_ptr(st);
        let (xp, _gx) = x.device_ptr(st);
        let n64 = n as u64;
        launch!(
            gpu,
            OP,
            gpu.function(Source::Reduce, "count_nonfinite", 0)?,
            reduce_grid(n),
            [&o, &xp, &n64]
        );
    }
    Ok(gpu.download(&out)?[0])
}

/// 2^e as an f64 (e in the normal range).
fn pow2(e: i32) -> f64 {
    f64::from_bits(u64::try_from(e + 1023).unwrap_or(0) << 52)
}

fn run_limbs(
    gpu: &Gpu,
    op: &'static str,
    kernel: &'static str,
    x: &impl DevicePtr<f32>,
    limbs: usize,
) -> Result<Vec<u64>> {
    let n = x.len();
    if u32::try_from(n).is_err() {
        // Each 64-bit limb adds up 32-bit pieces: 2^32 of them could carry
        // out of it.
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{n} values: exact sums take at most 2^32 - 1 per call"),
        });
    }
    let out = gpu.zeros::<u64>(limbs + 4)?;
    if n > 0 {
        let st = gpu.stream();
        let (o, _go) = out.device_ptr(st);
        let (xp, _gx) = x.device_ptr(st);
        let n64 = n as u64;
        launch!(
            gpu,
            op,
            gpu.function(Source::Reduce, kernel, 0)?,
            reduce_grid(n),
            [&o, &xp, &n64]
        );
    }
    gpu.download(&out)
}

/// Adds the special values the flags record, as [`ExactSum::add`] of the
/// original values would have: NaN, ±∞, and a zero whose sign follows
/// ExactSum's rule (−0 only when every value was −0).
fn add_flags(sum: &mut ExactSum, flags: &[u64], n: usize, limbs_zero: bool) {
    let [nan, pos, neg, not_neg_zero] = [flags[0], flags[1], flags[2], flags[3]];
    if nan > 0 {
        sum.add(f64::NAN);
    }
    if pos > 0 {
        sum.add(f64::INFINITY);
    }
    if neg > 0 {
        sum.add(f64::NEG_INFINITY);
    }
    if n > 0 && limbs_zero {
        sum.add(if not_neg_zero == 0 { -0.0 } else { 0.0 });
    }
}

/// The exact sum of `x`, as an [`ExactSum`] equal in value (and so in every
/// rounding) to `ExactSum::add_slice(x)` on the host: NaN and infinities
/// and the sign of zero follow its rules.
///
/// # Errors
/// [`Error::InvalidArgument`] for 2^32 values or more; [`Error::Cuda`].
pub fn exact_sum(gpu: &Gpu, x: &impl DevicePtr<f32>) -> Result<ExactSum> {
    let raw = run_limbs(gpu, "cuda::exact_sum", "exact_sum", x, NL)?;
    let mut sum = ExactSum::new();
    let mut zero = true;
    for (k, &l) in raw[..NL].iter().enumerate() {
        #[allow(clippy::cast_possible_wrap)]
        let l = l as i64;
        let (hi, lo) = (l >> 32, l & 0xffff_ffff);
        let at = 32 * i32::try_from(k).unwrap_or(0) - 149;
        #[allow(clippy::cast_precision_loss)]
        for (piece, e) in [(lo, at), (hi, at + 32)] {
            if piece != 0 {
                // |piece| < 2^32: exact in f64, and so is the scaling.
                sum.add(piece as f64 * pow2(e));
                zero = false;
            }
        }
    }
    add_flags(&mut sum, &raw[NL..], x.len(), zero);
    Ok(sum)
}

/// The exact sum of the squares of `x` (each square exact in f64), as the
/// CPU's gradient norm accumulates it (`weft_parallel::add_squares`):
/// merge it with the other ranks' sums, take `to_f64().sqrt()`.
///
/// # Errors
/// As [`exact_sum`].
pub fn exact_sum_squares(gpu: &Gpu, x: &impl DevicePtr<f32>) -> Result<ExactSum> {
    let raw = run_limbs(gpu, "cuda::exact_sum_squares", "exact_sum_squares", x, NLQ)?;
    let mut sum = ExactSum::new();
    let mut zero = true;
    for (k, &l) in raw[..NLQ].iter().enumerate() {
        let (hi, lo) = (l >> 32, l & 0xffff_ffff);
        let at = 32 * i32::try_from(k).unwrap_or(0) - 298;
        #[allow(clippy::cast_precision_loss)]
        for (piece, e) in [(lo, at), (hi, at + 32)] {
            if piece != 0 {
                sum.add(piece as f64 * pow2(e));
                zero = false;
            }
        }
    }
    add_flags(&mut sum, &raw[NLQ..], x.len(), zero);
    Ok(sum)
}

/// `out[j] = Σ_r inp[r, j]` over `rows` stacked vectors `inp (rows, len)`,
/// each column summed exactly and rounded once to f32: bit for bit
/// `ExactSum::to_f32` of the column (the reproducible all-reduce's sum
/// over ranks), whatever the order of the rows.
///
/// # Errors
/// [`Error::ShapeMismatch`]; [`Error::InvalidArgument`] for more than 1024
/// rows (the accumulator's headroom); [`Error::Cuda`].
pub fn exact_sum_columns(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    rows: usize,
    len: usize,
) -> Result<()> {
    const OP: &str = "cuda::exact_sum_columns";
    check_dev(OP, "out", out, len)?;
    check_dev(OP, "inp", inp, rows * len)?;
    if rows > 1024 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("{rows} rows: at most 1024"),
        });
    }
    if len == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (o, _go) = out.device_ptr_mut(st);
    let (x, _gx) = inp.device_ptr(st);
    let (r32, len64) = (dim32(OP, "rows", rows)?, len as u64);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Reduce, "exact_sum_columns", 0)?,
        super::device::grid_for(len),
        [&o, &x, &r32, &len64]
    );
    Ok(())
}
