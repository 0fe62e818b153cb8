//! bf16 GEMM (f32 accumulation) against the f32 GEMM, side by side in one
//! run, at GPT-2 small's linear layers (B·T = 1024 rows, C = 768): the
//! forward `x · W`, the input gradient `dY · Wᵀ` and the weight gradient
//! `xᵀ · dY` of each layer, and the three products of the tied
//! language-model head (V = 50257: `x · Wᵀ`, `dY · W`, `dYᵀ · x`), with the measured f32 FMA peak and bf16
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
    matmul_backward_weight, matmul_backward_wt_input, matmul_backward_wt_weight, matmul_bf16,
    matmul_forward, matmul_forward_wt,
};
use weft_numerics::bf16;

const N: usize = 1024;
const C: usize = 768;
/// GPT-2's vocabulary.
const V: usize = 50257;

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
    let mut layer_sum = Sum::default();
    for (name, ic, oc) in layers {
        let x = data(N * ic, 1);
        let w = data(ic * oc, 2);
        let dy = data(N * oc, 3);
        let (xb, wb, dyb) = (to_bf16(&x), to_bf16(&w), to_bf16(&dy));
        let flops = 2.0 * (N * ic * oc) as f64;
        let mut y = vec![0f32; N * oc];
        let mut dx = vec![0f32; N * ic];
        let mut dw = vec![0f32; ic * oc];
        let fwd = time(reps, |p| match p {
            Some(p) => {
                matmul_forward(&mut y, &x, &w, None, 1, N, ic, oc, Mode::Throughput, p).unwrap();
            }
            None => matmul_bf16(&mut y, &xb, false, &wb, false, N, oc, ic, false).unwrap(),
        });
        let bwd_x = time(reps, |p| match p {
            Some(p) => {
                matmul_backward_input(&mut dx, &dy, &w, 1, N, ic, oc, Mode::Throughput, p).unwrap();
            }
            None => matmul_bf16(&mut dx, &dyb, false, &wb, true, N, ic, oc, false).unwrap(),
        });
        let bwd_w = time(reps, |p| match p {
            Some(p) => matmul_backward_weight(&mut dw, None, &dy, &x, 1, N, ic, oc, p).unwrap(),
            None => matmul_bf16(&mut dw, &xb, true, &dyb, false, ic, oc, N, true).unwrap(),
        });
        for (kind, t) in [("fwd", fwd), ("dx", bwd_x), ("dw", bwd_w)] {
            let label = format!("{kind} {name} {ic}x{oc}");
            layer_sum.row(&label, flops, t, f32_peak, bf16_peak);
        }
    }
    layer_sum.total("all twelve");

    // The tied language-model head (the vocabulary's V × C weight used
    // transposed): the step's largest products, the input and weight
    // gradients with an output too narrow to split by columns.
    let x = data(N * C, 4);
    let w = data(V * C, 5);
    let dy = data(N * V, 6);
    let (xb, wb, dyb) = (to_bf16(&x), to_bf16(&w), to_bf16(&dy));
    let flops = 2.0 * (N * C * V) as f64;
    let mut y = vec![0f32; N * V];
    let mut dx = vec![0f32; N * C];
    let mut dw = vec![0f32; V * C];
    let fwd = time(reps, |p| match p {
        Some(p) => {
            matmul_forward_wt(&mut y, &x, &w, None, 1, N, C, V, Mode::Throughput, p).unwrap();
        }
        None => matmul_bf16(&mut y, &xb, false, &wb, true, N, V, C, false).unwrap(),
    });
    let bwd_x = time(reps, |p| match p {
        Some(p) => {
            matmul_backward_wt_input(&mut dx, &dy, &w, 1, N, C, V, Mode::Throughput, p).unwrap();
        }
        None => matmul_bf16(&mut dx, &dyb, false, &wb, false, N, C, V, false).unwrap(),
    });
    let bwd_w = time(reps, |p| match p {
        Some(p) => matmul_backward_wt_weight(&mut dw, None, &dy, &x, 1, N, C, V, p).unwrap(),
        None => matmul_bf16(&mut dw, &dyb, true, &xb, false, V, C, N, true).unwrap(),
    });
    let mut head_sum = Sum::default();
    for (kind, t) in [("fwd", fwd), ("dx", bwd_x), ("dw", bwd_w)] {
        let label = format!("{kind} lm_head {C}x{V}");
        head_sum.row(&label, flops, t, f32_peak, bf16_peak);
    }
    head_sum.total("lm_head's three");
    layer_sum.add(&head_sum);
    layer_sum.total("all (12 layers + head)");
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Best times of one product in alternating rounds: (the f32 kernel, the
/// same kernel in bf16, [`matmul_bf16`] on bf16 buffers), `run` called
/// with `Some(precision)` for the kernel and `None` for the buffers.
fn time(reps: usize, mut run: impl FnMut(Option<Precision>)) -> (f64, f64, f64) {
    let (mut t32, mut t16, mut tb) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..reps {
        t32 = t32.min(best(1, || run(Some(Precision::F32))));
        t16 = t16.min(best(1, || run(Some(Precision::Bf16))));
        tb = tb.min(best(1, || run(None)));
    }
    (t32, t16, tb)
}

/// Running totals of a group of rows (times in seconds, FLOPs).
#[derive(Default)]
struct Sum {
    t32: f64,
    t16: f64,
    tb: f64,
    flops: f64,
}

impl Sum {
    /// Prints one product's row and adds it to the totals.
    fn row(
        &mut self,
        label: &str,
        flops: f64,
        (t32, t16, tb): (f64, f64, f64),
        f32_peak: f64,
        bf16_peak: Option<f64>,
    ) {
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
        self.add(&Sum {
            t32,
            t16,
            tb,
            flops,
        });
    }

    fn add(&mut self, o: &Sum) {
        self.t32 += o.t32;
        self.t16 += o.t16;
        self.tb += o.tb;
        self.flops += o.flops;
    }

    /// Prints the group's total.
    fn total(&self, label: &str) {
        println!(
            "{label:<28} {:>8.2} {:>8.2} {:>8.2} {:>10.1} {:>10.1} {:>7.2}x",
            self.t32 * 1e3,
            self.t16 * 1e3,
            self.tb * 1e3,
            self.flops / self.t32 / 1e9,
            self.flops / self.t16 / 1e9,
            self.t32 / self.t16
        );
    }
}
