//! The dense GPT trained on one GPU ([`CudaGpt`], feature `cuda`) against
//! the CPU model ([`Gpt`]), llm.c's test_gpt2 way: the same initial
//! weights, the same batches; every gradient tensor after the first
//! backward, and the loss of every step, compared at a stated tolerance.
//!
//! Tolerances. Every GPU op agrees with its CPU twin to the rounding of
//! its sums (kernels/tests/cuda.rs), so the loss of a step agrees to about
//! `depth · k · 2⁻²⁴` relative, far under 1e-4 for this model; AdamW
//! divides by √v, which keeps the parameters' differences at the level of
//! the gradients' relative differences times the learning rate, so the
//! losses stay within 1e-4 (relative) over the steps in f32. In bf16 both
//! round the same operands, but operands that differ by an f32 rounding can
//! round to neighbouring bf16 values (2⁻⁸ apart): 2e-3 relative. Gradients:
//! each tensor's largest difference within 1e-3 (f32) of its largest
//! magnitude.
//!
//! Without a GPU each test prints `SKIPPED: <reason>` and passes — unless
//! `WEFT_REQUIRE_GPU=1` (scripts/gpu-check.sh sets it).
#![cfg(feature = "cuda")]
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write;

use weft_kernels::cuda::Gpu;
use weft_kernels::{AdamW, Mode, Precision};
use weft_model::cuda::CudaGpt;
use weft_model::{Gpt, GptConfig, MicroBatch};

fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(
                matches!(e, weft_kernels::Error::Unavailable { .. }),
                "expected a typed unavailability error, got {e:?}"
            );
            assert!(
                !std::env::var("WEFT_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "{test}: no GPU and WEFT_REQUIRE_GPU=1: {e}"
            );
            let _ = std::io::stderr().write_all(format!("\nSKIPPED: {test}: {e}\n").as_bytes());
            None
        }
    }
}

fn config() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        vocab_size: 301,
        block_size: 64,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

/// Batch `s` of B×T tokens and next tokens: a deterministic sequence with
/// structure (so the loss falls).
fn batch(s: usize, b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<u32>) {
    let seq: Vec<u32> = (0..b * t + 1)
        .map(|i| (((i + 7 * s) * (i + 3) / 5) % v) as u32)
        .collect();
    (seq[..b * t].to_vec(), seq[1..].to_vec())
}

fn compare(precision: Precision, mode: Mode, loss_tol: f64) {
    let what = format!("CudaGpt {} {mode:?}", precision.name());
    let Some(g) = gpu(&what) else { return };
    let (b, t) = (4, 64);
    let mut cpu = Gpt::new(config()).unwrap();
    cpu.init_gpt2(7);
    cpu.set_precision(precision);
    let hp = AdamW {
        lr: 1e-3,
        weight_decay: 0.1,
        ..AdamW::default()
    };
    let mut dev = CudaGpt::new(g, &cpu, b, t, hp, mode, precision).unwrap();
    assert_eq!(dev.params().unwrap(), cpu.params, "the uploaded parameters");
    let mut acts = cpu.activations(b, t).unwrap();
    let mut opt = cpu.adamw_state();
    let v = config().vocab_size;
    for step in 0..6 {
        let (tokens, targets) = batch(step, b, t, v);
        let want = cpu
            .forward(&mut acts, &tokens, Some(&targets))
            .unwrap()
            .unwrap();
        cpu.zero_grad();
        cpu.backward(&mut acts).unwrap();
        let got = dev.forward(&tokens, Some(&targets)).unwrap().unwrap();
        dev.backward().unwrap();
        if step == 0 {
            // Every gradient tensor, llm.c's test_gpt2 style.
            let gg = dev.grads().unwrap();
            let mut worst = 0.0f64;
            for spec in cpu.layout().specs() {
                let r = spec.range();
                let (a, c) = (&gg[r.clone()], &cpu.grads[r]);
                let scale = c.iter().fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
                let diff = a.iter().zip(c).fold(0.0f64, |m, (x, y)| {
                    m.max((f64::from(*x) - f64::from(*y)).abs())
                });
                let rel = if scale > 0.0 { diff / scale } else { diff };
                let tol = if precision == Precision::F32 {
                    1e-3
                } else {
                    2e-2
                };
                assert!(
                    rel <= tol,
                    "{what}: gradient of {}: max |Δ| {diff:e} vs max |g| {scale:e}",
                    spec.name
                );
                worst = worst.max(rel);
            }
            println!("{what}: every gradient within {worst:.2e} of its tensor's largest magnitude");
        }
        cpu.adamw_step(&mut opt, &hp).unwrap();
        dev.adamw_step(&hp).unwrap();
        let rel = (got - want).abs() / want.abs();
        println!("{what}: step {step}: loss GPU {got:.6} CPU {want:.6} (relative {rel:.1e})");
        assert!(
            rel <= loss_tol,
            "{what}: step {step}: GPU loss {got} vs CPU {want}"
        );
    }
    // every product ran in the operand buffer reserved up front
    assert_eq!(
        dev.memory(),
        CudaGpt::predict_memory(&cpu, b, t, precision),
        "{what}: memory held after training against its prediction"
    );
}

