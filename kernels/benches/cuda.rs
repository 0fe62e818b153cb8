//! The GPU kernels at GPT-2 small's training shapes (B=8, T=1024, C=768,
//! NH=12, V=50304; one layer's ops and the head), timed with CUDA events
//! (median of the timed runs after warm-up, the device synchronised before
//! reading), with bytes moved and FLOPs per op and the rates they imply;
//! then a projected training step (the ops of 12 layers, the head and
//! AdamW added up) as tokens/s and MFU against the bf16 dense peak.
//!
//! `cargo bench -p weft-kernels --features cuda --bench cuda` (prints
//! `SKIPPED:` and exits 0 without a GPU). `WEFT_BENCH_REPS` sets the timed
//! runs (default 10).
#![allow(clippy::print_stdout, clippy::print_stderr)]
#![allow(clippy::cast_precision_loss)]

use weft_kernels::cuda::{self, CudaSlice, Gpu};
use weft_kernels::{AdamW, Mode, Precision};

const B: usize = 8;
const T: usize = 1024;
const C: usize = 768;
const NH: usize = 12;
const L: usize = 12;
const V: usize = 50304;
const V_REAL: usize = 50257;
/// GPT-2 small's parameters (tied head; V padded to 50304).
const PARAMS: usize = 124_475_904;

/// The H100 SXM datasheet's dense bf16 peak, which the H200 shares
/// (H200.md); ~790 was measured through PyTorch on this workplace's H200.
const PEAK_BF16_TFLOPS: f64 = 989.0;

struct Row {
    name: String,
    ms: f64,
    bytes: f64,
    flops: f64,
    /// Times it runs in one training step.
    per_step: f64,
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / 16_777_216.0;
            2.0 * r - 1.0
        })
        .collect()
}

/// Median milliseconds of `f` over `reps` runs after two warm-ups.
fn time(g: &Gpu, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    f();
    g.synchronize().expect("synchronize");
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = g.timing_event().expect("event");
        f();
        let b = g.timing_event().expect("event");
        b.synchronize().expect("event sync");
        ms.push(f64::from(a.elapsed_ms(&b).expect("elapsed")));
    }
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

fn up(g: &Gpu, n: usize, seed: u64) -> CudaSlice<f32> {
    g.upload(&data(n, seed)).expect("upload")
}

