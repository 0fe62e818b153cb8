//! `weft train` on a GPU (`train.device = "cuda"`, feature `cuda`).
//!
//! Without a GPU (or the driver, NVRTC or cuBLAS) the run is refused
//! before anything is written, with a configuration error naming
//! `train.device` and what is missing — never a panic — and the test
//! prints `SKIPPED: <reason>` (a failure under `WEFT_REQUIRE_GPU=1`).
//! With one, a short run on the GPU matches the same run on the CPU to the
//! rounding of the GPU ops, and its checkpoint continues on the CPU.
//! `scripts/gpu-check.sh` runs the same comparison through the `weft`
//! binary.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stderr)]

use std::io::Write;

use weft_trainer::config::Config;
use weft_trainer::train::{Silent, TrainError, train};

fn config(dir: &std::path::Path, name: &str, device: &str) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "train.steps=8",
        "train.eval_every=4",
        "train.eval_sequences=12",
        "checkpoint.every=4",
        "optim.warmup_steps=2",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={:?}", dir.display().to_string()),
        format!("run.name={name}"),
        format!("train.device={device:?}"),
    ])
    .collect();
    Config::load(None, &sets).unwrap()
}

/// Every line of a run's metrics.jsonl with a loss: (step, loss), the
/// evaluations' as negative steps.
fn losses(run: &std::path::Path) -> Vec<(i64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let step = i64::try_from(v["step"].as_u64()?).ok()?;
            match v["event"].as_str() {
                None => Some((step, v["loss"].as_f64()?)),
                Some("eval") => Some((-step, v["val_loss"].as_f64()?)),
                Some(_) => None,
            }
        })
        .collect()
}

fn close(a: &[(i64, f64)], b: &[(i64, f64)], tol: f64) -> Result<f64, String> {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.0 != y.0) {
        return Err(format!("different steps: {a:?} vs {b:?}"));
    }
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.1 - y.1).abs() / y.1.abs())
        .fold(0.0, f64::max);
    if worst <= tol {
        Ok(worst)
    } else {
        Err(format!(
            "relative difference {worst:e} > {tol:e}: {a:?} vs {b:?}"
        ))
    }
}

#[test]
fn a_gpu_run_matches_the_cpu_and_its_checkpoint_continues_there() {
    let dir = std::env::temp_dir().join(format!("weft-gpu-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let gpu = config(&dir, "gpu", "cuda");
    if let Err(e) = weft_kernels::cuda::Gpu::new(0) {
        let err = train(&gpu, false, &mut Silent).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, TrainError::Config(_))
                && text.contains("key `train.device`: `cuda:0`: ")
                && text.contains("not available"),
            "{text}"
        );
        assert!(!dir.exists(), "a refused run wrote {}", dir.display());
        assert!(
            !std::env::var("WEFT_REQUIRE_GPU").is_ok_and(|v| v == "1"),
            "no GPU and WEFT_REQUIRE_GPU=1: {e}"
        );
        let _ = std::io::stderr()
            .write_all(format!("\nSKIPPED: weft train on a GPU: {e}\n").as_bytes());
        return;
    }
    let on_gpu = train(&gpu, false, &mut Silent).unwrap();
    let on_cpu = train(&config(&dir, "cpu", "cpu"), false, &mut Silent).unwrap();
    let (g, c) = (losses(&on_gpu.run_dir), losses(&on_cpu.run_dir));
    // the model check's f32 bound (model/tests/cuda.rs), with room for 8
    // steps and two micro-batches
    let worst = close(&g, &c, 1e-3).unwrap();
    eprintln!("GPU vs CPU, 8 steps: worst relative loss difference {worst:.2e}");
    assert!(
        on_gpu.final_eval_loss < on_gpu.initial_eval_loss,
        "{on_gpu:?}"
    );
    for f in ["config.toml", "metrics.jsonl", "summary.json"] {
        assert!(on_gpu.run_dir.join(f).is_file(), "{f}");
    }
    // The GPU's checkpoint of step 4 continues on the CPU (the newest,
    // step 8, set aside) as the CPU run did.
    let both = dir.join("gpu-then-cpu");
    std::fs::create_dir_all(both.join("checkpoints")).unwrap();
    for f in ["config.toml", "metrics.jsonl"] {
        std::fs::copy(on_gpu.run_dir.join(f), both.join(f)).unwrap();
    }
    let step4 = weft_checkpoint::step_dir_name(4);
    let (from, to) = (on_gpu.run_dir.join("checkpoints"), both.join("checkpoints"));
    std::fs::create_dir_all(to.join(&step4)).unwrap();
    for e in std::fs::read_dir(from.join(&step4)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(&step4).join(e.file_name())).unwrap();
    }
    let resumed = train(&config(&dir, "gpu-then-cpu", "cpu"), true, &mut Silent).unwrap();
    let r = losses(&resumed.run_dir);
    let tail = |l: &[(i64, f64)]| -> Vec<(i64, f64)> {
        l.iter().copied().filter(|s| s.0.abs() > 4).collect()
    };
    let worst = close(&tail(&r), &tail(&c), 1e-3).unwrap();
    eprintln!("GPU steps 1-4, then CPU steps 5-8, vs CPU: worst {worst:.2e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The GPU's memory prediction counts the 16-bit products' rounded
/// operands, which the device reserves once: 2 bytes per value of the
/// largest cuBLAS product's two operands — here the head's input gradient
/// `dY · W`, `V·(B·T) + V·C` values. A host computation: no GPU needed.
#[test]
fn the_gpu_memory_prediction_counts_the_rounded_operands() {
    use weft_kernels::Precision;
    use weft_model::cuda::CudaGpt;
    let cfg = weft_model::GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        block_size: 16,
        vocab_size: 1000,
        ..weft_model::GptConfig::gpt2_small()
    };
    let model = weft_model::Gpt::new(cfg).unwrap();
    let (b, t) = (2, 16);
    let f32 = CudaGpt::predict_memory(&model, b, t, Precision::F32);
    for p in [Precision::Bf16, Precision::F16] {
        let mixed = CudaGpt::predict_memory(&model, b, t, p);
        assert_eq!(mixed.activations - f32.activations, 2 * 1000 * (b * t + 64));
        assert_eq!(
            (mixed.params, mixed.grads, mixed.optimizer),
            (f32.params, f32.grads, f32.optimizer)
        );
    }
}
