//! Integration tests that cross crates, compiled into one binary.

use weft_checkpoint::{Checkpoint, Gpt2Export, export_hf_gpt2};
use weft_data::Dataset;
use weft_trainer::config::Config;
use weft_trainer::train::{Silent, train};

/// A checkpoint written by the trainer, exported by weft-checkpoint as a
/// Hugging Face folder and loaded by weft-model, is the trained model: its
/// validation loss is bitwise the trainer's final one.
#[test]
fn trainer_checkpoint_exports_to_a_loadable_hf_model() {
    let dir = std::env::temp_dir().join(format!("weft-it-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.steps=10",
        "train.eval_sequences=8",
        "checkpoint.every=10",
        "run.name=export",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([format!("run.dir={:?}", dir.display().to_string())])
    .collect();
    let config = Config::load(None, &sets).unwrap();
    let summary = train(&config, false, &mut Silent).unwrap();

    let ckpt = Checkpoint::open(&summary.run_dir.join("checkpoints/step-00000010")).unwrap();
    let hf = dir.join("hf");
    let report = export_hf_gpt2(&ckpt, &hf, &Gpt2Export::new("transformer.", 2)).unwrap();
    assert_eq!(
        report.tensors,
        2 + 12 * 2 + 2,
        "wte, wpe; 12 per block; ln_f"
    );

    let model = weft_model::hf::load(&hf).unwrap();
    let data = Dataset::open(&config.data, &config.dataset_options()).unwrap();
    let (mut total, mut n) = (0.0, 0usize);
    for b in data.val_batches(config.train.eval_sequences, 4).unwrap() {
        let mut acts = model.activations(b.batch, b.seq).unwrap();
        let loss = model
            .forward(&mut acts, &b.inputs, Some(&b.targets))
            .unwrap()
            .unwrap();
        total += loss * (b.batch * b.seq) as f64;
        n += b.batch * b.seq;
    }
    assert_eq!(
        (total / n as f64).to_bits(),
        summary.final_eval_loss.to_bits()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `scripts/count-tests.awk` (the test command's summary) counts distinct
/// tests: a binary run again (the SIMD baseline, other features: another
/// hash) counts once, a test that fails in any run is a failure, a binary
/// without libtest's per-test lines counts its `test result` line, and
/// doc-tests are named by their crate.
#[test]
fn the_test_summary_counts_distinct_tests() {
    let log = "\
     Running unittests src/lib.rs (/t/debug/deps/weft_numerics-0123abcd)
test a::one ... ok
test a::two ... ok
test a::three ... ignored
test result: ok. 2 passed; 0 failed; 1 ignored
     Running unittests src/lib.rs (/t/debug/deps/weft_numerics-4567ef01)
test a::one ... ok
test a::two ... FAILED
test result: FAILED. 1 passed; 1 failed; 0 ignored
     Running tests/mpi.rs (/t/debug/deps/mpi-89abcdef)
mpi tests: 997 checks passed on each of 4 ranks in 7.1s
test result: ok. 3 passed; 0 failed; 0 ignored
   Doc-tests weft_numerics
test numerics/src/lib.rs - (line 10) ... ok
test result: ok. 1 passed; 0 failed; 0 ignored
";
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/count-tests.awk");
    let mut child = std::process::Command::new("awk")
        .args(["-f", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("awk runs");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), log.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    // passed: a::one, mpi #1-#3, the doc-test; failed: a::two; runs: 8
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "5 1 8");
}
