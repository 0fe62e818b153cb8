//! The inference engine against the training forward: every logit a
//! [`Decoder`] returns — after a prefill of each prompt length, and at
//! every step of a greedy continuation to the full block — is bitwise the
//! logit [`Gpt::forward`] computes for the same prefix, for dense and MoE
//! models of several shapes, in f32 and in bf16 mixed precision, and
//! with document masking.

use weft_model::{Decoder, Error, Gpt, GptConfig, MoeFfn};
use weft_moe::{Gate, MoeConfig, Router};

fn cfg(n_layer: usize, n_head: usize, n_embd: usize, vocab: usize, block: usize) -> GptConfig {
    GptConfig {
        n_layer,
        n_head,
        n_embd,
        vocab_size: vocab,
        block_size: block,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    u32::try_from(best).unwrap()
}

/// The training forward's logits for the last position of `prefix`.
fn reference(model: &Gpt, prefix: &[u32]) -> Vec<f32> {
    let v = model.config().vocab_size;
    let mut acts = model.activations(1, prefix.len()).unwrap();
    model.forward(&mut acts, prefix, None).unwrap();
    acts.logits()[(prefix.len() - 1) * v..].to_vec()
}

fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: logit {i} is {} (decoder) vs {} (forward)",
            got[i], want[i]
        );
    }
}

/// Prefills each prompt length in `prompt_lens`, then decodes greedily to
/// the end of the block, comparing every position's logits with a full
/// forward over the prefix.
fn check_model(model: &Gpt, prompt_lens: &[usize], name: &str) {
    let c = model.config().clone();
    let mut dec = Decoder::new(model);
    assert_eq!(dec.capacity(), c.block_size);
    // every position per layer, a windowed layer only its window
    let positions: usize = (0..c.n_layer)
        .map(|l| c.window(l).map_or(c.block_size, |w| w.min(c.block_size)))
        .sum();
    assert_eq!(dec.kv_bytes(), positions * 2 * c.kv_dim() * 4);
    assert!(dec.bytes() > dec.kv_bytes());
    for &p in prompt_lens {
        dec.reset();
        // A varied prompt (ids spread over the vocabulary).
        let mut tokens: Vec<u32> = (0..p)
            .map(|i| u32::try_from((i * 7919 + p * 31) % c.vocab_size).unwrap())
            .collect();
        let logits = dec.prefill(&tokens).unwrap().to_vec();
        assert_bitwise(
            &logits,
            &reference(model, &tokens),
            &format!("{name}: prefill {p}"),
        );
        let mut next = argmax(&logits);
        while tokens.len() < c.block_size {
            tokens.push(next);
            let logits = dec.step(next).unwrap().to_vec();
            let what = format!("{name}: prompt {p}, position {}", tokens.len() - 1);
            assert_bitwise(&logits, &reference(model, &tokens), &what);
            next = argmax(&logits);
        }
        assert_eq!(dec.len(), c.block_size);
    }
}

#[test]
fn dense_models_decode_the_forwards_logits_bitwise_for_every_prompt_length() {
    let shapes = [
        // (L, NH, C, V, T): tiny vocabulary (narrow lm_head); wide vocabulary
        // and 3 heads of 8; one head; untied below.
        (2, 2, 16, 50, 12),
        (2, 3, 24, 300, 10),
        (1, 1, 8, 70, 9),
    ];
    for (i, &(l, nh, c, v, t)) in shapes.iter().enumerate() {
        let mut model = Gpt::new(cfg(l, nh, c, v, t)).unwrap();
        model.init_gpt2(10 + i as u64);
        let lens: Vec<usize> = (1..=t).collect();
        check_model(&model, &lens, &format!("dense {l}x{nh}x{c} V={v} T={t}"));
    }
    let mut untied = cfg(2, 2, 16, 40, 8);
    untied.tied_embeddings = false;
    let mut model = Gpt::new(untied).unwrap();
    model.init_gpt2(3);
    check_model(&model, &(1..=8).collect::<Vec<_>>(), "untied");
}

