//! The per-block API and pipeline stages against the whole model, bitwise:
//! the split backward (B then W) gives the whole backward's bits, and a
//! model cut into stages gives the whole model's losses and accumulated
//! gradients, for tied and untied embeddings and every kind of cut.

use weft_model::{
    BlockArch, Gpt, GptConfig, GptStage, MicroBatch, SlidingWindow, StageSpec, SwiGlu,
};
use weft_pipeline::Stage;

type R = Result<(), Box<dyn std::error::Error>>;

fn model(tied: bool, layers: usize, seed: u64) -> Gpt {
    let cfg = GptConfig {
        n_layer: layers,
        n_head: 2,
        n_embd: 16,
        vocab_size: 37,
        block_size: 12,
        tied_embeddings: tied,
        layer_norm_epsilon: 1e-5,
        arch: BlockArch::GPT2,
    };
    let mut m = Gpt::new(cfg).unwrap();
    m.init_gpt2(seed);
    m
}

/// A Llama-family block with every option at once: grouped-query
/// attention with a head size set apart, QK-norm, query/key/value biases,
/// rotary positions, sliding-window layers with every third layer global,
/// SwiGLU.
fn llama(tied: bool, layers: usize, seed: u64) -> Gpt {
    let mut arch = BlockArch::llama(2, 10_000.0);
    arch.head_dim = Some(6);
    arch.qk_norm = true;
    arch.qkv_bias = true;
    arch.sliding_window = Some(SlidingWindow {
        window: 3,
        global_every: Some(3),
    });
    let cfg = GptConfig {
        n_layer: layers,
        n_head: 4,
        n_embd: 16,
        vocab_size: 37,
        block_size: 12,
        tied_embeddings: tied,
        layer_norm_epsilon: 1e-5,
        arch,
    };
    let mut m = Gpt::with_ffn(cfg, Box::new(SwiGlu { hidden: 24 })).unwrap();
    m.init_gpt2(seed);
    m
}

/// Deterministic pseudo-random (tokens, targets) for micro-batch `mb`.
fn batch(n: usize, v: u32, mb: u64) -> (Vec<u32>, Vec<u32>) {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (mb + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        u32::try_from(s % u64::from(v)).unwrap()
    };
    let tokens = (0..n).map(|_| next()).collect();
    let targets = (0..n).map(|_| next()).collect();
    (tokens, targets)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn split_backward_equals_whole_backward_bitwise() -> R {
    let (b, t) = (2, 8);
    for (tied, build) in [
        (true, model as fn(bool, usize, u64) -> Gpt),
        (false, model),
        (true, llama),
        (false, llama),
    ] {
        let mut full = build(tied, 3, 11);
        let bl = full.blocks().clone();
        let c = bl.config().n_embd;
        let mut acts = full.activations(b, t)?;
        // Manual run with its own gradient buffer, two micro-batches
        // accumulated without zeroing (as the model does).
        let mut g = vec![0.0f32; full.params.len()];
        let p = full.params.clone();
        let mut layers: Vec<_> = (0..3).map(|_| bl.block_acts(b, t).unwrap()).collect();
        let mut saved: Vec<_> = (0..3).map(|_| bl.weight_inputs(b, t).unwrap()).collect();
        let mut head = bl.head_acts(b, t)?;
        let mut scratch = bl.scratch(b, t)?;
        let mut emb = vec![0.0f32; b * t * c];
        let mut dres = vec![0.0f32; b * t * c];
        for mb in 0..2 {
            let (tok, tg) = batch(b * t, 37, mb);
            let want = full.forward(&mut acts, &tok, Some(&tg))?.unwrap();
            full.backward(&mut acts)?;

            bl.embed_forward(&mut emb, &tok, &p[bl.embed_range()], b, t)?;
            for l in 0..3 {
                let (prev, cur) = layers.split_at_mut(l);
                let inp = if l == 0 {
                    &emb
                } else {
                    &prev[l - 1].out().to_vec()
                };
                bl.block_forward(
                    l,
                    &mut cur[0],
                    inp,
                    &p[bl.block_range(l)],
                    None,
                    &mut scratch,
                )?;
            }
            let got = bl
                .head_forward(
                    &mut head,
                    layers[2].out(),
                    &p[bl.lnf_range()],
                    &p[bl.lm_head_range()],
                    Some(&tg),
                )?
                .unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "loss, tied={tied}");
            let mut dlnf = g[bl.lnf_range()].to_vec();
            let mut dlm = g[bl.lm_head_range()].to_vec();
            bl.head_backward(
                &mut dres,
                &mut dlnf,
                &mut dlm,
                &mut head,
                layers[2].out(),
                &p[bl.lnf_range()],
                &p[bl.lm_head_range()],
                &mut scratch,
            )?;
            g[bl.lnf_range()].copy_from_slice(&dlnf);
            g[bl.lm_head_range()].copy_from_slice(&dlm);
            // All B first (last layer to first), then all W in forward order.
            for l in (0..3).rev() {
                let inp = if l == 0 {
                    emb.clone()
                } else {
                    layers[l - 1].out().to_vec()
                };
                bl.block_backward_input(
                    &mut dres,
                    &mut saved[l],
                    &layers[l],
                    &inp,
                    &p[bl.block_range(l)],
                    &mut scratch,
                )?;
            }
            for l in 0..3 {
                let inp = if l == 0 {
                    emb.clone()
                } else {
                    layers[l - 1].out().to_vec()
                };
                bl.block_backward_weight(
                    &mut g[bl.block_range(l)],
                    &mut saved[l],
                    &layers[l],
                    &inp,
                    &p[bl.block_range(l)],
                    &mut scratch,
                )?;
            }
            let r = bl.embed_range();
            bl.embed_backward(&mut g[r], &dres, &tok, b, t)?;
        }
        for spec in full.layout().specs() {
            assert_eq!(
                bits(&g[spec.range()]),
                bits(full.grad(&spec.name).unwrap()),
                "{} (tied={tied})",
                spec.name
            );
        }
        // A W without its B is an error, not a silent zero.
        let inp = emb.clone();
        let e = bl.block_backward_weight(
            &mut g[bl.block_range(0)],
            &mut saved[0],
            &layers[0],
            &inp,
            &p[bl.block_range(0)],
            &mut scratch,
        );
        assert!(e.is_err());
    }
    Ok(())
}

