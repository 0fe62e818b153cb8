//! The GPU ops: launch wrappers over the NVRTC kernels, with the CPU
//! kernels' names, arguments and shape checks.

use cudarc::driver::{
    CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, LaunchConfig, PushKernelArg,
};

use super::device::{Gpu, grid_for};
use super::nvrtc::Source;
use crate::adamw::{AdamW, Consts};
use crate::embedding::check_tokens;
use crate::error::{Error, Result};

/// Checks a device buffer's length against the dimensions.
pub(crate) fn check_dev<T>(
    op: &'static str,
    buffer: &'static str,
    buf: &impl DeviceSlice<T>,
    expected: usize,
) -> Result<()> {
    if buf.len() == expected {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            op,
            buffer,
            expected,
            got: buf.len(),
        })
    }
}

/// A dimension as the kernels' `u32`.
pub(crate) fn dim32(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument {
        op,
        reason: format!("{what} = {v} does not fit the kernels' 32-bit indices"),
    })
}

fn blocks(n: usize, per: usize) -> u32 {
    u32::try_from(n.div_ceil(per).max(1)).unwrap_or(u32::MAX)
}

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `f` with the arguments pushed by `args`, mapping the error.
macro_rules! launch {
    ($gpu:expr, $op:expr, $f:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let f = $f;
        let mut b = $gpu.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: every pointer argument comes from a live device buffer
        // whose length was checked against the dimensions passed with it,
        // and the kernel's parameter list matches these arguments (types
        // and order) as its source declares them.
        unsafe { b.launch($cfg) }.map_err(|e| $crate::cuda::device::cuda_err($op, e))?;
    }};
}
pub(crate) use launch;

/// `out = GELU(inp)` (tanh approximation), bit for bit the CPU's
/// [`gelu_forward`](crate::gelu_forward).
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong length; [`Error::Cuda`] if the
/// launch fails.
pub fn gelu_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda::gelu_forward";
    check_dev(OP, "out", out, n)?;
    check_dev(OP, "inp", inp, n)?;
    if n == 0 {
        return Ok(());
    }
    let (s, k, _) = gelu_consts();
    let st = gpu.stream();
    let (o, _go) = out.device_ptr_mut(st);
    let (i, _gi) = inp.device_ptr(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Pointwise, "gelu_forward", 0)?,
        grid_for(n),
        [&o, &i, &n64, &s, &k]
    );
    Ok(())
}

/// The CPU's constants, rounded as it rounds them: √(2/π), 0.044715, 3·0.044715.
#[allow(clippy::cast_possible_truncation)]
fn gelu_consts() -> (f32, f32, f32) {
    (
        (2.0 / std::f64::consts::PI).sqrt() as f32,
        0.044715f64 as f32,
        (3.0 * 0.044715f64) as f32,
    )
}

/// `dinp += GELU'(inp) · dout`, bit for bit the CPU's
/// [`gelu_backward`](crate::gelu_backward).
///
/// # Errors
/// As [`gelu_forward`].
pub fn gelu_backward(
    gpu: &Gpu,
    dinp: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    dout: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda::gelu_backward";
    check_dev(OP, "dinp", dinp, n)?;
    check_dev(OP, "inp", inp, n)?;
    check_dev(OP, "dout", dout, n)?;
    if n == 0 {
        return Ok(());
    }
    let (s, k, k3) = gelu_consts();
    let st = gpu.stream();
    let (d, _gd) = dinp.device_ptr_mut(st);
    let (i, _gi) = inp.device_ptr(st);
    let (g, _gg) = dout.device_ptr(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Pointwise, "gelu_backward", 0)?,
        grid_for(n),
        [&d, &i, &g, &n64, &s, &k, &k3]
    );
    Ok(())
}

/// `out = a + b`.
///
/// # Errors
/// As [`gelu_forward`].
pub fn residual_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda::residual_forward";
    check_dev(OP, "out", out, n)?;
    check_dev(OP, "a", a, n)?;
    check_dev(OP, "b", b, n)?;
    if n == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (o, _go) = out.device_ptr_mut(st);
    let (x, _gx) = a.device_ptr(st);
    let (y, _gy) = b.device_ptr(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Pointwise, "residual_forward", 0)?,
        grid_for(n),
        [&o, &x, &y, &n64]
    );
    Ok(())
}

