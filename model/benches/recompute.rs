//! Activation recomputation (`train.recompute`) and the loss in chunks
//! (`train.loss_chunk`): for each policy, the activation bytes per token a
//! micro-batch plans, the largest micro-batch whose activations fit a
//! budget, and the training step's time (forward, backward, AdamW) against
//! keeping every activation, printed as a table.
//!
//! The policies run in alternation, one step each per round, so a shared
//! machine's slow spells fall on all of them; the table gives the best
//! (shortest) step of the rounds and the mean, and the ratios of the
//! best steps to `none`'s.
//!
//! `cargo bench -p weft-model --bench recompute -- [--model gpt2|llama] [--t 256,1024] [--b 1] [--rounds 4] [--budget-gib 8] [--precision fp32|bf16] [--loss-chunk 1024]`
//!
//! `--rounds 0` prints the bytes without timing any step. With `--loss-chunk N` (N > 0, a multiple of 1024) `none` and `full` also
//! run with the loss in chunks of N tokens (which changes nothing where
//! the micro-batch has at most N tokens).
//!
//! `gpt2` is GPT-2 small (12 × 768, 12 heads, vocab 50257, tied); `llama`
//! a Llama-shaped model at that scale (12 query heads sharing 4 key/value
//! heads, SwiGLU 2048, RMSNorm, rotary, untied, vocab 32000).

use std::time::Instant;

use weft_kernels::{AdamW, Precision};
use weft_model::{BlockArch, Gpt, GptConfig, Recompute};

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn model(name: &str, t: usize) -> Gpt {
    let gpt2 = GptConfig {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        vocab_size: 50257,
        block_size: t,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: BlockArch::GPT2,
    };
    match name {
        "gpt2" => Gpt::new(gpt2).unwrap(),
        "llama" => {
            let cfg = GptConfig {
                vocab_size: 32000,
                tied_embeddings: false,
                arch: BlockArch::llama(4, 500_000.0),
                ..gpt2
            };
            Gpt::with_ffn(cfg, Box::new(weft_model::SwiGlu { hidden: 2048 })).unwrap()
        }
        other => panic!("--model {other}: expected gpt2 or llama"),
    }
}

#[allow(clippy::print_stdout)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = arg(&args, "--model").unwrap_or("gpt2");
    let ts: Vec<usize> = arg(&args, "--t")
        .unwrap_or("256,1024")
        .split(',')
        .map(|x| x.parse().expect("--t: sequence lengths, comma-separated"))
        .collect();
    let b: usize = arg(&args, "--b").map_or(1, |x| x.parse().expect("--b"));
    let rounds: usize = arg(&args, "--rounds").map_or(4, |x| x.parse().expect("--rounds"));
    let budget = arg(&args, "--budget-gib").map_or(8.0, |x| x.parse().expect("--budget-gib"))
        * f64::from(1u32 << 30);
    let precision = match arg(&args, "--precision").unwrap_or("fp32") {
        "fp32" => Precision::F32,
        "bf16" => Precision::Bf16,
        p => panic!("--precision {p}: expected fp32 or bf16"),
    };
    let chunk: usize = arg(&args, "--loss-chunk").map_or(0, |x| x.parse().expect("--loss-chunk"));
    let mut policies = vec![
        (Recompute::None, 0),
        (Recompute::Selective, 0),
        (Recompute::Every(2), 0),
        (Recompute::Full, 0),
    ];
    if chunk > 0 {
        policies.extend([(Recompute::None, chunk), (Recompute::Full, chunk)]);
    }
    let set = |m: &mut Gpt, (r, c): (Recompute, usize)| {
        m.set_recompute(r);
        m.set_loss_chunk(c).unwrap();
    };
    let name_of = |(r, c): (Recompute, usize)| {
        if c == 0 {
            r.to_string()
        } else {
            format!("{r}, loss in chunks of {c}")
        }
    };
    println!(
        "# {name}, {} products, micro-batch {b}, {rounds} rounds (one step of each policy a round), budget {:.0} GiB",
        precision.name(),
        budget / f64::from(1u32 << 30)
    );
    println!(
        "| T | policy | act bytes/token | vs none | largest micro-batch in budget | best s/step | mean s/step | step vs none |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &t in &ts {
        let mut m = model(name, t);
        m.set_precision(precision);
        m.init_gpt2(1);
        let mut opt = m.adamw_state();
        let hp = AdamW {
            lr: 1e-4,
            weight_decay: 0.1,
            ..AdamW::default()
        };
        let n = b * t;
        let v = u32::try_from(m.config().vocab_size).unwrap();
        let tokens: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % v)
            .collect();
        let targets: Vec<u32> = (0..n as u32)
            .map(|i| (i + 1).wrapping_mul(2_654_435_761) % v)
            .collect();
        // per policy: bytes per token and the largest micro-batch in the
        // budget (activations grow linearly in B once a micro-batch holds
        // a whole loss chunk: the bytes of b0 and b0 + 1 sequences give it)
        let mut rows = Vec::new();
        for &p in &policies {
            set(&mut m, p);
            let acts = m.activations(b, t).unwrap();
            let b0 = p.1.div_ceil(t).max(1);
            let at = |b: usize| m.activations(b, t).unwrap().bytes() as f64;
            let (first, slope) = (at(b0), at(b0 + 1) - at(b0));
            let fit = if first > budget {
                0
            } else {
                b0 + ((budget - first) / slope).floor() as usize
            };
            rows.push((name_of(p), acts.bytes_per_token(), fit));
        }
        let mut times = vec![Vec::new(); policies.len()];
        let mut acts: Vec<_> = policies
            .iter()
            .map(|&p| {
                set(&mut m, p);
                m.activations(b, t).unwrap()
            })
            .collect();
        // (`--rounds 0`: the bytes alone)
        for round in 0..rounds.min(1) + rounds {
            for (k, &p) in policies.iter().enumerate() {
                set(&mut m, p);
                let start = Instant::now();
                m.forward(&mut acts[k], &tokens, Some(&targets)).unwrap();
                m.zero_grad();
                m.backward(&mut acts[k]).unwrap();
                m.adamw_step(&mut opt, &hp).unwrap();
                // the first round warms up
                if round > 0 {
                    times[k].push(start.elapsed().as_secs_f64());
                }
            }
        }
        let best = |k: usize| times[k].iter().copied().fold(f64::INFINITY, f64::min);
        let mean = |k: usize| times[k].iter().sum::<f64>() / times[k].len() as f64;
        for (k, (r, bytes, fit)) in rows.iter().enumerate() {
            let times = if rounds == 0 {
                "- | - | -".to_owned()
            } else {
                format!(
                    "{:.3} | {:.3} | {:.2}x",
                    best(k),
                    mean(k),
                    best(k) / best(0)
                )
            };
            println!(
                "| {t} | {r} | {bytes} | {:.3} | {fit} | {times} |",
                *bytes as f64 / rows[0].1 as f64,
            );
        }
    }
}
