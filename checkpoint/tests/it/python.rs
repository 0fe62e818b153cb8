//! Interop: an independent Python reader (safetensors package) and
//! transformers read what we write. Skipped, saying why, without Python.

use std::path::{Path, PathBuf};
use std::process::Command;

use weft_checkpoint::{
    Checkpoint, Dtype, Gpt2Export, Layout, SaveOptions, TargetLayout, TrainerState, export_hf_gpt2,
    reshard, save,
};

use crate::util::{Tensor, borrow, model, shard_rows, tensor};
use weft_testkit::python;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/weft_ckpt_check.py")
}

fn run(py: &Path, args: &[&Path]) -> String {
    let out = Command::new(py).arg(script()).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "python failed:\n{text}");
    text
}

fn dump_expected(dir: &Path, ts: &[Tensor]) {
    std::fs::create_dir_all(dir).unwrap();
    for t in ts {
        std::fs::write(dir.join(format!("{}.bin", t.name)), &t.data).unwrap();
    }
}

#[test]
fn python_safetensors_reads_our_shards() {
    let Some(py) = python("safetensors, numpy") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ts = model(5);
    dump_expected(&dir.path().join("expected"), &ts);
    let c = save(
        &dir.path().join("ck"),
        3,
        &Layout::flat("dp", 3),
        &borrow(&shard_rows(&ts, 3)),
        &TrainerState::default(),
        &SaveOptions::default(),
    )
    .unwrap();
    let out = run(
        &py,
        &[Path::new("read"), &c.path, &dir.path().join("expected")],
    );
    // every tensor read, the bf16 one included (numpy alone cannot)
    assert!(out.contains(&format!("ok {} tensors", ts.len())), "{out}");
    // Column-resharded too.
    let src = Checkpoint::open(&c.path).unwrap();
    let tp = reshard(
        &src,
        &TargetLayout::parse("2:dim1").unwrap(),
        &dir.path().join("tp"),
        &SaveOptions::default(),
    )
    .unwrap();
    let out = run(
        &py,
        &[Path::new("read"), &tp.path, &dir.path().join("expected")],
    );
    // every tensor read, the bf16 one included (numpy alone cannot)
    assert!(out.contains(&format!("ok {} tensors", ts.len())), "{out}");
}

/// Small GPT-2 parameters with values of a sensible scale.
fn gpt2(prefix: &str, l: u64, c: u64, v: u64, p: u64) -> Vec<Tensor> {
    let mut names: Vec<(String, Vec<u64>)> = vec![
        ("wte.weight".into(), vec![v, c]),
        ("wpe.weight".into(), vec![p, c]),
    ];
    for i in 0..l {
        for (n, s) in [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![c, 3 * c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![c, 4 * c]),
            ("mlp.c_fc.bias", vec![4 * c]),
            ("mlp.c_proj.weight", vec![4 * c, c]),
            ("mlp.c_proj.bias", vec![c]),
        ] {
            names.push((format!("h.{i}.{n}"), s));
        }
    }
    names.push(("ln_f.weight".into(), vec![c]));
    names.push(("ln_f.bias".into(), vec![c]));
    let mut out = Vec::new();
    for (k, (n, s)) in names.into_iter().enumerate() {
        let mut t = tensor(&format!("{prefix}{n}"), Dtype::F32, &s, k as u64);
        // Map random bytes to floats in [-0.05, 0.05).
        for ch in t.data.chunks_mut(4) {
            let u = u32::from_le_bytes(ch.try_into().unwrap());
            let f = (u as f32 / u32::MAX as f32 - 0.5) * 0.1;
            ch.copy_from_slice(&f.to_le_bytes());
        }
        out.push(t);
    }
    // Optimizer state that the export must leave out.
    out.push(tensor("optim.exp_avg.wte.weight", Dtype::F32, &[v, c], 99));
    out
}

#[test]
fn transformers_loads_the_hf_export() {
    let Some(py) = python("safetensors, numpy, torch, transformers") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ts = gpt2("params.", 2, 16, 50, 12);
    let c = save(
        &dir.path().join("ck"),
        11,
        &Layout::flat("fsdp", 2),
        &borrow(&shard_rows(&ts, 2)),
        &TrainerState::default(),
        &SaveOptions::default(),
    )
    .unwrap();
    let ck = Checkpoint::open(&c.path).unwrap();
    let hf = dir.path().join("hf");
    let rep = export_hf_gpt2(&ck, &hf, &Gpt2Export::new("params.", 4)).unwrap();
    assert_eq!(rep.tensors, 2 + 2 * 12 + 2);
    assert_eq!(rep.config["n_layer"], 2);
    let out = run(&py, &[Path::new("hf"), &hf, &c.path, Path::new("params.")]);
    assert!(out.contains("ok 28 parameters"), "{out}");
}

#[test]
fn export_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let mut ts = gpt2("", 1, 8, 10, 4);
    ts.retain(|t| t.name != "h.0.mlp.c_proj.bias");
    let c = save(
        dir.path(),
        1,
        &Layout::flat("dp", 1),
        &borrow(&shard_rows(&ts, 1)),
        &TrainerState::default(),
        &SaveOptions::default(),
    )
    .unwrap();
    let err = export_hf_gpt2(
        &Checkpoint::open(&c.path).unwrap(),
        &dir.path().join("hf"),
        &Gpt2Export::new("", 2),
    )
    .unwrap_err();
    assert!(err.to_string().contains("h.0.mlp.c_proj.bias"), "{err}");
}
