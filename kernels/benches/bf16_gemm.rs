//! bf16 GEMM (f32 accumulation) against the f32 GEMM, side by side in one
//! run, at GPT-2 small's linear layers (B·T = 1024 rows, C = 768): the
//! forward `x · W`, the input gradient `dY · Wᵀ` and the weight gradient
//! `xᵀ · dY` of each layer, with the measured f32 FMA peak and bf16
//! dot-product peak of the same threads beside them. Three columns of
//! time: the linear-layer kernels in [`Precision::F32`], the same kernels
//! in [`Precision::Bf16`] (f32 buffers rounded to bf16 as they are
//! packed: what the model runs), and [`matmul_bf16`] on bf16 buffers (what
//! the rounding costs is the difference).
//!
//! `cargo bench -p weft-kernels --bench bf16_gemm [-- REPS]` (default 5:
//! each figure is the best of REPS alternating rounds, so that load on a
//! shared machine hits both alike).
#![allow(
    clippy::print_stdout,
    clippy::cast_precision_loss,
    clippy::too_many_lines,
    missing_docs
)]

use std::time::Instant;

use weft_kernels::{
    Mode, Precision, bf16_dot_peak_gflops, bf16_path, fma_peak_gflops, matmul_backward_input,
    matmul_backward_weight, matmul_bf16, matmul_forward,
};
use weft_numerics::bf16;

const N: usize = 1024;
const C: usize = 768;

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 * 1e-3 - 0.5)
        .collect()
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t = f64::MAX;
    for _ in 0..reps {
        let t0 = Instant::now();
        f();
        t = t.min(t0.elapsed().as_secs_f64());
    }
    t
}

fn main() {
    let reps: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let threads = rayon::current_num_threads();
    let f32_peak = fma_peak_gflops(threads, 3);
    let bf16_peak = bf16_dot_peak_gflops(threads, 3);
    println!(
        "# {threads} threads; f32 FMA peak {f32_peak:.1} GFLOP/s; bf16 dot-product peak {}; bf16 path: {}",
        bf16_peak.map_or_else(
            || "n/a (portable path)".into(),
            |p| format!("{p:.1} GFLOP/s")
        ),
        bf16_path().name()
    );
    println!(
        "{:<28} {:>8} {:>8} {:>8} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "product",
        "f32 ms",
        "bf16 ms",
        "buf ms",
        "f32 GF/s",
        "bf16 GF/s",
        "bf16/f32",
        "f32 %pk",
        "bf16 %pk"
    );
    let layers = [
        ("c_attn", C, 3 * C),
        ("attn.c_proj", C, C),
        ("c_fc", C, 4 * C),
        ("mlp.c_proj", 4 * C, C),
    ];
    let (mut t32_all, mut t16_all, mut tb_all, mut flops_all) = (0.0, 0.0, 0.0, 0.0);
    for (name, ic, oc) in layers {
        let x = data(N * ic, 1);
        let w = data(ic * oc, 2);
        let dy = data(N * oc, 3);
        let (xb, wb, dyb): (Vec<bf16>, Vec<bf16>, Vec<bf16>) = (
            x.iter().map(|&v| bf16::from_f32(v)).collect(),
            w.iter().map(|&v| bf16::from_f32(v)).collect(),
            dy.iter().map(|&v| bf16::from_f32(v)).collect(),
        );
        let flops = 2.0 * (N * ic * oc) as f64;
        let mut y = vec![0f32; N * oc];
        let mut dx = vec![0f32; N * ic];
        let mut dw = vec![0f32; ic * oc];
        // (label, f32, bf16 on f32 buffers, bf16 buffers), the same shapes
        // and layouts
        let mut rows: Vec<(String, f64, f64, f64)> = Vec::new();
        let (mut t32, mut t16, mut tb) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..reps {
            t32 = t32.min(best(1, || {
                matmul_forward(
                    &mut y,
                    &x,
                    &w,
                    None,
                    1,
                    N,
                    ic,
                    oc,
                    Mode::Throughput,
                    Precision::F32,
                )
                .unwrap();
            }));
            t16 = t16.min(best(1, || {
                matmul_forward(
                    &mut y,
                    &x,
                    &w,
                    None,
                    1,
                    N,
                    ic,
                    oc,
                    Mode::Throughput,
                    Precision::Bf16,
                )
                .unwrap();
            }));
            tb = tb.min(best(1, || {
                matmul_bf16(&mut y, &xb, false, &wb, false, N, oc, ic, false).unwrap();
            }));
        }
        rows.push((format!("fwd {name} {ic}x{oc}"), t32, t16, tb));
        let (mut t32, mut t16, mut tb) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..reps {
            t32 = t32.min(best(1, || {
                matmul_backward_input(
                    &mut dx,
                    &dy,
                    &w,
                    1,
                    N,
                    ic,
                    oc,
                    Mode::Throughput,
                    Precision::F32,
                )
                .unwrap();
            }));
            t16 = t16.min(best(1, || {
                matmul_backward_input(
                    &mut dx,
                    &dy,
                    &w,
                    1,
                    N,
                    ic,
                    oc,
                    Mode::Throughput,
                    Precision::Bf16,
                )
                .unwrap();
            }));
            tb = tb.min(best(1, || {
                matmul_bf16(&mut dx, &dyb, false, &wb, true, N, ic, oc, false).unwrap();
            }));
        }
        rows.push((format!("dx {name} {ic}x{oc}"), t32, t16, tb));
        let (mut t32, mut t16, mut tb) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..reps {
            t32 = t32.min(best(1, || {
                matmul_backward_weight(&mut dw, None, &dy, &x, 1, N, ic, oc, Precision::F32)
                    .unwrap();
            }));
            t16 = t16.min(best(1, || {
                matmul_backward_weight(&mut dw, None, &dy, &x, 1, N, ic, oc, Precision::Bf16)
                    .unwrap();
            }));
            tb = tb.min(best(1, || {
                matmul_bf16(&mut dw, &xb, true, &dyb, false, ic, oc, N, true).unwrap();
            }));
        }
        rows.push((format!("dw {name} {ic}x{oc}"), t32, t16, tb));
        for (label, t32, t16, tb) in rows {
            let (g32, g16) = (flops / t32 / 1e9, flops / t16 / 1e9);
            println!(
                "{label:<28} {:>8.2} {:>8.2} {:>8.2} {g32:>10.1} {g16:>10.1} {:>7.2}x {:>8.0}% {:>8}",
                t32 * 1e3,
                t16 * 1e3,
                tb * 1e3,
                t32 / t16,
                100.0 * g32 / f32_peak,
                bf16_peak.map_or_else(|| "-".into(), |p| format!("{:.0}%", 100.0 * g16 / p)),
            );
            t32_all += t32;
            t16_all += t16;
            tb_all += tb;
            flops_all += flops;
        }
    }
    println!(
        "{:<28} {:>8.2} {:>8.2} {:>8.2} {:>10.1} {:>10.1} {:>7.2}x",
        "all twelve",
        t32_all * 1e3,
        t16_all * 1e3,
        tb_all * 1e3,
        flops_all / t32_all / 1e9,
        flops_all / t16_all / 1e9,
        t32_all / t16_all
    );
}
