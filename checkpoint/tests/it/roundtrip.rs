//! Save then load.

use weft_checkpoint::{
    Checkpoint, HexBytes, Layout, Region, SaveOptions, TrainerState, VerifyLevel, list_checkpoints,
    load_latest, read_latest_pointer, save,
};

use crate::util::{borrow, model, shard_rows, slice};

fn state() -> TrainerState {
    let mut s = TrainerState {
        optimizer_step: 42,
        config_hash: Some("abc123".into()),
        data_position: Some(serde_json::json!({"epoch": 1, "offset": 4096})),
        loss_scaler: Some(serde_json::json!({"scale": 65536.0, "good_steps": 7})),
        ..Default::default()
    };
    s.rng
        .insert("rank0/data".into(), HexBytes(vec![0, 1, 0xfe, 0xff]));
    s.extra.insert("note".into(), serde_json::json!("hello"));
    s
}

#[test]
fn save_then_load_is_identity_across_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let ts = model(1);
    for world in [1usize, 2, 3, 5] {
        let root = dir.path().join(format!("w{world}"));
        let ranks = shard_rows(&ts, world);
        let opts = SaveOptions {
            chunk_bytes: 64,
            ..Default::default()
        };
        let c = save(
            &root,
            7,
            &Layout::flat("dp", world as u32),
            &borrow(&ranks),
            &state(),
            &opts,
        )
        .unwrap();
        assert!(c.path.ends_with("step-00000007"));
        let ck = Checkpoint::open(&c.path).unwrap();
        let rep = ck.verify().unwrap();
        assert_eq!(rep.files, world);
        assert_eq!(ck.state(), &state());
        for t in &ts {
            assert_eq!(
                ck.read_tensor(&t.name).unwrap(),
                t.data,
                "{} world {world}",
                t.name
            );
            if t.shape.len() == 2 {
                let r = Region::new(vec![1, 1], vec![t.shape[0] - 2, t.shape[1] - 1]);
                assert_eq!(ck.read_region(&t.name, &r).unwrap(), slice(t, &r));
            }
        }
        assert_eq!(
            read_latest_pointer(&root).unwrap().as_deref(),
            Some("step-00000007")
        );
        let info = ck.info();
        assert_eq!(info.tensors.len(), ts.len());
        let text = info.to_string();
        assert!(
            text.contains("wte.weight") && text.contains("step            7"),
            "{text}"
        );
    }
}

#[test]
fn latest_moves_forward_and_resave_replaces() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let opts = SaveOptions::default();
    for (step, seed) in [(1, 10), (2, 20), (2, 30)] {
        let ts = model(seed);
        let ranks = shard_rows(&ts, 2);
        save(
            root,
            step,
            &Layout::flat("dp", 2),
            &borrow(&ranks),
            &state(),
            &opts,
        )
        .unwrap();
    }
    let steps: Vec<u64> = list_checkpoints(root)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(steps, vec![1, 2]);
    let l = load_latest(root, VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 2);
    assert!(l.skipped.is_empty());
    // The re-save of step 2 (seed 30) replaced the first one.
    assert_eq!(
        l.checkpoint.read_tensor("wte.weight").unwrap(),
        model(30)[0].data
    );
}

#[test]
fn empty_root_is_a_fresh_run() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        load_latest(&dir.path().join("none"), VerifyLevel::Full)
            .unwrap()
            .is_none()
    );
}

#[test]
fn crc32c_known_vector() {
    // The check value of CRC-32C (Castagnoli) from the CRC catalogue.
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
}
