//! GPT-2's initialisation, element by element from a seed.
//!
//! Every element's value is a function of the seed, its tensor's name and
//! its index in the *whole* tensor (a counter-based generator: SplitMix64
//! over `(seed, name)` and the index, Box–Muller for the normal), so a rank
//! initialises only the part of each tensor it holds — its tensor- or
//! expert-parallel shard, its pipeline stage, its FSDP shard — and every
//! layout starts from the same weights as one rank, without any rank
//! building the whole model.

use rayon::prelude::*;
use weft_parallel::ParamLayout;

use crate::error::{Error, Result};

/// GPT-2's initialisation of the tensors `layout` places in `params`:
/// N(0, 0.02) weights (the residual projections, `*.c_proj.weight`,
/// scaled by 1/sqrt(2·`n_layer`)), zero biases (and any other vector),
/// unit gains of the layernorms and RMSNorms (QK-norm included). Each element of a rank's part takes the value
/// the whole tensor has there (see the module docs).
///
/// # Errors
/// [`Error::Batch`] if `params` does not fit `layout`;
/// [`Error::Parallel`] for a layout whose placements do not fit its
/// coordinates.
pub fn init_gpt2(
    layout: &ParamLayout,
    params: &mut [f32],
    seed: u64,
    n_layer: usize,
) -> Result<()> {
    if params.len() != layout.len() {
        return Err(Error::Batch {
            reason: format!(
                "{} parameters for a layout of {}",
                params.len(),
                layout.len()
            ),
        });
    }
    #[allow(clippy::cast_precision_loss)]
    let proj_std = 0.02 / (2.0 * n_layer.max(1) as f64).sqrt();
    let coords = layout.coords();
    for spec in layout.specs() {
        let p = &mut params[spec.range()];
        if spec.global_shape.len() == 1 {
            let gain = spec.name.contains("ln_") || spec.name.ends_with("_norm.weight");
            let one = if gain { 1.0 } else { 0.0 };
            p.fill(one);
            continue;
        }
        let std = if spec.name.ends_with("c_proj.weight") {
            proj_std
        } else {
            0.02
        };
        let key = name_key(seed, &spec.name);
        for run in spec.runs(&coords)? {
            p[run.local..run.local + run.len]
                .par_chunks_mut(1 << 14)
                .enumerate()
                .for_each(|(k, chunk)| {
                    let first = run.whole + (k << 14);
                    for (i, x) in chunk.iter_mut().enumerate() {
                        #[allow(clippy::cast_possible_truncation)]
                        {
                            *x = (normal(key, (first + i) as u64) * std) as f32;
                        }
                    }
                });
        }
    }
    Ok(())
}

/// SplitMix64's output function: a bijective mix of a 64-bit counter.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The generator's key for one tensor: FNV-1a of its name, mixed with the
/// seed.
fn name_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01B3);
    }
    splitmix64(seed ^ splitmix64(h))
}

/// A uniform in (0, 1) from 53 bits of `x`.
fn unit(x: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    u
}

/// Element `i`'s standard normal under `key` (Box–Muller over two
/// counter-based uniforms).
fn normal(key: u64, i: u64) -> f64 {
    let a = unit(splitmix64(key.wrapping_add(i.wrapping_mul(2))));
    let b = unit(splitmix64(key.wrapping_add(i.wrapping_mul(2) + 1)));
    (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GptConfig, Mlp, Sharding, param_layout};
    use weft_parallel::Coords;

    #[test]
    fn a_shard_takes_the_whole_tensors_values_and_the_moments_are_gpt2s() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 16,
            vocab_size: 37,
            block_size: 8,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: crate::BlockArch::GPT2,
        };
        let whole = param_layout(&cfg, &Mlp, &Sharding::SINGLE).unwrap();
        let mut w = vec![0.0f32; whole.len()];
        init_gpt2(&whole, &mut w, 7, 2).unwrap();
        for rank in 0..2 {
            let sharding = Sharding {
                coords: Coords {
                    tp: (rank, 2),
                    ..Coords::SINGLE
                },
                sequence_parallel: false,
            };
            let local = param_layout(&cfg, &Mlp, &sharding).unwrap();
            let mut mine = vec![0.0f32; local.len()];
            init_gpt2(&local, &mut mine, 7, 2).unwrap();
            let mut want = vec![0.0f32; local.len()];
            weft_parallel::extract(&local, &whole, &w, &mut want).unwrap();
            assert!(
                mine.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
        // N(0, 0.02): the sample moments of wte's 592 values
        let wte = &w[whole.range("transformer.wte.weight").unwrap()];
        let n = wte.len() as f64;
        let mean = wte.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = wte
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 4.0 * 0.02 / n.sqrt(), "{mean}");
        assert!((var.sqrt() / 0.02 - 1.0).abs() < 0.1, "{}", var.sqrt());
        // another seed, other values; layernorm gains 1, biases 0
        let mut o = vec![0.0f32; whole.len()];
        init_gpt2(&whole, &mut o, 8, 2).unwrap();
        assert_ne!(o, w);
        assert!(
            w[whole.range("transformer.h.0.ln_1.weight").unwrap()]
                .iter()
                .all(|&x| x == 1.0)
        );
        assert!(
            w[whole.range("transformer.h.0.attn.c_attn.bias").unwrap()]
                .iter()
                .all(|&x| x == 0.0)
        );
    }
}
