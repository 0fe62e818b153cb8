//! Corrupt, truncated and malicious checkpoints are clear errors.

use std::fs;
use std::path::{Path, PathBuf};

use weft_checkpoint::{
    Checkpoint, Error, Layout, SaveOptions, TrainerState, VerifyLevel, load_latest, save,
};

use crate::util::{borrow, model, shard_rows};

fn two_checkpoints(root: &Path) -> (PathBuf, PathBuf) {
    let opts = SaveOptions {
        chunk_bytes: 64,
        ..Default::default()
    };
    let a = save(
        root,
        1,
        &Layout::flat("dp", 2),
        &borrow(&shard_rows(&model(1), 2)),
        &TrainerState::default(),
        &opts,
    )
    .unwrap();
    let b = save(
        root,
        2,
        &Layout::flat("dp", 2),
        &borrow(&shard_rows(&model(2), 2)),
        &TrainerState::default(),
        &opts,
    )
    .unwrap();
    (a.path, b.path)
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn flipped_byte_is_a_checksum_error_and_load_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    let ck = Checkpoint::open(&b).unwrap();
    let s = &ck.manifest().tensors["wte.weight"].shards[1];
    let file = b.join(&s.file);
    let mut bytes = fs::read(&file).unwrap();
    bytes[(s.byte_offset + 70) as usize] ^= 0x10;
    fs::write(&file, bytes).unwrap();

    let err = ck.verify().unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Checksum { chunk: 1, .. }), "{msg}");
    assert!(
        msg.contains("rank-00001.safetensors") && msg.contains("wte.weight"),
        "{msg}"
    );
    assert!(ck.read_tensor("wte.weight").is_err());
    // A read that does not touch the corrupt chunk still works.
    assert!(ck.read_tensor("h.0.ln_1.bias").is_ok());

    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 1);
    assert_eq!(l.skipped.len(), 1);
    assert!(l.skipped[0].1.to_string().contains("checksum mismatch"));
}

#[test]
fn truncated_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    let file = b.join("rank-00000.safetensors");
    let len = fs::metadata(&file).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let err = Checkpoint::open(&b).unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("rank-00000.safetensors"), "{err}");
    assert!(err.to_string().contains("tensors cut: "), "{err}");
    let l = load_latest(dir.path(), VerifyLevel::Structure)
        .unwrap()
        .unwrap();
    assert_eq!(l.checkpoint.step(), 1);
}

#[test]
fn all_corrupt_is_no_valid_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = two_checkpoints(dir.path());
    fs::write(a.join("manifest.json"), b"{").unwrap();
    fs::remove_file(b.join("rank-00001.safetensors")).unwrap();
    let err = load_latest(dir.path(), VerifyLevel::Full).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::NoValidCheckpoint { .. }));
    assert!(
        msg.contains("step-00000001") && msg.contains("step-00000002"),
        "{msg}"
    );
}

#[test]
fn path_traversal_in_manifest_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    edit_manifest(&b, |v| {
        v["files"][0]["name"] = "../../etc/passwd".into();
    });
    let err = Checkpoint::open(&b).unwrap_err();
    assert!(matches!(err, Error::Manifest { .. }), "{err}");
    assert!(err.to_string().contains("files[0].name"), "{err}");
}

