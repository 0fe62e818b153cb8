//! `AdamWState`: a layout that does not fit the buffers is refused before
//! anything is updated.

use weft_kernels::AdamW;
use weft_model::{AdamWState, Gpt, GptConfig};

#[test]
fn a_bad_tensor_range_changes_nothing() {
    let cfg = GptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        vocab_size: 11,
        block_size: 4,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
    };
    let mut m = Gpt::new(cfg).unwrap();
    m.init_gpt2(3);
    let n = m.params.len();
    let mut params = m.params.clone();
    let grads = vec![0.5f32; n];
    let mut state = AdamWState::new(&m);
    let before = params.clone();
    // The first tensor fits, the second runs past the end: neither moves.
    let err = state
        .step_tensors(
            [("fits", 0..4, true), ("too.long", n - 2..n + 1, false)],
            &mut params,
            &grads,
            &AdamW::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("too.long"), "{err}");
    assert_eq!(state.step, 0);
    assert_eq!(params, before);
    assert!(state.m.iter().all(|&x| x == 0.0));
    // A good layout steps every tensor once.
    state
        .step_tensors(
            [("all", 0..n, true)],
            &mut params,
            &grads,
            &AdamW::default(),
        )
        .unwrap();
    assert_eq!(state.step, 1);
    assert!(params.iter().zip(&before).all(|(a, b)| a != b));
}
