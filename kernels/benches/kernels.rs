//! GFLOP/s of the kernels at GPT-2 small's shapes (B=4, T=256, C=768,
//! NH=12, V=50257). Criterion's "elem/s" throughput is FLOP/s here.
//!
//! Run with `cargo bench -p weft-kernels --bench kernels`. Groups:
//! `matmul` (forward and backward of every linear layer of GPT-2, both
//! modes side by side, so the cost of batch invariance is a ratio within
//! one run) and `attention` (forward + backward at T=256 and T=1024).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weft_kernels::{
    Mode, Precision, attention_backward, attention_forward, matmul_backward, matmul_forward,
};

const B: usize = 4;
const T: usize = 256;
const C: usize = 768;
const NH: usize = 12;
const V: usize = 50257;

fn data(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect()
}

fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    g.sample_size(10);
    let shapes = [
        ("c_attn", C, 3 * C),
        ("attn.c_proj", C, C),
        ("c_fc", C, 4 * C),
        ("mlp.c_proj", 4 * C, C),
        ("lm_head", C, V),
    ];
    for (name, ic, oc) in shapes {
        let n = B * T;
        let inp = data(n * ic);
        let w = data(ic * oc);
        let bias = data(oc);
        let mut out = vec![0.0f32; n * oc];
        let flops = 2 * n * ic * oc;
        g.throughput(Throughput::Elements(flops as u64));
        for (mode, tag) in [
            (Mode::BatchInvariant, "invariant"),
            (Mode::Throughput, "throughput"),
        ] {
            g.bench_function(format!("fwd/{name}/{ic}x{oc}/{tag}"), |bch| {
                bch.iter(|| {
                    matmul_forward(
                        &mut out,
                        &inp,
                        &w,
                        Some(&bias),
                        B,
                        T,
                        ic,
                        oc,
                        mode,
                        Precision::F32,
                    )
                    .unwrap();
                });
            });
        }
        let dout = data(n * oc);
        let mut dinp = vec![0.0f32; n * ic];
        let mut dw = vec![0.0f32; ic * oc];
        let mut db = vec![0.0f32; oc];
        g.throughput(Throughput::Elements(2 * flops as u64));
        g.bench_function(format!("bwd/{name}/{ic}x{oc}"), |bch| {
            bch.iter(|| {
                matmul_backward(
                    &mut dinp,
                    &mut dw,
                    Some(&mut db),
                    &dout,
                    &inp,
                    &w,
                    B,
                    T,
                    ic,
                    oc,
                    Mode::Throughput,
                    Precision::F32,
                )
                .unwrap();
            });
        });
    }
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10);
    // GPT-2 small's heads (HS=64) at two sequence lengths; B·T fixed at
    // 1024 tokens so the T=1024 case is one sequence.
    for (b, t) in [(B, T), (1, 4 * T)] {
        let qkv = data(b * t * 3 * C);
        let mut out = vec![0.0f32; b * t * C];
        let mut lse = vec![0.0f32; b * NH * t];
        // Causal: QKᵀ and PV each 2·T²·HS/2 per head; backward twice that.
        let fwd_flops = 2 * b * NH * t * t * (C / NH);
        g.throughput(Throughput::Elements(fwd_flops as u64));
        g.bench_function(format!("fwd/B={b}/T={t}"), |bch| {
            bch.iter(|| attention_forward(&mut out, &mut lse, &qkv, None, b, t, C, NH).unwrap());
        });
        // Document masking (three documents per sequence): the same work,
        // plus the starts (computed per micro-batch in the model).
        let tokens: Vec<u32> = (0..b * t)
            .map(|i| u32::from(i % t % (t / 3) == 0))
            .collect();
        let mut starts = vec![0u32; b * t];
        g.bench_function(format!("fwd-docs/B={b}/T={t}"), |bch| {
            bch.iter(|| {
                weft_kernels::doc_starts(&mut starts, &tokens, 1, b, t).unwrap();
                attention_forward(&mut out, &mut lse, &qkv, Some(&starts), b, t, C, NH).unwrap();
            });
        });
        let dout = data(b * t * C);
        let mut dqkv = vec![0.0f32; b * t * 3 * C];
        attention_forward(&mut out, &mut lse, &qkv, None, b, t, C, NH).unwrap();
        g.throughput(Throughput::Elements(2 * fwd_flops as u64));
        g.bench_function(format!("bwd/B={b}/T={t}"), |bch| {
            bch.iter(|| {
                attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, None, b, t, C, NH).unwrap();
            });
        });
    }
    g.finish();
}

criterion_group!(benches, matmul, attention);
criterion_main!(benches);