/// Runs `mbs` micro-batches through `stages` one after another (the
/// sequential order every schedule is equivalent to), passing activations,
/// gradients and the tied embedding's gradient by hand (the executor's
/// protocol); with `split`, W of a micro-batch is deferred until after the
/// next micro-batch's forward.
fn run_stages(
    stages: &mut [GptStage],
    mbs: u64,
    split: bool,
) -> Result<Vec<f64>, weft_model::Error> {
    let (b, t) = stages[0].batch_shape();
    let v = u32::try_from(stages[0].blocks().config().vocab_size).unwrap();
    let n = stages.len();
    let msg = stages[0].message_len();
    let mut losses = Vec::new();
    let mut pending: Option<(usize, Option<Vec<f32>>)> = None;
    let owner_takes = |s: &mut GptStage, m: usize, tied: &Option<Vec<f32>>| {
        if let (Some(sh), Some(g)) = (s.shared().first(), tied)
            && sh.owner == s.spec().index
        {
            s.add_shared_grad(sh.id, m, g)?;
        }
        Ok::<_, weft_model::Error>(())
    };
    for mb in 0..mbs {
        let (tok, tg) = batch(b * t, v, mb);
        let m = usize::try_from(mb).unwrap();
        let data = MicroBatch {
            tokens: &tok,
            targets: &tg,
        };
        let mut x: Vec<f32> = Vec::new();
        for (i, s) in stages.iter_mut().enumerate() {
            let mut out = vec![0.0; msg];
            let input = (i > 0).then_some(x.as_slice());
            let last = i + 1 == n;
            let loss = s.forward(m, &data, input, (!last).then_some(&mut out[..]))?;
            if let Some(l) = loss {
                losses.push(l);
            }
            x = out;
        }
        if let Some((prev, tied)) = pending.take() {
            for s in stages.iter_mut() {
                owner_takes(s, prev, &tied)?;
                s.backward_weight(prev)?;
            }
        }
        let mut d: Option<Vec<f32>> = None;
        let mut tied: Option<Vec<f32>> = None;
        for (i, s) in stages.iter_mut().enumerate().rev() {
            let mut dinp = vec![0.0; msg];
            let dinput = (i > 0).then_some(&mut dinp[..]);
            if split {
                s.backward_input(m, d.as_deref(), dinput)?;
            } else {
                owner_takes(s, m, &tied)?;
                s.backward(m, d.as_deref(), dinput)?;
            }
            if let Some(sh) = s.shared().first()
                && let Some(g) = s.shared_grad(sh.id, m)
            {
                tied = Some(g.to_vec());
            }
            d = Some(dinp);
        }
        if split {
            pending = Some((m, tied));
        }
    }
    if let Some((prev, tied)) = pending {
        for s in stages.iter_mut() {
            owner_takes(s, prev, &tied)?;
            s.backward_weight(prev)?;
        }
    }
    Ok(losses)
}

