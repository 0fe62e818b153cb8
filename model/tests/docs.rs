//! Document masking ([`weft_model::GptBlocks::set_doc_boundary`]): a
//! document packed into a sequence after others gets exactly the logits and
//! per-token losses it gets alone at the start of a sequence — attention
//! stops at the boundary token before it and positions restart after it —
//! for dense and mixture-of-experts models, in f32 and bf16, when it starts
//! on one of the attention kernel's leaves of 64 keys (elsewhere its keys
//! fall into other leaves, whose partial sums merge to the same values to
//! rounding); without the mask it does not (the earlier documents change
//! its logits).

use weft_kernels::Precision;
use weft_model::{Gpt, GptConfig, MoeFfn};
use weft_moe::MoeConfig;

/// The end-of-text token of these tests (the last id, as GPT-2's 50256).
const EOT: u32 = 49;

fn cfg(block: usize) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        vocab_size: 50,
        block_size: block,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

/// Three documents of lengths 64, 128 and 11 (each ending with EOT but
/// the last) packed into one sequence of 203 tokens, each starting on a
/// leaf of 64 keys: the second spans two of the kernel's blocks.
fn documents() -> Vec<Vec<u32>> {
    [64usize, 128, 11]
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            (0..n)
                .map(|i| {
                    if i + 1 == n && d < 2 {
                        EOT
                    } else {
                        u32::try_from((i * 7919 + d * 31 + 3) % 49).unwrap()
                    }
                })
                .collect()
        })
        .collect()
}

/// Logits and per-token losses of `tokens` as one sequence.
fn run(model: &Gpt, tokens: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let t = tokens.len();
    let targets: Vec<u32> = tokens.iter().map(|&x| (x + 1) % 50).collect();
    let mut acts = model.activations(1, t).unwrap();
    model.forward(&mut acts, tokens, Some(&targets)).unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect();
    (bits(acts.logits()), bits(acts.losses()))
}

fn check(model: &mut Gpt, what: &str) {
    let docs = documents();
    let packed: Vec<u32> = docs.concat();
    let v = 50;
    for masked in [true, false] {
        model.set_doc_boundary(masked.then_some(EOT));
        let (logits, losses) = run(model, &packed);
        let mut at = 0;
        let mut all_equal = true;
        for (d, doc) in docs.iter().enumerate() {
            let (l1, c1) = run(model, doc);
            let n = doc.len();
            let same = logits[at * v..(at + n) * v] == l1[..] && losses[at..at + n] == c1[..];
            if masked {
                assert!(
                    same,
                    "{what}: document {d} packed at {at} differs from alone"
                );
            }
            all_equal &= same;
            at += n;
        }
        if !masked {
            assert!(
                !all_equal,
                "{what}: without the mask documents see each other"
            );
        }
    }
}

#[test]
fn a_packed_document_gets_the_logits_it_gets_alone() {
    for precision in [Precision::F32, Precision::Bf16] {
        let mut dense = Gpt::new(cfg(203)).unwrap();
        dense.init_gpt2(3);
        dense.set_precision(precision);
        check(&mut dense, &format!("dense {precision:?}"));
        // A dropless token-choice router computes each token on its own.
        let (ffn, _) = MoeFfn::new(MoeConfig::new(16, 4, 2)).unwrap();
        let mut moe = Gpt::with_ffn(cfg(203), Box::new(ffn)).unwrap();
        moe.init_gpt2(4);
        moe.set_precision(precision);
        check(&mut moe, &format!("moe {precision:?}"));
    }
}
