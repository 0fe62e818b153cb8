//! The story of the fp16 all-reduce, in two tables.
//!
//! `cargo run --release -p weft-numerics --example drift`
//!
//! 1. 10,000 ones summed by each strategy: a naive f16 accumulator stalls at
//!    2048 (2048 + 1 is a tie that rounds back to 2048), bf16 at 256.
//! 2. A gradient-like workload (many small values of mixed sign with a
//!    positive mean, plus a few large ones), summed in many trials: the error
//!    of each strategy against the exact sum, split into bias (mean signed
//!    error — what compounds over steps) and spread (what averages out).

#![allow(clippy::print_stdout)] // an example's output is its point

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use weft_numerics::{Dtype, Element, ExactSum, Strategy, bf16, f16, measure};

fn ones_row<T: Element>(label: &str, strategy: Strategy) {
    let xs = vec![T::from_f32(1.0); 10_000];
    let got = strategy.sum(&xs);
    println!("{label:<34} {:<16} {got:>10}", strategy.name());
}

fn uniform(rng: &mut Pcg64) -> f64 {
    (rng.next_u64() >> 11) as f64 * (-53f64).exp2()
}

/// Gradient-like values: 99.9% small, uniform in [-1e-3, 3e-3] (mean 1e-3),
/// 0.1% large, ±[0.5, 2).
fn gradient_like<T: Element>(trial: usize, buf: &mut [T]) {
    let mut rng = Pcg64::seed_from_u64(0x5eed ^ trial as u64);
    for x in buf.iter_mut() {
        let v = if rng.next_u32() % 1000 == 0 {
            let mag = 0.5 + 1.5 * uniform(&mut rng);
            if rng.next_u32() & 1 == 0 { mag } else { -mag }
        } else {
            -1e-3 + 4e-3 * uniform(&mut rng)
        };
        *x = T::from_f64(v);
    }
}

fn drift_table<T: Element>(n: usize, trials: usize, strategies: &[Strategy]) {
    let mut probe = vec![T::ZERO; n];
    gradient_like(0, &mut probe);
    let mut exact = ExactSum::new();
    exact.add_slice(&probe);
    println!(
        "\n{n} {} values per trial, {trials} trials (exact sum of trial 0: {:.6})",
        T::DTYPE,
        exact.to_f64()
    );
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>8} {:>12}",
        "strategy", "bias", "spread", "worst", "bias/se", "rel worst"
    );
    for &s in strategies {
        let r = measure(s, gradient_like::<T>, n, trials);
        println!(
            "{:<16} {:>12.3e} {:>12.3e} {:>12.3e} {:>8.1} {:>12.2e}",
            s.name(),
            r.bias,
            r.spread,
            r.worst,
            r.bias_z(),
            r.rel_worst
        );
    }
}

fn main() {
    println!("10,000 ones");
    println!("{:<34} {:<16} {:>10}", "values", "strategy", "sum");
    ones_row::<f16>("f16, naive f16 accumulator", Strategy::Naive(Dtype::F16));
    ones_row::<bf16>("bf16, naive bf16 accumulator", Strategy::Naive(Dtype::BF16));
    ones_row::<f16>("f16, accumulated in f32", Strategy::Naive(Dtype::F32));
    ones_row::<f16>("f16, Kahan in f16", Strategy::Kahan(Dtype::F16));
    ones_row::<f16>("f16, Neumaier in f16", Strategy::Neumaier(Dtype::F16));
    ones_row::<f16>("f16, pairwise in f16", Strategy::Pairwise(Dtype::F16));
    ones_row::<bf16>("bf16, Kahan in bf16", Strategy::Kahan(Dtype::BF16));
    ones_row::<f16>("f16, exact", Strategy::Exact);

    let low = [
        Strategy::Naive(Dtype::F16),
        Strategy::Naive(Dtype::BF16),
        Strategy::Kahan(Dtype::BF16),
        Strategy::Pairwise(Dtype::BF16),
        Strategy::Naive(Dtype::F32),
        Strategy::Kahan(Dtype::F32),
        Strategy::Neumaier(Dtype::F32),
        Strategy::Pairwise(Dtype::F32),
        Strategy::Exact,
    ];
    println!("\nGradient-like workload: bias compounds, spread averages out.");
    println!("bias/se = |bias| / (spread/sqrt(trials)); above ~4 the bias is real.");
    drift_table::<bf16>(1 << 16, 64, &low);
    drift_table::<f32>(1 << 16, 64, &low);
}
