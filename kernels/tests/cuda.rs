//! The CUDA backend (feature `cuda`) against the CPU kernels, llm.c's
//! dev/cuda way: the CPU kernel is the reference, the GPU result is
//! compared with it at a stated tolerance (bit for bit where both run the
//! same operations in the same order).
//!
//! Two kinds of test:
//!
//! - `nvrtc_*`: every kernel source compiled by NVRTC for `sm_80` and
//!   `sm_90` (PTX and CUBIN). NVRTC needs no GPU, so these run in CI; they
//!   print `SKIPPED:` when libnvrtc cannot be loaded — or fail, when
//!   `WEFT_REQUIRE_ALL` is set (scripts/test-all.sh installs NVRTC and
//!   sets it).
//! - `gpu_*`: each op on device 0 against its CPU twin. Without a usable
//!   GPU each checks that the backend says why with a typed error, prints
//!   `SKIPPED: <reason>` and returns — or fails, when `WEFT_REQUIRE_GPU=1`
//!   (scripts/gpu-check.sh sets it).
//!
//! Tolerances. `u = 2⁻²⁴` is f32's unit roundoff. A sum of `k` terms
//! computed in two different orders differs by at most about `2·k·u·Σ|term|`
//! (each order's error is at most `(k−1)·u·Σ|term|` to first order), so
//! where only the order of a sum differs the bound is `4·k·u` times the sum
//! of the magnitudes (a factor 2 for the other roundings in the op). The
//! products of 16-bit operands are exact in f32, so the bf16 and fp16
//! products have the same bound as f32 ones over the *rounded* operands
//! (both sides round the same operands the same way). Tensor cores may
//! round their internal sums differently from IEEE addition (toward zero
//! in some generations): the bound's factor 4 covers one extra rounding
//! per addition.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write;
use std::sync::OnceLock;

use weft_kernels::cuda::{self, Gpu, Source, Target};
use weft_kernels::{AdamW, Error, Mode, Precision};
use weft_numerics::ExactSum;

fn skip(msg: &str) {
    // Past the harness's capture: shown, and counted as a skip by
    // scripts/test-all.sh (which counts lines starting `SKIPPED:`; the
    // harness may have printed `test name ... ` on the current line).
    let _ = std::io::stderr().write_all(format!("\nSKIPPED: {msg}\n").as_bytes());
}

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

// ------------------------------------------------------------------ NVRTC

/// Head sizes the attention module is compiled for in the test: the
/// GPU tests' (8, 64), GPT-2's (64) and larger models' (128), and 32.
const HEAD_SIZES: [usize; 4] = [8, 32, 64, 128];

/// NVRTC is loadable here, or the test should stop (printing why).
fn nvrtc_or_skip() -> bool {
    match cuda::nvrtc_version() {
        Ok((major, minor)) => {
            println!("NVRTC {major}.{minor}");
            true
        }
        Err(e) => {
            assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
            assert!(
                !required("WEFT_REQUIRE_ALL"),
                "NVRTC is missing and WEFT_REQUIRE_ALL is set: {e}"
            );
            skip(&format!("NVRTC compile test: {e}"));
            false
        }
    }
}

fn sizes(source: Source, all: bool) -> Vec<usize> {
    match (source.per_head_size(), all) {
        (true, true) => HEAD_SIZES.to_vec(),
        (true, false) => vec![64],
        (false, _) => vec![0],
    }
}

