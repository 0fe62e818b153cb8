//! A real crash: a child process saving in a loop is killed with SIGKILL at
//! arbitrary moments; every checkpoint left behind is complete and correct.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use weft_checkpoint::{
    Checkpoint, Dtype, Layout, Retention, SaveOptions, TrainerState, VerifyLevel, list_checkpoints,
    load_latest, save,
};

use crate::util::{Tensor, borrow, model, shard_rows, tensor};

const ENV: &str = "WEFT_CKPT_KILL_CHILD_ROOT";

fn data(step: u64) -> Vec<Tensor> {
    let mut ts = model(step);
    ts.push(tensor("big", Dtype::F32, &[256, 1024], step * 7));
    ts
}

/// The child: saves step after step until killed (run only by the parent).
#[test]
#[ignore = "run by kill::sigkill_during_saves"]
fn child_saver() {
    let Some(root) = std::env::var_os(ENV) else {
        return;
    };
    let root = Path::new(&root);
    let mut step = list_checkpoints(root)
        .unwrap()
        .last()
        .map_or(1, |c| c.0 + 1);
    let opts = SaveOptions {
        chunk_bytes: 4096,
        ..Default::default()
    };
    loop {
        let ts = data(step);
        let ranks = shard_rows(&ts, 3);
        let state = TrainerState {
            optimizer_step: step,
            ..Default::default()
        };
        save(
            root,
            step,
            &Layout::flat("dp", 3),
            &borrow(&ranks),
            &state,
            &opts,
        )
        .unwrap();
        Retention::new(3, None).apply(root).unwrap();
        step += 1;
    }
}

#[test]
fn sigkill_during_saves() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let exe = std::env::current_exe().unwrap();
    let mut mid_save = 0;
    // At least ten kills; more (up to 60, each a little later) until one
    // has landed inside a save and a save has committed — on a loaded
    // machine the child may start slowly, so no fixed count of kills is
    // sure to hit either.
    for i in 0..60u64 {
        if i >= 10 && mid_save > 0 && !list_checkpoints(root).unwrap().is_empty() {
            break;
        }
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "kill::child_saver",
                "--ignored",
                "--test-threads=1",
            ])
            .env(ENV, root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150 + 37 * (i % 10) + 20 * i));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let staging = std::fs::read_dir(root)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        mid_save += usize::from(staging);
        let all = list_checkpoints(root).unwrap();
        for (step, path) in &all {
            let ck = Checkpoint::open(path).unwrap_or_else(|e| panic!("kill {i}: {e}"));
            ck.verify().unwrap_or_else(|e| panic!("kill {i}: {e}"));
            assert_eq!(ck.state().optimizer_step, *step);
            for t in data(*step) {
                assert_eq!(
                    ck.read_tensor(&t.name).unwrap(),
                    t.data,
                    "kill {i} step {step}"
                );
            }
        }
        if !all.is_empty() {
            let l = load_latest(root, VerifyLevel::Full).unwrap().unwrap();
            assert_eq!(l.checkpoint.step(), all.last().unwrap().0);
            assert!(l.skipped.is_empty());
        }
    }
    assert!(
        !list_checkpoints(root).unwrap().is_empty(),
        "the child never committed a save"
    );
    assert!(mid_save > 0, "no kill landed inside a save");
}
