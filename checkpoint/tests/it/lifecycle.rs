//! Async saving and retention.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;

use weft_checkpoint::collective::{self, Background, SaveSpec};
use weft_checkpoint::{
    Checkpoint, CollectiveError, FaultHook, FaultPoint, FlatRun, Layout, Retention, SaveOptions,
    TrainerState, VerifyLevel, list_checkpoints, load_latest, save,
};
use weft_collectives::{Communicator, LocalCluster};

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

struct FailWrites;
impl FaultHook for FailWrites {
    fn before(&self, p: &FaultPoint<'_>) -> io::Result<()> {
        match p {
            FaultPoint::Rename { .. } => Err(io::Error::other("disk full")),
            _ => Ok(()),
        }
    }
}

/// Rank `rank`'s half of a 4-element tensor `w` at `step`, saved by a
/// [`Background`] over `group` (2 ranks) into `root`.
fn save_half(
    group: &dyn Communicator,
    root: &Path,
    step: u64,
    opts: &SaveOptions,
) -> Result<(), CollectiveError> {
    let rank = group.rank();
    let mine = [step as f32 * 10.0 + rank as f32; 2];
    let runs = [FlatRun {
        name: "w",
        global_shape: &[4],
        start: 2 * rank,
        values: vec![&mine],
    }];
    let spec = SaveSpec {
        step,
        runs: &runs,
        name: &|_, n| n.to_owned(),
        mesh: &[("dp", 2)],
        state: &TrainerState::default(),
        retention: Retention::new(2, None),
    };
    collective::save(group, root, &spec, opts, &mut || {})
}

fn w_at(root: &Path, step: u64) -> Vec<f32> {
    let ck = Checkpoint::open(&root.join(format!("step-{step:08}"))).unwrap();
    ck.verify().unwrap();
    ck.read_tensor("w")
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn background_saves_run_one_at_a_time_and_commit() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_owned();
    let out = LocalCluster::run(2, |world| {
        let mut saver = Background::new(&world).unwrap();
        assert!(saver.wait().is_none());
        let mut learned = Vec::new();
        for step in 1..=4u64 {
            let root = root.clone();
            let prev = saver
                .start(step, move |g| save_half(g, &root, step, &opts()))
                .unwrap();
            assert_eq!(saver.in_flight(), Some(step));
            if let Some(done) = prev {
                done.result.unwrap();
                learned.push(done.step);
            }
        }
        let last = saver.wait().unwrap();
        last.result.unwrap();
        assert!(last.seconds > 0.0);
        learned.push(last.step);
        learned
    });
    for learned in out.unwrap() {
        assert_eq!(learned, vec![1, 2, 3, 4]);
    }
    // retention ran after each commit: the newest two are left
    assert_eq!(
        list_checkpoints(dir.path())
            .unwrap()
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(w_at(dir.path(), 4), vec![40.0, 40.0, 41.0, 41.0]);
}

#[test]
fn failed_background_save_is_reported_on_every_rank_and_old_checkpoint_stays() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_owned();
    let failing = SaveOptions {
        fault: Some(Arc::new(FailWrites)),
        ..opts()
    };
    let out = LocalCluster::run(2, |world| {
        let mut saver = Background::new(&world).unwrap();
        let r1 = root.clone();
        saver
            .start(1, move |g| save_half(g, &r1, 1, &opts()))
            .unwrap();
        let (r2, failing) = (root.clone(), failing.clone());
        let first = saver
            .start(2, move |g| save_half(g, &r2, 2, &failing))
            .unwrap()
            .unwrap();
        first.result.unwrap();
        saver.wait().unwrap().result.map_err(|e| e.to_string())
    });
    let errs: Vec<String> = out.unwrap().into_iter().map(|r| r.unwrap_err()).collect();
    // rank 0 commits and names the failure; rank 1 learns of it
    assert!(errs[0].contains("disk full"), "{errs:?}");
    assert!(errs[1].contains("another rank"), "{errs:?}");
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 1);
}

#[test]
fn dropping_the_saver_finishes_the_save_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_owned();
    LocalCluster::run(2, |world| {
        let mut saver = Background::new(&world).unwrap();
        let root = root.clone();
        saver
            .start(7, move |g| {
                std::thread::sleep(std::time::Duration::from_millis(200));
                save_half(g, &root, 7, &opts())
            })
            .unwrap();
        // a run that ends (or fails) here still commits its last save
    })
    .unwrap();
    assert_eq!(w_at(dir.path(), 7), vec![70.0, 70.0, 71.0, 71.0]);
}