/// In bf16 mixed precision the decoder reproduces the bf16 forward's bits
/// (and they are not the f32 forward's).
#[test]
fn bf16_models_decode_the_bf16_forwards_logits_bitwise() {
    let mut model = Gpt::new(cfg(2, 3, 24, 300, 10)).unwrap();
    model.init_gpt2(7);
    let f32_logits = reference(&model, &[1, 2, 3]);
    model.set_precision(weft_kernels::Precision::Bf16);
    let bf16_logits = reference(&model, &[1, 2, 3]);
    assert_ne!(f32_logits, bf16_logits, "bf16 is not f32");
    check_model(&model, &(1..=10).collect::<Vec<_>>(), "bf16");
    let moe = MoeConfig::new(16, 4, 2);
    let (ffn, _) = MoeFfn::new(moe).unwrap();
    let mut model = Gpt::with_ffn(cfg(2, 2, 16, 50, 12), Box::new(ffn)).unwrap();
    model.init_gpt2(21);
    model.set_precision(weft_kernels::Precision::Bf16);
    check_model(&model, &[1, 5, 12], "bf16 moe");
}

/// Under document masking the decoder derives each position's document
/// from the boundary tokens it was fed, as the forward does from its
/// batch: bitwise the masked forward (prompts and greedy continuations
/// over a vocabulary of 9, so the boundary — the last id — comes often),
/// past the attention blocks too, and not the unmasked forward.
#[test]
fn doc_masked_models_decode_the_masked_forwards_logits_bitwise() {
    for (t, seed) in [(24, 8), (80, 9)] {
        let mut model = Gpt::new(cfg(2, 2, 16, 9, t)).unwrap();
        model.init_gpt2(seed);
        let prompt: Vec<u32> = (0..t as u32).map(|i| (i * 5 + 3) % 9).collect();
        assert!(prompt.contains(&8));
        let plain = reference(&model, &prompt);
        model.set_doc_boundary(Some(8));
        assert_ne!(
            plain,
            reference(&model, &prompt),
            "the mask changes the logits"
        );
        let lens: Vec<usize> = if t > 64 {
            vec![1, 7, 63, 64, 65, 80]
        } else {
            (1..=t).collect()
        };
        check_model(&model, &lens, &format!("documents T={t}"));
    }
}

/// Positions past the attention kernel's 64-row blocks.
#[test]
fn decoding_past_the_attention_blocks_matches_too() {
    let mut model = Gpt::new(cfg(2, 2, 16, 60, 80)).unwrap();
    model.init_gpt2(5);
    check_model(&model, &[1, 63, 64, 65, 79, 80], "block 80");
}

#[test]
fn moe_models_decode_the_forwards_logits_bitwise() {
    let routers = [
        Router::top_k(4, 2),
        Router::top_k(4, 1)
            .with_gate(Gate::Sigmoid)
            .with_normalize(true),
        // Fine-grained SwiGLU experts routed DeepSeek-V3's way, two
        // shared, after a dense first layer.
        Router::top_k(4, 2)
            .with_gate(Gate::Sigmoid)
            .with_normalize(true)
            .with_scale(2.5),
    ];
    for (i, router) in routers.into_iter().enumerate() {
        let fine = i == 2;
        let moe = MoeConfig {
            router,
            shared_experts: usize::from(i == 1) + 2 * usize::from(fine),
            ..MoeConfig::new(16, 4, 2)
        };
        let moe = if fine {
            MoeConfig {
                hidden: 6,
                expert: weft_moe::Expert::SwiGlu,
                ..moe
            }
        } else {
            moe
        };
        let (ffn, stats) = MoeFfn::new(moe).unwrap();
        let ffn = ffn.with_first_dense(
            usize::from(fine),
            std::sync::Arc::new(weft_model::SwiGlu { hidden: 24 }),
        );
        let mut model = Gpt::with_ffn(cfg(2, 2, 16, 50, 12), Box::new(ffn)).unwrap();
        model.init_gpt2(20 + i as u64);
        // Spread the router's logits so tokens go to different experts.
        for spec in model.layout().specs().to_vec() {
            if spec.name.ends_with("router.weight") {
                for x in &mut model.params[spec.range()] {
                    *x *= 50.0;
                }
            }
        }
        check_model(&model, &(1..=12).collect::<Vec<_>>(), &format!("moe {i}"));
        let log = stats.take();
        let used = log
            .iter()
            .flat_map(|(_, f)| f.stats.tokens_per_expert.iter().enumerate())
            .filter(|&(_, &n)| n > 0)
            .map(|(e, _)| e)
            .collect::<std::collections::BTreeSet<_>>();
        assert!(used.len() > 1, "every token went to one expert: {used:?}");
    }
}