/// `dst += src` element-wise.
///
/// # Errors
/// As [`gelu_forward`].
pub fn accumulate(
    gpu: &Gpu,
    dst: &mut impl DevicePtrMut<f32>,
    src: &impl DevicePtr<f32>,
) -> Result<()> {
    const OP: &str = "cuda::accumulate";
    let n = dst.len();
    check_dev(OP, "src", src, n)?;
    if n == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (d, _gd) = dst.device_ptr_mut(st);
    let (s, _gs) = src.device_ptr(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Pointwise, "accumulate", 0)?,
        grid_for(n),
        [&d, &s, &n64]
    );
    Ok(())
}

/// `da += dout`, `db += dout`: the backward of [`residual_forward`].
///
/// # Errors
/// As [`gelu_forward`].
pub fn residual_backward(
    gpu: &Gpu,
    da: &mut impl DevicePtrMut<f32>,
    db: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda::residual_backward";
    check_dev(OP, "da", da, n)?;
    check_dev(OP, "db", db, n)?;
    check_dev(OP, "dout", dout, n)?;
    accumulate(gpu, da, dout)?;
    accumulate(gpu, db, dout)
}

/// `buf *= a` element-wise.
///
/// # Errors
/// [`Error::Cuda`] if the launch fails.
pub fn scale(gpu: &Gpu, buf: &mut impl DevicePtrMut<f32>, a: f32) -> Result<()> {
    const OP: &str = "cuda::scale";
    let n = buf.len();
    if n == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (d, _gd) = buf.device_ptr_mut(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Pointwise, "scale", 0)?,
        grid_for(n),
        [&d, &n64, &a]
    );
    Ok(())
}

/// `dst = src` rounded to bf16 (ties to even; raw bits): the operand
/// copies of the bf16 products, and the weights' bf16 copy.
///
/// # Errors
/// As [`gelu_forward`].
pub fn round_to_bf16(
    gpu: &Gpu,
    dst: &mut impl DevicePtrMut<u16>,
    src: &impl DevicePtr<f32>,
) -> Result<()> {
    round_to(gpu, "cuda::round_to_bf16", "to_bf16", dst, src)
}

pub(crate) fn round_to(
    gpu: &Gpu,
    op: &'static str,
    kernel: &'static str,
    dst: &mut impl DevicePtrMut<u16>,
    src: &impl DevicePtr<f32>,
) -> Result<()> {
    let n = src.len();
    check_dev(op, "dst", dst, n)?;
    if n == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (d, _gd) = dst.device_ptr_mut(st);
    let (s, _gs) = src.device_ptr(st);
    let n64 = n as u64;
    launch!(
        gpu,
        op,
        gpu.function(Source::Pointwise, kernel, 0)?,
        grid_for(n),
        [&d, &s, &n64]
    );
    Ok(())
}

fn check_positions(
    op: &'static str,
    positions: Option<&[u32]>,
    max_t: usize,
    rows: usize,
) -> Result<()> {
    let Some(p) = positions else { return Ok(()) };
    if p.len() != rows {
        return Err(Error::ShapeMismatch {
            op,
            buffer: "positions",
            expected: rows,
            got: p.len(),
        });
    }
    match p.iter().position(|&x| x as usize >= max_t) {
        None => Ok(()),
        Some(row) => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "position {} of row {row} is outside the position table of {max_t}",
                p[row]
            ),
        }),
    }
}

fn table_rows(op: &'static str, name: &str, len: usize, c: usize) -> Result<usize> {
    if c == 0 || !len.is_multiple_of(c) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{name} has {len} elements, not a multiple of C={c}"),
        });
    }
    Ok(len / c)
}

