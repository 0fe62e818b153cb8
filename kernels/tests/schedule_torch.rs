//! The learning-rate schedules against PyTorch's schedulers, every step of
//! several runs (`tests/python/schedule_torch.py` computes PyTorch's side
//! and documents each chain of built-in schedulers). Skipped, saying why,
//! without a Python that has torch; a failure under `WEFT_REQUIRE_ALL`.
//!
//! Each run is compared with up to three PyTorch computations: a
//! `LambdaLR` with the multiplier written out (for WSD, Hägele et al.'s
//! `wsd_schedule` evaluated at `step + 1`), the built-in schedulers
//! (`LinearLR`, `CosineAnnealingLR`, `ConstantLR`) chained by
//! `SequentialLR` and stepped as a training loop steps them (their
//! recursive `get_lr`), and the same schedulers' closed forms
//! (`_get_closed_form_lr`).
//!
//! Tolerance: `|ours − torch| ≤ 1e-12 · max(|torch|, floor)` at every step
//! (relative, measured against the floor where a floor of 0 makes the
//! rate itself tiny). The differences are the order of f64 operations
//! (`peak · (t+1)/W` against `peak · (1/W + (1 − 1/W)·t/(W−1))`,
//! `floor + f·(peak − floor)` against `peak · (r + (1 − r)·f)`, `π·(t/D)`
//! against `π·t/D`): a few ulps, up to about 1e-13 relative in a cosine's
//! last steps to a floor of 0, where `1 + cos(π·p)` cancels. The recursive
//! forms multiply a rounded ratio per step and drift about linearly with
//! the step count (1.5e-14 after 1000 steps here; measured separately,
//! 1.8e-12 after 100 000 cosine steps), so the runs stay short and the
//! closed forms and `LambdaLR` are the exact references. The test prints
//! the largest difference of each.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use weft_kernels::{DecayShape, OptimConfig, Schedule};
use weft_testkit::python;

const TOL: f64 = 1e-12;

/// Written to the stderr handle directly, past the harness's capture.
fn report(msg: &str) {
    let _ = std::io::stderr().write_all(msg.as_bytes());
}

struct Run {
    name: &'static str,
    cfg: OptimConfig,
    total: u64,
}

fn opt(schedule: Schedule, lr: f64, min_lr_ratio: f64, warmup_steps: u64) -> OptimConfig {
    OptimConfig {
        lr,
        min_lr_ratio,
        warmup_steps,
        schedule,
        ..Default::default()
    }
}

fn wsd(lr: f64, ratio: f64, warmup: u64, shape: DecayShape, decay_steps: u64) -> OptimConfig {
    OptimConfig {
        decay_shape: shape,
        decay_steps,
        ..opt(Schedule::Wsd, lr, ratio, warmup)
    }
}

fn runs() -> Vec<Run> {
    use DecayShape::{Cosine, Linear, Sqrt};
    let run = |name, cfg, total| Run { name, cfg, total };
    vec![
        run("cosine", opt(Schedule::Cosine, 6e-4, 0.1, 50), 1000),
        run("cosine-floor0", opt(Schedule::Cosine, 3e-3, 0.0, 0), 2000),
        run("cosine-w1", opt(Schedule::Cosine, 1e-2, 0.5, 1), 37),
        run("linear", opt(Schedule::Linear, 3e-3, 0.1, 20), 500),
        run("linear-floor0", opt(Schedule::Linear, 1e-3, 0.0, 0), 300),
        // min_lr_ratio is not used by constant.
        run("constant", opt(Schedule::Constant, 3e-3, 0.1, 25), 200),
        run("constant-w0", opt(Schedule::Constant, 1e-3, 0.1, 0), 50),
        // decay_fraction 0.2 of 1000: K = 200.
        run("wsd-linear", wsd(3e-3, 0.1, 50, Linear, 0), 1000),
        run("wsd-cosine", wsd(2e-3, 0.0, 10, Cosine, 150), 500),
        // round(0.2 · 777) = 155.
        run("wsd-sqrt", wsd(4e-3, 0.01, 30, Sqrt, 0), 777),
        run("wsd-sqrt-k1", wsd(1e-3, 0.1, 5, Sqrt, 1), 40),
        // No stable phase: the decay starts right after warmup.
        run("wsd-linear-nostable", wsd(1e-3, 0.0, 10, Linear, 90), 100),
        run("wsd-cosine-w0-all", wsd(1e-3, 0.05, 0, Cosine, 64), 64),
    ]
}

#[test]
fn schedules_match_pytorch() {
    let Some(py) = python("torch") else {
        return;
    };
    let runs = runs();
    let mut input = String::new();
    for r in &runs {
        r.cfg.validate().unwrap();
        r.cfg.check_steps(r.total).unwrap();
        let k = r.cfg.lr_schedule().wsd_decay_steps(r.total);
        input += &format!(
            "{} {} {:?} {:?} {} {} {} {}\n",
            r.name,
            r.cfg.schedule,
            r.cfg.lr,
            r.cfg.min_lr_ratio,
            r.cfg.warmup_steps,
            r.total,
            r.cfg.decay_shape,
            k
        );
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/schedule_torch.py");
    let mut child = Command::new(&py)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );

    let mut table =
        String::from("schedule_torch: largest |ours − torch| / max(|torch|, floor), and / peak\n");
    let mut seen = Vec::new();
    let mut failures = Vec::new();
    for line in stdout.lines() {
        let mut words = line.split_whitespace();
        let (name, variant) = (words.next().unwrap(), words.next().unwrap());
        let torch: Vec<f64> = words.map(|w| w.parse().unwrap()).collect();
        let r = runs.iter().find(|r| r.name == name).unwrap();
        assert_eq!(torch.len() as u64, r.total, "{name} {variant}");
        let peak = r.cfg.lr;
        let floor = if r.cfg.schedule == Schedule::Constant {
            peak
        } else {
            peak * r.cfg.min_lr_ratio
        };
        let (mut worst_rel, mut worst_abs, mut at) = (0.0f64, 0.0f64, 0);
        for (step, &want) in torch.iter().enumerate() {
            let got = r.cfg.lr_at(step as u64, r.total);
            let diff = (got - want).abs();
            let scale = want.abs().max(floor);
            let rel = if scale > 0.0 {
                diff / scale
            } else {
                diff / peak
            };
            if rel > worst_rel {
                (worst_rel, at) = (rel, step);
            }
            worst_abs = worst_abs.max(diff / peak);
        }
        table += &format!(
            "  {name:<20} {variant:<10} {worst_rel:9.2e} (step {at:4}) {worst_abs:9.2e}\n"
        );
        if worst_rel > TOL {
            failures.push(format!("{name} {variant}: {worst_rel:e} at step {at}"));
        }
        seen.push((name, variant));
    }
    report(&table);
    assert!(failures.is_empty(), "beyond {TOL:e}: {failures:?}\n{table}");
    // Every run against its LambdaLR, and every run with built-in
    // schedulers (all but the 1−sqrt decay, and a WSD decay starting at
    // step 0, which no chain starts before) against both of their forms.
    for r in &runs {
        let builtin = !(r.cfg.schedule == Schedule::Wsd
            && (r.cfg.decay_shape == DecayShape::Sqrt
                || r.cfg.lr_schedule().decay_start(r.total) == Some(0)));
        for variant in ["lambda", "sequential", "closed"] {
            let want = variant == "lambda" || builtin;
            assert_eq!(
                seen.contains(&(r.name, variant)),
                want,
                "{} {variant}",
                r.name
            );
        }
    }
}
