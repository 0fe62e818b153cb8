//! Routing throughput (tokens/s) for 64 experts top-8 and 8 experts top-2
//! on 16k tokens, and the MoE block's forward+backward against the dense
//! GPT-2 MLP of equal active parameters (hidden width k·H), both on the
//! same tokens.
//!
//! Run with `cargo bench -p weft-moe --bench moe`.

#![allow(missing_docs)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use weft_kernels::{Mode, Precision, gelu_backward, gelu_forward, matmul_backward, matmul_forward};
use weft_moe::{Gate, MoeBlock, MoeConfig, Router};

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            (x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn routing(c: &mut Criterion) {
    let n = 16_384;
    let mut g = c.benchmark_group("route_16k");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    for (e, k) in [(64, 8), (8, 2)] {
        let logits = data(n * e, 1);
        let bias = vec![0.0f32; e];
        for router in [
            Router::top_k(e, k).with_normalize(true),
            Router::top_k(e, k)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true),
        ] {
            g.bench_function(router.name(), |b| {
                b.iter(|| black_box(router.route(&logits, &[n], Some(&bias)).unwrap()));
            });
        }
    }
    g.finish();
}

fn block(c: &mut Criterion) {
    let (ch, e, k) = (256, 8, 2);
    let (b, t) = (8, 256);
    let n = b * t;
    let lens = vec![t; b];
    let cfg = MoeConfig::new(ch, e, k);
    let h = cfg.hidden;
    let moe = MoeBlock::new(cfg).unwrap();
    let mut params = vec![0.0f32; moe.num_params()];
    moe.init(&mut params, 1, 1.0).unwrap();
    let inp = data(n * ch, 2);
    let dout = data(n * ch, 3);
    let mut g = c.benchmark_group("block_fwd_bwd");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    let mut out = vec![0.0f32; n * ch];
    let mut saved = vec![0.0f32; n * cfg.saved_per_token()];
    let mut dinp = vec![0.0f32; n * ch];
    let mut grads = vec![0.0f32; params.len()];
    g.bench_function(format!("moe_e{e}_top{k}_c{ch}"), |bch| {
        bch.iter(|| {
            moe.forward(&mut out, &mut saved, &inp, &params, &lens)
                .unwrap();
            moe.backward(&mut dinp, &mut grads, &dout, &inp, &saved, &params, &lens)
                .unwrap();
        });
    });
    // Dense MLP with the same active parameters per token: hidden k·H.
    let hd = k * h;
    let w1 = data(ch * hd, 4)
        .iter()
        .map(|x| x * 0.02)
        .collect::<Vec<_>>();
    let b1 = vec![0.0f32; hd];
    let w2 = data(hd * ch, 5)
        .iter()
        .map(|x| x * 0.02)
        .collect::<Vec<_>>();
    let b2 = vec![0.0f32; ch];
    let (mut hp, mut a) = (vec![0.0f32; n * hd], vec![0.0f32; n * hd]);
    let (mut da, mut dh) = (vec![0.0f32; n * hd], vec![0.0f32; n * hd]);
    let (mut dw1, mut db1) = (vec![0.0f32; ch * hd], vec![0.0f32; hd]);
    let (mut dw2, mut db2) = (vec![0.0f32; hd * ch], vec![0.0f32; ch]);
    let m = Mode::Throughput;
    g.bench_function(format!("dense_h{hd}_c{ch}"), |bch| {
        bch.iter(|| {
            matmul_forward(
                &mut hp,
                &inp,
                &w1,
                Some(&b1),
                b,
                t,
                ch,
                hd,
                m,
                Precision::F32,
            )
            .unwrap();
            gelu_forward(&mut a, &hp, n * hd).unwrap();
            matmul_forward(
                &mut out,
                &a,
                &w2,
                Some(&b2),
                b,
                t,
                hd,
                ch,
                m,
                Precision::F32,
            )
            .unwrap();
            da.fill(0.0);
            dh.fill(0.0);
            matmul_backward(
                &mut da,
                &mut dw2,
                Some(&mut db2),
                &dout,
                &a,
                &w2,
                b,
                t,
                hd,
                ch,
                m,
                Precision::F32,
            )
            .unwrap();
            gelu_backward(&mut dh, &hp, &da, n * hd).unwrap();
            matmul_backward(
                &mut dinp,
                &mut dw1,
                Some(&mut db1),
                &dh,
                &inp,
                &w1,
                b,
                t,
                ch,
                hd,
                m,
                Precision::F32,
            )
            .unwrap();
        });
    });
    g.finish();
}

criterion_group!(benches, routing, block);
criterion_main!(benches);