/// `out (B,T,C) = wte[tokens] + wpe[positions]`, the CPU's
/// [`encoder_forward`](crate::encoder_forward) bit for bit. `tokens` and
/// `positions` are host slices (they come from the data loader), copied
/// to the device by the call.
///
/// # Errors
/// As the CPU's: [`Error::ShapeMismatch`], [`Error::TokenOutOfRange`],
/// [`Error::InvalidArgument`]; [`Error::Cuda`] if a copy or the launch
/// fails.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    tokens: &[u32],
    positions: Option<&[u32]>,
    wte: &impl DevicePtr<f32>,
    wpe: &impl DevicePtr<f32>,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "cuda::encoder_forward";
    check_dev(OP, "out", out, b * t * c)?;
    if tokens.len() != b * t {
        return Err(Error::ShapeMismatch {
            op: OP,
            buffer: "tokens",
            expected: b * t,
            got: tokens.len(),
        });
    }
    let max_t = table_rows(OP, "wpe", wpe.len(), c)?;
    if max_t < t {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "position table has {} elements; need at least T*C = {t}*{c}",
                wpe.len()
            ),
        });
    }
    check_positions(OP, positions, max_t, b * t)?;
    let v = table_rows(OP, "wte", wte.len(), c)?;
    check_tokens(OP, tokens, v)?;
    if b * t == 0 {
        return Ok(());
    }
    let tok = gpu.upload(tokens)?;
    let pos = positions.map(|p| gpu.upload(p)).transpose()?;
    let st = gpu.stream();
    let (o, _go) = out.device_ptr_mut(st);
    let (tk, _gt) = tok.device_ptr(st);
    let (ps, _gp) = match &pos {
        Some(p) => {
            let (x, g) = p.device_ptr(st);
            (x, Some(g))
        }
        None => (0, None),
    };
    let (we, _ge) = wte.device_ptr(st);
    let (wp, _gw) = wpe.device_ptr(st);
    let n64 = (b * t) as u64;
    let (t32, c32) = (dim32(OP, "T", t)?, dim32(OP, "C", c)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Encoder, "encoder_forward", 0)?,
        grid_for(b * t * c),
        [&o, &tk, &ps, &we, &wp, &n64, &t32, &c32]
    );
    Ok(())
}

/// Rows grouped by id: `(ids, starts, rows)`, each group's rows in
/// increasing order (a stable sort by id).
fn group_rows(ids: impl Iterator<Item = u32>) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut pairs: Vec<(u32, u32)> = ids
        .enumerate()
        .map(|(row, id)| (id, u32::try_from(row).unwrap_or(u32::MAX)))
        .collect();
    pairs.sort_by_key(|&(id, _)| id);
    let mut uniq = Vec::new();
    let mut starts = Vec::new();
    let mut rows = Vec::with_capacity(pairs.len());
    for (i, &(id, row)) in pairs.iter().enumerate() {
        if i == 0 || pairs[i - 1].0 != id {
            uniq.push(id);
            starts.push(u32::try_from(i).unwrap_or(u32::MAX));
        }
        rows.push(row);
    }
    starts.push(u32::try_from(pairs.len()).unwrap_or(u32::MAX));
    (uniq, starts, rows)
}

fn embedding_backward(
    gpu: &Gpu,
    op: &'static str,
    d: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    ids: impl Iterator<Item = u32>,
    c: usize,
) -> Result<()> {
    let (uniq, starts, rows) = group_rows(ids);
    if uniq.is_empty() || c == 0 {
        return Ok(());
    }
    let (u, s, r) = (gpu.upload(&uniq)?, gpu.upload(&starts)?, gpu.upload(&rows)?);
    let st = gpu.stream();
    let (dp, _gd) = d.device_ptr_mut(st);
    let (g, _gg) = dout.device_ptr(st);
    let (up, _gu) = u.device_ptr(st);
    let (sp, _gs) = s.device_ptr(st);
    let (rp, _gr) = r.device_ptr(st);
    let c32 = dim32(op, "C", c)?;
    let threads = 256;
    launch!(
        gpu,
        op,
        gpu.function(Source::Encoder, "embedding_backward", 0)?,
        cfg(
            (
                dim32(op, "distinct ids", uniq.len())?,
                blocks(c, threads),
                1
            ),
            threads as u32
        ),
        [&dp, &g, &up, &sp, &rp, &c32]
    );
    Ok(())
}

