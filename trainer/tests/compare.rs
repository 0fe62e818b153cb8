//! `weft compare` and `weft train --seeds`: known-answer comparisons of
//! real and synthetic run folders, and malformed folders.

use std::path::{Path, PathBuf};
use std::process::Command;

use weft_trainer::compare::{self, CompareError, Options, Report};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weft-compare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tiny job on the synthetic corpus (a second or so).
fn tiny_sets(dir: &Path, name: &str) -> Vec<String> {
    [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.batch_size=8",
        "train.steps=16",
        "train.eval_every=8",
        "train.eval_sequences=16",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "data.synthetic.regular=40",
        "data.synthetic.successors=3",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={:?}", dir.display().to_string()),
        format!("run.name={name:?}"),
    ])
    .collect()
}

fn weft(args: &[String]) -> std::process::Output {
    Command::new(WEFT).args(args).output().unwrap()
}

/// `weft train [flags] --set ...` of the tiny job plus `extra` settings.
fn train_with(flags: &[&str], dir: &Path, name: &str, extra: &[&str]) {
    let mut args: Vec<String> = std::iter::once("train")
        .chain(flags.iter().copied())
        .map(str::to_owned)
        .collect();
    for s in tiny_sets(dir, name)
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
    {
        args.extend(["--set".to_owned(), s.to_owned()]);
    }
    let out = weft(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn train(dir: &Path, name: &str, extra: &[&str]) {
    train_with(&[], dir, name, extra);
}

#[test]
fn identical_runs_are_bitwise_and_another_seed_is_told_apart() {
    let dir = scratch("real");
    train(&dir, "a", &[]);
    train(&dir, "b", &[]);
    train(&dir, "c", &["train.seed=7"]);
    let groups: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| compare::load(&dir.join(n)).unwrap())
        .collect();
    let report = Report::new(&groups, &Options::default());
    let same = &report.against[0];
    assert_eq!(same.verdict, "bitwise_identical", "{report}");
    assert_eq!(same.bitwise_span, 16);
    assert_eq!(same.first_differing, None);
    assert!(same.config.is_empty(), "{:?}", same.config);
    let other = &report.against[1];
    assert_eq!(other.verdict, "differs", "{report}");
    assert_eq!(other.first_differing, Some(1));
    assert_eq!(other.bitwise_span, 0);
    // evaluations at steps 0, 8 and 16: different initial weights differ
    assert_eq!(other.val_shared, 3);
    assert!(other.val_max_abs > 0.0 && same.val_max_abs == 0.0);
    assert_eq!(
        other.config.get("train.seed"),
        Some(&[Some("42".to_owned()), Some("7".to_owned())])
    );
    // the summary's figures are read
    let a = &report.groups[0];
    assert!(a.floor.is_some() && a.gap_to_floor.unwrap() > 0.0, "{a:?}");
    assert!(a.memory_bytes.unwrap() > 0 && a.tokens_per_s.unwrap() > 0.0);
    assert_eq!(a.tokens_per_step, Some(8 * 32));

    // the command: a table, JSON, plots
    let path = |n: &str| dir.join(n).display().to_string();
    let plots = dir.join("plots");
    let out = weft(&[
        "compare".into(),
        path("a"),
        path("b"),
        path("c"),
        "--plot".into(),
        plots.display().to_string(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("B vs A: bitwise identical"), "{text}");
    assert!(text.contains("C vs A: "), "{text}");
    assert!(text.contains("config: train.seed = 7 (A: 42)"), "{text}");
    for f in ["loss.svg", "loss_diff.svg", "val_loss.svg"] {
        let svg = std::fs::read_to_string(plots.join(f)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{f}");
    }
    let out = weft(&["compare".into(), path("a"), path("c"), "--json".into()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["against"][0]["verdict"], "differs");
    assert_eq!(v["groups"][1]["seeds"][0], 7);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn seed_groups_compare_with_an_interval() {
    let dir = scratch("seeds");
    for (name, lr) in [("base", "optim.lr=1e-2"), ("slow", "optim.lr=1e-4")] {
        let longer = ["train.steps=48", "train.eval_every=16", lr];
        train_with(&["--seeds", "3"], &dir, name, &longer);
        for seed in 42..45 {
            assert!(
                dir.join(name)
                    .join(format!("seed-{seed}/summary.json"))
                    .is_file()
            );
        }
    }
    let groups = [
        compare::load(&dir.join("base")).unwrap(),
        compare::load(&dir.join("slow")).unwrap(),
    ];
    assert_eq!(groups[0].runs.len(), 3);
    let report = Report::new(&groups, &Options::default());
    let a = &report.against[0];
    // the seeds vary within each group: only the learning rate differs
    assert_eq!(
        a.config.keys().collect::<Vec<_>>(),
        ["optim.lr"],
        "{report}"
    );
    assert!(a.final_pm.is_some(), "{report}");
    // a hundred times lower a learning rate over 48 steps is far worse
    assert_eq!(a.verdict, "worse", "{report}");
    assert_eq!(report.groups[1].seeds, [42, 43, 44]);
    let out = weft(&["train".into(), "--seeds".into(), "0".into()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seeds 0"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Write a run folder by hand: a loss curve, evaluations and a config.
fn synthetic_run(dir: &Path, seed: u64, curve: impl Fn(u64) -> f64, final_val: f64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut m = String::new();
    for step in 1..=50u64 {
        m += &format!(
            "{{\"step\":{step},\"loss\":{},\"lr\":0.001,\"grad_norm\":1.0,\"tokens_per_s\":1000.0,\"time_s\":{step}.0}}\n",
            curve(step)
        );
    }
    m += &format!("{{\"step\":50,\"event\":\"eval\",\"val_loss\":{final_val},\"floor\":1.5}}\n");
    std::fs::write(dir.join("metrics.jsonl"), m).unwrap();
    std::fs::write(
        dir.join("config.toml"),
        format!("[train]\nseed = {seed}\nbatch_size = 8\n\n[model]\nblock_size = 32\n"),
    )
    .unwrap();
}

#[test]
fn a_known_difference_between_seed_groups_is_recovered() {
    let dir = scratch("synthetic");
    // final validation losses: the candidate is 0.05 lower; each seed
    // adds its own offset (sd about 0.01)
    let noise = [0.012, -0.007, 0.003, -0.015, 0.008];
    let truth = -0.05;
    for (k, e) in noise.iter().enumerate() {
        let seed = k as u64;
        synthetic_run(
            &dir.join(format!("base/seed-{seed}")),
            seed,
            |s| 3.0 / (s as f64).sqrt() + e,
            2.0 + e,
        );
        let e2 = noise[(k + 2) % noise.len()];
        synthetic_run(
            &dir.join(format!("new/seed-{seed}")),
            seed,
            |s| 3.0 / (s as f64).sqrt() + truth + e2,
            2.0 + truth + e2,
        );
    }
    let groups = [
        compare::load(&dir.join("base")).unwrap(),
        compare::load(&dir.join("new")).unwrap(),
    ];
    let report = Report::new(&groups, &Options::default());
    let a = &report.against[0];
    assert_eq!(a.verdict, "better", "{report}");
    let (d, pm) = (a.final_diff.unwrap(), a.final_pm.unwrap());
    assert!((d - truth).abs() <= pm, "{d} ± {pm} misses {truth}");
    assert!(
        (d - truth).abs() < 1e-12,
        "the same noise on both sides: {d}"
    );
    assert_eq!(a.first_differing, Some(1));
    assert!((a.mean_abs - 0.05).abs() < 1e-9, "{}", a.mean_abs);
    assert_eq!(
        report.groups[0].gap_to_floor.map(|g| (g * 1e6).round()),
        Some(0.5e6 + 200.0)
    );
    // on the training loss (the mean of the last 5 of 50 steps) too
    let train = Report::new(
        &groups,
        &Options {
            metric: compare::Metric::TrainLoss,
            ..Options::default()
        },
    );
    assert_eq!(train.metric, "train_loss");
    assert_eq!(train.against[0].verdict, "better", "{train}");
    assert!((train.against[0].final_diff.unwrap() - truth).abs() < 1e-12);
    // a tolerance wider than the gap makes them equal
    let loose = Report::new(
        &groups,
        &Options {
            tolerance: Some(0.1),
            ..Options::default()
        },
    );
    assert_eq!(loose.against[0].verdict, "equal_within");
    // a group against itself
    let mixed = Report::new(&[groups[0].clone(), groups[0].clone()], &Options::default());
    assert_eq!(mixed.against[0].verdict, "bitwise_identical");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn runs_with_different_batches_are_aligned_by_tokens() {
    let dir = scratch("tokens");
    synthetic_run(&dir.join("small"), 1, |s| 1.0 / s as f64, 1.0);
    // twice the tokens per step: its step s is the small run's step 2s
    synthetic_run(&dir.join("big"), 1, |s| 1.0 / (2 * s) as f64, 1.0);
    let cfg = dir.join("big/config.toml");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("batch_size = 8", "batch_size = 16");
    std::fs::write(&cfg, text).unwrap();
    let groups = [
        compare::load(&dir.join("small")).unwrap(),
        compare::load(&dir.join("big")).unwrap(),
    ];
    let a = &Report::new(&groups, &Options::default()).against[0];
    assert_eq!(a.aligned_by, "tokens");
    assert_eq!(a.shared, 25); // tokens of steps 2, 4, ..., 50 of the small run
    assert_eq!(a.max_abs, 0.0);
    assert_eq!(a.config.keys().collect::<Vec<_>>(), ["train.batch_size"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_run_folders_name_the_file_and_line() {
    let dir = scratch("bad");
    let run = dir.join("run");
    synthetic_run(&run, 1, |s| 1.0 / s as f64, 1.0);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();

    // a torn last line is skipped, with a note naming it
    std::fs::write(
        run.join("metrics.jsonl"),
        format!("{metrics}{{\"step\":51,\"lo"),
    )
    .unwrap();
    let g = compare::load(&run).unwrap();
    assert!(
        g.runs[0]
            .warnings
            .iter()
            .any(|w| w.contains("metrics.jsonl:52")),
        "{:?}",
        g.runs[0].warnings
    );

    // a bad line inside is an error with its line
    let mut lines: Vec<&str> = metrics.lines().collect();
    lines[2] = "{\"step\":3,\"loss\":";
    std::fs::write(run.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    let e = compare::load(&run).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl, line 3"), "{e}");
    lines[2] = "{\"step\":3,\"loss\":1.0}";
    std::fs::write(run.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    let e = compare::load(&run).unwrap_err().to_string();
    assert!(
        e.contains("metrics.jsonl, line 3") && e.contains("lr"),
        "{e}"
    );
    std::fs::write(run.join("metrics.jsonl"), &metrics).unwrap();

    std::fs::write(
        run.join("config.toml"),
        "[train]\nseed = 1\nbatch_size = \n",
    )
    .unwrap();
    let e = compare::load(&run).unwrap_err().to_string();
    assert!(e.contains("config.toml, line 3"), "{e}");
    std::fs::remove_file(run.join("config.toml")).unwrap();
    let g = compare::load(&run).unwrap();
    assert!(
        g.runs[0]
            .warnings
            .iter()
            .any(|w| w.contains("no config.toml"))
    );

    std::fs::write(run.join("summary.json"), "{\"steps\": 5,").unwrap();
    let e = compare::load(&run).unwrap_err().to_string();
    assert!(e.contains("summary.json"), "{e}");

    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join("sub")).unwrap();
    assert!(matches!(
        compare::load(&empty),
        Err(CompareError::NotARun { .. })
    ));
    let e = compare::load(&dir.join("missing")).unwrap_err().to_string();
    assert!(e.contains("not a run folder"), "{e}");

    // the command exits non-zero, saying which folder and why
    let out = weft(&[
        "compare".into(),
        run.display().to_string(),
        empty.display().to_string(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("summary.json"), "{err}");
    let out = weft(&["compare".into(), run.display().to_string()]);
    assert!(!out.status.success(), "one run is not a comparison");
    let _ = std::fs::remove_dir_all(&dir);
}
