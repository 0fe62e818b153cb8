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
    /// a row does not depend on later positions: changing every query, key
    /// and value after row `k` changes no bit of rows `..=k` (outputs and
    /// log-sum-exps).
    #[test]
    fn attention_is_per_sequence_and_causal(b in 1usize..4, t in 1usize..140, nh in 1usize..4, hs in 1usize..9, seed in 0u64..1000) {
        let c = nh * hs;
        let pos = (seed as usize) % b;
        let qkv = vals(b * t * 3 * c, seed);
        let mut out = vec![0.0f32; b * t * c];
        let mut lse = vec![0.0f32; b * nh * t];
        attention_forward(&mut out, &mut lse, &qkv, None, b, t, c, nh).unwrap();
        let mut x1 = qkv[pos * t * 3 * c..(pos + 1) * t * 3 * c].to_vec();
        let (mut out1, mut lse1) = (vec![0.0f32; t * c], vec![0.0f32; nh * t]);
        attention_forward(&mut out1, &mut lse1, &x1, None, 1, t, c, nh).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&out1), bits(&out[pos * t * c..(pos + 1) * t * c]));
        prop_assert_eq!(bits(&lse1), bits(&lse[pos * nh * t..(pos + 1) * nh * t]));
        let k = (seed as usize / 7) % t;
        for v in &mut x1[(k + 1) * 3 * c..] {
            *v = -3.0 * *v + 0.5;
        }
        let (mut out2, mut lse2) = (vec![0.0f32; t * c], vec![0.0f32; nh * t]);
        attention_forward(&mut out2, &mut lse2, &x1, None, 1, t, c, nh).unwrap();
        prop_assert_eq!(bits(&out2[..(k + 1) * c]), bits(&out1[..(k + 1) * c]));
        for h in 0..nh {
            prop_assert_eq!(bits(&lse2[h * t..h * t + k + 1]), bits(&lse1[h * t..h * t + k + 1]));
        }
    }

    /// Under document masking a row sees only its document (from one past
    /// the boundary token before it): changing every query, key and value
    /// before the last document changes no bit of its rows, and they
    /// equal the document alone to rounding (bitwise when it starts on a
    /// leaf of 64 keys).
    #[test]
    fn doc_masked_attention_stays_inside_documents(t in 1usize..150, nh in 1usize..3, hs in 1usize..9, every in 1u64..40, seed in 0u64..1000) {
        let c = nh * hs;
        let mut qkv = vals(t * 3 * c, seed);
        let tokens: Vec<u32> = (0..t as u64).map(|i| u32::from((i * 7 + seed) % every == 0)).collect();
        let mut starts = vec![0u32; t];
        doc_starts(&mut starts, &tokens, 1, 1, t).unwrap();
        for (i, &s0) in starts.iter().enumerate() {
            let s0 = s0 as usize;
            prop_assert!(s0 <= i && (s0 == 0 || tokens[s0 - 1] == 1));
        }
        let run = |x: &[f32]| {
            let (mut out, mut lse) = (vec![0.0f32; t * c], vec![0.0f32; nh * t]);
            attention_forward(&mut out, &mut lse, x, Some(&starts), 1, t, c, nh).unwrap();
            out
        };
        let out = run(&qkv);
        let last = starts[t - 1] as usize;
        for v in &mut qkv[..last * 3 * c] {
            *v = 2.0 * *v - 1.0;
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&run(&qkv)[last * c..]), bits(&out[last * c..]));
        let n = t - last;
        let mut alone = vec![0.0f32; n * c];
        let mut a1 = vec![0.0f32; nh * n];
        attention_forward(&mut alone, &mut a1, &qkv[last * 3 * c..], None, 1, n, c, nh).unwrap();
        if last.is_multiple_of(64) {
            prop_assert_eq!(bits(&alone), bits(&out[last * c..]));
        }
        for (a, b) in alone.iter().zip(&out[last * c..]) {
            prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{} vs {}", a, b);
        }
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

    /// Layernorm output has zero mean and, per row, the variance
    /// `s² / (s² + ε)` of its definition (unit gain, zero bias; `s²` the
    /// row's own variance): 1 for rows whose spread is far above `ε`, less
    /// for nearly constant ones, whatever the input's offset and scale; to
    /// f32 rounding, which subtracting the mean leaves at about an ulp of
    /// the inputs' magnitude, times `1/√(s² + ε)`.
    #[test]
    fn layernorm_normalises(n in 1usize..5, c in 2usize..100, shift in -100.0f32..100.0, scale in 0.1f32..50.0, seed in 0u64..1000) {
        let x: Vec<f32> = vals(n * c, seed).iter().map(|v| v * scale + shift).collect();
        let (mut out, mut m, mut r) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        layernorm_forward(&mut out, &mut m, &mut r, &x, &vec![1.0; c], &vec![0.0; c], n, c, 1e-5).unwrap();
        #[allow(clippy::cast_precision_loss)]
        let cf = c as f64;
        let moments = |row: &[f32]| {
            let mu = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cf;
            (mu, row.iter().map(|&v| (f64::from(v) - mu).powi(2)).sum::<f64>() / cf)
        };
        for (row, input) in out.chunks(c).zip(x.chunks(c)) {
            let (mu, var) = moments(row);
            let s2 = moments(input).1;
            let want = s2 / (s2 + 1e-5);
            let big = input.iter().fold(0f64, |m, &v| m.max(f64::from(v.abs())));
            let rounding = 4.0 * f64::from(f32::EPSILON) * big / (s2 + 1e-5).sqrt();
            prop_assert!(mu.abs() < 1e-4 + rounding, "mean {}", mu);
            prop_assert!((var - want).abs() < 2e-3 + 2.0 * rounding, "variance {} against {}", var, want);
        }
    }
}