/// Backward of [`encoder_forward`]: `dwte[tokens] += dout`,
/// `dwpe[positions] += dout`, rows of one id added in row order — the
/// CPU's [`encoder_backward`](crate::encoder_backward) bit for bit, and
/// deterministic (no atomics).
///
/// # Errors
/// As [`encoder_forward`].
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward(
    gpu: &Gpu,
    dwte: &mut impl DevicePtrMut<f32>,
    dwpe: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    tokens: &[u32],
    positions: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "cuda::encoder_backward";
    check_dev(OP, "dout", dout, b * t * c)?;
    if tokens.len() != b * t {
        return Err(Error::ShapeMismatch {
            op: OP,
            buffer: "tokens",
            expected: b * t,
            got: tokens.len(),
        });
    }
    let max_t = table_rows(OP, "dwpe", dwpe.len(), c)?;
    if max_t < t {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "position table has {} elements; need at least T*C = {t}*{c}",
                dwpe.len()
            ),
        });
    }
    check_positions(OP, positions, max_t, b * t)?;
    let v = table_rows(OP, "dwte", dwte.len(), c)?;
    check_tokens(OP, tokens, v)?;
    embedding_backward(gpu, OP, dwte, dout, tokens.iter().copied(), c)?;
    let t32 = u32::try_from(t.max(1)).unwrap_or(u32::MAX);
    match positions {
        Some(p) => embedding_backward(gpu, OP, dwpe, dout, p.iter().copied(), c),
        None => embedding_backward(
            gpu,
            OP,
            dwpe,
            dout,
            (0..b * t).map(|r| u32::try_from(r).unwrap_or(u32::MAX) % t32),
            c,
        ),
    }
}

/// Layer normalisation of `n` rows of `c` channels, saving `mean (N)` and
/// `rstd (N)`; the CPU's [`layernorm_forward`](crate::layernorm_forward)
/// to f32 rounding (its row sums run in another order).
///
/// # Errors
/// As [`gelu_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    mean: &mut impl DevicePtrMut<f32>,
    rstd: &mut impl DevicePtrMut<f32>,
    inp: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    bias: &impl DevicePtr<f32>,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "cuda::layernorm_forward";
    check_dev(OP, "out", out, n * c)?;
    check_dev(OP, "mean", mean, n)?;
    check_dev(OP, "rstd", rstd, n)?;
    check_dev(OP, "inp", inp, n * c)?;
    check_dev(OP, "weight", weight, c)?;
    check_dev(OP, "bias", bias, c)?;
    if n == 0 || c == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (o, _g1) = out.device_ptr_mut(st);
    let (m, _g2) = mean.device_ptr_mut(st);
    let (r, _g3) = rstd.device_ptr_mut(st);
    let (x, _g4) = inp.device_ptr(st);
    let (w, _g5) = weight.device_ptr(st);
    let (bb, _g6) = bias.device_ptr(st);
    let (n32, c32) = (dim32(OP, "N", n)?, dim32(OP, "C", c)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Layernorm, "layernorm_forward", 0)?,
        cfg((blocks(n, 8), 1, 1), 256),
        [&o, &m, &r, &x, &w, &bb, &n32, &c32, &eps]
    );
    Ok(())
}

/// The input-gradient half of [`layernorm_backward`]: `dinp +=`.
///
/// # Errors
/// As [`gelu_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input(
    gpu: &Gpu,
    dinp: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    inp: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "cuda::layernorm_backward_input";
    check_dev(OP, "dinp", dinp, n * c)?;
    check_dev(OP, "dout", dout, n * c)?;
    check_dev(OP, "inp", inp, n * c)?;
    check_dev(OP, "weight", weight, c)?;
    check_dev(OP, "mean", mean, n)?;
    check_dev(OP, "rstd", rstd, n)?;
    if n == 0 || c == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (di, _g1) = dinp.device_ptr_mut(st);
    let (g, _g2) = dout.device_ptr(st);
    let (x, _g3) = inp.device_ptr(st);
    let (w, _g4) = weight.device_ptr(st);
    let (m, _g5) = mean.device_ptr(st);
    let (r, _g6) = rstd.device_ptr(st);
    let (n32, c32) = (dim32(OP, "N", n)?, dim32(OP, "C", c)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Layernorm, "layernorm_backward_input", 0)?,
        cfg((blocks(n, 8), 1, 1), 256),
        [&di, &g, &x, &w, &m, &r, &n32, &c32]
    );
    Ok(())
}

/// Rows per chunk of the deterministic column sums.
const ROWS_PER_CHUNK: usize = 256;

