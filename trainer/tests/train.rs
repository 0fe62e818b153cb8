//! End-to-end: short runs of the training loop on the synthetic corpus.

use weft_trainer::config::Config;
use weft_trainer::train::{Silent, train};

fn tiny(dir: &std::path::Path, name: &str) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.batch_size=8",
        "train.steps=60",
        "train.eval_every=30",
        "train.eval_sequences=16",
        "optim.warmup_steps=5",
        "optim.lr=1e-2",
        "data.synthetic.regular=40",
        "data.synthetic.successors=3",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={}", toml_str(dir)),
        format!("run.name={name}"),
    ])
    .collect();
    Config::load(None, &sets).unwrap()
}

fn toml_str(p: &std::path::Path) -> String {
    format!("{:?}", p.display().to_string())
}

fn losses(run: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.contains("\"event\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            // Compare the exact bits through the JSON text of the number.
            v["loss"].to_string()
        })
        .collect()
}

#[test]
fn loss_falls_toward_the_floor_and_runs_are_reproducible() {
    let dir = std::env::temp_dir().join(format!("weft-train-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let a = train(&tiny(&dir, "a"), &mut Silent).unwrap();
    let floor = a.floor.unwrap();
    // Far above the floor at initialisation (uniform over the vocabulary),
    // much closer after 60 steps.
    assert!(a.initial_eval_loss - floor > 2.0, "{a:?}");
    assert!(
        a.final_eval_loss - floor < 0.5 * (a.initial_eval_loss - floor),
        "gap {} of initial {}",
        a.final_eval_loss - floor,
        a.initial_eval_loss - floor
    );
    assert_eq!(a.skipped_steps, 0);
    // The run folder has what it promises.
    for f in ["config.toml", "metrics.jsonl", "summary.json"] {
        assert!(a.run_dir.join(f).is_file(), "{f}");
    }
    let resolved = Config::from_toml(
        &std::fs::read_to_string(a.run_dir.join("config.toml")).unwrap(),
        "x",
    )
    .unwrap();
    assert_eq!(resolved, tiny(&dir, "a"));
    // Same seed: bitwise the same losses.
    let b = train(&tiny(&dir, "b"), &mut Silent).unwrap();
    let (la, lb) = (losses(&a.run_dir), losses(&b.run_dir));
    assert_eq!(la.len(), 60);
    assert_eq!(la, lb);
    // Runs are never overwritten.
    let err = train(&tiny(&dir, "a"), &mut Silent)
        .unwrap_err()
        .to_string();
    assert!(err.contains("already exists"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_data_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("weft-train-bad-{}", std::process::id()));
    let mut c = tiny(&dir, "x");
    c.data.source = dir.join("no-such-file.txt").display().to_string();
    let err = train(&c, &mut Silent).unwrap_err().to_string();
    assert!(err.contains("no-such-file.txt"), "{err}");
    assert!(
        !dir.join("x").exists(),
        "no run folder for a run that never started"
    );
}
