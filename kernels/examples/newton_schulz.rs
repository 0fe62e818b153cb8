//! Times Muon's Newton–Schulz orthogonalisation ([`newton_schulz`], five
//! steps) at GPT-2 small's weight shapes, in fp32 and bf16, on all the
//! rayon pool's threads: the best of a few calls each, with its GFLOP/s.
//!
//! Run with `cargo run --release -p weft-kernels --example newton_schulz`.

use std::time::Instant;

use weft_kernels::{Muon, Precision, WeightShape, newton_schulz};

#[allow(clippy::print_stdout, clippy::cast_precision_loss)]
fn main() -> Result<(), weft_kernels::Error> {
    let hp = Muon::default();
    println!(
        "Newton–Schulz, {} steps, {} threads, bf16 path {}",
        hp.ns_steps,
        rayon::current_num_threads(),
        weft_kernels::bf16_path().name()
    );
    for (name, fan_in, fan_out) in [
        ("attn.c_proj", 768, 768),
        ("c_attn", 768, 2304),
        ("c_fc", 768, 3072),
        ("mlp.c_proj", 3072, 768),
    ] {
        let shape = WeightShape::InOut { fan_in, fan_out };
        let n = fan_in * fan_out;
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let mut out = vec![0.0f32; n];
        let (m, k) = (fan_in.min(fan_out) as f64, fan_in.max(fan_out) as f64);
        let flops = hp.ns_steps as f64 * (4.0 * m * m * k + 2.0 * m * m * m);
        for precision in [Precision::F32, Precision::Bf16] {
            newton_schulz(&mut out, &g, shape, &hp, precision)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t = Instant::now();
                newton_schulz(&mut out, &g, shape, &hp, precision)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{name:<12} [{fan_in}, {fan_out}] {precision}: {:8.1} ms  {:6.1} GFLOP/s",
                best * 1e3,
                flops / best / 1e9
            );
        }
    }
    Ok(())
}