/// Every source compiles to PTX for compute_80 and compute_90 (the form a
/// newer GPU's driver would compile), and the PTX exports every entry
/// point the launch code looks up. (Attention at GPT-2's head size only:
/// the CUBIN test compiles every head size, and each head size costs
/// seconds of NVRTC time.)
#[test]
fn nvrtc_compiles_every_source_to_ptx_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    for (major, minor) in [(8, 0), (9, 0)] {
        for source in Source::ALL {
            for hs in sizes(source, false) {
                let target = Target::Ptx { major, minor };
                let t0 = std::time::Instant::now();
                let ptx = cuda::compile(source, target, hs)
                    .unwrap_or_else(|e| panic!("{} (HS={hs}): {e}", source.file()));
                let text = String::from_utf8_lossy(&ptx);
                assert!(
                    text.contains(&format!(".target sm_{major}{minor}")),
                    "{}: PTX for another target",
                    source.file()
                );
                for k in source.kernels() {
                    assert!(
                        text.contains(&format!(".entry {k}(")),
                        "{} (HS={hs}, {}): no entry point `{k}`",
                        source.file(),
                        target.arch()
                    );
                }
                println!(
                    "{} HS={hs} {}: {} bytes of PTX in {:.1} s",
                    source.file(),
                    target.arch(),
                    ptx.len(),
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
}

/// Every source compiles to machine code (CUBIN, an ELF image, what the
/// GPU path loads) for sm_80 and sm_90, attention for every head size
/// tested: NVRTC runs ptxas too, so register and shared-memory limits are
/// checked here, with no GPU. The image names every entry point.
#[test]
fn nvrtc_compiles_every_source_to_cubin_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    for (major, minor) in [(8, 0), (9, 0)] {
        for source in Source::ALL {
            for hs in sizes(source, true) {
                let target = Target::Cubin { major, minor };
                let t0 = std::time::Instant::now();
                let bin = cuda::compile(source, target, hs)
                    .unwrap_or_else(|e| panic!("{} (HS={hs}): {e}", source.file()));
                assert_eq!(&bin[..4], b"\x7fELF", "{}: not an ELF image", source.file());
                for k in source.kernels() {
                    let name = format!("{k}\0");
                    assert!(
                        bin.windows(name.len()).any(|w| w == name.as_bytes()),
                        "{} (HS={hs}, {}): no symbol `{k}`",
                        source.file(),
                        target.arch()
                    );
                }
                println!(
                    "{} HS={hs} {}: {} bytes of CUBIN in {:.1} s",
                    source.file(),
                    target.arch(),
                    bin.len(),
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
}

/// A source that does not compile is an error carrying the compiler's
/// log, and a head size out of range is refused before compiling.
#[test]
fn nvrtc_errors_are_typed() {
    if !nvrtc_or_skip() {
        return;
    }
    let e = cuda::compile(Source::Attention, Target::Ptx { major: 9, minor: 0 }, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let e = cuda::compile(Source::Attention, Target::Ptx { major: 9, minor: 0 }, 257).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    // An architecture NVRTC does not know.
    let e = cuda::compile(Source::Pointwise, Target::Cubin { major: 1, minor: 0 }, 0).unwrap_err();
    match e {
        Error::Compile { file, arch, log } => {
            assert_eq!((file.as_str(), arch.as_str()), ("pointwise.cu", "sm_10"));
            assert!(!log.is_empty());
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

// ------------------------------------------------------------- the device

/// Device 0, opened once for every test of this binary; `None` (with the
/// reason printed) when there is none.
fn gpu(test: &str) -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, Error>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::new(0)) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(
                matches!(e, Error::Unavailable { .. }),
                "expected a typed unavailability error, got {e:?}"
            );
            assert!(
                !required("WEFT_REQUIRE_GPU"),
                "{test}: no GPU and WEFT_REQUIRE_GPU=1: {e}"
            );
            skip(&format!("{test}: {e}"));
            None
        }
    }
}

/// Without a GPU (or a library) the entry points return typed errors that
/// say what is missing — never a panic.
#[test]
fn no_gpu_is_a_typed_error() {
    let libs = cuda::libraries();
    match Gpu::new(0) {
        Ok(g) => {
            assert!(libs.driver && libs.nvrtc && libs.cublas);
            assert!(cuda::device_count().unwrap() >= 1);
            println!(
                "GPU 0: {} (sm_{}{})",
                g.name(),
                g.compute_capability().0,
                g.compute_capability().1
            );
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
            if !libs.driver {
                assert!(
                    msg.contains("libcuda.so.1") && msg.contains("driver"),
                    "{msg}"
                );
                assert!(cuda::device_count().is_err());
            } else if !libs.nvrtc {
                assert!(msg.contains("libnvrtc"), "{msg}");
            } else if !libs.cublas {
                assert!(msg.contains("libcublas"), "{msg}");
            }
            assert_eq!(cuda::available().unwrap_err().to_string(), msg);
        }
    }
    // An ordinal past the last device is refused, whatever is present.
    let e = Gpu::new(usize::MAX).unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}

// -------------------------------------------------------------- test data

/// Deterministic values in [-scale, scale): xorshift64*.
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40; // 24 bits
            #[allow(clippy::cast_precision_loss)]
            let u = r as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Asserts bitwise equality, naming the first differing element.
fn assert_bitwise(what: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    if let Some(i) = (0..gpu.len()).find(|&i| gpu[i].to_bits() != cpu[i].to_bits()) {
        panic!(
            "{what}: element {i}: GPU {:e} vs CPU {:e} (not bit for bit)",
            gpu[i], cpu[i]
        );
    }
    assert_eq!(bits(gpu), bits(cpu));
    println!("{what}: {} values bit for bit", gpu.len());
}

/// Asserts `|gpu − cpu| ≤ bound[i]` everywhere; prints the largest ratio.
fn assert_within(what: &str, gpu: &[f32], cpu: &[f32], bound: &[f64]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let mut worst = (0.0f64, 0usize);
    for i in 0..gpu.len() {
        let d = (f64::from(gpu[i]) - f64::from(cpu[i])).abs();
        assert!(
            d <= bound[i],
            "{what}: element {i}: GPU {:e} vs CPU {:e}, |Δ| = {d:e} > bound {:e}",
            gpu[i],
            cpu[i],
            bound[i]
        );
        let r = if bound[i] > 0.0 { d / bound[i] } else { 0.0 };
        if r > worst.0 {
            worst = (r, i);
        }
    }
    println!(
        "{what}: {} values within bound (largest |Δ|/bound {:.3} at {})",
        gpu.len(),
        worst.0,
        worst.1
    );
}

const U: f64 = 1.0 / 16_777_216.0; // 2^-24

/// The bound of a sum of `k` terms whose magnitudes add up to `mag`,
/// computed in another order: `4·k·u·mag` (see the module docs), plus one
/// rounding of the result.
fn sum_bound(k: usize, mag: f64, result: f32) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let k = k as f64;
    4.0 * k * U * mag + U * f64::from(result).abs()
}

// ------------------------------------------------------------- pointwise

#[test]
fn gpu_gelu_forward_and_backward_are_the_cpus_bit_for_bit() {
    let Some(g) = gpu("gelu") else { return };
    let n = 100_003;
    let x = data(n, 1, 6.0);
    let dout = data(n, 2, 1.0);
    let dinp0 = data(n, 3, 1.0);
    let mut out = vec![0.0f32; n];
    weft_kernels::gelu_forward(&mut out, &x, n).unwrap();
    let mut dinp = dinp0.clone();
    weft_kernels::gelu_backward(&mut dinp, &x, &dout, n).unwrap();

    let dx = g.upload(&x).unwrap();
    let mut dout_d = g.zeros::<f32>(n).unwrap();
    cuda::gelu_forward(g, &mut dout_d, &dx, n).unwrap();
    assert_bitwise("gelu_forward", &g.download(&dout_d).unwrap(), &out);
    let dg = g.upload(&dout).unwrap();
    let mut di = g.upload(&dinp0).unwrap();
    cuda::gelu_backward(g, &mut di, &dx, &dg, n).unwrap();
    assert_bitwise("gelu_backward", &g.download(&di).unwrap(), &dinp);
    // A wrong length is the CPU's error.
    let e = cuda::gelu_forward(g, &mut dout_d, &dx, n - 1).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
}

#[test]
fn gpu_residual_and_accumulate_are_the_cpus_bit_for_bit() {
    let Some(g) = gpu("residual") else { return };
    let n = 4099;
    let (a, b, d) = (data(n, 4, 3.0), data(n, 5, 3.0), data(n, 6, 1.0));
    let mut out = vec![0.0f32; n];
    weft_kernels::residual_forward(&mut out, &a, &b, n).unwrap();
    let (mut da, mut db) = (a.clone(), b.clone());
    weft_kernels::residual_backward(&mut da, &mut db, &d, n).unwrap();

    let (ga, gb, gd) = (
        g.upload(&a).unwrap(),
        g.upload(&b).unwrap(),
        g.upload(&d).unwrap(),
    );
    let mut go = g.zeros::<f32>(n).unwrap();
    cuda::residual_forward(g, &mut go, &ga, &gb, n).unwrap();
    assert_bitwise("residual_forward", &g.download(&go).unwrap(), &out);
    let (mut gda, mut gdb) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
    cuda::residual_backward(g, &mut gda, &mut gdb, &gd, n).unwrap();
    assert_bitwise("residual_backward da", &g.download(&gda).unwrap(), &da);
    assert_bitwise("residual_backward db", &g.download(&gdb).unwrap(), &db);
}

#[test]
fn gpu_bf16_rounding_is_the_half_crates() {
    let Some(g) = gpu("round_to_bf16") else {
        return;
    };
    let mut x = data(10_000, 7, 100.0);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0e-40,
        f32::MAX,
        3.0e38,
    ]);
    let want: Vec<u16> = x
        .iter()
        .map(|&v| weft_numerics::bf16::from_f32(v).to_bits())
        .collect();
    let gx = g.upload(&x).unwrap();
    let mut h = g.zeros::<u16>(x.len()).unwrap();
    cuda::round_to_bf16(g, &mut h, &gx).unwrap();
    assert_eq!(g.download(&h).unwrap(), want);
}

// ------------------------------------------------------------- embedding

#[test]
fn gpu_encoder_is_the_cpus_bit_for_bit() {
    let Some(g) = gpu("encoder") else { return };
    let (b, t, c, v, max_t) = (3, 9, 37, 11, 12);
    // Repeated ids, so the backward adds several rows into one.
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 7) % 5) as u32).collect();
    let wte = data(v * c, 8, 1.0);
    let wpe = data(max_t * c, 9, 1.0);
    let dout = data(b * t * c, 10, 1.0);
    let mut starts = vec![0u32; b * t];
    weft_kernels::doc_starts(&mut starts, &tokens, 3, b, t).unwrap();
    let positions: Vec<u32> = (0..b * t).map(|r| (r % t) as u32 - starts[r]).collect();
    for pos in [None, Some(positions.as_slice())] {
        let mut out = vec![0.0f32; b * t * c];
        weft_kernels::encoder_forward(&mut out, &tokens, pos, &wte, &wpe, b, t, c).unwrap();
        let (mut dwte, mut dwpe) = (data(v * c, 11, 1.0), data(max_t * c, 12, 1.0));
        let (dwte0, dwpe0) = (dwte.clone(), dwpe.clone());
        weft_kernels::encoder_backward(&mut dwte, &mut dwpe, &dout, &tokens, pos, b, t, c).unwrap();

        let (gwte, gwpe) = (g.upload(&wte).unwrap(), g.upload(&wpe).unwrap());
        let mut go = g.zeros::<f32>(b * t * c).unwrap();
        cuda::encoder_forward(g, &mut go, &tokens, pos, &gwte, &gwpe, b, t, c).unwrap();
        assert_bitwise("encoder_forward", &g.download(&go).unwrap(), &out);
        let (mut gdwte, mut gdwpe) = (g.upload(&dwte0).unwrap(), g.upload(&dwpe0).unwrap());
        let gd = g.upload(&dout).unwrap();
        cuda::encoder_backward(g, &mut gdwte, &mut gdwpe, &gd, &tokens, pos, b, t, c).unwrap();
        assert_bitwise("encoder_backward dwte", &g.download(&gdwte).unwrap(), &dwte);
        assert_bitwise("encoder_backward dwpe", &g.download(&gdwpe).unwrap(), &dwpe);
    }
    // A token past the vocabulary is the CPU's error.
    let mut bad = tokens.clone();
    bad[4] = v as u32;
    let (gwte, gwpe) = (g.upload(&wte).unwrap(), g.upload(&wpe).unwrap());
    let mut go = g.zeros::<f32>(b * t * c).unwrap();
    let e = cuda::encoder_forward(g, &mut go, &bad, None, &gwte, &gwpe, b, t, c).unwrap_err();
    assert!(
        matches!(e, Error::TokenOutOfRange { position: 4, .. }),
        "{e:?}"
    );
}

