//! Training-step throughput (forward, backward, AdamW) of the two
//! configurations of the kernels-and-model issue, printed as a table:
//!
//! * (a) n_layer 4, n_embd 256, n_head 4, seq 256, batch 8, vocab 50304
//! * (b) GPT-2 small (124M), seq 256, batch 4
//! * (l) a Llama-shaped model at GPT-2-small scale: 12 layers, 768
//!   channels, 12 query heads sharing 4 key/value heads, SwiGLU 2048,
//!   untied, vocab 32000, seq 256, batch 4
//!
//! Achieved GFLOP/s counts 6·N per token (N = all parameters, tied head
//! once; an untied model's input embedding, a lookup, not at all) plus
//! 6·L·T·C per token for causal attention. PyTorch's numbers come
//! from `model/reference/bench_torch.py`; `model/reference/bench_compare.sh`
//! runs both in one go and prints the ratios.
//!
//! `cargo bench -p weft-model --bench train_step -- [a|b]... [--steps N] [--mode invariant|throughput] [--precision fp32|bf16|fp16|both|all|storage] [--peak]`
//!
//! `--precision both` runs each configuration in fp32 and in bf16 mixed
//! precision side by side (alternating rows) and prints the ratio; `all`
//! adds fp16 (operands rounded to fp16, f32 products: the cost of the
//! rounding; the step's loss is not scaled, which changes no timing).
//! `storage` runs bf16 twice over, alternating activations planned in
//! f32 (`bf16 f32-acts`: the products round their inputs as they pack)
//! and in bf16 (the products' inputs kept in bf16, the default): the same
//! bits, the cost and the bytes of keeping them.
//!
//! Tokens/s use the best (shortest) of the timed steps; the mean is shown
//! too. The next to last column divides the achieved GFLOP/s by the peak
//! of the run's products measured at start: the f32 FMA peak
//! ([`weft_kernels::fma_peak_gflops`]), or for bf16 the bf16 dot-product
//! peak ([`weft_kernels::bf16_dot_peak_gflops`]) where the CPU has bf16
//! instructions; `--peak` also
//! prints what the GEMM reaches on a 1024³ product.

use std::time::Instant;

use weft_kernels::{AdamW, Mode, Precision};
use weft_model::{Gpt, GptConfig};

struct Case {
    name: &'static str,
    cfg: GptConfig,
    /// The gated MLP's width (the Llama family), or GPT-2's MLP.
    swiglu: Option<usize>,
    b: usize,
    t: usize,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "a",
            cfg: GptConfig {
                n_layer: 4,
                n_head: 4,
                n_embd: 256,
                vocab_size: 50304,
                block_size: 1024,
                tied_embeddings: true,
                layer_norm_epsilon: 1e-5,
                arch: weft_model::BlockArch::GPT2,
            },
            swiglu: None,
            b: 8,
            t: 256,
        },
        Case {
            name: "b",
            cfg: GptConfig::gpt2_small(),
            swiglu: None,
            b: 4,
            t: 256,
        },
        Case {
            name: "l",
            cfg: GptConfig {
                n_layer: 12,
                n_head: 12,
                n_embd: 768,
                vocab_size: 32000,
                block_size: 1024,
                tied_embeddings: false,
                layer_norm_epsilon: 1e-5,
                arch: weft_model::BlockArch::llama(4, 500_000.0),
            },
            swiglu: Some(2048),
            b: 4,
            t: 256,
        },
    ]
}

