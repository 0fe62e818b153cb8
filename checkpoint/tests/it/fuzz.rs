//! Bounded fuzzing in the test suite: hostile manifests and safetensors
//! headers give errors, never panics or hangs. (The open-ended version is
//! the cargo-fuzz target in `checkpoint/fuzz`.)

use std::fs;
use std::path::Path;

use proptest::prelude::*;
use weft_checkpoint::{
    Checkpoint, Layout, Manifest, SaveOptions, TrainerState, parse_header, save,
};

use crate::util::{borrow, model, shard_rows};

/// A valid two-rank checkpoint; returns (manifest bytes, rank-0 file bytes).
fn sample(root: &Path) -> (Vec<u8>, Vec<u8>) {
    let opts = SaveOptions {
        chunk_bytes: 64,
        fsync: false,
        ..Default::default()
    };
    let c = save(
        root,
        1,
        &Layout::flat("dp", 2),
        &borrow(&shard_rows(&model(3), 2)),
        &TrainerState::default(),
        &opts,
    )
    .unwrap();
    (
        fs::read(c.path.join("manifest.json")).unwrap(),
        fs::read(c.path.join("rank-00000.safetensors")).unwrap(),
    )
}

/// Replaces the `k`-th number in a JSON text by `v`.
fn replace_number(text: &str, k: usize, v: &str) -> String {
    let b = text.as_bytes();
    let mut i = 0;
    let mut seen = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
            let j = (i..b.len())
                .find(|&j| !b[j].is_ascii_digit())
                .unwrap_or(b.len());
            if seen == k {
                return format!("{}{}{}", &text[..i], v, &text[j..]);
            }
            seen += 1;
            i = j;
        } else {
            i += 1;
        }
    }
    text.to_owned()
}

fn mutation() -> impl Strategy<Value = (usize, String)> {
    (
        0usize..400,
        prop::sample::select(vec![
            "0",
            "1",
            "7",
            "63",
            "64",
            "65",
            "4294967295",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "-1",
            "1e300",
            "null",
            "\"x\"",
            "[]",
            "{}",
        ])
        .prop_map(str::to_owned),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::from_json(&bytes, Path::new("m.json"));
        let _ = parse_header(&bytes, bytes.len() as u64, Path::new("f.safetensors"));
        let _ = parse_header(&bytes, u64::MAX, Path::new("f.safetensors"));
    }

    #[test]
    fn mutated_manifests_and_headers_never_panic(
        muts in prop::collection::vec(mutation(), 1..4),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (manifest, file) = sample(dir.path());
        let mut text = String::from_utf8(manifest).unwrap();
        for (k, v) in &muts {
            text = replace_number(&text, *k, v);
        }
        let _ = Manifest::from_json(text.as_bytes(), Path::new("m.json"));
        // Same with byte flips in the header region of the shard file.
        let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize + 8;
        let mut f = file.clone();
        for (i, x) in &flips {
            let k = i.index(n);
            f[k] ^= x;
        }
        let _ = parse_header(&f, f.len() as u64, Path::new("f.safetensors"));
        let short = &file[..cut.index(file.len())];
        let _ = parse_header(short, short.len() as u64, Path::new("f.safetensors"));
        // End to end: open, verify and read a checkpoint with both edits.
        let ck = dir.path().join("step-00000001");
        fs::write(ck.join("manifest.json"), &text).unwrap();
        fs::write(ck.join("rank-00000.safetensors"), &f).unwrap();
        if let Ok(c) = Checkpoint::open(&ck) {
            let _ = c.verify();
            for name in c.manifest().tensors.keys() {
                let _ = c.read_tensor(name);
            }
        }
    }
}

#[test]
fn fuzz_seed_manifest_is_valid() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/manifest/two-ranks.json");
    let m = Manifest::from_json(&fs::read(&p).unwrap(), &p).unwrap();
    assert_eq!(m.tensors.len(), 4);
    // written back, it carries its checksum (the seed predates it)
    let again = Manifest::from_json(&m.to_json(), &p).unwrap();
    assert!(m.manifest_crc32c.is_none() && again.manifest_crc32c.is_some());
    assert_eq!(
        Manifest {
            manifest_crc32c: None,
            ..again
        },
        m
    );
}