fn main() {
    let g = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("SKIPPED: CUDA kernel bench: {e}");
            return;
        }
    };
    let reps: usize = std::env::var("WEFT_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
        .max(1);
    let (major, minor) = g.compute_capability();
    println!(
        "device: {} (sm_{major}{minor}); GPT-2 small shapes B={B} T={T} C={C} NH={NH} V={V}; median of {reps}",
        g.name()
    );
    let n = B * T;
    let mut rows: Vec<Row> = Vec::new();
    let mut push = |name: &str, ms: f64, bytes: f64, flops: f64, per_step: f64| {
        rows.push(Row {
            name: name.into(),
            ms,
            bytes,
            flops,
            per_step,
        });
    };
    let f4 = 4.0;

    // Embedding.
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 7919) % V_REAL) as u32).collect();
    let (wte, wpe) = (up(&g, V * C, 1), up(&g, T * C, 2));
    let mut x = g.zeros::<f32>(n * C).unwrap();
    let ms = time(&g, reps, || {
        cuda::encoder_forward(&g, &mut x, &tokens, None, &wte, &wpe, B, T, C).unwrap();
    });
    push("encoder_forward", ms, 3.0 * (n * C) as f64 * f4, 0.0, 1.0);
    let (mut dwte, mut dwpe) = (
        g.zeros::<f32>(V * C).unwrap(),
        g.zeros::<f32>(T * C).unwrap(),
    );
    let dout = up(&g, n * C, 3);
    let ms = time(&g, reps, || {
        cuda::encoder_backward(&g, &mut dwte, &mut dwpe, &dout, &tokens, None, B, T, C).unwrap();
    });
    push("encoder_backward", ms, 4.0 * (n * C) as f64 * f4, 0.0, 1.0);

    // Layernorm.
    let inp = up(&g, n * C, 4);
    let (w, bias) = (up(&g, C, 5), up(&g, C, 6));
    let mut out = g.zeros::<f32>(n * C).unwrap();
    let (mut mean, mut rstd) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
    let ms = time(&g, reps, || {
        cuda::layernorm_forward(
            &g, &mut out, &mut mean, &mut rstd, &inp, &w, &bias, n, C, 1e-5,
        )
        .unwrap();
    });
    let ln_steps = (2 * L + 1) as f64;
    push(
        "layernorm_forward",
        ms,
        2.0 * (n * C) as f64 * f4,
        0.0,
        ln_steps,
    );
    let mut dinp = g.zeros::<f32>(n * C).unwrap();
    let (mut dw, mut db) = (g.zeros::<f32>(C).unwrap(), g.zeros::<f32>(C).unwrap());
    let ms = time(&g, reps, || {
        cuda::layernorm_backward(
            &g, &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, n, C,
        )
        .unwrap();
    });
    push(
        "layernorm_backward",
        ms,
        6.0 * (n * C) as f64 * f4,
        0.0,
        ln_steps,
    );

    // GELU and residual over the MLP's width.
    let h = up(&g, n * 4 * C, 7);
    let mut hg = g.zeros::<f32>(n * 4 * C).unwrap();
    let ms = time(&g, reps, || {
        cuda::gelu_forward(&g, &mut hg, &h, n * 4 * C).unwrap();
    });
    push(
        "gelu_forward",
        ms,
        2.0 * (n * 4 * C) as f64 * f4,
        0.0,
        L as f64,
    );
    let dh = up(&g, n * 4 * C, 8);
    let mut dhi = g.zeros::<f32>(n * 4 * C).unwrap();
    let ms = time(&g, reps, || {
        cuda::gelu_backward(&g, &mut dhi, &h, &dh, n * 4 * C).unwrap();
    });
    push(
        "gelu_backward",
        ms,
        4.0 * (n * 4 * C) as f64 * f4,
        0.0,
        L as f64,
    );
    let ms = time(&g, reps, || {
        cuda::residual_forward(&g, &mut out, &inp, &dout, n * C).unwrap();
    });
    push(
        "residual_forward",
        ms,
        3.0 * (n * C) as f64 * f4,
        0.0,
        2.0 * L as f64,
    );

    // The linear layers: (OC, C) per layer: qkv, attention proj, fc, proj.
    let shapes = [
        ("qkv", C, 3 * C),
        ("attn.proj", C, C),
        ("fc", C, 4 * C),
        ("mlp.proj", 4 * C, C),
    ];
    let mut gemm_ms = [[0.0f64; 3]; 2]; // [mode][fwd, bwd input, bwd weight], bf16
    for (label, c_in, oc) in shapes {
        let x = up(&g, n * c_in, 9);
        let wt = up(&g, c_in * oc, 10);
        let dy = up(&g, n * oc, 11);
        let mut y = g.zeros::<f32>(n * oc).unwrap();
        let mut dx = g.zeros::<f32>(n * c_in).unwrap();
        let mut dwt = g.zeros::<f32>(c_in * oc).unwrap();
        let flops = 2.0 * (n * c_in * oc) as f64;
        let bytes = ((n * c_in + c_in * oc + n * oc) * 4) as f64;
        for (mi, mode) in [Mode::Throughput, Mode::BatchInvariant]
            .into_iter()
            .enumerate()
        {
            for prec in [Precision::Bf16, Precision::F32] {
                if mode == Mode::BatchInvariant && prec == Precision::F32 {
                    continue;
                }
                let tag = format!(
                    "{label} {} {}",
                    prec.name(),
                    if mi == 0 { "cuBLAS" } else { "invariant" }
                );
                let per = if prec == Precision::Bf16 {
                    L as f64
                } else {
                    0.0
                };
                let ms = time(&g, reps, || {
                    cuda::matmul_forward(&g, &mut y, &x, &wt, None, n, c_in, oc, mode, prec)
                        .unwrap();
                });
                push(
                    &format!("matmul fwd {tag}"),
                    ms,
                    bytes,
                    flops,
                    if mi == 0 { per } else { 0.0 },
                );
                if prec == Precision::Bf16 {
                    gemm_ms[mi][0] += ms;
                }
                let ms = time(&g, reps, || {
                    cuda::matmul_backward_input(&g, &mut dx, &dy, &wt, n, c_in, oc, mode, prec)
                        .unwrap();
                });
                push(
                    &format!("matmul bwd-in {tag}"),
                    ms,
                    bytes,
                    flops,
                    if mi == 0 { per } else { 0.0 },
                );
                if prec == Precision::Bf16 {
                    gemm_ms[mi][1] += ms;
                }
                let ms = time(&g, reps, || {
                    cuda::matmul_backward_weight(
                        &g, &mut dwt, None, &dy, &x, n, c_in, oc, mode, prec,
                    )
                    .unwrap();
                });
                push(
                    &format!("matmul bwd-w {tag}"),
                    ms,
                    bytes,
                    flops,
                    if mi == 0 { per } else { 0.0 },
                );
                if prec == Precision::Bf16 {
                    gemm_ms[mi][2] += ms;
                }
            }
        }
    }

    // Attention (causal: half the T×T scores).
    let qkv = up(&g, n * 3 * C, 12);
    let mut att = g.zeros::<f32>(n * C).unwrap();
    let mut lse = g.zeros::<f32>(B * NH * T).unwrap();
    let attn_flops = 4.0 * (B * NH * T * T / 2 * (C / NH)) as f64;
    let ms = time(&g, reps, || {
        cuda::attention_forward(&g, &mut att, &mut lse, &qkv, None, B, T, C, NH).unwrap();
    });
    push(
        "attention_forward",
        ms,
        ((n * 4 * C) * 4) as f64,
        attn_flops,
        L as f64,
    );
    let mut dqkv = g.zeros::<f32>(n * 3 * C).unwrap();
    let ms = time(&g, reps, || {
        cuda::attention_backward(&g, &mut dqkv, &dout, &qkv, &att, &lse, None, B, T, C, NH)
            .unwrap();
    });
    // Recomputes the scores twice (dK/dV pass and dQ pass): 2 + 2·2.5.
    push(
        "attention_backward",
        ms,
        ((n * 8 * C) * 4) as f64,
        2.5 * attn_flops,
        L as f64,
    );

    // The head: logits (N, V) = x · wteᵀ, its loss and gradient.
    let xs = up(&g, n * C, 13);
    let mut logits = g.zeros::<f32>(n * V).unwrap();
    let head_flops = 2.0 * (n * C * V) as f64;
    let ms = time(&g, reps, || {
        cuda::matmul_forward_wt(
            &g,
            &mut logits,
            &xs,
            &wte,
            None,
            n,
            C,
            V,
            Mode::Throughput,
            Precision::Bf16,
        )
        .unwrap();
    });
    push(
        "lm_head fwd bf16 cuBLAS",
        ms,
        ((n * C + V * C + n * V) * 4) as f64,
        head_flops,
        1.0,
    );
    let (mut losses, mut stats) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(2 * n).unwrap());
    let ms = time(&g, reps, || {
        cuda::fused_classifier_forward(&g, &logits, &mut losses, &mut stats, &tokens, n, V, V_REAL)
            .unwrap();
    });
    push(
        "fused_classifier_forward",
        ms,
        ((n * V) * 4) as f64,
        0.0,
        1.0,
    );
    let ms = time(&g, reps, || {
        cuda::fused_classifier_backward(
            &g,
            &mut logits,
            &stats,
            &tokens,
            1.0 / n as f32,
            n,
            V,
            V_REAL,
        )
        .unwrap();
    });
    push(
        "fused_classifier_backward",
        ms,
        ((2 * n * V) * 4) as f64,
        0.0,
        1.0,
    );
    let mut dxs = g.zeros::<f32>(n * C).unwrap();
    let ms = time(&g, reps, || {
        cuda::matmul_backward_wt_input(
            &g,
            &mut dxs,
            &logits,
            &wte,
            n,
            C,
            V,
            Mode::Throughput,
            Precision::Bf16,
        )
        .unwrap();
    });
    push(
        "lm_head bwd-in bf16 cuBLAS",
        ms,
        ((n * C + V * C + n * V) * 4) as f64,
        head_flops,
        1.0,
    );
    let ms = time(&g, reps, || {
        cuda::matmul_backward_wt_weight(
            &g,
            &mut dwte,
            None,
            &logits,
            &xs,
            n,
            C,
            V,
            Mode::Throughput,
            Precision::Bf16,
        )
        .unwrap();
    });
    push(
        "lm_head bwd-w bf16 cuBLAS",
        ms,
        ((n * C + V * C + n * V) * 4) as f64,
        head_flops,
        1.0,
    );
    drop(logits);

    // The optimizer and the step's checks over every parameter.
    let mut p = up(&g, PARAMS, 14);
    let grads = up(&g, PARAMS, 15);
    let (mut m, mut v) = (
        g.zeros::<f32>(PARAMS).unwrap(),
        g.zeros::<f32>(PARAMS).unwrap(),
    );
    let mut p16 = g.zeros::<u16>(PARAMS).unwrap();
    let hp = AdamW::default();
    let ms = time(&g, reps, || {
        let mut hv = p16.as_view_mut();
        cuda::adamw_update(
            &g,
            &mut p,
            Some(&mut hv),
            &grads,
            &mut m,
            &mut v,
            &hp,
            1,
            true,
        )
        .unwrap();
    });
    push(
        "adamw (+ bf16 copy)",
        ms,
        (PARAMS * (4 * 7 + 2)) as f64,
        0.0,
        1.0,
    );
    let ms = time(&g, reps, || {
        std::hint::black_box(cuda::exact_sum_squares(&g, &grads).unwrap());
    });
    push(
        "exact_sum_squares (norm)",
        ms,
        (PARAMS * 4) as f64,
        0.0,
        1.0,
    );
    let ms = time(&g, reps, || {
        std::hint::black_box(cuda::count_nonfinite(&g, &grads).unwrap());
    });
    push("count_nonfinite", ms, (PARAMS * 4) as f64, 0.0, 0.0);

    println!();
    println!(
        "{:<36} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "kernel", "ms", "GB/s", "TFLOP/s", "x/step", "ms/step"
    );
    let mut step_ms = 0.0;
    for r in &rows {
        let gbs = r.bytes / (r.ms * 1e-3) / 1e9;
        let tf = if r.flops > 0.0 {
            format!("{:.1}", r.flops / (r.ms * 1e-3) / 1e12)
        } else {
            "-".into()
        };
        step_ms += r.ms * r.per_step;
        println!(
            "{:<36} {:>10.3} {:>10.0} {:>10} {:>8} {:>10.2}",
            r.name,
            r.ms,
            gbs,
            tf,
            if r.per_step > 0.0 {
                format!("{}", r.per_step)
            } else {
                "-".into()
            },
            r.ms * r.per_step
        );
    }
    let tokens_per_step = (B * T) as f64;
    let model_flops = 6.0 * PARAMS as f64 * tokens_per_step + L as f64 * 3.0 * attn_flops;
    let tps = tokens_per_step / (step_ms * 1e-3);
    let mfu = model_flops / (step_ms * 1e-3) / (PEAK_BF16_TFLOPS * 1e12);
    println!();
    println!(
        "projected GPT-2 small step (sum of the kernels above x per step, cuBLAS bf16 products): \
         {step_ms:.1} ms, {tps:.0} tokens/s, MFU {:.1}% of {PEAK_BF16_TFLOPS} TFLOP/s",
        100.0 * mfu
    );
    println!(
        "bf16 products per layer, invariant kernel vs cuBLAS: fwd {:.2}x, bwd-in {:.2}x, bwd-w {:.2}x",
        gemm_ms[1][0] / gemm_ms[0][0],
        gemm_ms[1][1] / gemm_ms[0][1],
        gemm_ms[1][2] / gemm_ms[0][2]
    );
    // Each op's share of the projected step.
    let mut shares: Vec<(&str, f64)> = rows
        .iter()
        .filter(|r| r.per_step > 0.0)
        .map(|r| (r.name.as_str(), r.ms * r.per_step / step_ms))
        .collect();
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("largest shares of the step:");
    for (name, s) in shares.iter().take(6) {
        println!("  {name:<36} {:5.1}%", 100.0 * s);
    }
}