// ------------------------------------------------------------- layernorm

#[test]
fn gpu_layernorm_matches_the_cpu_within_rounding() {
    let Some(g) = gpu("layernorm") else { return };
    for (n, c) in [(5, 19), (64, 768)] {
        let x: Vec<f32> = data(n * c, 13, 2.0).iter().map(|v| v + 0.5).collect();
        let (w, bias) = (data(c, 14, 1.0), data(c, 15, 1.0));
        let dout = data(n * c, 16, 1.0);
        let eps = 1e-5f32;
        let (mut out, mut mean, mut rstd) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        weft_kernels::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bias, n, c, eps)
            .unwrap();
        let dinp0 = data(n * c, 17, 1.0);
        let (mut dinp, mut dw, mut db) = (dinp0.clone(), data(c, 18, 1.0), data(c, 19, 1.0));
        let (dw0, db0) = (dw.clone(), db.clone());
        weft_kernels::layernorm_backward(
            &mut dinp, &mut dw, &mut db, &dout, &x, &w, &mean, &rstd, n, c,
        )
        .unwrap();

        let (gx, gw, gb) = (
            g.upload(&x).unwrap(),
            g.upload(&w).unwrap(),
            g.upload(&bias).unwrap(),
        );
        let mut go = g.zeros::<f32>(n * c).unwrap();
        let (mut gm, mut gr) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
        cuda::layernorm_forward(g, &mut go, &mut gm, &mut gr, &gx, &gw, &gb, n, c, eps).unwrap();
        // Mean: a sum of C values, divided. rstd: the variance is a sum of
        // C squares; rstd's relative error is half the variance's, and
        // the variance's is bounded by the sums' (mean error included).
        let xs: Vec<f64> = (0..n)
            .map(|r| {
                x[r * c..(r + 1) * c]
                    .iter()
                    .map(|v| f64::from(v.abs()))
                    .sum::<f64>()
            })
            .collect();
        #[allow(clippy::cast_precision_loss)]
        let cf = c as f64;
        let mb: Vec<f64> = (0..n).map(|r| sum_bound(c, xs[r], mean[r]) / cf).collect();
        assert_within("layernorm mean", &g.download(&gm).unwrap(), &mean, &mb);
        // Every normalised value depends on the row's mean and rstd, each
        // accurate to ~4·C·u relative (the mean to the row's scale): the
        // output to (|norm|·|w| + |w|)·8·C·u, plus its own roundings.
        let rb: Vec<f64> = rstd.iter().map(|&r| 8.0 * cf * U * f64::from(r)).collect();
        assert_within("layernorm rstd", &g.download(&gr).unwrap(), &rstd, &rb);
        let ob: Vec<f64> = (0..n * c)
            .map(|i| {
                let norm = f64::from((x[i] - mean[i / c]) * rstd[i / c]).abs();
                16.0 * cf * U * (norm + 1.0) * f64::from(w[i % c]).abs()
                    + 4.0 * U * f64::from(out[i]).abs()
            })
            .collect();
        assert_within(
            "layernorm_forward out",
            &g.download(&go).unwrap(),
            &out,
            &ob,
        );

        // The backward from the CPU's saved statistics.
        let (gm, gr) = (g.upload(&mean).unwrap(), g.upload(&rstd).unwrap());
        let gdo = g.upload(&dout).unwrap();
        let mut gdi = g.upload(&dinp0).unwrap();
        let (mut gdw, mut gdb) = (g.upload(&dw0).unwrap(), g.upload(&db0).unwrap());
        cuda::layernorm_backward(
            g, &mut gdi, &mut gdw, &mut gdb, &gdo, &gx, &gw, &gm, &gr, n, c,
        )
        .unwrap();
        // dinp: two row sums of C terms (|w·g| and |w·g·norm|) times rstd.
        let rowmag: Vec<f64> = (0..n)
            .map(|r| {
                (0..c)
                    .map(|j| {
                        let i = r * c + j;
                        let norm = f64::from((x[i] - mean[r]) * rstd[r]).abs();
                        f64::from(w[j] * dout[i]).abs() * (1.0 + norm)
                    })
                    .sum::<f64>()
            })
            .collect();
        let dib: Vec<f64> = (0..n * c)
            .map(|i| {
                let r = i / c;
                let norm = f64::from((x[i] - mean[r]) * rstd[r]).abs();
                (8.0 * U * rowmag[r] * (1.0 + norm) + 8.0 * U * f64::from(w[i % c] * dout[i]).abs())
                    * f64::from(rstd[r])
                    + 4.0 * U * f64::from(dinp[i]).abs()
            })
            .collect();
        assert_within(
            "layernorm_backward dinp",
            &g.download(&gdi).unwrap(),
            &dinp,
            &dib,
        );
        // dweight, dbias: sums over N rows.
        let colmag = |f: &dyn Fn(usize) -> f64| -> Vec<f64> {
            (0..c)
                .map(|j| (0..n).map(|r| f(r * c + j)).sum::<f64>())
                .collect()
        };
        let wm = colmag(&|i| f64::from((x[i] - mean[i / c]) * rstd[i / c] * dout[i]).abs());
        let bm = colmag(&|i| f64::from(dout[i]).abs());
        let dwb: Vec<f64> = (0..c)
            .map(|j| sum_bound(n + 1, wm[j] + f64::from(dw0[j]).abs(), dw[j]) * 2.0)
            .collect();
        let dbb: Vec<f64> = (0..c)
            .map(|j| sum_bound(n + 1, bm[j] + f64::from(db0[j]).abs(), db[j]))
            .collect();
        assert_within(
            "layernorm_backward dweight",
            &g.download(&gdw).unwrap(),
            &dw,
            &dwb,
        );
        assert_within(
            "layernorm_backward dbias",
            &g.download(&gdb).unwrap(),
            &db,
            &dbb,
        );
    }
}