/// GFLOP/s of one 1024³ f32 GEMM through the same kernel (best of 10).
#[allow(clippy::cast_precision_loss)]
fn gemm_peak() -> f64 {
    let n = 1024;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..11 {
        let t = Instant::now();
        weft_kernels::matmul_forward(
            &mut out,
            &a,
            &w,
            None,
            1,
            n,
            n,
            n,
            Mode::Throughput,
            Precision::F32,
        )
        .unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e9
}

#[allow(clippy::print_stdout, clippy::cast_precision_loss)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut steps = 5usize;
    let mut mode = Mode::BatchInvariant;
    let mut which: Vec<String> = Vec::new();
    let mut peak = false;
    // (precision, activations planned in f32 whatever the precision)
    let mut precisions = vec![(Precision::F32, false)];
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--steps" => {
                steps = args
                    .get(i + 1)
                    .and_then(|s| s.parse().ok())
                    .expect("--steps N");
                i += 1;
            }
            "--mode" => {
                mode = match args.get(i + 1).map(String::as_str) {
                    Some("throughput") => Mode::Throughput,
                    _ => Mode::BatchInvariant,
                };
                i += 1;
            }
            "--precision" => {
                let (f32, bf16, fp16) = (
                    (Precision::F32, false),
                    (Precision::Bf16, false),
                    (Precision::F16, false),
                );
                let wide = (Precision::Bf16, true);
                precisions = match args.get(i + 1).map(String::as_str) {
                    Some("bf16") => vec![bf16],
                    Some("fp16") => vec![fp16],
                    Some("both") => vec![f32, bf16],
                    Some("all") => vec![f32, bf16, fp16],
                    Some("storage") => vec![wide, bf16, bf16, wide],
                    _ => vec![f32],
                };
                i += 1;
            }
            "--peak" => peak = true,
            a if a.starts_with("--") => {}
            a => which.push(a.to_string()),
        }
        i += 1;
    }
    println!(
        "threads: {}, mode: {mode:?}, steps: {steps} (after 1 warm-up), bf16 path: {}",
        rayon::current_num_threads(),
        weft_kernels::bf16_path().name()
    );
    if peak {
        let g = gemm_peak();
        println!("GEMM peak (1024x1024x1024 f32, best of 10): {g:.1} GFLOP/s");
    }
    // The denominator of the last column: what the cores' FMA units
    // sustain now (a lower bound on a shared machine).
    let fma_peak = weft_kernels::fma_peak_gflops(rayon::current_num_threads(), 5);
    println!(
        "FMA peak ({} threads, measured): {fma_peak:.1} GFLOP/s",
        rayon::current_num_threads()
    );
    // bf16 rows are held against the bf16 products' own peak (where the
    // CPU has bf16 instructions; else the f32 one they are widened to)
    let bf16_peak = if precisions.iter().any(|&(p, _)| p == Precision::Bf16) {
        weft_kernels::bf16_dot_peak_gflops(rayon::current_num_threads(), 5)
    } else {
        None
    };
    if let Some(p) = bf16_peak {
        println!(
            "bf16 peak ({} threads, measured): {p:.1} GFLOP/s",
            rayon::current_num_threads()
        );
    }
    println!(
        "| config | precision | params | B | T | act bytes/token | best s/step | mean s/step | tokens/s | GFLOP/s | % of peak | vs fp32 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for case in cases() {
        if !which.is_empty() && !which.iter().any(|w| w == case.name) {
            continue;
        }
        let mut fp32_tps = None;
        for &(precision, wide_acts) in &precisions {
            let mut model = match case.swiglu {
                Some(hidden) => {
                    Gpt::with_ffn(case.cfg.clone(), Box::new(weft_model::SwiGlu { hidden }))
                        .unwrap()
                }
                None => Gpt::new(case.cfg.clone()).unwrap(),
            };
            model.set_mode(mode);
            if !wide_acts {
                model.set_precision(precision);
            }
            model.init_gpt2(1);
            let mut acts = model.activations(case.b, case.t).unwrap();
            model.set_precision(precision);
            let mut opt = model.adamw_state();
            let hp = AdamW {
                lr: 1e-4,
                weight_decay: 0.1,
                ..AdamW::default()
            };
            let n = case.b * case.t;
            let v = u32::try_from(case.cfg.vocab_size).unwrap();
            let tokens: Vec<u32> = (0..n as u32)
                .map(|i| i.wrapping_mul(2_654_435_761) % v)
                .collect();
            let targets: Vec<u32> = (0..n as u32)
                .map(|i| (i + 1).wrapping_mul(2_654_435_761) % v)
                .collect();
            let mut step = || {
                model.forward(&mut acts, &tokens, Some(&targets)).unwrap();
                model.zero_grad();
                model.backward(&mut acts).unwrap();
                model.adamw_step(&mut opt, &hp).unwrap();
            };
            step();
            // Best step of `steps`: on a shared machine the minimum is the
            // measurement least disturbed by other processes.
            let mut secs = f64::INFINITY;
            let mut total = 0.0;
            for _ in 0..steps {
                let start = Instant::now();
                step();
                let s = start.elapsed().as_secs_f64();
                secs = secs.min(s);
                total += s;
            }
            let mean = total / steps as f64;
            let params = model.params.len();
            let c = &case.cfg;
            let lookup = if c.tied_embeddings {
                0
            } else {
                c.vocab_size * c.n_embd
            };
            let flops_per_token =
                6.0 * (params - lookup) as f64 + 6.0 * (c.n_layer * case.t * c.q_dim()) as f64;
            let tps = n as f64 / secs;
            if precision == Precision::F32 {
                fp32_tps = Some(tps);
            }
            println!(
                "| {} | {} | {:.1}M | {} | {} | {} | {secs:.3} | {mean:.3} | {tps:.0} | {:.1} | {:.0} | {} |",
                case.name,
                if wide_acts {
                    format!("{} f32-acts", precision.name())
                } else {
                    precision.name().to_owned()
                },
                params as f64 / 1e6,
                case.b,
                case.t,
                acts.bytes_per_token(),
                tps * flops_per_token / 1e9,
                100.0 * tps * flops_per_token
                    / 1e9
                    / match precision {
                        Precision::Bf16 => bf16_peak.unwrap_or(fma_peak),
                        _ => fma_peak,
                    },
                fp32_tps.map_or_else(|| "-".into(), |f| format!("{:.2}x", tps / f))
            );
        }
    }
}