#[test]
fn stages_give_the_whole_models_losses_and_gradients_bitwise() -> R {
    let (b, t, mbs) = (2, 8, 3u64);
    for tied in [true, false] {
        let mut full = model(tied, 3, 5);
        let mut acts = full.activations(b, t)?;
        let mut want = Vec::new();
        for mb in 0..mbs {
            let (tok, tg) = batch(b * t, 37, mb);
            want.push(full.forward(&mut acts, &tok, Some(&tg))?.unwrap());
            full.backward(&mut acts)?;
        }
        for cut in [&[3][..], &[1, 2], &[1, 1, 1], &[0, 3], &[3, 0], &[0, 3, 0]] {
            for split in [false, true] {
                let mut stages = (0..cut.len())
                    .map(|i| GptStage::from_gpt(&full, StageSpec::nth(cut, i)?, b, t, 2, split))
                    .collect::<Result<Vec<_>, _>>()?;
                let got = run_stages(&mut stages, mbs, split)?;
                let what = format!("tied={tied} cut={cut:?} split={split}");
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "losses, {what}"
                );
                let mut g = vec![f32::NAN; full.params.len()];
                let mut covered = 0;
                for s in &stages {
                    for (l, gl) in s.segments() {
                        g[gl.clone()].copy_from_slice(&s.grads()[l.clone()]);
                    }
                    covered += s.params().len();
                    for spec in s.specs() {
                        assert_eq!(
                            bits(&s.grads()[spec.range()]),
                            bits(full.grad(&spec.name).unwrap()),
                            "{} {what}",
                            spec.name
                        );
                    }
                }
                assert_eq!(
                    covered,
                    full.params.len(),
                    "stages partition the parameters, {what}"
                );
                assert_eq!(bits(&g), bits(&full.grads), "{what}");
            }
        }
    }
    Ok(())
}

#[test]
fn stage_misuse_is_a_typed_error() -> R {
    let full = model(true, 2, 1);
    let bad = |spec: StageSpec| GptStage::from_gpt(&full, spec, 1, 4, 1, false).is_err();
    let spec = |layers: std::ops::Range<usize>, index: usize, stages: usize| StageSpec {
        layers,
        embed: index == 0,
        head: index + 1 == stages,
        index,
        stages,
    };
    assert!(bad(spec(1..3, 1, 2)), "layers beyond the model");
    assert!(bad(spec(1..2, 0, 2)), "embedding not at layer 0");
    assert!(bad(spec(0..1, 1, 2)), "head before the end");
    assert!(
        bad(StageSpec {
            embed: false,
            ..spec(0..1, 0, 2)
        }),
        "the first stage without the embedding"
    );
    assert!(StageSpec::nth(&[1, 1], 2).is_err());
    assert!(GptStage::from_gpt(&full, StageSpec::nth(&[2], 0)?, 1, 4, 0, false).is_err());

    let mut s = GptStage::from_gpt(&full, StageSpec::nth(&[1, 1], 0)?, 1, 4, 1, false)?;
    let tok = [1u32, 2, 3, 4];
    let tg = [2u32, 3, 4, 5];
    let mb = MicroBatch {
        tokens: &tok,
        targets: &tg,
    };
    let mut out = vec![0.0; 64];
    assert!(
        s.forward(0, &mb, Some(&[0.0; 64]), Some(&mut out)).is_err(),
        "hidden states into the embedding stage"
    );
    let short = MicroBatch {
        tokens: &tok[..3],
        targets: &tg,
    };
    assert!(
        s.forward(0, &short, None, Some(&mut out)).is_err(),
        "wrong length"
    );
    s.forward(0, &mb, None, Some(&mut out))?;
    assert!(
        s.forward(1, &mb, None, Some(&mut out)).is_err(),
        "no free slot"
    );
    assert!(s.backward_weight(0).is_err(), "W before B");
    assert!(
        s.backward_input(0, Some(&[0.0; 64]), None).is_err(),
        "not planned for split"
    );
    // The embedding stage of a tied pair needs the head's wte gradient.
    assert!(s.backward(0, Some(&[0.0; 64]), None).is_err());
    let sh = s.shared()[0];
    assert_eq!((sh.owner, sh.user), (0, 1));
    s.add_shared_grad(sh.id, 0, &vec![0.0; sh.len])?;
    s.backward(0, Some(&[0.0; 64]), None)?;
    assert!(
        s.backward(0, Some(&[0.0; 64]), None).is_err(),
        "backward twice"
    );
    assert!(
        s.add_shared_grad(sh.id, 0, &vec![0.0; sh.len]).is_err(),
        "not in flight"
    );
    Ok(())
}
