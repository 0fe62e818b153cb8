//! Batch invariance: a sequence's logits and losses are bitwise identical
//! whether it is computed alone or anywhere inside a batch of any size.

use proptest::prelude::*;
use weft_kernels::Mode;
use weft_model::{Gpt, GptConfig};

fn model() -> Gpt {
    // T up to 70 crosses attention's 64-row blocks; C=48 is not a multiple of 16.
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 3,
        n_embd: 48,
        vocab_size: 97,
        block_size: 70,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut m = Gpt::new(cfg).unwrap();
    m.init_gpt2(7);
    m
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            u32::try_from(s % 97).unwrap()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]
    #[test]
    fn sequence_result_is_independent_of_its_batch(b in 1usize..6, pos_frac in 0.0f64..1.0, t in prop::sample::select(vec![1usize, 2, 17, 70]), seed in 0u64..1000) {
        let m = model();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let pos = ((pos_frac * b as f64) as usize).min(b - 1);
        let seq = tokens(seed, t);
        let tgt = tokens(seed + 1, t);
        let mut alone = m.activations(1, t).unwrap();
        m.forward(&mut alone, &seq, Some(&tgt)).unwrap();

        let mut inputs = tokens(seed + 2, b * t);
        let mut targets = tokens(seed + 3, b * t);
        inputs[pos * t..(pos + 1) * t].copy_from_slice(&seq);
        targets[pos * t..(pos + 1) * t].copy_from_slice(&tgt);
        let mut batch = m.activations(b, t).unwrap();
        m.forward(&mut batch, &inputs, Some(&targets)).unwrap();
        let v = 97;
        let (l1, l2) = (alone.logits(), &batch.logits()[pos * t * v..(pos + 1) * t * v]);
        prop_assert!(l1.iter().zip(l2).all(|(a, b)| a.to_bits() == b.to_bits()), "logits differ (B={}, pos={})", b, pos);
        let (s1, s2) = (alone.losses(), &batch.losses()[pos * t..(pos + 1) * t]);
        prop_assert!(s1.iter().zip(s2).all(|(a, b)| a.to_bits() == b.to_bits()), "losses differ");
    }
}

#[test]
fn throughput_mode_agrees_closely() {
    let mut m = model();
    let (b, t) = (3, 33);
    let inputs = tokens(5, b * t);
    let targets = tokens(6, b * t);
    let mut acts = m.activations(b, t).unwrap();
    let l1 = m
        .forward(&mut acts, &inputs, Some(&targets))
        .unwrap()
        .unwrap();
    m.set_mode(Mode::Throughput);
    let l2 = m
        .forward(&mut acts, &inputs, Some(&targets))
        .unwrap()
        .unwrap();
    assert!((l1 - l2).abs() < 1e-6 * l1.abs(), "{l1} vs {l2}");
}