/// The parameter-gradient half of [`layernorm_backward`]: `dweight +=`,
/// `dbias +=`, summed over rows in fixed chunks then over chunks in order
/// (deterministic; the CPU sums rows in order, so the two agree to
/// rounding).
///
/// # Errors
/// As [`gelu_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_weight(
    gpu: &Gpu,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    inp: &impl DevicePtr<f32>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "cuda::layernorm_backward_weight";
    check_dev(OP, "dweight", dweight, c)?;
    check_dev(OP, "dbias", dbias, c)?;
    check_dev(OP, "dout", dout, n * c)?;
    check_dev(OP, "inp", inp, n * c)?;
    check_dev(OP, "mean", mean, n)?;
    check_dev(OP, "rstd", rstd, n)?;
    if n == 0 || c == 0 {
        return Ok(());
    }
    let chunks = n.div_ceil(ROWS_PER_CHUNK);
    let partial = gpu.zeros::<f32>(chunks * 2 * c)?;
    let st = gpu.stream();
    let (p, _gp) = partial.device_ptr(st);
    let (g, _g2) = dout.device_ptr(st);
    let (x, _g3) = inp.device_ptr(st);
    let (m, _g5) = mean.device_ptr(st);
    let (r, _g6) = rstd.device_ptr(st);
    let (n32, c32) = (dim32(OP, "N", n)?, dim32(OP, "C", c)?);
    let (rpc, ch32) = (ROWS_PER_CHUNK as u32, dim32(OP, "chunks", chunks)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Layernorm, "layernorm_backward_weight_partial", 0)?,
        cfg((blocks(c, 128), ch32, 1), 128),
        [&p, &g, &x, &m, &r, &n32, &c32, &rpc]
    );
    let (dw, _g7) = dweight.device_ptr_mut(st);
    let (db, _g8) = dbias.device_ptr_mut(st);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Layernorm, "layernorm_backward_weight_finish", 0)?,
        cfg((blocks(c, 128), 1, 1), 128),
        [&dw, &db, &p, &ch32, &c32]
    );
    Ok(())
}

/// Backward of [`layernorm_forward`]: [`layernorm_backward_input`] then
/// [`layernorm_backward_weight`].
///
/// # Errors
/// As [`gelu_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    gpu: &Gpu,
    dinp: &mut impl DevicePtrMut<f32>,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    inp: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    layernorm_backward_input(gpu, dinp, dout, inp, weight, mean, rstd, n, c)?;
    layernorm_backward_weight(gpu, dweight, dbias, dout, inp, mean, rstd, n, c)
}

/// `dbias (OC) += Σ_rows dout (N, OC)`: a bias gradient on its own (the
/// `dbias` of [`matmul_backward_weight`](super::matmul_backward_weight)),
/// deterministic (fixed chunks of rows, then the chunks in order).
///
/// # Errors
/// [`Error::ShapeMismatch`]; [`Error::Cuda`].
pub fn bias_backward(
    gpu: &Gpu,
    dbias: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    n: usize,
    oc: usize,
) -> Result<()> {
    const OP: &str = "cuda::bias_backward";
    check_dev(OP, "dbias", dbias, oc)?;
    check_dev(OP, "dout", dout, n * oc)?;
    column_sums(gpu, OP, dbias, dout, n, oc)
}

/// Sets every element of `buf` to zero (a memset: NaNs too).
///
/// # Errors
/// [`Error::Cuda`].
pub fn zero(gpu: &Gpu, buf: &mut impl DevicePtrMut<f32>) -> Result<()> {
    if buf.len() == 0 {
        return Ok(());
    }
    gpu.stream()
        .memset_zeros(buf)
        .map_err(|e| crate::cuda::device::cuda_err("cuda::zero", e))
}

/// `dbias (OC) += Σ_rows dout (N, OC)`, deterministic (fixed chunks).
pub(crate) fn column_sums(
    gpu: &Gpu,
    op: &'static str,
    dbias: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    n: usize,
    oc: usize,
) -> Result<()> {
    if n == 0 || oc == 0 {
        return Ok(());
    }
    let chunks = n.div_ceil(ROWS_PER_CHUNK);
    let partial = gpu.zeros::<f32>(chunks * oc)?;
    let st = gpu.stream();
    let (p, _gp) = partial.device_ptr(st);
    let (g, _gg) = dout.device_ptr(st);
    let (n32, oc32) = (dim32(op, "N", n)?, dim32(op, "OC", oc)?);
    let (rpc, ch32) = (ROWS_PER_CHUNK as u32, dim32(op, "chunks", chunks)?);
    launch!(
        gpu,
        op,
        gpu.function(Source::Layernorm, "column_sum_partial", 0)?,
        cfg((blocks(oc, 128), ch32, 1), 128),
        [&p, &g, &n32, &oc32, &rpc]
    );
    let (d, _gd) = dbias.device_ptr_mut(st);
    launch!(
        gpu,
        op,
        gpu.function(Source::Layernorm, "column_sum_finish", 0)?,
        cfg((blocks(oc, 128), 1, 1), 128),
        [&d, &p, &ch32, &oc32]
    );
    Ok(())
}

