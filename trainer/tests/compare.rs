//! `weft compare` and `weft train --seeds` on real runs: identical runs
//! are bitwise, another seed or learning rate is told apart, and the
//! command names a bad folder. (Known answers on run folders written by
//! hand are weft-compare's own tests.)

use std::path::{Path, PathBuf};
use std::process::Command;

use weft_compare::{self as compare, Options, Report};

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
        .map(|n| compare::load_group(&dir.join(n)).unwrap())
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
        compare::load_group(&dir.join("base")).unwrap(),
        compare::load_group(&dir.join("slow")).unwrap(),
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
    // the same seeds on both sides: paired by seed; `--unpaired`: Welch's
    assert_eq!(a.interval, Some("paired"), "{report}");
    for (flags, kind) in [(&[][..], "paired"), (&["--unpaired"][..], "welch")] {
        let mut args = vec!["compare".to_owned(), "--json".to_owned()];
        args.extend(["base", "slow"].map(|g| dir.join(g).display().to_string()));
        args.extend(flags.iter().map(|f| (*f).to_owned()));
        let out = weft(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["against"][0]["interval"], kind);
        assert_eq!(v["against"][0]["verdict"], "worse");
    }
    let out = weft(&["train".into(), "--seeds".into(), "0".into()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seeds 0"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_command_names_a_bad_run_folder() {
    let dir = scratch("bad");
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(
        run.join("metrics.jsonl"),
        "{\"step\":1,\"loss\":2.0,\"lr\":0.001,\"grad_norm\":1.0,\"tokens_per_s\":10.0,\"time_s\":1.0}\n",
    )
    .unwrap();
    std::fs::write(run.join("summary.json"), "{\"steps\": 5,").unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join("sub")).unwrap();
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
