//! Per-op profile of one training step: every kernel call of the step of a
//! GPT-2-style model, timed on its own at the step's shapes (best of a few
//! runs), with its count per step, milliseconds per step and GFLOP/s, and
//! the sum beside a measured whole step.
//!
//! `cargo bench -p weft-model --bench step_profile -- [a|b|l] [--reps N] [--cpu]`
//!
//! `--cpu` times each op by the CPU time of all threads divided by the
//! thread count rather than by the wall clock: steadier on a shared
//! machine (time spent descheduled does not count).
//!
//! Configurations as in `train_step`: (a) n_layer 4, n_embd 256, n_head 4,
//! seq 256, batch 8, vocab 50304; (b) GPT-2 small at seq 256, batch 4; (l)
//! the Llama-shaped model at GPT-2-small scale (12 layers, 768 channels,
//! 12 query heads over 4 key/value heads, SwiGLU 2048, RMSNorm, rotary
//! positions, untied, vocab 32000), seq 256, batch 4. The
//! forward's linear layers run in the model's default (batch-invariant)
//! mode, the backward's as whole-batch GEMMs, as [`weft_model::Gpt`] does.

use std::time::Instant;

use weft_kernels::{
    AdamW, Heads, Mode, Precision, Rope, attention_backward, attention_forward, encoder_backward,
    encoder_forward, fused_classifier_backward, fused_classifier_forward, gelu_backward,
    gelu_forward, layernorm_backward, layernorm_forward, matmul_backward_input,
    matmul_backward_weight, matmul_backward_wt_input, matmul_backward_wt_weight, matmul_forward,
    matmul_forward_wt, residual_forward, rmsnorm_backward, rmsnorm_forward, rope_backward,
    rope_forward, swiglu_backward, swiglu_forward,
};
use weft_model::{Gpt, GptConfig};

struct Shape {
    l: usize,
    nh: usize,
    /// Key/value heads (`nh`: multi-head attention).
    nkv: usize,
    c: usize,
    v: usize,
    b: usize,
    t: usize,
    /// The gated MLP's width (SwiGLU, with RMSNorm and rotary positions:
    /// the Llama family), or `None` for GPT-2's GELU MLP and layernorms.
    swiglu: Option<usize>,
}

/// Pseudo-random values uniform in [-0.5, 0.5) times `scale` (weights
/// scaled like GPT-2's initialisation keep the logits in a realistic range:
/// correlated or large inputs would make the softmax underflow into
/// subnormals, which are slow).
fn data(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    let mut s = (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

struct Row {
    op: String,
    count: usize,
    ms: f64,
    flops: f64,
}

/// CPU time (seconds) of all threads of this process so far, from
/// `/proc/self/task/*/schedstat` (nanoseconds on the CPU), or `None` where
/// that is unavailable.
fn cpu_secs() -> Option<f64> {
    let mut total = 0u64;
    for e in std::fs::read_dir("/proc/self/task").ok()? {
        let p = e.ok()?.path().join("schedstat");
        let s = std::fs::read_to_string(p).ok()?;
        total += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total as f64 * 1e-9)
}

/// Whether [`time`] reports CPU time divided by the thread count instead
/// of wall time (`--cpu`: on a machine shared with other jobs, time spent
/// descheduled then does not count; idle spinning of the pool does).
static CPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Best time (ms) of `reps` runs of `f` after one warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let cpu = CPU.load(std::sync::atomic::Ordering::Relaxed);
    let threads = rayon::current_num_threads() as f64;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let c0 = if cpu { cpu_secs() } else { None };
        let s = Instant::now();
        f();
        let wall = s.elapsed().as_secs_f64();
        let t = match (c0, if cpu { cpu_secs() } else { None }) {
            (Some(a), Some(b)) => (b - a) / threads,
            _ => wall,
        };
        best = best.min(t);
    }
    best * 1e3
}