/// `out (N, OC) += bias (OC)` on every row.
pub(crate) fn add_bias(
    gpu: &Gpu,
    op: &'static str,
    out: &mut impl DevicePtrMut<f32>,
    bias: &CudaView<'_, f32>,
    n: usize,
    oc: usize,
) -> Result<()> {
    if n * oc == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (o, _go) = out.device_ptr_mut(st);
    let (b, _gb) = bias.device_ptr(st);
    let (n64, oc32) = (n as u64, dim32(op, "OC", oc)?);
    launch!(
        gpu,
        op,
        gpu.function(Source::Layernorm, "add_bias", 0)?,
        grid_for(n * oc),
        [&o, &b, &n64, &oc32]
    );
    Ok(())
}

/// Threads per block of the attention kernels for head size `hs` (the
/// `ROWS` of attention.cu).
fn attention_rows(hs: usize) -> u32 {
    if hs <= 64 {
        64
    } else {
        u32::try_from(4096 / hs).unwrap_or(16)
    }
}

fn attention_dims(op: &'static str, b: usize, t: usize, c: usize, nh: usize) -> Result<usize> {
    if nh == 0 || !c.is_multiple_of(nh) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("C = {c} is not divisible by NH = {nh}"),
        });
    }
    let hs = c / nh;
    if hs > 256 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("head size {hs} is over the GPU kernels' 256"),
        });
    }
    dim32(op, "B", b)?;
    dim32(op, "T", t)?;
    Ok(hs)
}

fn check_docs(op: &'static str, docs: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
    let Some(d) = docs else { return Ok(()) };
    if d.len() != b * t {
        return Err(Error::ShapeMismatch {
            op,
            buffer: "docs",
            expected: b * t,
            got: d.len(),
        });
    }
    if let Some(r) = (0..b * t).find(|&r| d[r] as usize > r % t) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "row {} of sequence {} starts its document at {}, after itself",
                r % t,
                r / t,
                d[r]
            ),
        });
    }
    Ok(())
}