#[test]
fn manifest_lies_are_caught() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "at byte 1",
            Box::new(|v| v["tensors"]["wte.weight"]["shards"][0]["byte_offset"] = 1u64.into()),
        ),
        (
            "gap",
            Box::new(|v| {
                v["tensors"]["wte.weight"]["shards"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
        ),
        (
            "outside global shape",
            Box::new(|v| v["tensors"]["wte.weight"]["shape"] = serde_json::json!([3, 8])),
        ),
        (
            "crc32c",
            Box::new(|v| {
                v["tensors"]["wte.weight"]["shards"][0]["crc32c"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
        ),
        ("version", Box::new(|v| v["version"] = 99.into())),
        (
            "world_size",
            Box::new(|v| v["layout"]["world_size"] = 0.into()),
        ),
        (
            "dtype",
            Box::new(|v| v["tensors"]["wte.weight"]["dtype"] = "F8".into()),
        ),
        (
            "does not match the manifest",
            Box::new(|v| v["tensors"]["wte.weight"]["dtype"] = "I32".into()),
        ),
    ];
    for (want, edit) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (_, b) = two_checkpoints(dir.path());
        // without its checksum (as manifests before it were), so that the
        // checks behind it are what catches the lie
        edit_manifest(&b, |v| {
            edit(v);
            v.as_object_mut().unwrap().remove("manifest_crc32c");
        });
        let err = Checkpoint::open(&b).unwrap_err().to_string();
        assert!(err.contains(want), "case {want}: {err}");
    }
}

#[test]
fn every_byte_a_resume_reads_is_verified() {
    // values the format allows, changed after the save: only the
    // manifest's own checksum can tell
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("step", Box::new(|v| v["step"] = 7.into())),
        (
            "optimizer step",
            Box::new(|v| v["state"]["optimizer_step"] = 12345.into()),
        ),
        (
            "extra",
            Box::new(|v| v["state"]["extra"]["adamw_t"] = 3.into()),
        ),
        (
            "checksum itself",
            Box::new(|v| v["manifest_crc32c"] = "00000000".into()),
        ),
    ];
    for (what, edit) in edits {
        let dir = tempfile::tempdir().unwrap();
        let (_, b) = two_checkpoints(dir.path());
        edit_manifest(&b, edit);
        let err = Checkpoint::open(&b).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{what}: {err}");
        // and loading falls back to the older checkpoint
        let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
        assert_eq!(l.checkpoint.step(), 1, "{what}");
    }
    // a step changed consistently with the checksum still disagrees with
    // the folder's name
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    let mut m = Checkpoint::open(&b).unwrap().manifest().clone();
    m.step = 9;
    fs::write(b.join("manifest.json"), m.to_json()).unwrap();
    let err = Checkpoint::open(&b).unwrap_err().to_string();
    assert!(
        err.contains("the folder is step 2 but its manifest says step 9"),
        "{err}"
    );
}

#[test]
fn bad_header_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    let file = b.join("rank-00000.safetensors");
    let mut bytes = fs::read(&file).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    fs::write(&file, bytes).unwrap();
    let err = Checkpoint::open(&b).unwrap_err();
    assert!(matches!(err, Error::Header { .. }), "{err}");
    assert!(err.to_string().contains("rank-00000.safetensors"));
}

#[test]
fn bad_latest_pointer_does_not_stop_loading() {
    let dir = tempfile::tempdir().unwrap();
    two_checkpoints(dir.path());
    fs::write(dir.path().join("latest"), b"../../../etc\n").unwrap();
    assert!(weft_checkpoint::read_latest_pointer(dir.path()).is_err());
    let l = load_latest(dir.path(), VerifyLevel::Full).unwrap().unwrap();
    assert_eq!(l.checkpoint.step(), 2);
}

#[test]
fn reads_touch_only_the_shards_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = two_checkpoints(dir.path());
    let ck = Checkpoint::open(&b).unwrap();
    // Corrupt rank 1's rows of wte (rows 6..13); rows 0..6 live on rank 0.
    let s = &ck.manifest().tensors["wte.weight"].shards[1];
    assert_eq!(s.offsets, vec![6, 0]);
    let file = b.join(&s.file);
    let mut bytes = fs::read(&file).unwrap();
    bytes[s.byte_offset as usize] ^= 1;
    fs::write(&file, bytes).unwrap();
    let top = weft_checkpoint::Region::new(vec![0, 0], vec![6, 8]);
    assert_eq!(
        ck.read_region("wte.weight", &top).unwrap(),
        crate::util::slice(&model(2)[0], &top)
    );
    let bottom = weft_checkpoint::Region::new(vec![5, 0], vec![2, 8]);
    let err = ck.read_region("wte.weight", &bottom).unwrap_err();
    assert!(matches!(err, Error::Checksum { chunk: 0, .. }), "{err}");
}

#[test]
fn large_pipelined_reads_verify_every_piece() {
    use weft_checkpoint::Dtype;
    let dir = tempfile::tempdir().unwrap();
    // 12 MiB in one shard: read in three 4 MiB pieces, read and verified in parallel.
    let t = crate::util::tensor("big", Dtype::F32, &[3 * 1024, 1024], 77);
    let opts = SaveOptions {
        chunk_bytes: 1 << 20,
        ..Default::default()
    };
    let c = save(
        dir.path(),
        1,
        &Layout::flat("dp", 1),
        &[vec![weft_checkpoint::ShardData::full(
            "big",
            Dtype::F32,
            &t.shape,
            &t.data,
        )]],
        &TrainerState::default(),
        &opts,
    )
    .unwrap();
    let ck = Checkpoint::open(&c.path).unwrap();
    assert_eq!(ck.read_tensor("big").unwrap(), t.data);
    let s = &ck.manifest().tensors["big"].shards[0];
    let file = c.path.join(&s.file);
    let mut bytes = fs::read(&file).unwrap();
    bytes[(s.byte_offset + 9 * (1 << 20) + 5) as usize] ^= 4;
    fs::write(&file, &bytes).unwrap();
    let err = ck.read_tensor("big").unwrap_err();
    assert!(matches!(err, Error::Checksum { chunk: 9, .. }), "{err}");
    assert!(matches!(
        ck.verify().unwrap_err(),
        Error::Checksum { chunk: 9, .. }
    ));
    // Truncated after opening: the read names the tensor.
    fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(s.byte_offset + (6 << 20))
        .unwrap();
    let err = ck.read_tensor("big").unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("big"), "{err}");
}