#[allow(clippy::too_many_lines, clippy::cast_precision_loss)]
fn profile(s: &Shape, reps: usize) -> Vec<Row> {
    let Shape {
        l,
        nh,
        nkv,
        c,
        v,
        b,
        t,
        swiglu,
    } = *s;
    let n = b * t;
    let ckv = c / nh * nkv;
    // The MLP's hidden width and its first product's width (gate|up side
    // by side for SwiGLU).
    let (hidden, fc_out) = match swiglu {
        Some(h) => (h, 2 * h),
        None => (4 * c, 4 * c),
    };
    let inv = Mode::BatchInvariant;
    let thr = Mode::Throughput;
    let mut rows = Vec::new();
    let mut push = |op: String, count: usize, ms: f64, flops: f64| {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("  {op}: {ms:.2} ms");
        }
        rows.push(Row {
            op,
            count,
            ms,
            flops,
        });
    };
    // Linear layers: (name, in, out, forward mode as the model runs it).
    let linears = [
        ("attn.c_attn", c, c + 2 * ckv, inv),
        ("attn.c_proj", c, c, inv),
        ("mlp.c_fc", c, fc_out, thr),
        ("mlp.c_proj", hidden, c, thr),
    ];
    for (name, ic, oc, mode) in linears {
        let x = data(n * ic, 1, 1.0);
        let w = data(ic * oc, 2, 0.04);
        let bias = data(oc, 3, 1.0);
        let dout = data(n * oc, 4, 1.0);
        let mut out = vec![0.0f32; n * oc];
        let mut dx = vec![0.0f32; n * ic];
        let mut dw = vec![0.0f32; ic * oc];
        let mut db = vec![0.0f32; oc];
        let f = 2.0 * (n * ic * oc) as f64;
        let ms = time(reps, || {
            matmul_forward(
                &mut out,
                &x,
                &w,
                Some(&bias),
                b,
                t,
                ic,
                oc,
                mode,
                Precision::F32,
            )
            .unwrap();
        });
        push(format!("fwd {name} {n}x{ic}x{oc}"), l, ms, f);
        let ms = time(reps, || {
            matmul_backward_input(&mut dx, &dout, &w, b, t, ic, oc, thr, Precision::F32).unwrap();
        });
        push(format!("bwd {name} dx"), l, ms, f);
        let ms = time(reps, || {
            matmul_backward_weight(
                &mut dw,
                Some(&mut db),
                &dout,
                &x,
                b,
                t,
                ic,
                oc,
                Precision::F32,
            )
            .unwrap();
        });
        push(format!("bwd {name} dw+db"), l, ms, f);
    }
    // Head.
    {
        let x = data(n * c, 5, 1.0);
        let w = data(v * c, 6, 0.04);
        let mut logits = vec![0.0f32; n * v];
        let mut losses = vec![0.0f32; n];
        let targets: Vec<u32> = (0..n).map(|i| (i * 31 % v) as u32).collect();
        let f = 2.0 * (n * c * v) as f64;
        let ms = time(reps, || {
            matmul_forward_wt(&mut logits, &x, &w, None, b, t, c, v, inv, Precision::F32).unwrap();
        });
        push(format!("fwd lm_head {n}x{c}x{v}"), 1, ms, f);
        let mut stats = vec![0.0f32; 2 * n];
        let ms = time(reps, || {
            fused_classifier_forward(&logits, &mut losses, &mut stats, &targets, n, v, v).unwrap();
        });
        push("softmax+CE fwd (saving row stats)".into(), 1, ms, 0.0);
        let base = logits.clone();
        let ms = time(reps, || {
            logits.copy_from_slice(&base);
            fused_classifier_backward(&mut logits, &stats, &targets, 1.0, n, v, v).unwrap();
        });
        let copy = time(reps, || logits.copy_from_slice(&base));
        push("softmax+CE bwd (one pass)".into(), 1, ms - copy, 0.0);
        let mut dx = vec![0.0f32; n * c];
        let mut dw = vec![0.0f32; v * c];
        let ms = time(reps, || {
            matmul_backward_wt_input(&mut dx, &logits, &w, b, t, c, v, thr, Precision::F32)
                .unwrap();
        });
        push("bwd lm_head dx".into(), 1, ms, f);
        let ms = time(reps, || {
            matmul_backward_wt_weight(&mut dw, None, &logits, &x, b, t, c, v, Precision::F32)
                .unwrap();
        });
        push("bwd lm_head dw".into(), 1, ms, f);
    }
    // Attention.
    {
        let w = c + 2 * ckv;
        let heads = Heads { q: nh, kv: nkv };
        let qkv = data(n * w, 7, 1.0);
        let mut out = vec![0.0f32; n * c];
        let mut lse = vec![0.0f32; b * nh * t];
        let f = 2.0 * (b * nh * t * t * (c / nh)) as f64; // causal: half of 2 GEMMs
        let ms = time(reps, || {
            attention_forward(&mut out, &mut lse, &qkv, None, b, t, c, heads).unwrap();
        });
        push(format!("attention fwd T={t} NH={nh} NKV={nkv}"), l, ms, f);
        let dout = data(n * c, 8, 1.0);
        let mut dqkv = vec![0.0f32; n * w];
        let ms = time(reps, || {
            attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, None, b, t, c, heads).unwrap();
        });
        push("attention bwd".into(), l, ms, 2.0 * f);
    }
    // Row-wise and element-wise.
    {
        let x = data(n * c, 9, 1.0);
        let w = data(c, 10, 1.0);
        let bb = data(c, 11, 1.0);
        let mut out = vec![0.0f32; n * c];
        if swiglu.is_some() {
            let mut rstd = vec![0.0f32; n];
            let ms = time(reps, || {
                rmsnorm_forward(&mut out, &mut rstd, &x, &w, n, c, 1e-5).unwrap();
            });
            push("rmsnorm fwd".into(), 2 * l + 1, ms, 0.0);
            let mut dx = vec![0.0f32; n * c];
            let mut dw = vec![0.0f32; c];
            let ms = time(reps, || {
                rmsnorm_backward(&mut dx, &mut dw, &x, &x, &w, &rstd, n, c).unwrap();
            });
            push("rmsnorm bwd".into(), 2 * l + 1, ms, 0.0);
            // Rotary positions on the query and key heads of each Q|K|V row.
            let hs = c / nh;
            let table = Rope::new(hs, hs, 500_000.0).table::<f32>(t).unwrap();
            let wq = c + 2 * ckv;
            let mut qkv = data(n * wq, 15, 1.0);
            let pos: Vec<u32> = (0..n).map(|i| (i % t) as u32).collect();
            let ms = time(reps, || {
                rope_forward(&mut qkv, &table, &pos, n, wq, nh + nkv).unwrap();
            });
            push("rope fwd (q, k)".into(), l, ms, 0.0);
            let ms = time(reps, || {
                rope_backward(&mut qkv, &table, &pos, n, wq, nh + nkv).unwrap();
            });
            push("rope bwd (q, k)".into(), l, ms, 0.0);
        } else {
            let mut mean = vec![0.0f32; n];
            let mut rstd = vec![0.0f32; n];
            let ms = time(reps, || {
                layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bb, n, c, 1e-5).unwrap();
            });
            push("layernorm fwd".into(), 2 * l + 1, ms, 0.0);
            let mut dx = vec![0.0f32; n * c];
            let mut dw = vec![0.0f32; c];
            let mut db = vec![0.0f32; c];
            let ms = time(reps, || {
                layernorm_backward(&mut dx, &mut dw, &mut db, &x, &x, &w, &mean, &rstd, n, c)
                    .unwrap();
            });
            push("layernorm bwd".into(), 2 * l + 1, ms, 0.0);
        }
        let dx = data(n * c, 16, 1.0);
        let ms = time(reps, || residual_forward(&mut out, &x, &dx, n * c).unwrap());
        push("residual fwd".into(), 2 * l, ms, 0.0);
        let h = data(n * fc_out, 12, 1.0);
        let mut g = vec![0.0f32; n * hidden];
        let mut dg = vec![0.0f32; n * fc_out];
        let dact = data(n * hidden, 17, 1.0);
        if swiglu.is_some() {
            let ms = time(reps, || swiglu_forward(&mut g, &h, n, hidden).unwrap());
            push("swiglu fwd".into(), l, ms, 0.0);
            let ms = time(reps, || {
                swiglu_backward(&mut dg, &h, &dact, n, hidden).unwrap();
            });
            push("swiglu bwd".into(), l, ms, 0.0);
        } else {
            let ms = time(reps, || gelu_forward(&mut g, &h, n * hidden).unwrap());
            push("gelu fwd".into(), l, ms, 0.0);
            let ms = time(reps, || gelu_backward(&mut dg, &h, &g, n * hidden).unwrap());
            push("gelu bwd".into(), l, ms, 0.0);
        }
        // Backward buffer zeroing per block (dln x2, datty, dqkv, MLP scratch).
        let mut z = vec![0.0f32; n * (2 * c + c + (c + 2 * ckv) + 2 * fc_out)];
        let ms = time(reps, || z.fill(0.0));
        push("zero fills (bwd scratch)".into(), l, ms, 0.0);
        let tokens: Vec<u32> = (0..n).map(|i| (i * 31 % v) as u32).collect();
        let wte = data(v * c, 13, 0.04);
        let wpe = data(1024 * c, 14, 0.04);
        let ms = time(reps, || {
            encoder_forward(&mut out, &tokens, None, &wte, &wpe, b, t, c).unwrap();
        });
        push("embedding fwd".into(), 1, ms, 0.0);
        let mut dwte = vec![0.0f32; v * c];
        let mut dwpe = vec![0.0f32; 1024 * c];
        let ms = time(reps, || {
            encoder_backward(&mut dwte, &mut dwpe, &x, &tokens, None, b, t, c).unwrap();
        });
        push("embedding bwd".into(), 1, ms, 0.0);
    }
    rows
}