/// Causal attention, flash-style: `out (B,T,C)` and `lse (B,NH,T)` (each
/// row's log-sum-exp of its scaled scores, what the backward needs) from
/// `qkv (B,T,3C)`; no `(T, T)` matrix is stored. `docs` (host, `(B,T)`)
/// masks at document starts as the CPU's
/// [`attention_forward`](crate::attention_forward) does. Agrees with the
/// CPU's `out` to f32 rounding.
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::InvalidArgument`] (NH not dividing
/// C, a head size over 256, a document starting after its row);
/// [`Error::Cuda`], [`Error::Compile`].
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<f32>,
    lse: &mut impl DevicePtrMut<f32>,
    qkv: &impl DevicePtr<f32>,
    docs: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    const OP: &str = "cuda::attention_forward";
    let hs = attention_dims(OP, b, t, c, nh)?;
    check_dev(OP, "out", out, b * t * c)?;
    check_dev(OP, "lse", lse, b * nh * t)?;
    check_dev(OP, "qkv", qkv, b * t * 3 * c)?;
    check_docs(OP, docs, b, t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    let dev_docs = docs.map(|d| gpu.upload(d)).transpose()?;
    let rows = attention_rows(hs);
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
    let scale = (1.0 / (hs as f64).sqrt()) as f32;
    let st = gpu.stream();
    let (o, _g1) = out.device_ptr_mut(st);
    let (l, _g2) = lse.device_ptr_mut(st);
    let (q, _g3) = qkv.device_ptr(st);
    let (dd, _g4) = match &dev_docs {
        Some(d) => {
            let (p, g) = d.device_ptr(st);
            (p, Some(g))
        }
        None => (0, None),
    };
    let (t32, nh32) = (t as u32, dim32(OP, "NH", nh)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Attention, "attention_forward", hs)?,
        cfg((blocks(t, rows as usize), nh32, b as u32), rows),
        [&o, &l, &q, &dd, &t32, &nh32, &scale]
    );
    Ok(())
}

/// Backward of [`attention_forward`], accumulating into `dqkv (B,T,3C)`:
/// recomputes each probability from `qkv` and the saved `lse`, with the
/// forward's `out` for the softmax correction `rowsum(dout ⊙ out)`. Two
/// deterministic passes (dK and dV by key tiles, dQ by query tiles), no
/// atomics. Agrees with the CPU's
/// [`attention_backward`](crate::attention_backward) to f32 rounding.
///
/// # Errors
/// As [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    gpu: &Gpu,
    dqkv: &mut impl DevicePtrMut<f32>,
    dout: &impl DevicePtr<f32>,
    qkv: &impl DevicePtr<f32>,
    out: &impl DevicePtr<f32>,
    lse: &impl DevicePtr<f32>,
    docs: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    const OP: &str = "cuda::attention_backward";
    let hs = attention_dims(OP, b, t, c, nh)?;
    check_dev(OP, "dqkv", dqkv, b * t * 3 * c)?;
    check_dev(OP, "dout", dout, b * t * c)?;
    check_dev(OP, "qkv", qkv, b * t * 3 * c)?;
    check_dev(OP, "out", out, b * t * c)?;
    check_dev(OP, "lse", lse, b * nh * t)?;
    check_docs(OP, docs, b, t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    let dev_docs = docs.map(|d| gpu.upload(d)).transpose()?;
    let delta = gpu.zeros::<f32>(b * nh * t)?;
    let rows = attention_rows(hs);
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
    let scale = (1.0 / (hs as f64).sqrt()) as f32;
    let st = gpu.stream();
    let (dl, _g0) = delta.device_ptr(st);
    let (g, _g2) = dout.device_ptr(st);
    let (q, _g3) = qkv.device_ptr(st);
    let (o, _g4) = out.device_ptr(st);
    let (l, _g5) = lse.device_ptr(st);
    let (dd, _g6) = match &dev_docs {
        Some(d) => {
            let (p, g) = d.device_ptr(st);
            (p, Some(g))
        }
        None => (0, None),
    };
    let (b32, t32, nh32) = (b as u32, t as u32, dim32(OP, "NH", nh)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Attention, "attention_backward_delta", hs)?,
        grid_for(b * t * nh),
        [&dl, &g, &o, &b32, &t32, &nh32]
    );
    let (dq, _g1) = dqkv.device_ptr_mut(st);
    let grid = (blocks(t, rows as usize), nh32, b32);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Attention, "attention_backward_dkdv", hs)?,
        cfg(grid, rows),
        [&dq, &g, &q, &l, &dl, &dd, &t32, &nh32, &scale]
    );
    launch!(
        gpu,
        OP,
        gpu.function(Source::Attention, "attention_backward_dq", hs)?,
        cfg(grid, rows),
        [&dq, &g, &q, &l, &dl, &dd, &t32, &nh32, &scale]
    );
    Ok(())
}

fn classifier_checks(
    op: &'static str,
    targets: &[u32],
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    if targets.len() != n {
        return Err(Error::ShapeMismatch {
            op,
            buffer: "targets",
            expected: n,
            got: targets.len(),
        });
    }
    if v_real > v || v_real == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("v_real = {v_real} must be in 1..={v}"),
        });
    }
    check_tokens(op, targets, v_real)
}

/// The loss of the fused softmax + cross-entropy: `losses (N)` and the
/// row statistics `stats (N, 2)` = (max, Σ exp) for the backward, from
/// `logits (N, V)` (only the first `v_real` columns take part), as the
/// CPU's [`fused_classifier_forward`](crate::fused_classifier_forward):
/// the maxima are its bits, the sums and losses agree to f32 rounding.
/// `targets` is a host slice, copied by the call.
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::InvalidArgument`],
/// [`Error::TokenOutOfRange`]; [`Error::Cuda`].
#[allow(clippy::too_many_arguments)]
pub fn fused_classifier_forward(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    losses: &mut impl DevicePtrMut<f32>,
    stats: &mut impl DevicePtrMut<f32>,
    targets: &[u32],
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    const OP: &str = "cuda::fused_classifier_forward";
    check_dev(OP, "logits", logits, n * v)?;
    check_dev(OP, "losses", losses, n)?;
    check_dev(OP, "stats", stats, 2 * n)?;
    classifier_checks(OP, targets, n, v, v_real)?;
    if n == 0 {
        return Ok(());
    }
    let tg = gpu.upload(targets)?;
    let st = gpu.stream();
    let (x, _g1) = logits.device_ptr(st);
    let (l, _g2) = losses.device_ptr_mut(st);
    let (s, _g3) = stats.device_ptr_mut(st);
    let (tp, _g4) = tg.device_ptr(st);
    let (v32, vr32) = (dim32(OP, "V", v)?, dim32(OP, "v_real", v_real)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Classifier, "fused_classifier_forward", 0)?,
        cfg((dim32(OP, "N", n)?, 1, 1), 512),
        [&x, &l, &s, &tp, &v32, &vr32]
    );
    Ok(())
}

