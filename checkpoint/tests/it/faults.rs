//! Killing a save at every fault point leaves the old or the new checkpoint.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use weft_checkpoint::{
    Checkpoint, FaultHook, FaultPoint, Layout, SaveOptions, TrainerState, VerifyLevel,
    list_checkpoints, load_latest, save,
};

use crate::util::{Tensor, borrow, model, shard_rows};

/// Fails at the `fail_at`-th point (0-based); counts points.
struct KillAt {
    fail_at: usize,
    seen: AtomicUsize,
}

impl FaultHook for KillAt {
    fn before(&self, _p: &FaultPoint<'_>) -> io::Result<()> {
        let i = self.seen.fetch_add(1, Ordering::SeqCst);
        if i == self.fail_at {
            Err(io::Error::other(format!("killed at point {i}")))
        } else {
            Ok(())
        }
    }
}

fn save_model(
    root: &Path,
    step: u64,
    ts: &[Tensor],
    fault: Option<Arc<dyn FaultHook>>,
) -> weft_checkpoint::Result<()> {
    let ranks = shard_rows(ts, 3);
    let opts = SaveOptions {
        chunk_bytes: 128,
        fault,
        ..Default::default()
    };
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
    .map(|_| ())
}

fn assert_is(ck: &Checkpoint, ts: &[Tensor]) {
    for t in ts {
        assert_eq!(ck.read_tensor(&t.name).unwrap(), t.data, "{}", t.name);
    }
}

#[test]
fn crash_at_every_point_leaves_old_or_new() {
    let old = model(100);
    let new = model(200);
    // Count the fault points of one save.
    let counter = Arc::new(KillAt {
        fail_at: usize::MAX,
        seen: AtomicUsize::new(0),
    });
    let dir = tempfile::tempdir().unwrap();
    save_model(&dir.path().join("count"), 2, &new, Some(counter.clone())).unwrap();
    let points = counter.seen.load(Ordering::SeqCst);
    assert!(points > 30, "only {points} fault points");

    let (mut saw_old, mut saw_new) = (0, 0);
    for k in 0..points {
        let root = dir.path().join(format!("k{k}"));
        save_model(&root, 1, &old, None).unwrap();
        let hook = Arc::new(KillAt {
            fail_at: k,
            seen: AtomicUsize::new(0),
        });
        let err = save_model(&root, 2, &new, Some(hook)).unwrap_err();
        assert!(err.to_string().contains("killed at point"), "{err}");
        // Every folder that looks like a checkpoint is complete.
        for (step, path) in list_checkpoints(&root).unwrap() {
            let ck = Checkpoint::open(&path).unwrap_or_else(|e| panic!("k={k}: step {step}: {e}"));
            ck.verify().unwrap();
            assert_is(&ck, if step == 1 { &old } else { &new });
        }
        let l = load_latest(&root, VerifyLevel::Full).unwrap().unwrap();
        assert!(l.skipped.is_empty(), "k={k}: {:?}", l.skipped);
        match l.checkpoint.step() {
            1 => {
                saw_old += 1;
                assert_is(&l.checkpoint, &old);
            }
            2 => {
                saw_new += 1;
                assert_is(&l.checkpoint, &new);
            }
            s => panic!("step {s}"),
        }
        // The next save after the crash succeeds and wins.
        save_model(&root, 2, &new, None).unwrap();
        let l = load_latest(&root, VerifyLevel::Full).unwrap().unwrap();
        assert_eq!(l.checkpoint.step(), 2);
        assert_is(&l.checkpoint, &new);
        assert!(!root.join("step-00000002.tmp").exists());
    }
    assert!(saw_old > 0 && saw_new > 0, "old {saw_old} new {saw_new}");
}