#[test]
fn gpu_training_matches_the_cpu_model_in_f32() {
    compare(Precision::F32, Mode::Throughput, 1e-4);
}

#[test]
fn gpu_training_matches_the_cpu_model_in_bf16() {
    compare(Precision::Bf16, Mode::Throughput, 2e-3);
}

#[test]
fn gpu_training_matches_the_cpu_model_batch_invariant() {
    compare(Precision::Bf16, Mode::BatchInvariant, 2e-3);
}

/// What the trainer's GPU loop calls, against the CPU model: two
/// micro-batches' gradients accumulated and averaged, the exact norm, the
/// clipping (active: the clip is under the norm), AdamW — three steps;
/// evaluation of a full batch and of a shorter one (padded on the
/// device); the AdamW state downloaded and put back; the memory count
/// against its prediction. Tolerances as above (f32).
#[test]
fn gpu_steps_accumulate_clip_and_evaluate_like_the_cpu_model() {
    let what = "CudaGpt::train_step_batches";
    let Some(g) = gpu(what) else { return };
    let (b, t) = (2, 64);
    let v = config().vocab_size;
    let mut cpu = Gpt::new(config()).unwrap();
    cpu.init_gpt2(11);
    let hp = AdamW {
        lr: 1e-3,
        weight_decay: 0.1,
        ..AdamW::default()
    };
    let mut dev = CudaGpt::new(g, &cpu, b, t, hp, Mode::Throughput, Precision::F32).unwrap();
    assert_eq!(
        dev.memory(),
        CudaGpt::predict_memory(&cpu, b, t, Precision::F32)
    );
    let mut acts = cpu.activations(b, t).unwrap();
    let mut opt = cpu.adamw_state();
    let rel = |a: f64, c: f64| (a - c).abs() / c.abs();
    for step in 0..3 {
        let data: Vec<_> = (0..2).map(|m| batch(2 * step + m, b, t, v)).collect();
        let mbs: Vec<MicroBatch<'_>> = data
            .iter()
            .map(|(tokens, targets)| MicroBatch { tokens, targets })
            .collect();
        cpu.zero_grad();
        let mut loss = 0.0;
        for (tokens, targets) in &data {
            loss += cpu
                .forward(&mut acts, tokens, Some(targets))
                .unwrap()
                .unwrap();
            cpu.backward(&mut acts).unwrap();
        }
        loss /= 2.0;
        cpu.grads.iter_mut().for_each(|x| *x *= 0.5);
        let norm = cpu
            .grads
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        let clip = 0.5 * norm;
        let coef = (clip / (norm + 1e-6)) as f32;
        cpu.grads.iter_mut().for_each(|x| *x *= coef);
        cpu.adamw_step(&mut opt, &hp).unwrap();
        let out = dev.train_step_batches(&mbs, &hp, clip).unwrap();
        println!(
            "{what}: step {step}: loss GPU {:.6} CPU {loss:.6}, norm GPU {:.6} CPU {norm:.6}",
            out.loss, out.grad_norm
        );
        assert!(out.applied);
        assert!(
            rel(out.loss, loss) <= 1e-4,
            "step {step}: loss {} vs {loss}",
            out.loss
        );
        assert!(
            rel(out.grad_norm, norm) <= 1e-3,
            "step {step}: norm {} vs {norm}",
            out.grad_norm
        );
    }
    // evaluation: a whole batch, and one sequence of the B = 2 planned
    let (tokens, targets) = batch(9, b, t, v);
    let whole = cpu
        .forward(&mut acts, &tokens, Some(&targets))
        .unwrap()
        .unwrap();
    let mut one_acts = cpu.activations(1, t).unwrap();
    let one = cpu
        .forward(&mut one_acts, &tokens[..t], Some(&targets[..t]))
        .unwrap()
        .unwrap();
    let mb = |n: usize| MicroBatch {
        tokens: &tokens[..n],
        targets: &targets[..n],
    };
    let got_whole = dev.eval_loss(&[mb(b * t)]).unwrap();
    let got_one = dev.eval_loss(&[mb(t)]).unwrap();
    let got_both = dev.eval_loss(&[mb(b * t), mb(t)]).unwrap();
    println!("{what}: eval GPU {got_whole:.6} / {got_one:.6}, CPU {whole:.6} / {one:.6}");
    assert!(rel(got_whole, whole) <= 1e-4 && rel(got_one, one) <= 1e-4);
    let mean = (whole * 2.0 + one) / 3.0;
    assert!(rel(got_both, mean) <= 1e-4, "{got_both} vs {mean}");
    assert!(dev.backward().is_err(), "no backward after an evaluation");
    assert!(dev.eval_loss(&[mb(t - 1)]).is_err(), "not whole sequences");
    // the optimizer state: close to the CPU's, and put back exactly
    let state = dev.optimizer_state().unwrap();
    assert_eq!(state.step, opt.step);
    dev.set_optimizer_state(&opt).unwrap();
    assert_eq!(dev.optimizer_state().unwrap(), opt);
}