// ------------------------------------------------------------- attention

#[test]
fn gpu_attention_matches_the_cpu_within_rounding() {
    let Some(g) = gpu("attention") else { return };
    // (B, T, C, NH): small heads over a T that is no multiple of a tile,
    // and GPT-2's head size.
    for (b, t, c, nh) in [(2, 37, 32, 4), (1, 130, 128, 2)] {
        let hs = c / nh;
        let qkv = data(b * t * 3 * c, 20, 1.0);
        let dout = data(b * t * c, 21, 1.0);
        let dqkv0 = data(b * t * 3 * c, 22, 1.0);
        let tokens: Vec<u32> = (0..b * t).map(|i| u32::from(i % 17 == 5)).collect();
        let mut starts = vec![0u32; b * t];
        weft_kernels::doc_starts(&mut starts, &tokens, 1, b, t).unwrap();
        for docs in [None, Some(starts.as_slice())] {
            let mut out = vec![0.0f32; b * t * c];
            let mut lse_cpu = vec![0.0f32; b * nh * t];
            weft_kernels::attention_forward(&mut out, &mut lse_cpu, &qkv, docs, b, t, c, nh)
                .unwrap();
            let mut dqkv = dqkv0.clone();
            weft_kernels::attention_backward(
                &mut dqkv, &dout, &qkv, &out, &lse_cpu, docs, b, t, c, nh,
            )
            .unwrap();

            let gq = g.upload(&qkv).unwrap();
            let mut go = g.zeros::<f32>(b * t * c).unwrap();
            let mut gl = g.zeros::<f32>(b * nh * t).unwrap();
            cuda::attention_forward(g, &mut go, &mut gl, &gq, docs, b, t, c, nh).unwrap();
            let gout = g.download(&go).unwrap();
            // out[i] = Σ_j p_ij v_j: a sum of up to T terms, each p carrying
            // the error of its row's softmax (sums over T exponentials, a
            // dot product over HS): bound 8·(T + HS)·u·Σ_j p_ij |v_j| with
            // Σ p = 1, so 8·(T + HS)·u·max|v| covers it.
            let vmax = (0..b * t)
                .flat_map(|r| qkv[r * 3 * c + 2 * c..(r + 1) * 3 * c].iter())
                .fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
            let ob = vec![8.0 * (t + hs) as f64 * U * vmax; out.len()];
            let what = if docs.is_some() {
                "attention_forward (docs)"
            } else {
                "attention_forward"
            };
            assert_within(what, &gout, &out, &ob);
            // lse against the CPU's: both the log of a sum of up to T
            // exponentials of HS-long dots
            let lse = g.download(&gl).unwrap();
            for (r, (&got, &want)) in lse.iter().zip(&lse_cpu).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "lse of row {r}: GPU {got}, CPU {want}"
                );
            }

            let gd = g.upload(&dout).unwrap();
            let mut gdq = g.upload(&dqkv0).unwrap();
            cuda::attention_backward(g, &mut gdq, &gd, &gq, &go, &gl, docs, b, t, c, nh).unwrap();
            // Each gradient entry is a sum over up to T rows of products of
            // O(1) values (|q|, |k|, |v|, |dout| ≤ 1, p ≤ 1, HS-long dots):
            // bound 16·(T + HS)·u·HS·T·scale-free magnitude, taken as the
            // largest such sum, HS·T, plus the accumulated value's rounding.
            let db: Vec<f64> = dqkv
                .iter()
                .map(|&x| {
                    16.0 * (t + hs) as f64 * U * (hs as f64) * 2.0 + 4.0 * U * f64::from(x).abs()
                })
                .collect();
            let what = if docs.is_some() {
                "attention_backward (docs)"
            } else {
                "attention_backward"
            };
            assert_within(what, &g.download(&gdq).unwrap(), &dqkv, &db);
        }
    }
}

