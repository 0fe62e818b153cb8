//! Async saving and retention.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;

use weft_checkpoint::{
    AsyncSaver, Checkpoint, FaultHook, FaultPoint, Layout, Retention, SaveOptions, Snapshot,
    TrainerState, VerifyLevel, list_checkpoints, load_latest, save,
};

use crate::util::{borrow, model, shard_rows};

fn opts() -> SaveOptions {
    SaveOptions {
        chunk_bytes: 64,
        ..Default::default()
    }
}

fn save_step(root: &Path, step: u64) {
    let ranks = shard_rows(&model(step), 2);
    save(
        root,
        step,
        &Layout::flat("dp", 2),
        &borrow(&ranks),
        &TrainerState::default(),
        &opts(),
    )
    .unwrap();
}

fn corrupt(root: &Path, step: u64) {
    let f = root
        .join(format!("step-{step:08}"))
        .join("rank-00000.safetensors");
    let mut b = fs::read(&f).unwrap();
    let n = b.len();
    b[n - 1] ^= 0xff;
    fs::write(&f, b).unwrap();
}

fn steps(root: &Path) -> Vec<u64> {
    list_checkpoints(root)
        .unwrap()
        .into_iter()
        .map(|c| c.0)
        .collect()
}

#[test]
fn retention_keeps_last_k_and_every_n() {
    let dir = tempfile::tempdir().unwrap();
    for s in 1..=10 {
        save_step(dir.path(), s);
    }
    fs::create_dir(dir.path().join("step-00000003.tmp")).unwrap();
    let rep = Retention::new(2, Some(4)).apply(dir.path()).unwrap();
    assert_eq!(steps(dir.path()), vec![4, 8, 9, 10]);
    assert_eq!(rep.deleted, vec![1, 2, 3, 5, 6, 7]);
    assert_eq!(rep.removed_stale.len(), 1);
}

#[test]
fn retention_never_deletes_the_only_valid_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    for s in 1..=4 {
        save_step(dir.path(), s);
    }
    // Newest two are corrupt: step 2 is what a restart would load.
    corrupt(dir.path(), 3);
    corrupt(dir.path(), 4);
    Retention::new(1, None).apply(dir.path()).unwrap();
    assert_eq!(steps(dir.path()), vec![2, 3, 4]);
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 2);
    assert_eq!(l.skipped.len(), 2);
    // Nothing valid at all: nothing is deleted.
    corrupt(dir.path(), 2);
    let rep = Retention::new(0, None).apply(dir.path()).unwrap();
    assert!(rep.deleted.is_empty());
    assert_eq!(steps(dir.path()), vec![2, 3, 4]);
}

#[test]
fn retention_counts_only_checkpoints_that_verify() {
    let dir = tempfile::tempdir().unwrap();
    for s in 1..=6 {
        save_step(dir.path(), s);
    }
    // 4 is damaged: the last 3 that verify are 3, 5 and 6 (counting 4 would
    // have pushed 3 out); 4, older than the newest valid checkpoint, goes
    corrupt(dir.path(), 4);
    let rep = Retention::new(3, None).apply(dir.path()).unwrap();
    assert_eq!(steps(dir.path()), vec![3, 5, 6]);
    assert_eq!(rep.deleted, vec![1, 2, 4]);
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 6);
}

#[test]
fn async_saves_run_one_at_a_time_and_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut saver = AsyncSaver::new(dir.path(), opts())
        .unwrap()
        .with_retention(Retention::new(2, None));
    assert!(saver.wait().is_none());
    let mut results = Vec::new();
    for step in 1..=4u64 {
        let ranks = shard_rows(&model(step), 3);
        let layout = Layout::flat("dp", 3);
        let prev = if step <= 2 {
            let snap = Snapshot::capture(step, &layout, &borrow(&ranks), &TrainerState::default());
            assert!(snap.bytes() > 0);
            drop(ranks); // the training state may change now
            saver.save(snap)
        } else {
            // Reuses the previous save's host buffers.
            saver.save_from(step, &layout, &borrow(&ranks), &TrainerState::default())
        };
        if let Some(prev) = prev {
            results.push(prev.unwrap().committed.manifest.step);
        }
        assert_eq!(saver.in_flight(), Some(step));
    }
    let last = saver.wait().unwrap().unwrap();
    assert_eq!(last.retention.as_ref().unwrap().kept, vec![3, 4]);
    results.push(last.committed.manifest.step);
    assert_eq!(results, vec![1, 2, 3, 4]);
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 4);
    for t in model(4) {
        assert_eq!(l.checkpoint.read_tensor(&t.name).unwrap(), t.data);
    }
}

struct FailWrites;
impl FaultHook for FailWrites {
    fn before(&self, p: &FaultPoint<'_>) -> io::Result<()> {
        match p {
            FaultPoint::Rename { .. } => Err(io::Error::other("disk full")),
            _ => Ok(()),
        }
    }
}

#[test]
fn failed_background_save_is_reported_and_old_checkpoint_stays() {
    let dir = tempfile::tempdir().unwrap();
    save_step(dir.path(), 1);
    let failing = SaveOptions {
        fault: Some(Arc::new(FailWrites)),
        ..opts()
    };
    let mut saver = AsyncSaver::new(dir.path(), failing).unwrap();
    let ranks = shard_rows(&model(2), 2);
    saver.save(Snapshot::capture(
        2,
        &Layout::flat("dp", 2),
        &borrow(&ranks),
        &TrainerState::default(),
    ));
    let err = saver.wait().unwrap().unwrap_err().to_string();
    assert!(err.contains("disk full"), "{err}");
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 1);
    Checkpoint::open(l.checkpoint.dir()).unwrap();
}

#[test]
fn reserved_buffers_are_used_and_saves_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut saver = AsyncSaver::new(dir.path(), opts()).unwrap();
    let layout = Layout::flat("dp", 2);
    let first = shard_rows(&model(3), 2);
    assert!(saver.reserve(&borrow(&first)).is_none());
    for (step, seed) in [(1u64, 3u64), (2, 4)] {
        let ranks = shard_rows(&model(seed), 2);
        if let Some(prev) =
            saver.save_from(step, &layout, &borrow(&ranks), &TrainerState::default())
        {
            prev.unwrap();
        }
        // Reserving while a save is in flight waits for it and reports it.
        if step == 1 {
            let done = saver.reserve(&borrow(&ranks)).unwrap().unwrap();
            assert_eq!(done.committed.manifest.step, 1);
        }
    }
    saver.wait().unwrap().unwrap();
    for (step, seed) in [(1u64, 3u64), (2, 4)] {
        let ck = Checkpoint::open(&dir.path().join(format!("step-{step:08}"))).unwrap();
        ck.verify().unwrap();
        for t in model(seed) {
            assert_eq!(
                ck.read_tensor(&t.name).unwrap(),
                t.data,
                "step {step} {}",
                t.name
            );
        }
    }
}