/// Overwrites `logits (N, V)` with the gradient of `dloss · Σ losses`,
/// `(softmax − onehot(target)) · dloss`, from the saved `stats`: given
/// the same statistics, the CPU's
/// [`fused_classifier_backward`](crate::fused_classifier_backward) bit
/// for bit. Padding columns `v_real..v` get 0.
///
/// # Errors
/// As [`fused_classifier_forward`].
#[allow(clippy::too_many_arguments)]
pub fn fused_classifier_backward(
    gpu: &Gpu,
    logits: &mut impl DevicePtrMut<f32>,
    stats: &impl DevicePtr<f32>,
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    const OP: &str = "cuda::fused_classifier_backward";
    check_dev(OP, "logits", logits, n * v)?;
    check_dev(OP, "stats", stats, 2 * n)?;
    classifier_checks(OP, targets, n, v, v_real)?;
    if n == 0 {
        return Ok(());
    }
    let tg = gpu.upload(targets)?;
    let st = gpu.stream();
    let (x, _g1) = logits.device_ptr_mut(st);
    let (s, _g3) = stats.device_ptr(st);
    let (tp, _g4) = tg.device_ptr(st);
    let (v32, vr32) = (dim32(OP, "V", v)?, dim32(OP, "v_real", v_real)?);
    launch!(
        gpu,
        OP,
        gpu.function(Source::Classifier, "fused_classifier_backward", 0)?,
        cfg((dim32(OP, "N", n)?, 1, 1), 512),
        [&x, &s, &tp, &dloss, &v32, &vr32]
    );
    Ok(())
}

/// One AdamW step on f32 master weights with f32 moments, bit for bit the
/// CPU's [`adamw_update`](crate::adamw_update); when `params_bf16` is
/// given, the updated weights rounded to bf16 are written there too (the
/// copy the bf16 products read), in the same pass.
///
/// # Errors
/// [`Error::ShapeMismatch`] if the buffers differ in length,
/// [`Error::InvalidArgument`] if `step` is 0; [`Error::Cuda`].
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    gpu: &Gpu,
    params: &mut impl DevicePtrMut<f32>,
    params_bf16: Option<&mut CudaViewMut<'_, u16>>,
    grads: &impl DevicePtr<f32>,
    m: &mut impl DevicePtrMut<f32>,
    v: &mut impl DevicePtrMut<f32>,
    hp: &AdamW,
    step: u32,
    decay: bool,
) -> Result<()> {
    const OP: &str = "cuda::adamw_update";
    let n = params.len();
    check_dev(OP, "grads", grads, n)?;
    check_dev(OP, "m", m, n)?;
    check_dev(OP, "v", v, n)?;
    if let Some(h) = &params_bf16 {
        check_dev(OP, "params_bf16", *h, n)?;
    }
    let k = Consts::new(OP, hp, step, decay)?;
    if n == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let (p, _g1) = params.device_ptr_mut(st);
    let (h, _g2) = match params_bf16 {
        Some(h) => {
            let (x, g) = h.device_ptr_mut(st);
            (x, Some(g))
        }
        None => (0, None),
    };
    let (g, _g3) = grads.device_ptr(st);
    let (mp, _g4) = m.device_ptr_mut(st);
    let (vp, _g5) = v.device_ptr_mut(st);
    let n64 = n as u64;
    launch!(
        gpu,
        OP,
        gpu.function(Source::Adamw, "adamw", 0)?,
        grid_for(n),
        [
            &p,
            &h,
            &g,
            &mp,
            &vp,
            &n64,
            &k.keep,
            &k.b1,
            &k.b2,
            &k.step_size,
            &k.bc2_sqrt,
            &k.eps
        ]
    );
    Ok(())
}