// ------------------------------------------------------------ classifier

#[test]
fn gpu_fused_classifier_matches_the_cpu() {
    let Some(g) = gpu("fused_classifier") else {
        return;
    };
    for (n, v, v_real) in [(6, 50, 45), (64, 50304, 50257)] {
        let logits = data(n * v, 23, 8.0);
        let targets: Vec<u32> = (0..n).map(|i| ((i * 7919) % v_real) as u32).collect();
        let (mut losses, mut stats) = (vec![0.0f32; n], vec![0.0f32; 2 * n]);
        weft_kernels::fused_classifier_forward(
            &logits,
            &mut losses,
            &mut stats,
            &targets,
            n,
            v,
            v_real,
        )
        .unwrap();
        let dloss = 1.0 / n as f32;
        let mut dlogits = logits.clone();
        weft_kernels::fused_classifier_backward(
            &mut dlogits,
            &stats,
            &targets,
            dloss,
            n,
            v,
            v_real,
        )
        .unwrap();

        let gx = g.upload(&logits).unwrap();
        let (mut gl, mut gs) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(2 * n).unwrap());
        cuda::fused_classifier_forward(g, &gx, &mut gl, &mut gs, &targets, n, v, v_real).unwrap();
        let gst = g.download(&gs).unwrap();
        let maxes: Vec<f32> = gst.iter().step_by(2).copied().collect();
        let want_max: Vec<f32> = stats.iter().step_by(2).copied().collect();
        assert_bitwise("fused_classifier_forward max", &maxes, &want_max);
        // The sum of v_real exponentials ≤ 1 each, in another order.
        let sums: Vec<f32> = gst.iter().skip(1).step_by(2).copied().collect();
        let want_sum: Vec<f32> = stats.iter().skip(1).step_by(2).copied().collect();
        let sb: Vec<f64> = want_sum
            .iter()
            .map(|&s| sum_bound(v_real, f64::from(s), s))
            .collect();
        assert_within("fused_classifier_forward sum", &sums, &want_sum, &sb);
        // loss = ln(sum) − (x_t − max): ln's relative error moves it by
        // (sum's relative bound) plus two roundings of the result; CUDA's
        // logf is within 1 ulp, Rust's within 1 ulp.
        let lb: Vec<f64> = (0..n)
            .map(|i| sb[i] / f64::from(want_sum[i]) + 4.0 * U * (1.0 + f64::from(losses[i]).abs()))
            .collect();
        assert_within(
            "fused_classifier_forward loss",
            &g.download(&gl).unwrap(),
            &losses,
            &lb,
        );
        // The backward from the CPU's statistics: bit for bit.
        let mut gx = g.upload(&logits).unwrap();
        let gs = g.upload(&stats).unwrap();
        cuda::fused_classifier_backward(g, &mut gx, &gs, &targets, dloss, n, v, v_real).unwrap();
        assert_bitwise(
            "fused_classifier_backward",
            &g.download(&gx).unwrap(),
            &dlogits,
        );
    }
}

// ------------------------------------------------------------------ AdamW

