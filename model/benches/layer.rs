//! Whole-layer forward + backward at GPT-2 small's shapes (C=768, NH=12,
//! B=4, T=256), both kernel modes side by side; criterion's "elem/s" is
//! FLOP/s (6·12·C² per token for the linear layers plus 6·T·C per token
//! for causal attention).
//!
//! The layer is measured as a one-layer model with a 64-token vocabulary,
//! so embedding and head cost well under 1% of it.
//!
//! Run with `cargo bench -p weft-model --bench layer`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weft_kernels::Mode;
use weft_model::{Gpt, GptConfig};

fn layer(c: &mut Criterion) {
    let (b, t) = (4, 256);
    let cfg = GptConfig {
        n_layer: 1,
        n_head: 12,
        n_embd: 768,
        vocab_size: 64,
        block_size: 256,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let ch = cfg.n_embd;
    let mut model = Gpt::new(cfg).unwrap();
    model.init_gpt2(1);
    let mut acts = model.activations(b, t).unwrap();
    let tokens: Vec<u32> = (0..b * t)
        .map(|i| u32::try_from(i * 7 % 64).unwrap())
        .collect();
    let flops = (6 * 12 * ch * ch + 6 * t * ch) * b * t;
    let mut g = c.benchmark_group("layer");
    g.sample_size(10);
    g.throughput(Throughput::Elements(flops as u64));
    for (mode, tag) in [
        (Mode::BatchInvariant, "invariant"),
        (Mode::Throughput, "throughput"),
    ] {
        model.set_mode(mode);
        g.bench_function(format!("gpt2_small_fwd_bwd_B{b}_T{t}/{tag}"), |bch| {
            bch.iter(|| {
                model.forward(&mut acts, &tokens, Some(&tokens)).unwrap();
                model.backward(&mut acts).unwrap();
            });
        });
    }
    g.finish();
}

criterion_group!(benches, layer);
criterion_main!(benches);