/// The configuration, its SwiGLU width (the Llama family) if any, B and T.
fn config(which: &str) -> (GptConfig, Option<usize>, usize, usize) {
    match which {
        "l" => (
            GptConfig {
                n_layer: 12,
                n_head: 12,
                n_embd: 768,
                vocab_size: 32000,
                block_size: 1024,
                tied_embeddings: false,
                layer_norm_epsilon: 1e-5,
                arch: weft_model::BlockArch::llama(4, 500_000.0),
            },
            Some(2048),
            4,
            256,
        ),
        "a" => (
            GptConfig {
                n_layer: 4,
                n_head: 4,
                n_embd: 256,
                vocab_size: 50304,
                block_size: 1024,
                tied_embeddings: true,
                layer_norm_epsilon: 1e-5,
                arch: weft_model::BlockArch::GPT2,
            },
            None,
            8,
            256,
        ),
        _ => (GptConfig::gpt2_small(), None, 4, 256),
    }
}

#[allow(clippy::print_stdout, clippy::cast_precision_loss)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut reps = 3usize;
    let mut which = Vec::new();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--reps" => {
                reps = args[i + 1].parse().expect("--reps N");
                i += 1;
            }
            "--cpu" => CPU.store(true, std::sync::atomic::Ordering::Relaxed),
            a if a.starts_with("--") => {}
            a => which.push(a.to_string()),
        }
        i += 1;
    }
    if which.is_empty() {
        which = vec!["a".into(), "b".into()];
    }
    println!("threads: {}, reps: {reps}", rayon::current_num_threads());
    let peak = {
        let n = 1024;
        let a = data(n * n, 1, 1.0);
        let w = data(n * n, 2, 1.0);
        let mut out = vec![0.0f32; n * n];
        let ms = time(reps.max(5), || {
            matmul_forward(
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
        });
        2.0 * (n * n * n) as f64 / ms / 1e6
    };
    println!("GEMM peak (1024^3 f32 through matmul_forward): {peak:.1} GFLOP/s");
    for w in which {
        let (cfg, swiglu, b, t) = config(&w);
        let s = Shape {
            l: cfg.n_layer,
            nh: cfg.n_head,
            nkv: cfg.n_kv_head(),
            c: cfg.n_embd,
            v: cfg.vocab_size,
            b,
            t,
            swiglu,
        };
        let mut rows = profile(&s, reps);
        // AdamW and zero_grad over the whole model, as the step runs them.
        let mut model = match swiglu {
            Some(hidden) => {
                Gpt::with_ffn(cfg.clone(), Box::new(weft_model::SwiGlu { hidden })).unwrap()
            }
            None => Gpt::new(cfg.clone()).unwrap(),
        };
        model.init_gpt2(1);
        let mut st = model.adamw_state();
        let hp = AdamW::default();
        let np = model.params.len();
        let ms = time(reps, || model.zero_grad());
        rows.push(Row {
            op: format!("zero_grad ({:.1}M)", np as f64 / 1e6),
            count: 1,
            ms,
            flops: 0.0,
        });
        let ms = time(reps, || model.adamw_step(&mut st, &hp).unwrap());
        rows.push(Row {
            op: "adamw step".into(),
            count: 1,
            ms,
            flops: 0.0,
        });
        // The whole step, for the sum's reference.
        let mut acts = model.activations(b, t).unwrap();
        let v = u32::try_from(cfg.vocab_size).unwrap();
        let tokens: Vec<u32> = (0..(b * t) as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % v)
            .collect();
        let step_ms = time(reps, || {
            model.forward(&mut acts, &tokens, Some(&tokens)).unwrap();
            model.zero_grad();
            model.backward(&mut acts).unwrap();
            model.adamw_step(&mut st, &hp).unwrap();
        });
        println!("\n## ({w}) L={} C={} V={} B={b} T={t}", s.l, s.c, s.v);
        println!("| op | per step | ms each | ms/step | % of step | GFLOP/s | % of peak |");
        println!("|---|---|---|---|---|---|---|");
        let total: f64 = rows.iter().map(|r| r.ms * r.count as f64).sum();
        for r in &rows {
            let per = r.ms * r.count as f64;
            let gf = if r.flops > 0.0 {
                let g = r.flops / r.ms / 1e6;
                format!("{g:.1} | {:.0}", 100.0 * g / peak)
            } else {
                " | ".into()
            };
            println!(
                "| {} | {} | {:.2} | {:.1} | {:.1} | {gf} |",
                r.op,
                r.count,
                r.ms,
                per,
                100.0 * per / total
            );
        }
        println!("| **sum of ops** | | | {total:.1} | | | |");
        println!("| **measured step** | | | {step_ms:.1} | | | |");
    }
}
