//! Property tests of kernel invariants.

use proptest::prelude::*;
use weft_kernels::{
    Mode, Precision, attention_forward, doc_starts, fused_classifier, layernorm_forward,
    matmul_forward, softmax_forward,
};

fn vals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            #[allow(clippy::cast_precision_loss)]
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            2.0 * u - 1.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// A sequence's linear-layer output is bitwise the same alone or at any
    /// position of a batch of any size (batch-invariant mode).
    #[test]
    fn matmul_is_batch_invariant(b in 1usize..5, t in 1usize..40, c in 1usize..40, oc in 1usize..80, seed in 0u64..1000) {
        let pos = (seed as usize) % b;
        let w = vals(c * oc, seed + 1);
        let bias = vals(oc, seed + 2);
        let x = vals(b * t * c, seed + 3);
        let mut all = vec![0.0f32; b * t * oc];
        matmul_forward(&mut all, &x, &w, Some(&bias), b, t, c, oc, Mode::BatchInvariant, Precision::F32).unwrap();
        let mut one = vec![0.0f32; t * oc];
        matmul_forward(&mut one, &x[pos * t * c..(pos + 1) * t * c], &w, Some(&bias), 1, t, c, oc, Mode::BatchInvariant, Precision::F32).unwrap();
        let got = &all[pos * t * oc..(pos + 1) * t * oc];
        prop_assert!(one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// Attention of a sequence does not depend on the other sequences, and
    /// each row of the saved probabilities is causal and sums to 1.
    #[test]
    fn attention_is_per_sequence_and_causal(b in 1usize..4, t in 1usize..70, nh in 1usize..4, hs in 1usize..9, seed in 0u64..1000) {
        let c = nh * hs;
        let pos = (seed as usize) % b;
        let qkv = vals(b * t * 3 * c, seed);
        let mut out = vec![0.0f32; b * t * c];
        let mut att = vec![0.0f32; b * nh * t * t];
        attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
        let mut out1 = vec![0.0f32; t * c];
        let mut att1 = vec![0.0f32; nh * t * t];
        attention_forward(&mut out1, &mut att1, &qkv[pos * t * 3 * c..(pos + 1) * t * 3 * c], None, 1, t, c, nh).unwrap();
        prop_assert!(out1.iter().zip(&out[pos * t * c..(pos + 1) * t * c]).all(|(a, b)| a.to_bits() == b.to_bits()));
        for (r, row) in att1.chunks(t).enumerate() {
            let i = r % t;
            prop_assert!(row[i + 1..].iter().all(|&p| p == 0.0));
            let s: f32 = row.iter().sum();
            prop_assert!((s - 1.0).abs() < 1e-5, "row sums to {}", s);
        }
    }

    /// Under document masking each row's probabilities are zero outside
    /// its document (before the boundary token that precedes it, and after
    /// itself) and sum to 1 inside, and the last document's rows are
    /// bitwise those it gets alone.
    #[test]
    fn doc_masked_attention_stays_inside_documents(t in 1usize..90, nh in 1usize..3, hs in 1usize..9, every in 1u64..9, seed in 0u64..1000) {
        let c = nh * hs;
        let qkv = vals(t * 3 * c, seed);
        let tokens: Vec<u32> = (0..t as u64).map(|i| u32::from((i * 7 + seed) % every == 0)).collect();
        let mut starts = vec![0u32; t];
        doc_starts(&mut starts, &tokens, 1, 1, t).unwrap();
        let mut out = vec![0.0f32; t * c];
        let mut att = vec![0.0f32; nh * t * t];
        attention_forward(&mut out, &mut att, &qkv, Some(&starts), 1, t, c, nh).unwrap();
        for (r, row) in att.chunks(t).enumerate() {
            let i = r % t;
            let s0 = starts[i] as usize;
            prop_assert!(s0 <= i && (s0 == 0 || tokens[s0 - 1] == 1));
            prop_assert!(row[..s0].iter().chain(&row[i + 1..]).all(|&p| p == 0.0));
            let s: f32 = row.iter().sum();
            prop_assert!((s - 1.0).abs() < 1e-5, "row sums to {}", s);
        }
        let last = starts[t - 1] as usize;
        let n = t - last;
        let mut alone = vec![0.0f32; n * c];
        let mut a1 = vec![0.0f32; nh * n * n];
        attention_forward(&mut alone, &mut a1, &qkv[last * 3 * c..], None, 1, n, c, nh).unwrap();
        prop_assert!(alone.iter().zip(&out[last * c..]).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// The fused classifier's gradient rows sum to zero (softmax minus a
    /// one-hot, scaled) and its losses equal -ln softmax at the target.
    #[test]
    fn classifier_gradient_rows_sum_to_zero(n in 1usize..6, v in 2usize..300, seed in 0u64..1000) {
        let logits: Vec<f32> = vals(n * v, seed).iter().map(|x| x * 8.0).collect();
        let targets: Vec<u32> = (0..n).map(|i| u32::try_from((seed as usize + 7 * i) % v).unwrap()).collect();
        let mut probs = vec![0.0f32; n * v];
        softmax_forward(&mut probs, &logits, n, v).unwrap();
        let mut g = logits.clone();
        let mut losses = vec![0.0f32; n];
        fused_classifier(&mut g, &mut losses, &targets, Some(1.0), n, v, v).unwrap();
        for i in 0..n {
            let s: f64 = g[i * v..(i + 1) * v].iter().map(|&x| f64::from(x)).sum();
            prop_assert!(s.abs() < 1e-5, "row {} sums to {}", i, s);
            let want = -f64::from(probs[i * v + targets[i] as usize]).ln();
            prop_assert!((f64::from(losses[i]) - want).abs() < 1e-4 * want.abs().max(1.0));
        }
    }

    /// Layernorm output has zero mean and unit variance per row (unit gain,
    /// zero bias), whatever the input's offset and scale.
    #[test]
    fn layernorm_normalises(n in 1usize..5, c in 2usize..100, shift in -100.0f32..100.0, scale in 0.1f32..50.0, seed in 0u64..1000) {
        let x: Vec<f32> = vals(n * c, seed).iter().map(|v| v * scale + shift).collect();
        let (mut out, mut m, mut r) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        layernorm_forward(&mut out, &mut m, &mut r, &x, &vec![1.0; c], &vec![0.0; c], n, c, 1e-5).unwrap();
        for row in out.chunks(c) {
            #[allow(clippy::cast_precision_loss)]
            let cf = c as f64;
            let mu = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cf;
            let var = row.iter().map(|&v| (f64::from(v) - mu).powi(2)).sum::<f64>() / cf;
            prop_assert!(mu.abs() < 1e-4, "mean {}", mu);
            // var + eps in the denominator: tiny spread rows come out < 1.
            prop_assert!(var < 1.0 + 1e-3 && var > 0.9, "variance {}", var);
        }
    }
}
