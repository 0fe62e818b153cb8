//! Throughput of every summation strategy on every element dtype, at 1 Mi
//! and 64 Mi elements (elements per second in criterion's report).
//!
//! `cargo bench -p weft-numerics` runs it all; `-- 'exact|pairwise'` filters.
//! The figure that matters for collectives is `exact` against
//! `pairwise/f32` on the same f32 buffer (`f32/1Mi/...`): the exact sum is
//! meant to cost at most a few times the fast inexact one.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use weft_numerics::{Dtype, Element, Strategy, bf16, count_nonfinite, f16};

fn data<T: Element>(n: usize) -> Vec<T> {
    // Gradient-like: mostly small values of both signs, occasional large ones.
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let big = if i % 1024 == 0 { 100.0 } else { 1e-3 };
            T::from_f64(u * big)
        })
        .collect()
}

fn strategies() -> Vec<Strategy> {
    vec![
        Strategy::Naive(Dtype::F32),
        Strategy::Kahan(Dtype::F32),
        Strategy::Pairwise(Dtype::F32),
        Strategy::Pairwise(Dtype::F64),
        Strategy::Exact,
    ]
}

fn bench_dtype<T: Element>(c: &mut Criterion) {
    for (label, n, samples) in [("1Mi", 1usize << 20, 30), ("64Mi", 1 << 26, 10)] {
        let xs = data::<T>(n);
        let mut g = c.benchmark_group(format!("{}/{label}", T::DTYPE));
        g.throughput(Throughput::Elements(n as u64));
        g.sample_size(samples);
        for s in strategies() {
            g.bench_with_input(BenchmarkId::from_parameter(s.name()), &xs, |b, xs| {
                b.iter(|| black_box(s.sum(black_box(xs))));
            });
        }
        g.finish();
    }
}

fn bench_nonfinite(c: &mut Criterion) {
    let n = 1usize << 24;
    let xs = data::<f32>(n);
    let mut g = c.benchmark_group("count_nonfinite/f32/16Mi");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(20);
    g.bench_function("count_nonfinite", |b| {
        b.iter(|| black_box(count_nonfinite(black_box(&xs))));
    });
    // The obvious scalar-looking loop, for comparison.
    g.bench_function("iter_filter_is_finite", |b| {
        b.iter(|| black_box(black_box(&xs).iter().filter(|x| !x.is_finite()).count()));
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_nonfinite(c);
    bench_dtype::<f32>(c);
    bench_dtype::<f64>(c);
    bench_dtype::<f16>(c);
    bench_dtype::<bf16>(c);
}

criterion_group!(sum, benches);
criterion_main!(sum);