#[test]
fn gpu_adamw_is_the_cpus_bit_for_bit() {
    let Some(g) = gpu("adamw") else { return };
    let n = 70_001;
    let hp = AdamW {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    for decay in [true, false] {
        let mut p = data(n, 24, 1.0);
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut gp = g.upload(&p).unwrap();
        let mut gh = g.zeros::<u16>(n).unwrap();
        let (mut gm, mut gv) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
        for step in 1..=3 {
            let grads = data(n, 100 + u64::from(step), 0.1);
            weft_kernels::adamw_update(&mut p, &grads, &mut m, &mut v, &hp, step, decay).unwrap();
            let gg = g.upload(&grads).unwrap();
            let mut hv = gh.as_view_mut();
            cuda::adamw_update(
                g,
                &mut gp,
                Some(&mut hv),
                &gg,
                &mut gm,
                &mut gv,
                &hp,
                step,
                decay,
            )
            .unwrap();
        }
        assert_bitwise("adamw params", &g.download(&gp).unwrap(), &p);
        assert_bitwise("adamw m", &g.download(&gm).unwrap(), &m);
        assert_bitwise("adamw v", &g.download(&gv).unwrap(), &v);
        let want: Vec<u16> = p
            .iter()
            .map(|&x| weft_numerics::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(g.download(&gh).unwrap(), want, "the bf16 copy");
    }
}

#[test]
fn gpu_parameter_store_and_its_adamw_follow_the_host_layout() {
    let Some(g) = gpu("DeviceParams") else { return };
    use weft_kernels::cuda::{DeviceParams, GpuAdamW, TensorSpec};
    let spec = |name: &str, range: std::ops::Range<usize>, decay| TensorSpec {
        name: name.into(),
        range,
        decay,
    };
    let tensors = vec![
        spec("wte", 0..600, true),
        spec("ln.weight", 600..620, false),
        spec("ln.bias", 620..640, false),
        spec("fc.weight", 640..1000, true),
    ];
    let host = data(1000, 30, 1.0);
    let mut params = DeviceParams::upload(g, &host, tensors.clone()).unwrap();
    assert_eq!(
        g.download(&params.view("ln.bias").unwrap()).unwrap(),
        host[620..640]
    );
    assert!(params.view("nope").is_err());
    params.refresh_bf16(g).unwrap();
    let hp = AdamW::default();
    let mut opt = GpuAdamW::new(g, &params, hp).unwrap();
    let (mut p, mut m, mut v) = (host.clone(), vec![0.0f32; 1000], vec![0.0f32; 1000]);
    for step in 1..=2 {
        let grads = data(1000, 40 + u64::from(step), 0.5);
        for t in &tensors {
            let r = t.range.clone();
            weft_kernels::adamw_update(
                &mut p[r.clone()],
                &grads[r.clone()],
                &mut m[r.clone()],
                &mut v[r],
                &hp,
                step,
                t.decay,
            )
            .unwrap();
        }
        opt.step(g, &mut params, &g.upload(&grads).unwrap())
            .unwrap();
    }
    assert_eq!(opt.steps(), 2);
    assert_bitwise("GpuAdamW params", &params.download(g).unwrap(), &p);
    assert_bitwise("GpuAdamW m", &opt.moments().0.download(g).unwrap(), &m);
    let bf: Vec<u16> = p[640..1000]
        .iter()
        .map(|&x| weft_numerics::bf16::from_f32(x).to_bits())
        .collect();
    assert_eq!(
        g.download(&params.view_bf16("fc.weight").unwrap()).unwrap(),
        bf
    );
    // Overlapping ranges are refused.
    let bad = vec![spec("a", 0..10, true), spec("b", 5..20, true)];
    assert!(DeviceParams::upload(g, &host, bad).is_err());
}

// ------------------------------------------------------------ exact sums

/// Values over the whole f32 range: wide exponents, both signs,
/// subnormals, exact cancellations, negative zeros.
fn wide(n: usize, seed: u64) -> Vec<f32> {
    let u = data(n, seed, 1.0);
    let e = data(n, seed + 1, 1.0);
    (0..n)
        .map(|i| match i % 11 {
            0 => -0.0,
            1 => 1.0e-42 * u[i],
            2 => 3.0e38 * u[i],
            3 => -u[i - 3].max(0.0),
            _ => u[i] * 2f32.powi((e[i] * 60.0) as i32),
        })
        .collect()
}

#[test]
fn gpu_exact_sums_are_exactsums_bit_for_bit() {
    let Some(g) = gpu("exact_sum") else { return };
    let cases: Vec<(&str, Vec<f32>)> = vec![
        ("wide", wide(300_001, 50)),
        ("cancelling", {
            let mut x = data(10_000, 51, 1.0e30);
            let neg: Vec<f32> = x.iter().map(|v| -v).collect();
            x.extend(neg);
            x.push(1.0e-30);
            x
        }),
        ("all -0", vec![-0.0; 33]),
        ("+0 and -0", vec![-0.0, 0.0, -0.0]),
        ("inf", vec![1.0, f32::INFINITY, 2.0]),
        ("inf - inf", vec![f32::NEG_INFINITY, 1.0, f32::INFINITY]),
        ("nan", vec![1.0, f32::NAN]),
        ("overflow", vec![f32::MAX, f32::MAX, -1.0]),
    ];
    for (what, x) in &cases {
        let mut want = ExactSum::new();
        want.add_slice(x.as_slice());
        let gx = g.upload(x).unwrap();
        let got = cuda::exact_sum(g, &gx).unwrap();
        assert_eq!(
            got.to_f32().to_bits(),
            want.to_f32().to_bits(),
            "exact_sum {what}: to_f32"
        );
        assert_eq!(
            got.to_f64().to_bits(),
            want.to_f64().to_bits(),
            "exact_sum {what}: to_f64"
        );
        // Squares, exact in f64, as the gradient norm adds them.
        let mut sq = ExactSum::new();
        let squares: Vec<f64> = x.iter().map(|&v| f64::from(v) * f64::from(v)).collect();
        sq.add_slice(&squares);
        let got = cuda::exact_sum_squares(g, &gx).unwrap();
        assert_eq!(
            got.to_f64().to_bits(),
            sq.to_f64().to_bits(),
            "exact_sum_squares {what}"
        );
        let nonfinite = x.iter().filter(|v| !v.is_finite()).count() as u64;
        assert_eq!(
            cuda::count_nonfinite(g, &gx).unwrap(),
            nonfinite,
            "count_nonfinite {what}"
        );
    }
    println!("exact sums: {} cases bit for bit", cases.len());
}

#[test]
fn gpu_exact_column_sums_are_exactsums_bit_for_bit() {
    let Some(g) = gpu("exact_sum_columns") else {
        return;
    };
    let (rows, len) = (7, 20_011);
    let mut x = wide(rows * len, 60);
    // Columns with special values.
    x[3] = f32::NAN;
    x[len + 4] = f32::INFINITY;
    x[5] = f32::INFINITY;
    x[2 * len + 5] = f32::NEG_INFINITY;
    for r in 0..rows {
        x[r * len + 6] = -0.0;
        x[r * len + 7] = f32::MAX;
    }
    let want: Vec<f32> = (0..len)
        .map(|j| {
            let mut s = ExactSum::new();
            for r in 0..rows {
                s.add(x[r * len + j]);
            }
            s.to_f32()
        })
        .collect();
    let gx = g.upload(&x).unwrap();
    let mut go = g.zeros::<f32>(len).unwrap();
    cuda::exact_sum_columns(g, &mut go, &gx, rows, len).unwrap();
    assert_bitwise("exact_sum_columns", &g.download(&go).unwrap(), &want);
    // The order of the rows does not matter.
    let mut rev = Vec::with_capacity(x.len());
    for r in (0..rows).rev() {
        rev.extend_from_slice(&x[r * len..(r + 1) * len]);
    }
    let gr = g.upload(&rev).unwrap();
    cuda::exact_sum_columns(g, &mut go, &gr, rows, len).unwrap();
    assert_bitwise(
        "exact_sum_columns (rows reversed)",
        &g.download(&go).unwrap(),
        &want,
    );
}

// ---------------------------------------------------------------- matmul

/// The six products of the linear layers, on the GPU and the CPU.
#[derive(Clone, Copy, Debug)]
enum Prod {
    Fwd,
    FwdWt,
    BwdIn,
    BwdWtIn,
    BwdW,
    BwdWtW,
}

struct Shapes {
    bt: usize,
    c: usize,
    oc: usize,
}

/// Runs `p` on the CPU (b = 1, t = bt) and the GPU; returns (gpu, cpu,
/// bound). The bound is `4·K·u·Σ_k |a_k|·|b_k|` over the rounded operands
/// (see the module docs), plus the accumulated value's rounding.
fn product(
    g: &Gpu,
    p: Prod,
    s: &Shapes,
    mode: Mode,
    prec: Precision,
) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let Shapes { bt, c, oc } = *s;
    let x = data(bt * c, 70, 1.0);
    let w = data(c * oc, 71, 1.0);
    let dy = data(bt * oc, 72, 1.0);
    let bias = data(oc, 73, 1.0);
    let r = |v: &[f32]| -> Vec<f64> {
        v.iter()
            .map(|&z| match prec {
                Precision::F32 => f64::from(z),
                Precision::Bf16 => f64::from(weft_numerics::bf16::from_f32(z).to_f32()),
                Precision::F16 => f64::from(weft_numerics::f16::from_f32(z).to_f32()),
            })
            .collect()
    };
    let (rx, rw, rdy) = (r(&x), r(&w), r(&dy));
    let (gx, gw, gdy) = (
        g.upload(&x).unwrap(),
        g.upload(&w).unwrap(),
        g.upload(&dy).unwrap(),
    );
    let gbias = g.upload(&bias).unwrap();
    // |A|·|B| for the bound, with the weight as stored ([in,out] = (C, OC),
    // [out,in] = (OC, C)).
    let w_in_out = |i: usize, o: usize| rw[i * oc + o].abs();
    let w_out_in = |o: usize, i: usize| rw[o * c + i].abs();
    match p {
        Prod::Fwd | Prod::FwdWt => {
            let wt = matches!(p, Prod::FwdWt);
            let mut cpu = vec![0.0f32; bt * oc];
            if wt {
                weft_kernels::matmul_forward_wt(
                    &mut cpu,
                    &x,
                    &w,
                    Some(&bias),
                    1,
                    bt,
                    c,
                    oc,
                    mode,
                    prec,
                )
            } else {
                weft_kernels::matmul_forward(
                    &mut cpu,
                    &x,
                    &w,
                    Some(&bias),
                    1,
                    bt,
                    c,
                    oc,
                    mode,
                    prec,
                )
            }
            .unwrap();
            let mut go = g.zeros::<f32>(bt * oc).unwrap();
            let bv = gbias.as_view();
            if wt {
                cuda::matmul_forward_wt(g, &mut go, &gx, &gw, Some(&bv), bt, c, oc, mode, prec)
            } else {
                cuda::matmul_forward(g, &mut go, &gx, &gw, Some(&bv), bt, c, oc, mode, prec)
            }
            .unwrap();
            let bound = (0..bt * oc)
                .map(|e| {
                    let (m, o) = (e / oc, e % oc);
                    let mag: f64 = (0..c)
                        .map(|k| {
                            rx[m * c + k].abs() * if wt { w_out_in(o, k) } else { w_in_out(k, o) }
                        })
                        .sum::<f64>()
                        + f64::from(bias[o].abs());
                    sum_bound(c + 1, mag, cpu[e])
                })
                .collect();
            (g.download(&go).unwrap(), cpu, bound)
        }
        Prod::BwdIn | Prod::BwdWtIn => {
            let wt = matches!(p, Prod::BwdWtIn);
            let d0 = data(bt * c, 74, 1.0);
            let mut cpu = d0.clone();
            if wt {
                weft_kernels::matmul_backward_wt_input(&mut cpu, &dy, &w, 1, bt, c, oc, mode, prec)
            } else {
                weft_kernels::matmul_backward_input(&mut cpu, &dy, &w, 1, bt, c, oc, mode, prec)
            }
            .unwrap();
            let mut gd = g.upload(&d0).unwrap();
            if wt {
                cuda::matmul_backward_wt_input(g, &mut gd, &gdy, &gw, bt, c, oc, mode, prec)
            } else {
                cuda::matmul_backward_input(g, &mut gd, &gdy, &gw, bt, c, oc, mode, prec)
            }
            .unwrap();
            let bound = (0..bt * c)
                .map(|e| {
                    let (m, i) = (e / c, e % c);
                    let mag: f64 = (0..oc)
                        .map(|o| {
                            rdy[m * oc + o].abs() * if wt { w_out_in(o, i) } else { w_in_out(i, o) }
                        })
                        .sum::<f64>()
                        + f64::from(d0[e].abs());
                    sum_bound(oc + 1, mag, cpu[e])
                })
                .collect();
            (g.download(&gd).unwrap(), cpu, bound)
        }
        Prod::BwdW | Prod::BwdWtW => {
            let wt = matches!(p, Prod::BwdWtW);
            let d0 = data(c * oc, 75, 1.0);
            let db0 = data(oc, 76, 1.0);
            let (mut cpu, mut cdb) = (d0.clone(), db0.clone());
            if wt {
                weft_kernels::matmul_backward_wt_weight(
                    &mut cpu,
                    Some(&mut cdb),
                    &dy,
                    &x,
                    1,
                    bt,
                    c,
                    oc,
                    prec,
                )
            } else {
                weft_kernels::matmul_backward_weight(
                    &mut cpu,
                    Some(&mut cdb),
                    &dy,
                    &x,
                    1,
                    bt,
                    c,
                    oc,
                    prec,
                )
            }
            .unwrap();
            let (mut gd, mut gdb) = (g.upload(&d0).unwrap(), g.upload(&db0).unwrap());
            let mut dbv = gdb.as_view_mut();
            if wt {
                cuda::matmul_backward_wt_weight(
                    g,
                    &mut gd,
                    Some(&mut dbv),
                    &gdy,
                    &gx,
                    bt,
                    c,
                    oc,
                    mode,
                    prec,
                )
            } else {
                cuda::matmul_backward_weight(
                    g,
                    &mut gd,
                    Some(&mut dbv),
                    &gdy,
                    &gx,
                    bt,
                    c,
                    oc,
                    mode,
                    prec,
                )
            }
            .unwrap();
            // The bias gradient: column sums of dout, f32 in both.
            let dbb: Vec<f64> = (0..oc)
                .map(|o| {
                    let mag: f64 = (0..bt)
                        .map(|m| f64::from(dy[m * oc + o].abs()))
                        .sum::<f64>();
                    sum_bound(bt + 1, mag + f64::from(db0[o].abs()), cdb[o])
                })
                .collect();
            assert_within(
                &format!("{p:?} dbias"),
                &g.download(&gdb).unwrap(),
                &cdb,
                &dbb,
            );
            let bound = (0..c * oc)
                .map(|e| {
                    // [in,out]: dW[i, o]; [out,in]: dW[o, i].
                    let (i, o) = if wt { (e % c, e / c) } else { (e / oc, e % oc) };
                    let mag: f64 = (0..bt)
                        .map(|m| rx[m * c + i].abs() * rdy[m * oc + o].abs())
                        .sum::<f64>()
                        + f64::from(d0[e].abs());
                    sum_bound(bt + 1, mag, cpu[e])
                })
                .collect();
            (g.download(&gd).unwrap(), cpu, bound)
        }
    }
}

#[test]
fn gpu_matmul_matches_the_cpu_in_every_layout_precision_and_mode() {
    let Some(g) = gpu("matmul") else { return };
    let shapes = [
        Shapes {
            bt: 37,
            c: 45,
            oc: 70,
        },
        Shapes {
            bt: 256,
            c: 768,
            oc: 2304,
        },
    ];
    for s in &shapes {
        for p in [
            Prod::Fwd,
            Prod::FwdWt,
            Prod::BwdIn,
            Prod::BwdWtIn,
            Prod::BwdW,
            Prod::BwdWtW,
        ] {
            for prec in [Precision::F32, Precision::Bf16, Precision::F16] {
                for mode in [Mode::BatchInvariant, Mode::Throughput] {
                    let (gpu_out, cpu, bound) = product(g, p, s, mode, prec);
                    let what =
                        format!("{p:?} {} {mode:?} ({}x{}x{})", prec.name(), s.bt, s.c, s.oc);
                    assert_within(&what, &gpu_out, &cpu, &bound);
                }
            }
        }
    }
}

/// In Mode::BatchInvariant a row's bits do not depend on the other rows:
/// one sequence alone, or inside a batch of four, or one row at a time
/// (the decoder), gives the same bits — forward and input gradient.
#[test]
fn gpu_batch_invariant_products_do_not_depend_on_the_batch() {
    let Some(g) = gpu("batch invariance") else {
        return;
    };
    let (t, c, oc) = (33, 64, 96);
    let x = data(4 * t * c, 80, 1.0);
    let w = data(c * oc, 81, 1.0);
    let gw = g.upload(&w).unwrap();
    for prec in [Precision::F32, Precision::Bf16] {
        let run = |rows: &[f32]| -> Vec<f32> {
            let bt = rows.len() / c;
            let gx = g.upload(rows).unwrap();
            let mut go = g.zeros::<f32>(bt * oc).unwrap();
            cuda::matmul_forward(
                g,
                &mut go,
                &gx,
                &gw,
                None,
                bt,
                c,
                oc,
                Mode::BatchInvariant,
                prec,
            )
            .unwrap();
            g.download(&go).unwrap()
        };
        let batch = run(&x);
        let alone = run(&x[2 * t * c..3 * t * c]);
        assert_bitwise(
            "invariant forward: sequence 2 alone",
            &alone,
            &batch[2 * t * oc..3 * t * oc],
        );
        let row = run(&x[(2 * t + 5) * c..(2 * t + 6) * c]);
        assert_bitwise(
            "invariant forward: one row",
            &row,
            &batch[(2 * t + 5) * oc..(2 * t + 6) * oc],
        );
        // The input gradient.
        let dy = data(4 * t * oc, 82, 1.0);
        let back = |rows: &[f32]| -> Vec<f32> {
            let bt = rows.len() / oc;
            let gd = g.upload(rows).unwrap();
            let mut gi = g.zeros::<f32>(bt * c).unwrap();
            cuda::matmul_backward_input(
                g,
                &mut gi,
                &gd,
                &gw,
                bt,
                c,
                oc,
                Mode::BatchInvariant,
                prec,
            )
            .unwrap();
            g.download(&gi).unwrap()
        };
        let batch = back(&dy);
        let alone = back(&dy[t * oc..2 * t * oc]);
        assert_bitwise(
            "invariant backward input: sequence 1 alone",
            &alone,
            &batch[t * c..2 * t * c],
        );
    }
}