#[test]
fn bad_input_is_an_error_and_leaves_the_cache_alone() {
    let mut model = Gpt::new(cfg(1, 2, 8, 20, 6)).unwrap();
    model.init_gpt2(1);
    let mut dec = Decoder::new(&model);
    assert!(matches!(dec.prefill(&[]), Err(Error::Batch { .. })));
    let e = dec.prefill(&[1, 2, 3, 4, 5, 6, 7]).unwrap_err();
    assert!(e.to_string().contains("block_size = 6"), "{e}");
    dec.prefill(&[1, 2, 3]).unwrap();
    let e = dec.step(20).unwrap_err();
    assert!(e.to_string().contains("20"), "{e}");
    assert_eq!(dec.len(), 3);
    let logits = dec.step(4).unwrap().to_vec();
    assert_bitwise(&logits, &reference(&model, &[1, 2, 3, 4]), "after an error");
    dec.prefill(&[5, 6]).unwrap();
    assert!(dec.step(7).is_err(), "a seventh position does not fit");
    assert_eq!(dec.len(), 6);
}

/// Llama-family blocks decode the forward's logits bitwise too: rotary
/// positions (restarting at each document under masking), RMSNorm,
/// grouped- and multi-query attention with a head size set apart, QK-norm,
/// sliding-window layers with every second one global, SwiGLU; in f32 and
/// bf16, past the attention blocks.
#[test]
fn llama_family_models_decode_the_forwards_logits_bitwise() {
    use weft_model::{BlockArch, SlidingWindow, SwiGlu};
    let llama = |kv: usize, t: usize, qk_norm: bool| {
        let mut arch = BlockArch::llama(kv, 10_000.0);
        arch.head_dim = Some(6);
        arch.qk_norm = qk_norm;
        arch.sliding_window = Some(SlidingWindow {
            window: 5,
            global_every: Some(2),
        });
        let c = GptConfig {
            arch,
            tied_embeddings: false,
            ..cfg(2, 4, 16, 29, t)
        };
        let mut m = Gpt::with_ffn(c, Box::new(SwiGlu { hidden: 24 })).unwrap();
        m.init_gpt2(17);
        m
    };
    check_model(
        &llama(2, 12, true),
        &(1..=12).collect::<Vec<_>>(),
        "qwen3-like GQA",
    );
    check_model(&llama(1, 12, false), &[1, 4, 12], "llama-like MQA");
    let long = llama(2, 80, true);
    check_model(&long, &[1, 63, 64, 65, 80], "GQA T=80");
    // the windowed layer (of 2) holds 5 positions, the global one 80
    assert_eq!(Decoder::new(&long).kv_bytes(), (80 + 5) * 2 * 12 * 4);
    let mut model = llama(2, 24, true);
    model.set_doc_boundary(Some(28));
    check_model(&model, &[1, 9, 24], "GQA documents");
    let mut model = llama(4, 12, true);
    model.set_precision(weft_kernels::Precision::Bf16);
    check_model(&model, &[1, 6, 12], "bf16 MHA");
}
